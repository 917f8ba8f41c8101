"""Rollout-GDRO per-prompt variance (gdro.rollout.variance_source=prompt) and allocation_quality."""

import itertools
import math

import numpy as np
import pytest

from verl_ext import GDROController, RolloutGDRO, RolloutGDROConfig, gdro_config_from_dict
from verl_ext.rollout_gdro import allocation_quality, oracle_allocation


def _brute_force_optimum(v, n_mean, n_min, n_max):
    best = np.inf
    for n in itertools.product(range(n_min, n_max + 1), repeat=len(v)):
        if sum(n) == len(v) * n_mean:
            best = min(best, float((np.asarray(v) / np.asarray(n)).sum()))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_oracle_is_the_exact_integer_optimum(seed):
    rng = np.random.default_rng(seed)
    v = rng.random(5) * 0.25 * (rng.random(5) < 0.8)
    n = oracle_allocation(v, 4, 2, 9)
    assert n.sum() == 20 and n.min() >= 2 and n.max() <= 9
    assert (v / n).sum() == pytest.approx(_brute_force_optimum(v, 4, 2, 9), rel=1e-9)


def test_allocation_quality_reference_points():
    v = np.array([0.0, 0.01, 0.2, 0.25, 0.25, 0.05])
    uniform = allocation_quality(np.full(6, 4), v, 4, 2, 12)
    assert uniform["se_reduction"] == 0.0 and uniform["variance_reduction"] == 0.0 and uniform["efficiency"] == 0.0
    assert uniform["oracle_se_reduction"] > 0.1
    best = allocation_quality(oracle_allocation(v, 4, 2, 12), v, 4, 2, 12)
    assert best["efficiency"] == pytest.approx(1.0) and best["se_proxy"] == pytest.approx(best["se_proxy_oracle"])
    assert best["variance_reduction"] == pytest.approx(1 - (1 - best["se_reduction"]) ** 2)
    worse = allocation_quality(np.array([12, 2, 2, 2, 2, 4]), v, 4, 2, 12)
    assert worse["se_reduction"] < 0 and worse["efficiency"] < 0
    # Equal variances: uniform is optimal, nothing is achievable.
    flat = np.full(4, 0.2)
    assert allocation_quality(np.full(4, 4), flat, 4, 2, 12)["efficiency"] == 1.0
    off = allocation_quality(np.array([2, 6, 4, 4]), flat, 4, 2, 12)
    assert off["oracle_se_reduction"] == 0.0 and off["efficiency"] == 0.0 and off["se_reduction"] < 0
    zero = allocation_quality(np.array([2, 6]), np.zeros(2), 4, 2, 12)
    assert zero["se_reduction"] == 0.0 and zero["oracle_se_reduction"] == 0.0 and zero["efficiency"] == 1.0
    with pytest.raises(ValueError, match="counts"):
        allocation_quality(np.array([4, 4]), np.zeros(3), 4, 2, 12)


