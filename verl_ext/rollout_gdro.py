"""Rollout-GDRO: the compute adversary, per-prompt rollout counts under a fixed mean budget.

Paper Eq. 17-21 (§4.3, App. A.2.2). A step draws B prompts; prompt x_i in group b_i gets n_i
rollouts with

    Σ_i n_i = B · n̄  exactly,   n_min <= n_i <= n_max,   n_min >= 2.

Variance analysis: the group-mean estimator of bin b has variance ≈ v_b / n_b. Minimising
Σ_b q̂_b v_b / n_b under the budget gives, with shadow price μ on the budget constraint,

    n_b(μ) = √(v_b / μ)        (the square-root law, n_b ∝ √v_b)                    (Eq. 19-20)

and μ follows dual ascent on the budget violation (Eq. 21). We take the step in log space,
log μ ← log μ + α_μ (n̂ - n̄), because μ's scale is v/n² (≈ 0.01 at n̄ = 4): an additive step of
α_μ = 0.05 would overshoot by a factor of five. n̂ is the mean of the allocator's own, unrepaired
proposal, so μ moves whenever the proposal misses the budget (in the released code μ only moved
when the budget was already met, so it never moved).

v_b, the within-group reward variance of bin b, is an EMA over steps of the unbiased per-prompt
sample variance s² = p̂(1 - p̂) n/(n - 1) of the 0/1 outcomes, averaged over the bin's prompts;
a bin never observed has ``variance_prior``.

Allocators (same interface, chosen by ``rollout.allocator``):

* ``sqrt``: n_i = clip(√(v_{b_i} / μ), n_min, n_max), rounded, then repaired to the exact total.
* ``hedge`` (earlier name ``bandit``, still accepted): per-bin exponential weights over arms
  n ∈ {n_min..n_max}. It is *not* the paper's EXP3P: EXP3P sees only the pulled arm's loss and
  importance-weights it; this is full-information Hedge on per-bin rescaled losses, with η = 5
  and Gumbel noise inside the DP (reasons below). Each
  (bin, arm) keeps an EMA score of the Lagrangian loss L_b(n) = v̂_b / n + μ n, rescaled per bin
  to [0, 1] over the arms; π_b(n) = (1-γ) softmax(-η S_b)(n) + γ/#arms. Every step an exact-budget
  dynamic programme picks one arm per bin maximising Σ_b |B_b| (log π_b(n) + G_b(n)) with Gumbel
  noise G (so, without the budget, each bin would sample its arm from π_b). Fixed relative to the
  released code: EMA, not cumulative, scores; lower Lagrangian loss is better (the released update
  rewarded higher loss); μ moves on the gap between the bins' preferred arms (argmin S_b, weighted
  by |B_b|) and n̄ (in the released code μ never moved); the allocation is keyed by each prompt's
  own group, not by batch position. Once v̂_b is observed the loss of *every* arm is known, so all
  arms are updated (full information, as in Hedge): with importance-weighted pulled-arm updates the
  arms the budget never affords keep their initial score, look best forever, and drive μ to
  overflow (found by the simulator). A bin whose arms were never scored (never observed while the
  allocator ran) has no preference: its flat scores would argmin to n_min and pull μ down, so it
  is left out of the budget-pressure mean (no μ step while no bin present has been scored).
* ``knapsack``: Knapsack-RL's value (1 - p^N - (1 - p)^N) · p (1 - p)² per prompt
  (arXiv 2509.25849), filled greedily by marginal value from n_min.
* ``discovery``: maximise the expected number of *informative* groups (a group with at least one
  success and one failure; only those carry a GRPO gradient). For prompt i with window counts
  k_i correct of m_i and a Jeffreys prior, p_i ~ Beta(k_i + ½, m_i - k_i + ½), and

      value_i(n) = P(0 < successes < n) = 1 - E[p_i^n] - E[(1 - p_i)^n],

  with E[p^n] = Π_{j<n} (a + j) / (a + b + j) for Beta(a, b). Its marginal gain
  E[p^{n-1}(1-p)] + E[(1-p)^{n-1} p] falls with n, so granting the B (n̄ - n_min) increments of
  largest gain from n_min (one top-k) is the exact optimum. The ``sqrt`` law gives a rare-success
  prompt (p ≈ 0.05) few rollouts because p(1 - p) is small, yet more rollouts are what find its
  first success (HORA, arXiv 2605.07114, makes the same argument); here a prompt that has failed
  m times has posterior mean ½/(m + 1), so a prompt the model keeps failing loses its claim.
* ``failure_weighted``: maximise the expected number of informative groups, each weighted by how
  much a gradient on its prompt can raise the prompt's pass@k: the slope d/dp [1 - (1 - p)^k] =
  k (1 - p)^(k-1), large for the prompts the policy fails (k = ``failure_weight_k``, default 8, the
  studies' pass@8; at k = 2 the weight is 1 - p, the prompt's pass@1 headroom; k = 1 is
  ``discovery``). Under the same window posterior p_i ~ Beta(k_i + ½, m_i - k_i + ½) (k_i correct),

      maximise Σ_i V_i(n_i),   V_i(n) = E[(1 - p_i)^(k-1) (1 - p_i^n - (1 - p_i)^n)],
      subject to Σ_i n_i = B n̄,  n_min <= n_i <= n_max.

  Its increment Δ_i(n) = E[p^n (1 - p)^k] + E[p (1 - p)^(n+k-1)] (:func:`failure_weighted_gains`)
  falls with n, so V_i is concave and the one top-k of the B (n̄ - n_min) largest increments from
  n_min is the exact optimum. The weight moves rollouts from mostly-solved and middling prompts to
  rarely-solved ones: at a known p, Δ(2) at k = 2 is 0.009 for p = 0.9 against ``discovery``'s 0.090;
  ``discovery`` counts a group of a 90%-solved prompt as much as one of a 5%-solved prompt. On a
  v2-like mix (2048 prompts, 64 a step, 29% with p ~ Beta(0.3, 12), the rest U(0.1, 1), a frozen
  policy, steps 101-200) the tail's rollouts per prompt are 2.31 under ``sqrt``, 2.45 under
  ``discovery``, 3.23 at k = 2, 4.43 at k = 4 and 5.97 at k = 8 (n̄ = 4). Prompts that never
  succeed: with none correct in m windowed rollouts the posterior mean is ½/(m + 1) and every
  increment is below E[p^2] + E[p] <= 2 E[p] = 1/(m + 1), whatever k (k = 2: Δ(2) = 0.021 after 20
  failed rollouts, 0.009 after 50, 0.0025 after 200), so each all-fail visit lowers the prompt's
  claim, faster the more rollouts it was given: an unlearnable prompt cannot keep the budget. The
  window bounds m (``binner.window`` visits), so a never-solved prompt keeps a small claim rather
  than none, and one success in the window restores it. An unseen prompt (m = 0, Beta(½, ½)) is
  worth exploring, as under ``discovery``.
* ``fixed_tail_share`` (a *positive control* for studies, not a method): prompts seen with
  windowed p̂ < ``tail_threshold`` get ``tail_share_factor`` · n̄ each (at most n_max), the others
  share the rest equally (:func:`fixed_tail_share`). It states no objective; it tests whether
  tail-directed compute can move the tail at all.
* ``uniform``: n_i = n̄.

The repair that makes any proposal exact adds the rollouts with the largest marginal variance
reduction v/(k(k-1)) (or removes those with the smallest), one vectorised top-k selection.

Per-prompt variance (``variance_source=prompt``): bin 0 mixes unsolvable prompts (variance 0)
with hard-but-solvable ones, so the bin's v_b wastes rollouts on the former. Each prompt's own
window (the binner's Σ correct = k and Σ rollouts = m over its last H visits) gives the unbiased
s² = k(m-k) / (m(m-1)) with d = m - 1 degrees of freedom; it is shrunk toward its bin's v_b,

    v_i = (d s² + κ v_b) / (d + κ)                                   (κ = ``variance_shrinkage``)

the posterior mean of a prompt's variance under a prior centred on the bin's empirical v_b
(empirical Bayes: the prior is estimated from the data) worth κ rollouts. An unseen prompt gets
v_b. O(batch): two gathers from the binner's running sums.

Token budget (``budget=tokens``). Rollouts are not what a step costs; generated tokens are, and
hard prompts write longer responses. With ĉ_i the expected response length of prompt i (its EMA
over visits; an unseen prompt takes its bin's, a bin not yet seen the batch mean), minimise

    Σ_i v_i / n_i   subject to   Σ_i n_i = B n̄   (verl's batch shape)
                                 Σ_i ĉ_i n_i <= n̄ Σ_i ĉ_i   (the uniform allocation's tokens)

over n_min <= n_i <= n_max. The Lagrangian Σ v_i/n_i + μ (Σ n_i - B n̄) + λ (Σ ĉ_i n_i - n̄ Σ ĉ_i)
with λ >= 0 is separable; ∂/∂n_i = -v_i/n_i² + μ + λ ĉ_i = 0 gives

    n_i = √(v_i / (μ + λ ĉ_i)),   clipped to [n_min, n_max],

with complementary slackness λ (Σ ĉ n - n̄ Σ ĉ) = 0: λ = 0 while the token constraint is slack
(the square-root law unchanged), λ > 0 moves rollouts from long to short prompts at equal v. We
keep λ in relative units, ρ = λ c̄ / μ (c̄ the batch's mean ĉ), so n_i = √(v_i / (μ (1 + ρ ĉ_i/c̄)))
and ρ is dimensionless; ρ follows projected dual ascent ρ ← max(0, ρ + α_λ (T̂/T_u - 1)) on the
proposal's expected tokens T̂ against uniform's T_u (``token_lr``), as μ does on the count. The
integer allocation is made exact by :func:`repair_to_budget` (count) and then
:func:`repair_to_token_budget` (tokens, keeping the count and the bounds), which every allocator
goes through, so ``bandit``, ``knapsack`` and ``uniform`` honour the token budget too.

The weighted standard-error proxy se(n) = √(Σ_i v_{b_i} / n_i) / B is reported for the
realised allocation and for the uniform counterfactual n_i = n̄ (the paper reports 22.6-37.1%
reductions). :func:`allocation_quality` adds the per-prompt oracle: the exact integer optimum of
Σ v_i / n_i under the same budget and bounds, and the share of its reduction an allocation gets.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verl_ext.config import RolloutGDROConfig

# Allocators that read each prompt's window counts (Σ correct, Σ rollouts) instead of its bin.
WINDOW_ALLOCATORS = ("discovery", "failure_weighted", "fixed_tail_share")
_TIE_BREAK = 1e-12  # prefers spreading extra rollouts over piling them on one prompt


def _top_k_increments(gains: np.ndarray, k: int) -> np.ndarray:
    """Count, per row, how many of the ``k`` largest entries of ``gains`` fall in that row.

    Rows must be non-increasing along axis 1 (a concave value), so the chosen entries of a row
    are a prefix of it and the count is the number of increments to grant.
    """
    rows, cols = gains.shape
    if k <= 0 or rows == 0 or cols == 0:
        return np.zeros(rows, dtype=np.int64)
    flat = gains.ravel()
    k = min(k, int(np.count_nonzero(np.isfinite(flat))))
    if k == 0:
        return np.zeros(rows, dtype=np.int64)
    chosen = np.argpartition(-flat, k - 1)[:k]
    return np.bincount(chosen // cols, minlength=rows).astype(np.int64)


def variance_gains_up(n: np.ndarray, v: np.ndarray, n_max: int) -> np.ndarray:
    """Matrix of marginal reductions v/(k(k-1)) for raising n_i to k = n_i+1 .. n_max (-inf past n_max)."""
    steps = np.arange(1, max(n_max - int(n.min(initial=n_max)), 0) + 1)  # enough columns for any row
    k = n[:, None] + steps[None, :]
    gains = v[:, None] / (k * (k - 1.0)) - _TIE_BREAK * k
    gains[k > n_max] = -np.inf
    return gains


def repair_to_budget(n: np.ndarray, v: np.ndarray, budget: int, n_min: int, n_max: int) -> np.ndarray:
    """Make Σ n = budget exactly within [n_min, n_max], moving the least variance-costly rollouts."""
    n = np.clip(np.asarray(n, dtype=np.int64), n_min, n_max)
    gap = int(budget - n.sum())
    if gap > 0:
        n = n + _top_k_increments(variance_gains_up(n, v, n_max), gap)
    elif gap < 0:
        # Removing a rollout from k costs v/(k(k-1)); pick the |gap| cheapest (k = n_i, n_i - 1, ...).
        steps = np.arange(0, n_max)
        k = n[:, None] - steps[None, :]
        safe_k = np.maximum(k, 2)  # rows past n_min are masked below; avoid 0-division there
        cost = np.where(k <= n_min, np.inf, v[:, None] / (safe_k * (safe_k - 1.0)) - _TIE_BREAK * k)
        n = n - _top_k_increments(-cost, -gap)
    return n


def token_excess(n: Any, cost: Any, n_mean: int) -> float:
    """Σ_i ĉ_i (n_i - n̄): expected tokens above the uniform allocation's (<= 0 means within budget)."""
    return float(np.dot(np.asarray(cost, dtype=np.float64), np.asarray(n, dtype=np.int64) - int(n_mean)))


