"""The evidence protocol of the study harness: primary comparisons declared before running, Holm's
correction over them, a refusal to compare runs whose budgets differ, tokens-to-target, and a run
cache keyed by the full configuration.

A comparison is only as good as the rules around it:

* **Declared families.** :class:`Comparison` rows are either ``primary`` (declared before any run:
  their p-values form one family under Holm's step-down correction) or ``exploratory`` (reported
  with unadjusted intervals and labelled so). A primary row cannot be added once results exist.
* **Holm (1979).** Sort the m p-values ascending, p_(1) ≤ ... ≤ p_(m); reject H_(i) while
  p_(i) ≤ α / (m - i + 1); the adjusted p-value is max_{j ≤ i} min(1, (m - j + 1) p_(j)). It
  controls the family-wise error rate at α under any dependence between the tests. (Written here:
  scipy has no Holm, its ``false_discovery_control`` is Benjamini-Hochberg / -Yekutieli, and
  statsmodels' ``multipletests`` is not a dependency.) A family may be methods x endpoints: the
  names are the keys.
* **Paired tests.** :func:`paired_t_pvalue` and :func:`paired_ci` are scipy's ``ttest_rel``; a
  family of comparisons is planned by :func:`plan_seeds` (power after Holm) before it is run, or
  by :func:`plan_for_mdes`: per endpoint, a target minimum detectable effect after Holm on the upper
  confidence bound of the SD (:func:`sd_upper_bound`, chi-square) from at least 4 tuning seeds.
* **Censoring.** A budget-to-target of a run that never reaches the target is censored at its
  total budget (:func:`censored_budgets`), never dropped.
* **Equal budgets.** Two methods are compared at equal generated tokens or at equal rollouts;
  :func:`check_equal_budgets` refuses a comparison whose budgets differ beyond a tolerance, naming
  the method and both totals.
* **Run cache.** :class:`RunCache` stores one result per configuration under the SHA-256 of its
  canonical JSON; a lookup returns a stored run only when every key of its stored configuration
  equals the requested one (a hash collision or an edited file is a miss, never a wrong reuse).
  Writes are atomic, so an interrupted study leaves whole runs or none, and a study resumes by
  running only what the cache lacks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from verl_ext.atomic import atomic_replace

PRIMARY = "primary"
EXPLORATORY = "exploratory"


# ----------------------------------------------------------------------------------------- Holm
@dataclass(frozen=True)
class HolmResult:
    p: float
    p_adjusted: float
    rejected: bool


def holm(pvalues: Mapping[Hashable, float], alpha: float = 0.05) -> dict[Hashable, HolmResult]:
    """Holm's step-down correction of a family of p-values (module docstring).

    A NaN p-value (a comparison that could not be tested, e.g. one seed) counts in the family size
    m, is never rejected, and has adjusted p NaN: leaving it out would make the others easier to
    reject.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha}: must be in (0, 1)")
    names = list(pvalues)
    m = len(names)
    p = np.array([float(pvalues[n]) for n in names], dtype=np.float64)
    if np.any((p < 0) | (p > 1)):
        bad = next(n for n, v in zip(names, p, strict=True) if v < 0 or v > 1)
        raise ValueError(f"p-value of {bad!r} is {pvalues[bad]}: must be in [0, 1]")
    finite = ~np.isnan(p)
    order = sorted((i for i in range(m) if finite[i]), key=lambda i: p[i])
    out: dict[Hashable, HolmResult] = {n: HolmResult(float("nan"), float("nan"), False) for n in names}
    running_max = 0.0
    still_rejecting = True
    for rank, i in enumerate(order):  # rank 0 is the smallest p
        running_max = max(running_max, min(1.0, (m - rank) * p[i]))
        still_rejecting = still_rejecting and p[i] <= alpha / (m - rank)
        out[names[i]] = HolmResult(float(p[i]), float(running_max), bool(still_rejecting))
    return out


@dataclass(frozen=True)
class FamilyRow:
    """One comparison of a Holm family: the mean per-seed difference, its t interval, the seeds, the
    paired t p-value, its Holm adjustment and whether Holm rejects it."""

    mean: float
    lo: float
    hi: float
    n: int
    p: float
    p_holm: float
    rejected: bool