def _binomial_pmf(m, p):
    from math import comb

    k = np.arange(m + 1)
    return k, np.array([comb(m, int(i)) * p**i * (1 - p) ** (m - i) for i in k])


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5])
def test_prompt_variance_estimate_behaves_as_a_shrinkage_estimator(p):
    """What the estimate is for, checked by exact expectations over k ~ Binomial(m, p), not by
    retyping its formula: κ = 0 is unbiased for p(1-p); κ > 0 moves it toward the bin's v_b, more
    for short windows; with a prior near the truth it has lower mean squared error than the raw
    s² on a short window; an unseen prompt gets v_b."""
    truth = p * (1 - p)
    v_b = 0.2

    def estimate(kappa, k, m):
        rg = RolloutGDRO(RolloutGDROConfig(variance_shrinkage=kappa, variance_floor=1e-9), num_groups=1)
        rg.variance[:] = v_b
        return rg.prompt_variance_estimate(np.zeros(len(k), dtype=np.int64), k, np.full(len(k), m))

    for m in (2, 4, 40):
        k, pmf = _binomial_pmf(m, p)
        raw = estimate(0.0, k, m)
        assert pmf @ raw == pytest.approx(truth, abs=2e-9)  # unbiased (up to the 1e-9 floor) without shrinkage
        shrunk = estimate(8.0, k, m)
        lo, hi = np.minimum(raw, v_b), np.maximum(raw, v_b)
        assert np.all((shrunk >= lo - 1e-12) & (shrunk <= hi + 1e-12))  # between s² and v_b
    # Shrinkage fades with evidence: the estimate's distance to v_b grows with the window size.
    far = []
    for m in (4, 40, 400):
        k, pmf = _binomial_pmf(m, p)
        far.append(abs(pmf @ estimate(8.0, k, m) - v_b))
    assert far[0] < far[1] < far[2] and far[2] == pytest.approx(abs(truth - v_b) * 399 / 407, rel=1e-6)
    # With a prior near the truth, a short window is better estimated shrunk than raw (MSE).
    k, pmf = _binomial_pmf(4, p)
    rg = RolloutGDRO(RolloutGDROConfig(variance_shrinkage=8.0, variance_floor=1e-9), num_groups=1)
    rg.variance[:] = truth * 1.1
    shrunk = rg.prompt_variance_estimate(np.zeros(5, dtype=np.int64), k, np.full(5, 4))
    assert pmf @ (shrunk - truth) ** 2 < pmf @ (estimate(0.0, k, 4) - truth) ** 2
    unseen = estimate(8.0, np.array([0]), 0)
    assert unseen[0] == v_b


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_allocation_is_the_brute_force_optimum(seed):
    """Knapsack-RL's rule maximises Σ_i value(p_i, n_i), value = (1 - p^n - (1-p)^n) p (1-p)^2, under
    Σ n_i = B n̄ and the bounds; checked against every allocation of a small batch."""
    rng = np.random.default_rng(seed)
    acc = rng.random(4)
    acc[rng.random(4) < 0.25] = np.nan  # unseen: treated as p = 0.5
    if seed == 0:
        acc[:2] = [0.0, 1.0]  # zero value at any n
    cfg = RolloutGDROConfig(enable=True, allocator="knapsack", n_min=2, n_mean=4, n_max=9)
    n = RolloutGDRO(cfg, num_groups=1).allocate(np.zeros(4, dtype=np.int64), acc)
    p = np.where(np.isfinite(acc), acc, 0.5)

    def value(alloc):
        a = np.asarray(alloc, dtype=np.float64)
        return float(((1 - p**a - (1 - p) ** a) * p * (1 - p) ** 2).sum())

    best = max(value(a) for a in itertools.product(range(2, 10), repeat=4) if sum(a) == 16)
    assert n.sum() == 16 and n.min() >= 2 and n.max() <= 9
    assert value(n) == pytest.approx(best, rel=1e-9, abs=1e-12)


def _run(source, steps=80, seed=0):
    """bin 0 mixes unsolvable prompts (p = 0) with hard but solvable ones (p = 0.08)."""
    P, B = 600, 64
    cfg = gdro_config_from_dict(
        {"binner": {"window": 8}, "rollout": {"enable": True, "variance_source": source, "n_mean": 4, "n_max": 12}}
    )
    ctl = GDROController(cfg, P)
    rng = np.random.default_rng(seed)
    p_true = np.concatenate([np.zeros(150), np.full(150, 0.08), rng.uniform(0.2, 0.9, 300)])
    eff, eff_true, per_kind = [], [], {"unsolvable": [], "solvable": []}
    for t in range(steps):
        ids = rng.choice(P, B, replace=False)
        n = ctl.schedule(ids)
        assert n.sum() == B * 4 and n.min() >= 2 and n.max() <= 12
        if t >= steps // 2:
            eff.append(ctl._schedule_metrics["gdro/se/efficiency"])
            eff_true.append(allocation_quality(n, p_true[ids] * (1 - p_true[ids]), 4, 2, 12)["efficiency"])
            per_kind["unsolvable"] += n[ids < 150].tolist()
            per_kind["solvable"] += n[(ids >= 150) & (ids < 300)].tolist()
        rp = np.repeat(ids, n)
        ctl.observe(rp, rng.random(len(rp)) < p_true[rp])
    return np.mean(eff), np.mean(eff_true), {k: np.mean(v) for k, v in per_kind.items()}, ctl