def repair_to_token_budget(
    n: Any, v: Any, cost: Any, n_mean: int, n_min: int, n_max: int, rel_tol: float = 1e-9
) -> np.ndarray:
    """Make Σ ĉ_i n_i <= n̄ Σ ĉ_i while keeping Σ n_i and every n_i in [n_min, n_max] (``budget=tokens``).

    ``n`` must already satisfy the count budget and the bounds (:func:`repair_to_budget`). While
    the allocation is over the token budget, one rollout moves from a donor i (n_i > n_min) to the
    receiver j of least ĉ_j (n_j < n_max) with ĉ_i > ĉ_j; among donors, the one with the smallest
    variance cost per token saved, v_i / (n_i (n_i - 1)) / (ĉ_i - ĉ_j). Every move keeps Σ n and the
    bounds and lowers the expected tokens strictly, so the loop ends; it cannot get stuck over
    budget: Σ ĉ (n - n̄) > 0 with Σ (n - n̄) = 0 implies some prompt above n̄ (a donor) has a larger
    ĉ than some prompt below n̄ (a receiver). ``rel_tol`` absorbs float rounding of Σ ĉ n̄.
    """
    n = np.asarray(n, dtype=np.int64).copy()
    v = np.asarray(v, dtype=np.float64)
    cost = np.asarray(cost, dtype=np.float64)
    if n.shape != cost.shape or v.shape != cost.shape:
        raise ValueError(f"repair_to_token_budget: {len(n)} counts, {len(v)} variances, {len(cost)} costs")
    tol = rel_tol * float(np.abs(cost).sum()) * max(int(n_mean), 1)
    excess = token_excess(n, cost, n_mean)
    for _ in range(len(n) * (n_max - n_min) * 4 + 1):
        if excess <= tol:
            excess = token_excess(n, cost, n_mean)  # exact, without the running sum's rounding
            if excess <= tol:
                return n
        receivers = np.flatnonzero(n < n_max)
        donors = np.flatnonzero(n > n_min)
        if len(receivers) == 0 or len(donors) == 0:
            break
        # Cheapest receiver; among equally cheap ones, the largest variance gain v/(n(n+1)).
        rc = cost[receivers]
        tied = receivers[rc == rc.min()]
        j = int(tied[np.argmax(v[tied] / (n[tied] * (n[tied] + 1.0)))])
        saving = cost[donors] - cost[j]
        ok = saving > 0
        if not ok.any():
            break
        d = donors[ok]
        i = int(d[np.argmin(v[d] / (n[d] * (n[d] - 1.0)) / saving[ok])])
        n[i] -= 1
        n[j] += 1
        excess -= cost[i] - cost[j]
    if token_excess(n, cost, n_mean) > tol:  # pragma: no cover - excluded by the argument above
        raise RuntimeError("repair_to_token_budget: could not meet the token budget")
    return n


