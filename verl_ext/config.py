"""Typed, self-validating configuration for the GDRO controllers.

Defaults are the paper's appendix values (Panaganti et al., 2026, App. A.2) unless a field's
``help`` says otherwise. Each field documents itself in its ``help`` metadata (as TRL's config
dataclasses do); ``python -m recipe.gdro.main_gdro --help`` prints them. Every dataclass
validates itself in ``__post_init__`` and raises :class:`GDROConfigError` naming the offending
field, so an impossible setting fails at start-up, before any GPU time is spent.

The recipe's Hydra section ``gdro:`` maps one-to-one onto :class:`GDROConfig`
(``gdro.binner.*``, ``gdro.prompt.*``, ``gdro.rollout.*``); :func:`gdro_config_from_dict` builds
it through ``pydantic.TypeAdapter`` (the dataclasses stay stdlib ones: numbers and booleans are pydantic's
strict types, unknown keys forbidden) and rejects unknown keys and wrong types. verl_ext needs numpy and pydantic.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import itertools
import math
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, StrictBool, StrictFloat, StrictInt, with_config


class Choice(str, enum.Enum):
    """A string option, checked by :meth:`parse`: in ``__post_init__``, in pydantic (the config's validation),
    and by name in OmegaConf (recipe_config's structured keys).

    A ``str`` mixin whose ``str()`` and format are the plain value, so ``cfg.rollout.allocator ==
    "sqrt"``, f-strings, JSON and the metrics see the same strings as before; member name == value.
    """

    def __str__(self) -> str:
        return str(self.value)

    __format__ = str.__format__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value: Any) -> Choice:
        """``value`` as a member, or ``ValueError`` listing the choices (with a did-you-mean)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value in cls.values():
            return cls(value)
        close = difflib.get_close_matches(str(value), cls.values(), n=1, cutoff=0.4)
        raise ValueError(f"must be one of {cls.values()}" + (f"; did you mean {close[0]}?" if close else ""))

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """pydantic validates a choice by :meth:`parse` (member or exact value; no other conversion)."""
        from pydantic_core import PydanticCustomError, core_schema

        def validate(value: Any) -> Choice:
            try:
                return cls.parse(value)
            except ValueError as e:
                raise PydanticCustomError("choice", str(e)) from None

        return core_schema.no_info_plain_validator_function(validate)


class LossSignal(Choice):
    learnability = "learnability"
    failure_rate = "failure_rate"
    mean_abs_advantage = "mean_abs_advantage"


class Allocator(Choice):
    sqrt = "sqrt"
    hedge = "hedge"
    bandit = "bandit"  # the earlier name of hedge (runs the same code)
    knapsack = "knapsack"
    discovery = "discovery"
    failure_weighted = "failure_weighted"
    fixed_tail_share = "fixed_tail_share"  # a positive control for studies, not a method
    uniform = "uniform"


class UnseenMode(Choice):
    own_bin = "own_bin"
    prior = "prior"


class Coupling(Choice):
    none = "none"
    divide_by_allocation = "divide_by_allocation"


class NormalizeMode(Choice):
    advantage_mass = "advantage_mass"
    all_responses = "all_responses"


class VarianceSource(Choice):
    bin = "bin"
    prompt = "prompt"


class Budget(Choice):
    rollouts = "rollouts"
    tokens = "tokens"


class ScoreInit(Choice):
    first_observation = "first_observation"
    zero = "zero"


# pydantic refuses unknown keys in every section (gdro_config_from_dict names them with a did-you-mean)
_FORBID_EXTRA = ConfigDict(extra="forbid")


class GDROConfigError(ValueError):
    """An impossible or malformed GDRO setting. The message names the field at fault."""


def _fail(field_name: str, value: Any, why: str) -> None:
    raise GDROConfigError(f"gdro config: gdro.{field_name}={value!r} is invalid: {why}")


@dataclass(frozen=True)
class Range:
    """A field's allowed values, kept in its metadata (``"range"``): the check (:func:`range_violation`, run by
    ``__post_init__`` here, after the typed parse in the scenario and the protocol) and the text ``--help``, the
    YAML and the README show come from this one object."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    def text(self) -> str:
        """``[0, 1)``, ``> 0``, ``>= 2``."""
        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}"

    def violation(self, value: Any) -> str | None:
        """Why ``value`` is out of range (``must lie in [0, 1)``, ``must be an integer >= 1``), or ``None``."""
        if self.integer:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (self.lo is None or (value > self.lo if self.lo_open else value >= self.lo))
        ok = ok and (self.hi is None or (value < self.hi if self.hi_open else value <= self.hi))
        if ok:
            return None
        if self.lo is not None and self.hi is not None:
            return f"must lie in {self.text()}"
        return f"must be {'an integer' if self.integer else 'a finite number'} {self.text()}"


def _check_ranges(config: Any, section: str) -> None:
    """Run every field's ``range`` metadata check (a ``None`` value is the field's "unset")."""
    bad = range_violation(config, section)
    if bad:
        _fail(*bad)


def _choice(field_name: str, cls: type[Choice], value: Any) -> Choice:
    """``value`` as a member of ``cls``, or :class:`GDROConfigError` listing the choices (did-you-mean)."""
    try:
        return cls.parse(value)
    except ValueError as e:
        _fail(field_name, value, str(e))
        raise AssertionError from None  # unreachable: _fail raises


@with_config(_FORBID_EXTRA)
@dataclass
class BinnerConfig:
    """Online difficulty binner (paper §3.1.2; docs/controllers.md)."""

    num_bins: StrictInt = field(
        default=10,
        metadata={
            "brief": "K equal-width accuracy bins on [0, 1]",
            "range": Range(lo=1, integer=True),
            "help": (
                "K, the number of equal-width accuracy bins on [0, 1] (appendix: 10). Ignored when ``bin_edges`` "
                "is given."
            ),
        },
    )
    bin_edges: list[StrictFloat] | None = field(
        default=None,
        metadata={
            "brief": "explicit edges ``[0, ..., 1]``; overrides ``num_bins``",
            "help": (
                "explicit edges 0 = a_0 < a_1 < ... < a_K = 1 on windowed accuracy (K + 1 edges give K bins [a_k,"
                " a_{k+1}), the last closed). Bin 0 is the hardest. The released code's [0, .1, .2, .4, .6, .8, "
                ".9, 1] are 8 edges, i.e. 7 bins (bin_00 .. bin_06)."
            ),
        },
    )
    window: StrictInt = field(
        default=50,
        metadata={
            "brief": "H, visits in a prompt's sliding window",
            "range": Range(lo=1, integer=True),
            "help": (
                "H, the number of most recent visits a prompt's statistic is computed over (authors' scripts: 50 "
                "or 100)."
            ),
        },
    )
    half_life: StrictFloat | None = field(
        default=None,
        metadata={
            "brief": "``null`` = window mean; h: visit j ago weighs 2^(−j/h)",
            "range": Range(lo=0, lo_open=True),
            "help": (
                "recency weighting of a prompt's visits, in visits. ``null`` (default): the plain mean over the "
                "last ``window`` visits. A number h: every visit of the prompt so far, the one j visits ago "
                "weighted 2^(-j/h), so p̂ follows a prompt the model is learning instead of averaging over its "
                "whole history (with H = 50, a 1,000-step DAPO run visits a prompt ~18 times, so the window never"
                " fills); ``window`` is then unused."
            ),
        },
    )
    hysteresis: StrictFloat = field(
        default=0.0,
        metadata={
            "brief": "δ, margin beyond a bin edge before a prompt moves",
            "range": Range(0, 0.5, hi_open=True),
            "help": (
                "δ, a prompt leaves its bin only when its statistic is beyond the bin's boundary by more than δ "
                "(authors' scripts: 0.03 for Prompt-GDRO, 0 for Rollout-GDRO)."
            ),
        },
    )
    unseen: UnseenMode = field(
        default=UnseenMode.own_bin,
        metadata={
            "brief": "never-visited prompts: own group ``unseen``, or ``prior``",
            "help": (
                "how never-visited prompts are grouped. ``own_bin`` (default) gives them a separate group K that "
                "both adversaries treat like any other bin; ``prior`` puts them in the bin that contains "
                '``unseen_prior``. Never "hardest bin" (the released code\'s accuracy-0 default makes every fresh '
                "prompt look maximally hard)."
            ),
        },
    )
    unseen_prior: StrictFloat = field(
        default=0.5,
        metadata={
            "brief": "prior accuracy for ``unseen=prior``",
            "range": Range(0, 1),
            "help": "prior accuracy used by ``unseen=prior``.",
        },
    )

    def __post_init__(self) -> None:
        _check_ranges(self, "binner")
        if self.bin_edges is not None:
            edges = [float(e) for e in self.bin_edges]
            if len(edges) < 2:
                _fail("binner.bin_edges", self.bin_edges, "needs at least two edges (0 and 1)")
            if edges[0] != 0.0 or edges[-1] != 1.0:
                _fail("binner.bin_edges", self.bin_edges, "must start at 0 and end at 1")
            if any(b <= a for a, b in itertools.pairwise(edges)):
                _fail("binner.bin_edges", self.bin_edges, "must be strictly increasing")
            self.bin_edges = edges
            self.num_bins = len(edges) - 1
        self.unseen = _choice("binner.unseen", UnseenMode, self.unseen)

    def edges(self) -> list[float]:
        """The K+1 bin edges in use."""
        if self.bin_edges is not None:
            return list(self.bin_edges)
        return [i / self.num_bins for i in range(self.num_bins + 1)]


@with_config(_FORBID_EXTRA)
@dataclass
class PromptGDROConfig:
    """Prompt-GDRO, the data adversary: EMA-debiased EXP3P over bins (paper Eq. 12-16, App. A.2.1)."""

    enable: StrictBool = field(
        default=False,
        metadata={
            "brief": "Prompt-GDRO on/off",
            "help": "multiply each response's GRPO advantage by its bin's adversary weight.",
        },
    )
    eta: StrictFloat = field(
        default=0.65,
        metadata={
            "brief": "η, EXP3P learning rate (Eq. 15)",
            "range": Range(lo=0, lo_open=True),
            "help": "η_q, the EXP3P learning rate in ω(b) = exp(η · clip(S(b), -C, C)).",
        },
    )
    gamma: StrictFloat = field(
        default=0.01,
        metadata={
            "brief": "γ, uniform exploration in q(b) (Eq. 16)",
            "range": Range(0, 1),
            "help": "γ, uniform exploration mixed into q(b) = (1-γ) ω(b)/Σω + γ/K.",
        },
    )
    beta: StrictFloat = field(
        default=0.12,
        metadata={
            "brief": "β, EMA rate of the debiased score (Eq. 14)",
            "range": Range(0, 1, lo_open=True),
            "help": "β, the EMA rate of the debiased score S(b) ← (1-β) S(b) + β ℓ̄(b)/q̂(b).",
        },
    )
    score_clip: StrictFloat = field(
        default=5.0,
        metadata={
            "brief": "C, score clip before exp (ours)",
            "range": Range(lo=0, lo_open=True),
            "help": "C, the score clip before exponentiation (keeps ω finite).",
        },
    )
    weight_cap: StrictFloat = field(
        default=15.0,
        metadata={
            "brief": "ω_max, cap on a response's multiplier",
            "range": Range(lo=1),
            "help": "ω_max, per-response multipliers are capped here after normalisation.",
        },
    )
    share_floor: StrictFloat = field(
        default=0.01,
        metadata={
            "brief": "floor on the realised share q̂(b)",
            "range": Range(0, 1, lo_open=True),
            "help": "floor on the realised batch share q̂(b) in the debiasing division.",
        },
    )
    loss_signal: LossSignal = field(
        default=LossSignal.learnability,
        metadata={
            "brief": "``learnability`` p̂(1−p̂), ``failure_rate``, ``mean_abs_advantage``",
            "help": (
                "the per-prompt loss ℓ(x) the adversary sees (see :mod:`verl_ext.prompt_gdro`): ``learnability`` "
                "p̂(1-p̂), ``failure_rate`` 1-p̂, ``mean_abs_advantage`` mean |A|."
            ),
        },
    )
    rollout_coupling: Coupling = field(
        default=Coupling.none,
        metadata={
            "brief": "joint mode: ``none`` or ``divide_by_allocation``",
            "help": (
                "joint mode only. ``divide_by_allocation`` divides a prompt's weight by n(x)/n̄ so a prompt given"
                " more rollouts does not also get more total weight through its extra tokens; ``none`` leaves "
                "weights as they are."
            ),
        },
    )
    normalize: NormalizeMode = field(
        default=NormalizeMode.advantage_mass,
        metadata={
            "brief": "``advantage_mass`` (keeps Σ|A|) or ``all_responses`` (mean 1)",
            "help": (
                "how multipliers are normalised. ``advantage_mass`` (default): Σ|A·m| = Σ|A| over the batch, so "
                "Prompt-GDRO changes the update's direction, not its size (needs |A| per response). "
                "``all_responses``: mean 1 over all responses (the released code's; zero-advantage groups make it"
                " a larger step size)."
            ),
        },
    )
    lagged: StrictBool = field(
        default=False,
        metadata={
            "brief": "``true``: weights from the scores before this step's update",
            "help": (
                "weights from the scores before this step's update (the step's own outcomes do not scale its own "
                "advantages); false uses the updated scores."
            ),
        },
    )
    min_group_prompts: StrictFloat = field(
        default=8.0,
        metadata={
            "brief": "k₀, evidence pseudo-count; ``0`` = off",
            "range": Range(lo=0),
            "help": (
                "k0, evidence pseudo-count. A bin with c prompts in the batch moves its score by β·c/(c+k0) of "
                "the way to its debiased loss (c/(c+k0) at its first observation, from the batch's reference "
                "level), so a bin holding one prompt, or the few unseen prompts left after an epoch, cannot swing"
                " a weight. 0 = no evidence weighting (Eq. 14 as printed needs ``score_init=zero`` too)."
            ),
        },
    )
    score_init: ScoreInit = field(
        default=ScoreInit.first_observation,
        metadata={
            "brief": "``first_observation`` or the paper's S₀ = 0 (``zero``)",
            "help": (
                "where a bin's score starts. ``first_observation`` (default): the bin's first observation sets it"
                " (shrunk toward the batch's reference level), so a bin first seen late is not under-weighted for"
                " ~1/β steps. ``zero``: the paper's S_0(b) = 0, every observation an EMA step; with "
                "``min_group_prompts=0`` this is Eq. 14 as printed."
            ),
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            _fail("prompt.enable", self.enable, "must be true or false")
        self.score_init = _choice("prompt.score_init", ScoreInit, self.score_init)
        if not isinstance(self.lagged, bool):
            _fail("prompt.lagged", self.lagged, "must be true or false")
        self.normalize = _choice("prompt.normalize", NormalizeMode, self.normalize)
        _check_ranges(self, "prompt")
        self.loss_signal = _choice("prompt.loss_signal", LossSignal, self.loss_signal)
        self.rollout_coupling = _choice("prompt.rollout_coupling", Coupling, self.rollout_coupling)


N_MAX_PER_MEAN = 3  # the appendix's n_max = 3·n̄ (12 at n̄ = 4), RolloutGDROConfig.n_max's default


@with_config(_FORBID_EXTRA)
@dataclass
class RolloutGDROConfig:
    """Rollout-GDRO, the compute adversary (paper Eq. 17-21, §4.3, App. A.2.2)."""

    enable: StrictBool = field(
        default=False,
        metadata={
            "brief": "Rollout-GDRO on/off",
            "help": "schedule per-prompt rollout counts; otherwise every prompt gets ``n_mean``.",
        },
    )
    allocator: Allocator = field(
        default=Allocator.sqrt,
        metadata={
            "brief": (
                "``sqrt`` (Eq. 17-21), ``hedge`` (``bandit`` alias), ``knapsack``, ``discovery``, "
                "``failure_weighted``, ``fixed_tail_share`` (control), ``uniform``"
            ),
            "help": (
                "``sqrt`` (square-root law via the shadow price), ``hedge`` (per-bin full-information Hedge over "
                "arms with an exact-budget DP; not the paper's EXP3P, see :mod:`verl_ext.rollout_gdro`; "
                "``bandit`` is its earlier name and runs the same code), ``knapsack`` (Knapsack-RL's value rule),"
                " ``discovery`` (most expected groups with both a success and a failure, under a Beta posterior"
                " per prompt), ``failure_weighted`` (the same groups, each weighted by the slope of the "
                "prompt's pass@k, k (1 - p)^(k-1): rollouts toward the prompts the policy fails), "
                "``fixed_tail_share`` (a positive control for studies: ``tail_share_factor`` · n̄ to every prompt "
                "with windowed p̂ < ``tail_threshold``), ``uniform``."
            ),
        },
    )
    n_mean: StrictInt = field(
        default=4,
        metadata={
            "brief": "n̄; follows ``actor_rollout_ref.rollout.n`` (set that)",
            "help": (
                "n̄, the mean rollouts per prompt; Σ_i n(x_i) = B · n̄ exactly every step. The recipe ties it to "
                "``actor_rollout_ref.rollout.n``."
            ),
        },
    )
    n_min: StrictInt = field(
        default=2,
        metadata={
            "brief": "smallest count for any prompt (≥ 2)",
            "help": (
                "smallest count for any prompt; at least 2 (a GRPO group of one gets its raw reward as advantage "
                "in verl)."
            ),
        },
    )
    n_max: StrictInt | None = field(
        default=None,
        metadata={
            "brief": "largest count for any prompt; ``null`` = 3·n̄ (appendix: 12)",
            "derived": True,
            "help": (
                "largest count for any prompt. ``null`` (default): N_MAX_PER_MEAN · n̄ = 3·n̄, the appendix's rule "
                "(12 at its n̄ = 4), resolved here so the recipe, the simulator and the benchmarks share it."
            ),
        },
    )
    mu_lr: StrictFloat = field(
        default=0.05,
        metadata={
            "brief": "α_μ, dual-ascent step on log μ",
            "range": Range(lo=0, lo_open=True),
            "help": (
                "α_μ, the dual-ascent step on the shadow price, taken in log space: log μ ← log μ + α_μ (n̂ - "
                "n̄), with n̂ the mean of the unrepaired proposal; log μ is projected onto the range where it "
                "still changes the allocation."
            ),
        },
    )
    mu_init: StrictFloat | None = field(
        default=None,
        metadata={
            "brief": "initial μ; ``null`` clears the first budget",
            "range": Range(lo=0, lo_open=True),
            "help": "initial μ; ``None`` clears the first batch's budget exactly.",
        },
    )
    variance_beta: StrictFloat = field(
        default=0.1,
        metadata={
            "brief": "EMA rate of each bin's variance v_b",
            "range": Range(0, 1, lo_open=True),
            "help": "EMA rate of each bin's within-group reward variance v_b.",
        },
    )
    variance_prior: StrictFloat = field(
        default=0.25,
        metadata={
            "brief": "v_b of a bin never observed",
            "range": Range(0, 1, lo_open=True),
            "help": "v_b for a bin never observed (Bernoulli maximum 0.25); a bin's first observation replaces it.",
        },
    )
    variance_floor: StrictFloat = field(
        default=1e-3,
        metadata={
            "brief": "floor on v_b",
            "range": Range(0, 1, lo_open=True),
            "help": "lower bound on v_b, so a solved bin still has a finite price.",
        },
    )
    variance_source: VarianceSource = field(
        default=VarianceSource.bin,
        metadata={
            "brief": "``bin`` (v_b) or ``prompt`` (own, shrunk toward v_b)",
            "help": (
                "the variance the ``sqrt`` allocator and the exact-budget repair use per prompt. ``bin``: the "
                "bin's v_b. ``prompt``: the prompt's own windowed variance shrunk toward v_b (see "
                ":meth:`verl_ext.rollout_gdro.RolloutGDRO.prompt_variance_estimate`)."
            ),
        },
    )
    variance_shrinkage: StrictFloat = field(
        default=8.0,
        metadata={
            "brief": "κ, weight of v_b in the per-prompt variance",
            "range": Range(lo=0),
            "help": "κ, the prior strength (in rollouts) of v_b in the per-prompt estimate.",
        },
    )
    bandit_eta: StrictFloat = field(
        default=5.0,
        metadata={
            "brief": "``hedge``: learning rate (released: 0.65)",
            "range": Range(lo=0, lo_open=True),
            "help": "``hedge``: learning rate on the per-(bin, arm) scores rescaled to [0, 1] per bin.",
        },
    )
    bandit_gamma: StrictFloat = field(
        default=0.05,
        metadata={
            "brief": "``hedge``: exploration over arms",
            "range": Range(0, 1),
            "help": "``hedge``: uniform exploration mixed into the per-bin arm distribution.",
        },
    )
    bandit_beta: StrictFloat = field(
        default=0.12,
        metadata={
            "brief": "``hedge``: EMA rate of arm scores (released: 0.4)",
            "range": Range(0, 1, lo_open=True),
            "help": "``hedge``: EMA rate of the per-(bin, arm) scores.",
        },
    )
    seed: StrictInt = field(
        default=0,
        metadata={"brief": "RNG seed (checkpointed)", "help": "RNG seed (the bandit's exploration; ties)."},
    )
    budget: Budget = field(
        default=Budget.rollouts,
        metadata={
            "brief": "``rollouts`` (Σn = B·n̄) or ``tokens`` (also tokens ≤ uniform's)",
            "help": (
                "what the allocation holds fixed. ``rollouts``: Σ n = B·n̄ only. ``tokens``: also the expected "
                "generated tokens Σ n_x ĉ_x <= Σ n̄ ĉ_x (the uniform allocation's), via a second dual variable λ "
                "(see :mod:`verl_ext.rollout_gdro`); every allocator honours it through the exact two-constraint "
                "repair (``uniform`` meets it with equality)."
            ),
        },
    )
    token_lr: StrictFloat = field(
        default=1.0,
        metadata={
            "brief": "``budget=tokens``: dual step on the token price",
            "range": Range(lo=0, lo_open=True),
            "help": (
                "α_λ, the projected dual-ascent step on the token price ρ = λ c̄ / μ (relative units): ρ ← max(0,"
                " ρ + α_λ (T̂ / T_uniform - 1)) with T̂ the proposal's expected tokens."
            ),
        },
    )
    failure_weight_k: StrictInt = field(
        default=8,
        metadata={
            "brief": "``failure_weighted``: pass@k's k",
            "range": Range(lo=1, integer=True),
            "help": (
                "``failure_weighted`` only: each prompt's informative groups are weighted by the slope of its "
                "pass@k, k (1 - p)^(k-1) (2: the failure rate 1 - p; 1: ``discovery``'s unweighted count; the "
                "default 8 is the studies' pass@8)."
            ),
        },
    )
    tail_threshold: StrictFloat = field(
        default=0.1,
        metadata={
            "brief": "control: p̂ below it = tail",
            "range": Range(0, 1, lo_open=True),
            "help": (
                "``fixed_tail_share`` only (a positive control): a prompt seen in its window with pass rate p̂ "
                "below this is in the tail; unseen prompts never are."
            ),
        },
    )
    tail_share_factor: StrictFloat = field(
        default=2.0,
        metadata={
            "brief": "control: tail count / n̄",
            "range": Range(lo=1),
            "help": (
                "``fixed_tail_share`` only: each tail prompt gets this times n̄ rollouts (at most n_max), the "
                "others share the rest equally (at least n_min; a tail too large for it shares what is left)."
            ),
        },
    )
    length_beta: StrictFloat = field(
        default=0.3,
        metadata={
            "brief": "EMA rate of response length ĉ",
            "range": Range(0, 1, lo_open=True),
            "help": (
                "EMA rate of the per-prompt (per visit) and per-bin (per step) mean response length ĉ, kept for "
                "the token metrics in every run and used by ``budget=tokens``."
            ),
        },
    )
    length_shrinkage: StrictFloat = field(
        default=8.0,
        metadata={
            "brief": "κ, weight of the bin's mean length in ĉ",
            "range": Range(lo=0),
            "help": (
                "κ, the prior strength (in responses) of the bin's mean length in a prompt's expected length ĉ "
                "(see :mod:`verl_ext.tokens`); 0 uses the prompt's own EMA."
            ),
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            _fail("rollout.enable", self.enable, "must be true or false")
        self.allocator = _choice("rollout.allocator", Allocator, self.allocator)
        for name in ("n_mean", "n_min", "n_max", "seed"):
            value = getattr(self, name)
            if (value is not None or name != "n_max") and (not isinstance(value, int) or isinstance(value, bool)):
                _fail(f"rollout.{name}", value, "must be an integer")
        if self.n_min < 2:
            _fail("rollout.n_min", self.n_min, "must be >= 2 (a GRPO group of one rollout has no baseline)")
        if self.n_min > self.n_mean:
            _fail("rollout.n_min", self.n_min, f"must be <= rollout.n_mean={self.n_mean}")
        if self.n_max is None:
            self.n_max = N_MAX_PER_MEAN * self.n_mean
        if self.n_max < self.n_mean:
            _fail("rollout.n_max", self.n_max, f"must be >= rollout.n_mean={self.n_mean}")
        if self.n_max > 4096:
            _fail("rollout.n_max", self.n_max, "must be <= 4096")
        self.variance_source = _choice("rollout.variance_source", VarianceSource, self.variance_source)
        self.budget = _choice("rollout.budget", Budget, self.budget)
        _check_ranges(self, "rollout")


@with_config(_FORBID_EXTRA)
@dataclass
class GDROConfig:
    """The controllers' part of the ``gdro:`` section: the binner, the two adversaries, ``observe``.

    The recipe's own keys of that section (``gdro.dry_run``, ``gdro.metrics_file``, ``gdro.backend``)
    are not the controllers' business: :mod:`recipe.gdro.startup.recipe_config` owns them.
    """

    binner: BinnerConfig = field(
        default_factory=BinnerConfig,
        metadata={"help": "the online difficulty binner, shared by both adversaries."},
    )
    prompt: PromptGDROConfig = field(
        default_factory=PromptGDROConfig,
        metadata={"help": "Prompt-GDRO (advantage reweighting)."},
    )
    rollout: RolloutGDROConfig = field(
        default_factory=RolloutGDROConfig,
        metadata={"help": "Rollout-GDRO (rollout allocation)."},
    )
    observe: StrictBool = field(
        default=True,
        metadata={
            "brief": "adversaries off: still bin and log ``gdro/*``; ``false`` skips GDRO",
            "help": (
                "with both adversaries off, still run the binner and log the ``gdro/*`` metrics (advantages and "
                "rollout counts stay exactly verl's), so a GRPO baseline can be compared with the GDRO runs bin "
                "by bin. Set false to skip the driver work altogether."
            ),
        },
    )

    @property
    def enabled(self) -> bool:
        """True when at least one adversary changes training."""
        return self.prompt.enable or self.rollout.enable

    @property
    def active(self) -> bool:
        """True when the controller runs at all (an adversary is on, or observe-only)."""
        return self.enabled or self.observe


# ------------------------------------------------------------------ pydantic errors and ranges as one line
# Shared by every typed config the project reads (this GDRO config, the simulator's scenario, the study's
# protocol): each formats its own one-line error from these pieces.
TYPE_WANTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "too_short": "a non-empty list",
    "string_too_short": "a non-empty string",
    "dict_type": "a mapping",
}


def error_key(loc: Iterable[Any]) -> str:
    """``skills[0].difficulty.std`` from pydantic's error location ``("skills", 0, "difficulty", "std")``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def value_at(data: Any, loc: Iterable[Any]) -> Any:
    """The input value at pydantic's error location ``loc`` (or ``None`` when it is missing)."""
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _bare(annotation: Any) -> Any:
    """``X`` from ``Annotated[X, ...]`` and ``Optional[X]`` (a union of several types stays as it is)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _bare(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _bare(args[0]) if len(args) == 1 else annotation
    return annotation


def fields_at(root: type, loc: Sequence[Any]) -> list[str]:
    """Field names of the dataclass that holds the key at ``loc`` under ``root`` (for did-you-mean),
    through nested dataclasses, lists (``[i]``) and mappings (``.name``) of them."""
    cls: Any = root
    for part in loc[:-1]:
        cls = _bare(cls)
        if dataclasses.is_dataclass(cls):
            cls = typing.get_type_hints(cls, include_extras=True).get(part)
        elif typing.get_origin(cls) in (list, tuple, dict):
            cls = typing.get_args(cls)[-1] if typing.get_args(cls) else None
    cls = _bare(cls)
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def set_fields(obj: Any, path: str = "") -> Iterator[tuple[str, Mapping[str, Any], Any]]:
    """``(key, field metadata, value)`` of every set (not ``None``) value of the dataclass ``obj``, recursively:
    nested dataclasses, and the items of lists (``key[i]``) and mappings (``key.name``), which share their
    field's metadata (so a ``range`` on ``lr_grid: list[float]`` bounds each lr)."""
    for f in dataclasses.fields(obj):
        key = f"{path}.{f.name}" if path else f.name
        value = getattr(obj, f.name)
        items = (
            [(f"{key}[{i}]", v) for i, v in enumerate(value)]
            if isinstance(value, (list, tuple))
            else [(f"{key}.{k}", v) for k, v in value.items()]
            if isinstance(value, dict)
            else [(key, value)]
        )
        for item_key, item in items:
            if dataclasses.is_dataclass(item):
                yield from set_fields(item, item_key)
            elif item is not None:
                yield item_key, f.metadata, item


def range_violation(obj: Any, path: str = "") -> tuple[str, Any, str] | None:
    """The first number of ``obj`` (:func:`set_fields`) outside its field's ``range``: ``(key, value, why)``."""
    for key, metadata, value in set_fields(obj, path):
        why = metadata["range"].violation(value) if "range" in metadata else None
        if why:
            return key, value, why
    return None


def _config_error(error: Mapping[str, Any], data: Any) -> GDROConfigError:
    """pydantic's first error as one :class:`GDROConfigError` line naming ``gdro.<key>`` and the value."""
    kind, loc = error["type"], tuple(error["loc"])
    if kind == "value_error" and isinstance(error.get("ctx", {}).get("error"), GDROConfigError):
        return error["ctx"]["error"]  # a dataclass's own __post_init__ check: its message as it is
    keys = tuple(itertools.takewhile(lambda part: isinstance(part, str), loc))  # list indices dropped
    path = ".".join(("gdro", *keys))
    value = value_at(data, keys)
    if kind == "unexpected_keyword_argument":
        valid = fields_at(GDROConfig, keys)
        close = difflib.get_close_matches(keys[-1], valid, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        where = ".".join(("gdro", *keys[:-1]))
        listed = ", ".join(valid)
        return GDROConfigError(f"gdro config: unknown key(s) {path}{hint} (valid keys under {where}: {listed})")
    if kind in ("int_type", "float_type", "bool_type"):
        strings = value if isinstance(value, (list, tuple)) else [value]
        why = ", not a string" if any(isinstance(v, str) for v in strings) else ""
        return GDROConfigError(f"gdro config: {path}={value!r} must be {TYPE_WANTED[kind]}{why}")
    if kind == "list_type":
        return GDROConfigError(f"gdro config: {path}={value!r} must be a list of numbers")
    if kind in ("dataclass_type", "dict_type"):
        return GDROConfigError(f"gdro config: {path} must be a mapping of its keys, got {value!r}")
    if kind == "choice":
        return GDROConfigError(f"gdro config: {path}={value!r} is invalid: {error['msg']}")
    return GDROConfigError(f"gdro config: {path}={value!r}: {error['msg']}")


@functools.cache
def _adapter() -> Any:
    import pydantic

    return pydantic.TypeAdapter(GDROConfig)


def gdro_config_from_dict(data: Any) -> GDROConfig:
    """Build a validated :class:`GDROConfig` from a mapping (e.g. the Hydra ``gdro`` section).

    pydantic validates the mapping against the dataclasses (``extra="forbid"``; numbers and booleans
    are pydantic's strict types, so a string is refused where OmegaConf would convert it; a choice is
    :class:`Choice`'s own validator), then each dataclass's ``__post_init__`` checks ranges and
    cross-field rules. Raises :class:`GDROConfigError` naming the key for unknown keys (with a
    did-you-mean), wrong types and impossible values.
    """
    import pydantic
    from omegaconf import DictConfig, OmegaConf

    if isinstance(data, DictConfig):
        data = OmegaConf.to_container(data, resolve=True)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise GDROConfigError(f"gdro config: gdro must be a mapping, got {data!r}")
    data = dict(data)
    for section in ("binner", "prompt", "rollout"):
        if section in data and data[section] is None:
            data[section] = {}  # an empty YAML section means "all defaults"
    try:
        return _adapter().validate_python(data)
    except pydantic.ValidationError as e:
        raise _config_error(e.errors()[0], data) from None


def gdro_config_to_dict(config: GDROConfig) -> dict[str, Any]:
    """The plain-dict form of a config (for logging and checkpoints); choices as their strings."""
    return dataclasses.asdict(config, dict_factory=lambda items: {k: _plain(v) for k, v in items})


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Choice) else value