def test_per_prompt_variance_separates_unsolvable_from_hard_prompts():
    eff_bin, true_bin, kinds_bin, _ = _run("bin")
    eff_prompt, true_prompt, kinds_prompt, ctl = _run("prompt")
    # With the bin's v_b both kinds in bin 0 get the same count; per prompt, the solvable ones get more.
    assert kinds_prompt["solvable"] > kinds_prompt["unsolvable"] + 1.0
    assert abs(kinds_bin["solvable"] - kinds_bin["unsolvable"]) < abs(
        kinds_prompt["solvable"] - kinds_prompt["unsolvable"]
    )
    # Against the TRUE per-prompt variances, the per-prompt allocator gets more of the oracle's reduction.
    assert true_prompt > true_bin + 0.05
    assert eff_prompt > eff_bin
    m = ctl.metrics()
    for key in (
        "proxy",
        "proxy_uniform",
        "proxy_oracle",
        "reduction",
        "variance_reduction",
        "oracle_reduction",
        "oracle_variance_reduction",
        "efficiency",
        "seen_share",
    ):
        assert np.isfinite(m[f"gdro/se/{key}"]), key
    assert m["gdro/se/seen_share"] > 0.9


def test_se_metrics_are_logged_for_the_grpo_baseline_too():
    ctl = GDROController(gdro_config_from_dict({}), 50)
    ids = np.arange(8)
    n = ctl.schedule(ids)
    ctl.observe(np.repeat(ids, n), np.arange(32) % 3 == 0)
    m = ctl.metrics()
    assert m["gdro/se/reduction"] == 0.0 and m["gdro/se/seen_share"] == 0.0
    assert "gdro/se_proxy" not in m  # the allocator's own SE proxy needs Rollout-GDRO


@pytest.mark.parametrize("seed", range(4))
def test_bandit_dp_picks_the_best_exact_budget_arms(seed):
    """The exact-budget DP maximises Σ_b |B_b| (log π_b(n_b) + G_b(n_b)) subject to Σ_b |B_b| n_b = B n̄."""
    rng = np.random.default_rng(seed)
    rg = RolloutGDRO(RolloutGDROConfig(allocator="bandit", n_min=2, n_mean=4, n_max=8, mu_init=0.01, seed=seed), 4)
    rg.arm_scores[:] = rng.random(rg.arm_scores.shape)
    noise = rng.gumbel(size=(4, len(rg.arms)))
    rg.rng = type("FixedNoise", (), {"gumbel": lambda self, size: noise[: size[0]]})()
    groups = np.repeat(np.arange(4), [3, 1, 5, 2])
    n = rg.allocate(groups)
    value = np.log(rg.arm_probabilities()) + noise
    cnt = np.array([3, 1, 5, 2])
    best = max(
        sum(cnt[b] * value[b, a] for b, a in enumerate(arms))
        for arms in itertools.product(range(len(rg.arms)), repeat=4)
        if sum(cnt[b] * rg.arms[a] for b, a in enumerate(arms)) == 44
    )
    chosen = [int(n[groups == b][0]) - 2 for b in range(4)]
    assert n.sum() == 44 and sum(cnt[b] * value[b, a] for b, a in enumerate(chosen)) == pytest.approx(best)


# ------------------------------------------------------------------------------------ discovery
def _beta_moment(a, b, n):
    """E[p^n] for p ~ Beta(a, b) through the Beta function (independent of the running product)."""
    return math.exp(math.lgamma(a + n) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(a + b + n))