def oracle_allocation(prompt_variance: Any, n_mean: int, n_min: int, n_max: int) -> np.ndarray:
    """Exact integer minimiser of Σ_i v_i / n_i subject to Σ n_i = B n̄, n_min <= n_i <= n_max.

    The objective is convex and separable, so granting the B (n̄ - n_min) increments with the
    largest marginal gains v_i / (k (k-1)) (greedy water-filling from n_min) is optimal; it is
    one vectorised top-k over a (B, n_max) gain matrix.
    """
    v = np.asarray(prompt_variance, dtype=np.float64)
    base = np.full(len(v), n_min, dtype=np.int64)
    return base + _top_k_increments(variance_gains_up(base, v, n_max), len(v) * (n_mean - n_min))


def allocation_quality(counts: Any, prompt_variance: Any, n_mean: int, n_min: int, n_max: int) -> dict[str, float]:
    """How good an allocation is for given per-prompt variances v_i, against uniform and the oracle.

    With V(n) = Σ_i v_i / n_i (the variance of the batch-mean estimator up to 1/B²) and the SE
    proxy se(n) = √V(n) / B:

    * ``se_proxy``, ``se_proxy_uniform`` (n_i = n̄), ``se_proxy_oracle`` (:func:`oracle_allocation`);
    * ``se_reduction`` = 1 - se / se_uniform, ``variance_reduction`` = 1 - V / V_uniform, and the
      oracle's ``oracle_se_reduction`` / ``oracle_variance_reduction``;
    * ``efficiency`` = se_reduction / oracle_se_reduction: the share of the achievable SE
      reduction obtained (1 = optimal, 0 = no better than uniform, < 0 = worse). When the oracle
      cannot improve on uniform (e.g. all v_i equal) it is 1.0 if the allocation is optimal too,
      else 0.0 (the loss shows in ``se_reduction`` < 0).

    Reductions are 0 when V_uniform = 0 (every prompt solved or unsolvable). The simulator
    passes the true per-prompt variances, the controller its own estimates.
    """
    n = np.asarray(counts, dtype=np.float64)
    v = np.maximum(np.asarray(prompt_variance, dtype=np.float64), 0.0)
    if n.shape != v.shape:
        raise ValueError(f"allocation_quality: {n.shape[0]} counts for {v.shape[0]} variances")
    if len(n) and n.min() < 1:
        raise ValueError("allocation_quality: every count must be >= 1")
    b = max(len(n), 1)
    var = float((v / n).sum())
    var_u = float(v.sum() / n_mean)
    var_o = float((v / oracle_allocation(v, n_mean, n_min, n_max)).sum()) if len(n) else 0.0

    def red(x: float, ref: float) -> float:
        return 1.0 - x / ref if ref > 0 else 0.0

    se, se_u, se_o = np.sqrt(var) / b, np.sqrt(var_u) / b, np.sqrt(var_o) / b
    se_red, se_red_o = red(se, se_u), red(se_o, se_u)
    if se_red_o > 1e-12:
        efficiency = se_red / se_red_o
    else:
        efficiency = 1.0 if var <= var_o * (1.0 + 1e-9) + 1e-300 else 0.0
    return {
        "se_proxy": float(se),
        "se_proxy_uniform": float(se_u),
        "se_proxy_oracle": float(se_o),
        "se_reduction": float(se_red),
        "variance_reduction": red(var, var_u),
        "oracle_se_reduction": float(se_red_o),
        "oracle_variance_reduction": red(var_o, var_u),
        "efficiency": float(efficiency),
    }