def paired_family(
    differences: Mapping[Hashable, Sequence[float]], alpha: float = 0.05, confidence: float = 0.95
) -> dict[Hashable, FamilyRow]:
    """A declared family of paired comparisons under one Holm correction: every key (e.g. a
    ``(method, endpoint)`` pair: Holm over methods x endpoints) gets :func:`paired_ci` and
    :func:`paired_t_pvalue` of its per-seed differences (method minus reference), and :func:`holm`
    runs over all of them together."""
    adjusted = holm({k: paired_t_pvalue(d) for k, d in differences.items()}, alpha=alpha)
    rows = {}
    for key, d in differences.items():
        mean, lo, hi, n = paired_ci(d, [0.0] * len(d), confidence)
        h = adjusted[key]
        rows[key] = FamilyRow(mean, lo, hi, n, h.p, h.p_adjusted, h.rejected)
    return rows


def paired_t_pvalue(differences: Sequence[float]) -> float:
    """Two-sided p-value of the paired t-test that the mean per-seed difference is 0
    (``scipy.stats.ttest_rel`` against zeros; NaN seeds are dropped).

    NaN when the test cannot answer: fewer than two seeds, or every difference the same non-zero
    value (no variance: t is undefined, and "no variance, no doubt" would let Holm reject on a tie
    that worst-skill accuracy, in steps of 1/60, makes likely by chance). 1.0 when every difference
    is exactly 0 (the runs agree). Holm counts a NaN in the family and never rejects it.
    """
    d = np.asarray(differences, dtype=np.float64)
    d = d[~np.isnan(d)]
    if d.size < 2:
        return float("nan")
    if np.all(d == d[0]):
        return 1.0 if d[0] == 0 else float("nan")
    return float(_ttest(d).pvalue)


def _ttest(d: np.ndarray):
    from scipy import stats

    return stats.ttest_rel(d, np.zeros_like(d))


def paired_ci(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float, int]:
    """Mean of the per-seed differences a - b and its t interval: (mean, lo, hi, n).

    ``scipy.stats.ttest_rel(a, b).confidence_interval()``. Seeds are paired: the same seed gives both
    runs the same data, batches and draws. With one seed, or no variance, the interval is (nan, nan).
    """
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = len(d)
    if n == 0:
        return float("nan"), float("nan"), float("nan"), 0
    mean = float(d.mean())
    if n < 2 or np.all(d == d[0]):
        return mean, float("nan"), float("nan"), n
    ci = _ttest(d).confidence_interval(confidence)
    return mean, float(ci.low), float(ci.high), n