@pytest.mark.parametrize("k, m", [(0, 0), (0, 12), (3, 4), (1.5, 7.25)])
def test_informative_probability_is_the_beta_posterior_value(k, m):
    from verl_ext.rollout_gdro import informative_probability

    got = informative_probability(np.array([k]), np.array([m]), 10)[0]
    a, b = k + 0.5, m - k + 0.5
    want = [0.0] + [1 - _beta_moment(a, b, n) - _beta_moment(b, a, n) for n in range(1, 11)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] == got[1] == 0.0  # a group of 0 or 1 rollouts can never be informative


def test_informative_probability_tends_to_the_known_p_value():
    from verl_ext.rollout_gdro import informative_probability

    p, m = 0.05, 10**7
    got = informative_probability(np.array([p * m]), np.array([m]), 16)[0]
    n = np.arange(17)
    assert got == pytest.approx(np.maximum(1 - p**n - (1 - p) ** n, 0.0), abs=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_discovery_allocation_is_the_brute_force_optimum(seed):
    """``discovery`` maximises Σ_i P(0 < successes_i < n_i) under Σ n_i = B n̄ and the bounds; checked
    against every allocation of a small batch."""
    from verl_ext.rollout_gdro import informative_probability

    rng = np.random.default_rng(seed)
    m = rng.integers(0, 20, 4)
    k = rng.binomial(m, rng.random(4))
    cfg = RolloutGDROConfig(enable=True, allocator="discovery", n_min=2, n_mean=4, n_max=9)
    n = RolloutGDRO(cfg, num_groups=1).allocate(np.zeros(4, dtype=np.int64), window_counts=(k, m))
    table = informative_probability(k, m, 9)

    def value(alloc):
        return float(sum(table[i, a] for i, a in enumerate(alloc)))

    best = max(value(a) for a in itertools.product(range(2, 10), repeat=4) if sum(a) == 16)
    assert n.sum() == 16 and n.min() >= 2 and n.max() <= 9
    assert value(n) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_discovery_gives_rare_successes_the_rollouts_the_sqrt_law_withholds():
    """A prompt seen 8 times with 1 success (p̂ 0.125) against one at 4 of 8 and a saturated one at 8 of 8:
    the sqrt law, fed the same per-prompt variances, gives the rare-success prompt fewer rollouts
    than the 50% one; discovery gives it more. A prompt failed 64 times gets n_min: it lost its claim."""
    k = np.array([1, 4, 8, 0, 0])
    m = np.array([8, 8, 8, 64, 0])
    groups = np.zeros(5, dtype=np.int64)
    disc = RolloutGDRO(RolloutGDROConfig(enable=True, allocator="discovery", n_max=16), 1)
    n_disc = disc.allocate(groups, window_counts=(k, m))
    sqrt = RolloutGDRO(RolloutGDROConfig(enable=True, allocator="sqrt", n_max=16), 1)
    v = sqrt.prompt_variance_estimate(groups, k, m)
    n_sqrt = sqrt.allocate(groups, prompt_variance=v)
    assert n_disc.sum() == n_sqrt.sum() == 20
    assert n_sqrt[0] < n_sqrt[1]
    assert n_disc[0] > n_disc[1]
    assert n_disc[3] == 2 and n_disc[2] == 2
    assert n_disc[4] > 2  # never seen: its posterior is wide, worth exploring


def test_discovery_through_the_controller_rejects_missing_window_counts():
    cfg = gdro_config_from_dict({"rollout": {"enable": True, "allocator": "discovery", "n_max": 12}})
    ctl = GDROController(cfg, 300)
    rng = np.random.default_rng(0)
    p_true = np.where(np.arange(300) < 100, 0.06, 0.97)  # a rare-success third, a saturated rest
    for _ in range(30):
        ids = rng.choice(300, 64, replace=False)
        n = ctl.schedule(ids)
        assert n.sum() == 256
        rp = np.repeat(ids, n)
        ctl.observe(rp, rng.random(len(rp)) < p_true[rp])
    assert n[ids < 100].mean() > 4 > n[ids >= 100].mean()
    with pytest.raises(ValueError, match="discovery needs per-prompt window counts"):
        ctl.rollout.allocate(np.zeros(3, dtype=np.int64))