def _beta_posterior_moments(
    window_correct: Any, window_rollouts: Any, n_max: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, E[p^n], E[(1-p)^n]) for p ~ Beta(a, b) = Beta(k + ½, m - k + ½), n = 0..n_max, per prompt.

    k correct of m from the window counts (floats under ``half_life``); the moments by the running
    products Π_{j<n} (a + j) / (a + b + j). a, b have shape (B, 1), the moments (B, n_max + 1).
    """
    k = np.asarray(window_correct, dtype=np.float64)
    m = np.asarray(window_rollouts, dtype=np.float64)
    if k.shape != m.shape or np.any(k < 0) or np.any(k > m + 1e-9):
        raise ValueError("informative_probability: need 0 <= correct <= rollouts, one pair per prompt")
    a, b = k[:, None] + 0.5, np.maximum(m - k, 0.0)[:, None] + 0.5
    j = np.arange(n_max, dtype=np.float64)[None, :]
    ones = np.ones((len(k), 1))
    moment_p = np.hstack([ones, np.cumprod((a + j) / (a + b + j), axis=1)])
    moment_q = np.hstack([ones, np.cumprod((b + j) / (a + b + j), axis=1)])
    return a, b, moment_p, moment_q


def informative_probability(window_correct: Any, window_rollouts: Any, n_max: int) -> np.ndarray:
    """P(a group of n rollouts has a success and a failure), n = 0..n_max, per prompt (``discovery``).

    p ~ Beta(k + ½, m - k + ½) from the window counts (k correct of m; floats under ``half_life``);
    E[p^n] and E[(1-p)^n] by the running products Π_{j<n} (a + j) / (a + b + j). Shape (B, n_max + 1).
    """
    _, _, moment_p, moment_q = _beta_posterior_moments(window_correct, window_rollouts, n_max)
    value = np.clip(1.0 - moment_p - moment_q, 0.0, 1.0)
    value[:, :2] = 0.0  # exact: a group of fewer than 2 rollouts is never informative (removes rounding)
    return value


def failure_weighted_gains(window_correct: Any, window_rollouts: Any, n_min: int, n_max: int, k: int) -> np.ndarray:
    """``failure_weighted``'s marginal gains: column j is prompt i's gain from n_min + j to n_min + j + 1.

    The value of n rollouts is V_i(n) = E[(1 - p_i)^(k-1) (1 - p_i^n - (1 - p_i)^n)] under the window's
    posterior p_i ~ Beta(a, b), a = correct + ½, b = failed + ½ (the module docstring); its increment is

        Δ_i(n) = V_i(n + 1) - V_i(n) = E[p^n (1 - p)^k] + E[p (1 - p)^(n+k-1)]
               = E[p^n] · Π_{j<k} (b + j) / (a + b + n + j) + E[(1 - p)^(n+k-1)] · a / (a + b + n + k - 1),

    each term a positive Beta moment with no cancellation, strictly falling in n (so the top-k of
    :func:`fill_by_marginal_gain` is the exact optimum). ``k`` is the pass@k whose slope weights a
    prompt (``rollout.failure_weight_k``; 1 gives ``discovery``'s value). Shape (B, n_max - n_min).
    """
    a, b, moment_p, moment_q = _beta_posterior_moments(window_correct, window_rollouts, n_max + k - 1)
    s = a + b + np.arange(n_min, n_max, dtype=np.float64)[None, :]
    failing = np.ones_like(s)
    for j in range(k):
        failing = failing * (b + j) / (s + j)
    return moment_p[:, n_min:n_max] * failing + moment_q[:, n_min + k - 1 : n_max + k - 1] * a / (s + k - 1)


def fixed_tail_share(
    window_correct: Any, window_rollouts: Any, threshold: float, factor: float, n_mean: int, n_min: int, n_max: int
) -> np.ndarray:
    """The positive control's counts: a fixed larger share for the prompts the policy fails.

    Tail = prompts seen in the window with p̂ = k/m below ``threshold``; each gets t = min(factor · n̄,
    n_max), the others share the rest equally, o = (B n̄ - T t) / (B - T). When that puts o below
    n_min (a tail too large for the factor) the others get n_min and the tail shares what is left.
    Each class's total is rounded once and split evenly, the remainder going to its lowest p̂ first,
    so Σ n = B n̄ and n_min <= n <= n_max hold exactly. No tail, or all tail: n̄ each.
    """
    k = np.asarray(window_correct, dtype=np.float64)
    m = np.asarray(window_rollouts, dtype=np.float64)
    B, budget = len(k), len(k) * n_mean
    p_hat = np.divide(k, m, out=np.full(B, np.inf), where=m > 0)  # unseen: never tail
    tail = p_hat < threshold
    T = int(tail.sum())
    if T in (0, B):
        return np.full(B, n_mean, dtype=np.int64)
    t = min(factor * n_mean, float(n_max))
    if (budget - T * t) / (B - T) < n_min:
        tail_total = budget - (B - T) * n_min
    else:
        tail_total = int(round(T * t))
    n = np.zeros(B, dtype=np.int64)
    for members, total in ((np.flatnonzero(tail), tail_total), (np.flatnonzero(~tail), budget - tail_total)):
        members = members[np.argsort(p_hat[members], kind="stable")]
        n[members] = total // len(members)
        n[members[: total % len(members)]] += 1
    return n


def fill_by_marginal_gain(gains: np.ndarray, n_min: int, budget: int) -> np.ndarray:
    """n_min rollouts each, then the ``budget``'s remaining increments with the largest gains.

    ``gains[i, j]`` is prompt i's gain of going from n_min + j to n_min + j + 1 rollouts; rows must be
    non-increasing (a concave value), so the top-k is the exact optimum of Σ value_i(n_i). A tiny
    penalty growing with n prefers spreading rollouts over piling them on one prompt at equal gain.
    """
    k = np.arange(n_min + 1, n_min + 1 + gains.shape[1])[None, :]
    base = np.full(gains.shape[0], n_min, dtype=np.int64)
    return base + _top_k_increments(gains - _TIE_BREAK * k, budget - base.sum())


class RolloutGDRO:
    """Shadow-price rollout allocator over ``num_groups`` bins (see the module docstring)."""

    def __init__(self, config: RolloutGDROConfig, num_groups: int):
        self.config = config
        self.num_groups = int(num_groups)
        self.variance = np.full(self.num_groups, config.variance_prior)
        self.observed = np.zeros(self.num_groups, dtype=bool)
        self.log_mu = np.nan if config.mu_init is None else float(np.log(config.mu_init))
        self.arms = np.arange(config.n_min, config.n_max + 1)
        self.arm_scores = np.zeros((self.num_groups, len(self.arms)))  # EMA of the rescaled Lagrangian loss
        self.arm_scored = np.zeros(self.num_groups, dtype=bool)  # the bin's arm scores hold an observation
        self.rng = np.random.default_rng(config.seed)
        self.last: dict[str, Any] = {}
        self.steps = 0
        self.token_price = 0.0  # ρ = λ c̄ / μ >= 0, budget=tokens (see token_sqrt_law)
        self._token_proposal_ratio = float("nan")

    # ------------------------------------------------------------------ helpers
    @property
    def mu(self) -> float:
        return float(np.exp(self.log_mu)) if np.isfinite(self.log_mu) else float("nan")

    def prompt_variance(self, groups: np.ndarray) -> np.ndarray:
        return np.maximum(self.variance[groups], self.config.variance_floor)

    def prompt_variance_estimate(self, groups: Any, window_correct: Any, window_rollouts: Any) -> np.ndarray:
        """Per-prompt variance shrunk toward the bin's: v_i = (d s² + κ v_b) / (d + κ) (module docstring).

        ``window_correct`` / ``window_rollouts`` are each prompt's sums over its binner window
        (0 for an unseen prompt, which then gets v_b). Floored at ``variance_floor``.
        """
        g = np.asarray(groups, dtype=np.int64)
        k = np.asarray(window_correct, dtype=np.float64)
        m = np.asarray(window_rollouts, dtype=np.float64)
        d = np.maximum(m - 1.0, 0.0)
        ss = np.divide(k * (m - k), m, out=np.zeros_like(m), where=m > 0)  # = d · s², the sum of squares
        kappa = self.config.variance_shrinkage
        v_b = self.variance[g]
        den = d + kappa
        v = np.divide(ss + kappa * v_b, den, out=v_b.copy(), where=den > 0)
        return np.maximum(v, self.config.variance_floor)

    def _clearing_log_mu(self, v: np.ndarray, budget: int) -> float:
        """log μ at which Σ_i clip(√(v_i/μ), n_min, n_max) equals ``budget`` (bisection)."""
        c = self.config
        lo, hi = self._log_mu_bounds()
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            total = np.clip(np.sqrt(v / np.exp(mid)), c.n_min, c.n_max).sum()
            lo, hi = (mid, hi) if total > budget else (lo, mid)
        return 0.5 * (lo + hi)

    def _log_mu_bounds(self) -> tuple[float, float]:
        """μ below the lower bound puts every prompt at n_max, above the upper bound at n_min."""
        c = self.config
        return np.log(c.variance_floor / c.n_max**2) - 1.0, np.log(c.variance_prior / c.n_min**2) + 1.0

    def _dual_step(self, proposal_mean: float) -> None:
        # Projected dual ascent: outside the bounds μ no longer changes any allocation.
        lo, hi = self._log_mu_bounds()
        self.log_mu = float(np.clip(self.log_mu + self.config.mu_lr * (proposal_mean - self.config.n_mean), lo, hi))

    # ------------------------------------------------------------------ allocators
    def _allocate_sqrt(
        self, groups: np.ndarray, v: np.ndarray, budget: int, cost_rel: np.ndarray | None = None
    ) -> tuple[np.ndarray, float]:
        c = self.config
        if not np.isfinite(self.log_mu):
            self.log_mu = self._clearing_log_mu(v, budget)
        # budget=tokens: n = √(v / (μ + λ ĉ)) = √(v / (μ (1 + ρ ĉ/c̄)))  (see token_sqrt_law)
        price = 1.0 if cost_rel is None else 1.0 + self.token_price * cost_rel
        proposal = np.clip(np.sqrt(v / (self.mu * price)), c.n_min, c.n_max)
        if cost_rel is not None:
            self._token_proposal_ratio = float((cost_rel * proposal).sum() / (c.n_mean * cost_rel.sum()))
        return np.rint(proposal).astype(np.int64), float(proposal.mean())

    def arm_probabilities(self) -> np.ndarray:
        """π_b(n) per bin: (1-γ) softmax(-η S_b) + γ / #arms (S_b in [0, 1])."""
        c = self.config
        logits = -c.bandit_eta * self.arm_scores
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (1.0 - c.bandit_gamma) * w / w.sum(axis=1, keepdims=True) + c.bandit_gamma / len(self.arms)

    def _allocate_bandit(self, groups: np.ndarray, v: np.ndarray, budget: int) -> tuple[np.ndarray, float]:
        c = self.config
        if not np.isfinite(self.log_mu):
            self.log_mu = self._clearing_log_mu(v, budget)
        per_group = np.bincount(groups, minlength=self.num_groups)
        present = np.flatnonzero(per_group)
        counts = per_group[present]
        value = np.log(self.arm_probabilities()[present]) + self.rng.gumbel(size=(len(present), len(self.arms)))
        # Exact-budget DP over bins: best[t] = max Σ |B_b| value_b(n_b) over bins so far with
        # Σ |B_b| (n_b - n_min) = t, i.e. counted above the n_min floor every bin pays anyway.
        extra = budget - int(counts.sum()) * c.n_min
        steps = self.arms - c.n_min
        best = np.full(extra + 1, -np.inf)
        best[0] = 0.0
        choice = np.zeros((len(present), extra + 1), dtype=np.int16)
        for j, cnt in enumerate(counts):
            # Running max over arms (strict >: the first best arm wins ties, as argmax would);
            # row-wise updates avoid a strided argmax over an (arms, budget) matrix.
            new = np.full(extra + 1, -np.inf)
            pick = choice[j]
            for a, k in enumerate(steps):
                shift = int(cnt * k)
                if shift > extra:
                    break  # steps increase with the arm
                cand = best[: extra + 1 - shift] + cnt * value[j, a]
                better = cand > new[shift:]
                new[shift:][better] = cand[better]
                pick[shift:][better] = a
            best = new
        feasible = np.flatnonzero(np.isfinite(best))
        t = extra if np.isfinite(best[extra]) else int(feasible.max())
        arm_of = np.zeros(self.num_groups, dtype=np.int64)
        for j in range(len(present) - 1, -1, -1):  # backtrack
            a = int(choice[j, t])
            arm_of[present[j]] = a
            t -= int(counts[j] * steps[a])
        # Budget pressure: the mean of the arms the scored bins prefer, without the budget. A bin
        # never scored has flat scores (argmin = n_min), not a preference: it would pull μ down.
        scored = self.arm_scored[present]
        if not scored.any():
            return self.arms[arm_of[groups]], float(c.n_mean)
        wanted = self.arms[np.argmin(self.arm_scores[present][scored], axis=1)]
        return self.arms[arm_of[groups]], float((counts[scored] * wanted).sum() / counts[scored].sum())

    def _allocate_knapsack(self, accuracy: np.ndarray, budget: int) -> np.ndarray:
        c = self.config
        p = np.where(np.isfinite(accuracy), accuracy, 0.5)[:, None]
        k = np.arange(c.n_min, c.n_max + 1)[None, :].astype(np.float64)
        value = (1.0 - p**k - (1.0 - p) ** k) * p * (1.0 - p) ** 2
        gains = np.minimum.accumulate(np.diff(value, axis=1), axis=1)  # concave envelope
        return fill_by_marginal_gain(gains, c.n_min, budget)

    def _allocate_from_window(self, window_correct: np.ndarray, window_rollouts: np.ndarray, budget: int) -> np.ndarray:
        """:data:`WINDOW_ALLOCATORS`: counts from each prompt's own window (Σ correct, Σ rollouts)."""
        c = self.config
        if c.allocator == "fixed_tail_share":
            return fixed_tail_share(
                window_correct, window_rollouts, c.tail_threshold, c.tail_share_factor, c.n_mean, c.n_min, c.n_max
            )
        if c.allocator == "failure_weighted":
            gains = failure_weighted_gains(window_correct, window_rollouts, c.n_min, c.n_max, c.failure_weight_k)
        else:
            value = informative_probability(window_correct, window_rollouts, c.n_max)
            gains = np.diff(value[:, c.n_min :], axis=1)
        return fill_by_marginal_gain(gains, c.n_min, budget)

    # ------------------------------------------------------------------ token budget
    def _token_step(self, n: np.ndarray, v: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """budget=tokens: enforce Σ ĉ n <= n̄ Σ ĉ exactly, then one projected dual-ascent step on ρ.

        ρ moves on the relative excess of the ``sqrt`` proposal's expected tokens (the continuous
        √(v/(μ + λĉ)) before rounding and repair), projected onto ρ >= 0, so it stays 0 while the
        proposal is within the token budget. Other allocators have no ρ in their proposal; for them
        the repair alone keeps the budget (ρ stays 0).
        """
        c = self.config
        n = repair_to_token_budget(n, v, cost, c.n_mean, c.n_min, c.n_max)
        if c.allocator == "sqrt" and np.isfinite(self._token_proposal_ratio):
            self.token_price = max(0.0, self.token_price + c.token_lr * (self._token_proposal_ratio - 1.0))
        return n

    @property
    def lam(self) -> float:
        """λ of n = √(v / (μ + λ ĉ)) in units of μ per token, for the last batch's mean length c̄."""
        c_bar = self.last.get("cost_mean", float("nan")) if self.last else float("nan")
        return float(self.token_price * self.mu / c_bar) if np.isfinite(c_bar) and c_bar > 0 else float("nan")

    # ------------------------------------------------------------------ public API
    def allocate(
        self,
        groups: Any,
        accuracy: Any | None = None,
        prompt_variance: Any | None = None,
        prompt_cost: Any | None = None,
        window_counts: tuple[Any, Any] | None = None,
    ) -> np.ndarray:
        """Rollout counts for the next batch, one per prompt, summing to ``len(groups) · n̄``.

        ``groups`` are the prompts' current bins; ``accuracy`` (per prompt windowed pass rate,
        NaN if unseen) is needed by ``knapsack`` only. ``prompt_variance`` (per prompt), if
        given, replaces the bins' v_b in the ``sqrt`` law, the repair and the SE proxy
        (``variance_source=prompt``); the ``hedge`` arms stay per bin. ``prompt_cost`` (per prompt
        expected response length ĉ) is required by ``budget=tokens``. ``window_counts`` (per prompt
        Σ correct, Σ rollouts over its binner window) is needed by :data:`WINDOW_ALLOCATORS` only.
        """
        c = self.config
        g = np.asarray(groups, dtype=np.int64)
        budget = len(g) * c.n_mean
        if prompt_variance is None:
            v = self.prompt_variance(g)
        else:
            v = np.maximum(np.asarray(prompt_variance, dtype=np.float64), c.variance_floor)
            if v.shape != g.shape:
                raise ValueError(f"rollout_gdro.allocate: {v.shape[0]} variances for {g.shape[0]} prompts")
        proposal_mean = float(c.n_mean)
        cost = cost_rel = None
        if c.budget == "tokens":
            if prompt_cost is None:
                raise ValueError("rollout.budget=tokens needs the per-prompt expected length (prompt_cost)")
            cost = np.asarray(prompt_cost, dtype=np.float64)
            if cost.shape != g.shape or not np.all(np.isfinite(cost)) or (len(cost) and cost.min() <= 0):
                raise ValueError("rollout_gdro.allocate: prompt_cost must be one finite value > 0 per prompt")
            cost_rel = cost / cost.mean() if len(cost) else cost
        self._token_proposal_ratio = float("nan")
        if c.allocator == "uniform" or len(g) == 0:
            n = np.full(len(g), c.n_mean, dtype=np.int64)
        elif c.allocator == "sqrt":
            n, proposal_mean = self._allocate_sqrt(g, v, budget, cost_rel)
        elif c.allocator in ("hedge", "bandit"):
            n, proposal_mean = self._allocate_bandit(g, v, budget)
        elif c.allocator == "knapsack":
            if accuracy is None:
                raise ValueError("rollout.allocator=knapsack needs per-prompt accuracy")
            n = self._allocate_knapsack(np.asarray(accuracy, dtype=np.float64), budget)
        elif c.allocator in WINDOW_ALLOCATORS:
            if window_counts is None:
                raise ValueError(f"rollout.allocator={c.allocator} needs per-prompt window counts")
            correct, rollouts = (np.asarray(x, dtype=np.float64) for x in window_counts)
            if correct.shape != g.shape or rollouts.shape != g.shape:
                raise ValueError(f"rollout_gdro.allocate: window counts for {len(correct)} of {len(g)} prompts")
            n = self._allocate_from_window(correct, rollouts, budget)
        else:  # pragma: no cover - the config rejects it
            raise ValueError(c.allocator)
        n = repair_to_budget(n, v, budget, c.n_min, c.n_max)
        if cost is not None and len(g):
            n = self._token_step(n, v, cost)
        if c.allocator in ("sqrt", "hedge", "bandit"):
            self._dual_step(proposal_mean)
        se = np.sqrt((v / n).sum()) / max(len(g), 1)
        se_uniform = np.sqrt((v / c.n_mean).sum()) / max(len(g), 1)
        self.last = {
            "groups": g,
            "counts": n,
            "proposal_mean": proposal_mean,
            "se_proxy": float(se),
            "se_proxy_uniform": float(se_uniform),
        }
        if cost is not None and len(g):
            self.last["cost_mean"] = float(cost.mean())
            self.last["token_proposal_ratio"] = self._token_proposal_ratio
        return n

    def observe(self, groups: Any, correct: Any, rollouts: Any, update_allocator: bool = True) -> None:
        """Fold one step's outcomes (per prompt, grouped by the bins used at allocation) into v_b and the bandit.

        v_b is always updated (the controller calls this with ``update_allocator=False`` when
        Rollout-GDRO is off, so the per-bin variance metrics of a GRPO run are real).
        """
        c = self.config
        g = np.asarray(groups, dtype=np.int64)
        n = np.asarray(rollouts, dtype=np.float64)
        p = np.asarray(correct, dtype=np.float64) / np.maximum(n, 1.0)
        s2 = p * (1.0 - p) * n / np.maximum(n - 1.0, 1.0)  # unbiased sample variance of 0/1 rewards
        count = np.bincount(g, minlength=self.num_groups)
        present = count > 0
        v_hat = np.bincount(g, weights=s2, minlength=self.num_groups)[present] / count[present]
        # A bin's first observation replaces the prior; later ones are averaged in (EMA).
        seen_before = self.observed[present]
        ema = (1.0 - c.variance_beta) * self.variance[present] + c.variance_beta * v_hat
        self.variance[present] = np.where(seen_before, ema, v_hat)
        self.observed |= present
        if update_allocator and c.allocator in ("hedge", "bandit") and np.isfinite(self.log_mu):
            # Full-information update of every arm of every bin present (see the module docstring).
            v_obs = np.maximum(v_hat, c.variance_floor)[:, None]
            n_arm = self.arms[None, :].astype(np.float64)
            loss = v_obs / n_arm + self.mu * n_arm
            span = loss.max(axis=1, keepdims=True) - loss.min(axis=1, keepdims=True)
            scaled = (loss - loss.min(axis=1, keepdims=True)) / np.maximum(span, 1e-300)
            self.arm_scores[present] = (1 - c.bandit_beta) * self.arm_scores[present] + c.bandit_beta * scaled
            self.arm_scored |= present
        self.steps += 1

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "variance": self.variance.copy(),
            "observed": self.observed.copy(),
            "log_mu": float(self.log_mu),
            "arm_scores": self.arm_scores.copy(),
            "arm_scored": self.arm_scored.copy(),
            "rng": self.rng.bit_generator.state,
            "steps": self.steps,
            "token_price": float(self.token_price),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        variance = np.asarray(state["variance"], dtype=np.float64)
        if variance.shape != (self.num_groups,):
            raise ValueError(f"rollout_gdro checkpoint has {variance.shape[0]} groups; this run has {self.num_groups}")
        arm_scores = np.asarray(state["arm_scores"], dtype=np.float64)
        if arm_scores.shape != self.arm_scores.shape:
            raise ValueError(
                f"rollout_gdro checkpoint has arms {arm_scores.shape[1]}; this run has {len(self.arms)} "
                "(n_min..n_max changed)"
            )
        self.variance = variance.copy()
        self.observed = np.asarray(state["observed"], dtype=bool).copy()
        self.log_mu = float(state["log_mu"])
        self.arm_scores = arm_scores.copy()
        # Older checkpoints: a bin was scored iff its scores moved off the zero start.
        self.arm_scored = np.asarray(state.get("arm_scored", arm_scores.any(axis=1)), dtype=bool).copy()
        self.rng.bit_generator.state = state["rng"]
        self.steps = int(state["steps"])
        self.token_price = float(state["token_price"])