# ---------------------------------------------------------------------------------------- power
def paired_t_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` with ``n`` seeds when the per-seed
    differences are N(effect, sd²): P(|T| > t_{1-alpha/2, n-1}), T noncentral t with n - 1 df and
    noncentrality effect·√n / sd."""
    from scipy import stats

    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0 if effect != 0 else alpha
    df = n - 1
    crit = stats.t.ppf(1 - alpha / 2, df)
    ncp = abs(effect) * math.sqrt(n) / sd
    lower = float(stats.nct.cdf(-crit, df, ncp))  # the wrong-sign tail: ~0, and NaN in scipy when tiny
    return float(stats.nct.sf(crit, df, ncp)) + (lower if math.isfinite(lower) else 0.0)


@dataclass(frozen=True)
class PowerPlan:
    """The declared design: seeds, the effect they are powered for, and the minimum detectable effect."""

    n_seeds: int
    effect: float  # the effect the design must detect: max(floor, fraction x GRPO's gain)
    # The per-seed SD of the paired differences the plan used, as given to plan_seeds (the tiny-LM
    # study's v1 passes the point estimate pooled over the family: the root of the mean of the
    # comparisons' variances on the tuning seeds; plan_for_mdes plans on an upper confidence bound).
    sd: float
    family_size: int
    alpha: float
    power: float  # achieved power at ``effect`` with ``n_seeds``
    mde: float  # the smallest effect with the target power at ``n_seeds``
    capped: bool  # True when ``max_seeds`` was reached before the target power


def plan_seeds(
    sd: float,
    grpo_gain: float,
    family_size: int,
    *,
    alpha: float = 0.05,
    target_power: float = 0.8,
    floor: float = 0.01,
    fraction: float = 0.25,
    max_seeds: int = 64,
) -> PowerPlan:
    """Evaluation seeds so that each comparison of the primary family has ``target_power`` after Holm
    for an effect of max(``floor``, ``fraction`` × ``grpo_gain``).

    Holm rejects a hypothesis whose effect is alone in its family exactly when its p-value is below
    alpha / m (its first step); so the per-comparison test is the paired t at level alpha / m, whose
    power is :func:`paired_t_power`. (When several comparisons carry effects Holm's later steps are
    laxer, so this is the conservative case.) The minimum detectable effect (MDE) at the chosen n
    is the effect with exactly ``target_power``.
    """

    if not (sd >= 0 and math.isfinite(sd)):
        raise ValueError(f"sd={sd}: must be a finite number >= 0 (the per-seed SD of the paired differences)")
    if family_size < 1:
        raise ValueError(f"family_size={family_size}: must be >= 1")
    level = alpha / family_size
    effect = max(floor, fraction * abs(grpo_gain))
    n = 2
    while paired_t_power(effect, sd, n, level) < target_power and n < max_seeds:
        n += 1
    power = paired_t_power(effect, sd, n, level)
    mde = minimum_detectable_effect(sd, n, level, target_power)
    return PowerPlan(n, effect, float(sd), family_size, alpha, power, mde, capped=power < target_power)


@dataclass(frozen=True)
class PowerRule:
    """How the seeds of a family are planned from tuning seeds (:func:`plan_for_mdes`); each setting's
    default is here only."""

    alpha: float = 0.05  # family-wise error rate (Holm over methods x endpoints)
    target_power: float = 0.8
    sd_confidence: float = 0.8  # plan on the upper bound of this one-sided confidence interval for the SD
    min_tuning_seeds: int = 4  # fewer seeds give an SD bound too loose to plan on (2 seeds: df 1)
    max_seeds: int = 64


@dataclass(frozen=True)
class SDBound:
    """A per-seed SD estimated on tuning seeds and its one-sided upper confidence bound."""

    point: float  # sqrt of the mean of the comparisons' sample variances (ddof 1)
    upper: float  # upper ``confidence`` bound: point * sqrt(df / chi2.ppf(1 - confidence, df))
    df: int  # seeds - 1
    confidence: float


def sd_upper_bound(differences: Sequence[Sequence[float]], confidence: float = 0.8) -> SDBound:
    """The SD of per-seed paired differences and its upper ``confidence`` bound (chi-square).

    For n normal draws with sample variance s², (n - 1) s² / σ² ~ χ²_{n-1}, so
    σ ≤ s √((n - 1) / χ²_{n-1}(1 - confidence)) with probability ``confidence``: the one-sided
    chi-square interval for a normal SD (χ² quantiles from ``scipy.stats.chi2.ppf``). Several comparisons
    over the same seeds (methods against one reference) are pooled as the mean of their variances,
    with df = n - 1, not their sum: they share the reference's runs, so they are not independent
    estimates and the bound keeps the width of one.
    """
    from scipy import stats

    rows = [np.asarray(d, dtype=np.float64) for d in differences]
    if not rows or any(r.ndim != 1 for r in rows) or len({r.size for r in rows}) != 1:
        raise ValueError("differences: one list of per-seed differences per comparison, all over the same seeds")
    n = rows[0].size
    if n < 2:
        raise ValueError(f"{n} seed(s): an SD needs at least 2")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: must be in (0, 1)")
    point = float(np.sqrt(np.mean([np.var(r, ddof=1) for r in rows])))
    df = n - 1
    upper = point * math.sqrt(df / float(stats.chi2.ppf(1 - confidence, df)))
    return SDBound(point, float(upper), df, float(confidence))


def seeds_for_mde(sd: float, mde: float, family_size: int, rule: PowerRule = PowerRule()) -> tuple[int, bool]:
    """The fewest seeds (>= 2) at which the paired t at level alpha / ``family_size`` (Holm's first
    step, as in :func:`plan_seeds`) detects ``mde`` with ``rule.target_power`` when the per-seed SD is
    ``sd``; and whether ``rule.max_seeds`` capped it (then the power is below target)."""
    if not (sd >= 0 and math.isfinite(sd)):
        raise ValueError(f"sd={sd}: must be a finite number >= 0")
    if not mde > 0:
        raise ValueError(f"mde={mde}: must be > 0")
    level = rule.alpha / family_size
    n = 2
    while paired_t_power(mde, sd, n, level) < rule.target_power and n < rule.max_seeds:
        n += 1
    return n, paired_t_power(mde, sd, n, level) < rule.target_power


@dataclass(frozen=True)
class EndpointPlan:
    """One endpoint of a planned family: its SD bound, the seeds its target MDE needs, and the MDE the
    family's seed count gives it (what the design can in fact detect)."""

    endpoint: str
    sd: SDBound
    target_mde: float
    seeds_needed: int
    capped: bool
    mde: float  # at the plan's n_seeds, on sd.upper


@dataclass(frozen=True)
class FamilyPlan:
    n_seeds: int  # max over endpoints of seeds_needed (at most rule.max_seeds)
    family_size: int  # methods x endpoints: Holm's m
    rule: PowerRule
    endpoints: tuple[EndpointPlan, ...]


def plan_for_mdes(
    differences: Mapping[str, Sequence[Sequence[float]]],
    target_mdes: Mapping[str, float],
    n_methods: int,
    rule: PowerRule = PowerRule(),
) -> FamilyPlan:
    """Seeds for a family of ``n_methods`` x endpoints comparisons under Holm, each endpoint powered
    for its ``target_mdes[endpoint]`` on the upper ``rule.sd_confidence`` bound of its SD
    (:func:`sd_upper_bound`) from the tuning seeds' paired differences ``differences[endpoint]`` (one
    list per method). The seed count is the largest any endpoint needs; each endpoint's MDE at that
    count is reported (below its target when another endpoint needs more seeds; above it when the
    count is capped). Refuses fewer than ``rule.min_tuning_seeds`` tuning seeds."""
    if set(differences) != set(target_mdes):
        raise ValueError(f"endpoints with differences {sorted(differences)} but target MDEs for {sorted(target_mdes)}")
    family_size = n_methods * len(differences)
    if family_size < 1:
        raise ValueError("an empty family")
    bounds = {}
    for name, diffs in differences.items():
        seeds = len(diffs[0]) if diffs else 0
        if seeds < rule.min_tuning_seeds:
            raise ValueError(
                f"endpoint {name!r}: {seeds} tuning seeds; the power plan needs at least {rule.min_tuning_seeds}"
            )
        bounds[name] = sd_upper_bound(diffs, rule.sd_confidence)
    needed = {name: seeds_for_mde(b.upper, float(target_mdes[name]), family_size, rule) for name, b in bounds.items()}
    n = max(k for k, _ in needed.values())
    level = rule.alpha / family_size
    plans = tuple(
        EndpointPlan(
            name,
            bounds[name],
            float(target_mdes[name]),
            needed[name][0],
            needed[name][1],
            minimum_detectable_effect(bounds[name].upper, n, level, rule.target_power),
        )
        for name in differences
    )
    return FamilyPlan(n, family_size, rule, plans)


def minimum_detectable_effect(sd: float, n: int, level: float, target_power: float = 0.8) -> float:
    """The smallest effect the two-sided paired t at ``level`` detects with ``target_power`` on ``n``
    seeds whose per-seed differences have SD ``sd`` (inf below 2 seeds)."""
    from scipy.optimize import brentq

    if n < 2:
        return math.inf
    if sd == 0:
        return 0.0
    hi = sd
    while paired_t_power(hi, sd, n, level) < target_power:
        hi *= 2
    return float(brentq(lambda e: paired_t_power(e, sd, n, level) - target_power, 0.0, hi, xtol=1e-9))


# ------------------------------------------------------------------------------------ censoring
@dataclass(frozen=True)
class CensoredSummary:
    """Budget-to-target over seeds, censored runs kept: ``reached`` of ``n`` reached the target; the
    Kaplan-Meier median (inf when fewer than half reached it, i.e. "beyond the budget")."""

    n: int
    reached: int
    km_median: float
    budgets: tuple[float, ...]  # each seed's budget-to-target, or its total budget if censored
    censored: tuple[bool, ...]


def censored_budgets(times: Sequence[float], totals: Sequence[float]) -> CensoredSummary:
    """Summarise per-seed budgets-to-target where ``inf`` (never reached) is right-censored at the
    run's total budget (:func:`budget_to_reach` gives inf); no seed is dropped.

    Kaplan-Meier (1958): S(t) = Π_{t_i <= t} (1 - d_i / r_i) over event times t_i, with d_i events and
    r_i seeds still at risk; the median is the first t with S(t) <= 0.5.
    """
    t = np.asarray(times, dtype=np.float64)
    tot = np.asarray(totals, dtype=np.float64)
    cens = ~np.isfinite(t)
    obs = np.where(cens, tot, t)
    surv, median = 1.0, float("inf")
    for u in np.unique(obs[~cens]):
        at_risk = int(np.sum(obs >= u))
        events = int(np.sum((obs == u) & ~cens))
        surv *= 1 - events / at_risk
        if surv <= 0.5:
            median = float(u)
            break
    return CensoredSummary(len(t), int((~cens).sum()), median, tuple(map(float, obs)), tuple(map(bool, cens)))


# ---------------------------------------------------------------------------------- comparisons
@dataclass(frozen=True)
class Comparison:
    """One declared comparison: ``method`` against ``baseline`` on ``metric`` (higher is better
    unless ``lower_is_better``), ``family`` = ``primary`` or ``exploratory``."""

    name: str
    method: str
    baseline: str
    metric: str
    family: str = PRIMARY
    lower_is_better: bool = False

    def __post_init__(self):
        if self.family not in (PRIMARY, EXPLORATORY):
            raise ValueError(f"comparison {self.name!r}: family={self.family!r}; use {PRIMARY!r} or {EXPLORATORY!r}")


class BudgetMismatch(ValueError):
    """Two runs compared at 'equal budget' whose budgets differ."""


def check_equal_budgets(totals: Mapping[str, float], what: str, rtol: float = 0.0) -> float:
    """Refuse a comparison across methods whose ``what`` totals (``rollouts`` or ``tokens``)
    differ by more than ``rtol`` of the largest; returns the common total.

    Rollout-GDRO keeps Σ n = B·n̄ exactly, so equal rollouts is ``rtol=0``; generated tokens are
    random, so a comparison "at equal tokens" either reads every method at one token count (see
    :func:`value_at_budget`) or states the tolerance it accepts.
    """
    if not totals:
        raise BudgetMismatch(f"no runs to compare at equal {what}")
    values = {k: float(v) for k, v in totals.items()}
    bad = [k for k, v in values.items() if not math.isfinite(v) or v <= 0]
    if bad:
        raise BudgetMismatch(f"{what} budget of {bad[0]!r} is {values[bad[0]]}: must be a positive number")
    hi_name = max(values, key=values.get)
    lo_name = min(values, key=values.get)
    hi, lo = values[hi_name], values[lo_name]
    if hi - lo > rtol * hi:
        raise BudgetMismatch(
            f"unequal {what}: {lo_name!r} used {lo:g}, {hi_name!r} used {hi:g} "
            f"({100 * (hi - lo) / hi:.2f}% apart; tolerance {100 * rtol:g}%)"
        )
    return hi


def value_at_budget(budget: Sequence[float], values: Sequence[float], at: float) -> float:
    """A learning curve read at cumulative budget ``at`` (linear interpolation between the two
    evaluations around it; NaN beyond the run's last evaluation: never extrapolated)."""
    x = np.asarray(budget, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    if x.size == 0 or at > x[-1] or at < x[0]:
        return float("nan")
    if np.any(np.diff(x) < 0):
        raise ValueError("budget must be non-decreasing along the curve")
    return float(np.interp(at, x, y))


def budget_to_reach(budget: Sequence[float], values: Sequence[float], target: float) -> float:
    """The cumulative budget (tokens, rollouts) at which a curve first reaches ``target``,
    interpolated between the evaluations around the crossing; ``inf`` if it never does."""
    x = np.asarray(budget, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    hit = np.nonzero(y >= target)[0]
    if hit.size == 0:
        return float("inf")
    i = int(hit[0])
    if i == 0:
        return float(x[0])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    return float(x0 + (target - y0) * (x1 - x0) / (y1 - y0))


# ------------------------------------------------------------------------------------ run cache
def canonical_json(config: Mapping[str, Any]) -> str:
    """Key-sorted, whitespace-free JSON: equal configurations give equal text. Floats keep their
    full repr, so 3e-4 and 0.0003 are one key but 3e-4 and 3.0001e-4 are two."""
    try:
        return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=True)
    except TypeError as e:
        raise TypeError(f"run config is not JSON-serialisable ({e}); pass plain dicts, lists, str, numbers") from e


def config_key(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(config).encode("utf-8")).hexdigest()


class RunCache:
    """Results of finished runs, one JSON file per configuration (module docstring)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        os.makedirs(self.folder, exist_ok=True)

    def path(self, config: Mapping[str, Any]) -> str:
        return os.path.join(self.folder, config_key(config) + ".json")

    def get(self, config: Mapping[str, Any]) -> Optional[dict]:
        """The stored result of exactly ``config``, or None."""
        path = self.path(config)
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                stored = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None  # unreadable: run again rather than trust it
        if not isinstance(stored, dict) or canonical_json(stored.get("config", {})) != canonical_json(config):
            return None
        return stored.get("result")

    def put(self, config: Mapping[str, Any], result: Mapping[str, Any]) -> str:
        path = self.path(config)
        text = json.dumps({"config": config, "result": result}, sort_keys=True, allow_nan=True)
        with atomic_replace(path, "w") as f:
            f.write(text)
        return path
