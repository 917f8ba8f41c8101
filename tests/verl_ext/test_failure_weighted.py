"""The allocators aimed at the failures (issue 45): ``failure_weighted`` (an objective, solved exactly) and
``fixed_tail_share`` (a positive control). Exact budget and bounds for every allocator are
test_rollout_gdro.py's (both budgets: test_tokens.py); checkpoint round trips: test_config_and_state.py."""

import itertools

import numpy as np
import pytest
from scipy import integrate, stats

from verl_ext import GDROController, RolloutGDRO, RolloutGDROConfig, gdro_config_from_dict
from verl_ext.rollout_gdro import failure_weighted_gains, fixed_tail_share, informative_probability


def _value(k: float, m: float, n: int, pass_k: int = 8) -> float:
    """V(n) = E[(1 - p)^(pass_k - 1) (1 - p^n - (1 - p)^n)], p ~ Beta(k + ½, m - k + ½), by numerical
    integration (independent of the closed-form Beta moments the allocator uses)."""
    post = stats.beta(k + 0.5, m - k + 0.5)
    f = lambda p: (1 - p) ** (pass_k - 1) * (1 - p**n - (1 - p) ** n) * post.pdf(p)  # noqa: E731
    return integrate.quad(f, 0, 1, points=[1e-6, 1e-3, 0.5, 1 - 1e-3], limit=200)[0]


@pytest.mark.parametrize("pass_k", [1, 2, 8])
@pytest.mark.parametrize("k, m", [(0, 0), (0, 12), (3, 4), (1.5, 7.25), (0, 200)])
def test_gains_are_the_increments_of_the_failure_weighted_value(k, m, pass_k):
    got = failure_weighted_gains(np.array([k]), np.array([m]), 2, 9, pass_k)[0]
    want = [_value(k, m, n + 1, pass_k) - _value(k, m, n, pass_k) for n in range(2, 9)]
    assert got == pytest.approx(want, rel=1e-6, abs=1e-10)
    assert np.all(np.diff(got) < 0)  # concave: the greedy top-k is exact
    if pass_k == 1:  # no weight: discovery's value
        assert got == pytest.approx(np.diff(informative_probability([k], [m], 9)[0, 2:]), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("seed, pass_k", [(s, pk) for s in range(4) for pk in (2, 8)])
def test_failure_weighted_allocation_is_the_brute_force_optimum(seed, pass_k):
    """Σ_i V_i(n_i) under Σ n_i = B n̄ and the bounds, against every allocation of a batch of 4."""
    rng = np.random.default_rng(seed)
    m = rng.integers(0, 30, 4)
    k = rng.binomial(m, rng.random(4) ** 2)  # skewed toward failures
    cfg = RolloutGDROConfig(
        enable=True, allocator="failure_weighted", n_min=2, n_mean=4, n_max=9, failure_weight_k=pass_k
    )
    n = RolloutGDRO(cfg, num_groups=1).allocate(np.zeros(4, dtype=np.int64), window_counts=(k, m))
    table = np.array([[_value(k[i], m[i], c, pass_k) for c in range(10)] for i in range(4)])
    every = np.array([a for a in itertools.product(range(2, 10), repeat=4) if sum(a) == 16])  # 4 prompts
    assert n.sum() == 16 and n.min() >= 2 and n.max() <= 9
    assert table[np.arange(4), n].sum() == pytest.approx(table[np.arange(4), every].sum(axis=1).max(), rel=1e-7)


def test_failure_weighted_moves_rollouts_from_solved_to_failing_prompts_unlike_discovery():
    """Same window counts: a prompt at 18 of 20 gets n_min under ``failure_weighted`` but more under
    ``discovery``; a prompt at 1 of 20 gets more under ``failure_weighted``."""
    k, m = np.array([18, 1, 10, 5]), np.array([20, 20, 20, 20])
    groups = np.zeros(4, dtype=np.int64)
    alloc = {
        a: RolloutGDRO(RolloutGDROConfig(enable=True, allocator=a, n_max=12), 1).allocate(groups, window_counts=(k, m))
        for a in ("failure_weighted", "discovery")
    }
    assert alloc["failure_weighted"][0] == 2 < alloc["discovery"][0]
    assert alloc["failure_weighted"][1] > alloc["discovery"][1]


def test_a_never_solved_prompt_loses_its_claim_with_every_failed_visit():
    """k = 0 of m, at the config's pass@k weight: every increment below 1/(m + 1), falling with each failed
    visit (m = 4, 20, ...; unseen, m = 0, the prior's mass near p = 1 keeps it below a first failed
    visit of 4 at k = 8); a prompt failed 200 times in its window gets n_min beside prompts that still
    succeed sometimes."""
    m = np.array([0, 4, 20, 50, 200], dtype=float)
    gains = failure_weighted_gains(np.zeros(5), m, 2, 12, RolloutGDROConfig().failure_weight_k)
    assert np.all(np.diff(gains[1:, 0]) < 0)
    assert np.all(gains < 1 / (m[:, None] + 1))
    groups = np.zeros(4, dtype=np.int64)
    k, m = np.array([0, 2, 10, 19]), np.array([200, 40, 20, 20])
    n = RolloutGDRO(RolloutGDROConfig(enable=True, allocator="failure_weighted"), 1).allocate(
        groups, window_counts=(k, m)
    )
    assert n[0] == 2 and n[1] > 4


def _tail_population(allocator: str, steps: int = 60, **rollout):
    """A controller over 300 prompts: 90 tail (p 0.03), 90 unsolvable (p 0), 120 mid (p 0.5) and easy (0.95)
    prompts; 60 prompts a step. Mean count per class over the last 20 steps."""
    cfg = gdro_config_from_dict({"rollout": {"enable": True, "allocator": allocator, **rollout}})
    ctl = GDROController(cfg, 300)
    rng = np.random.default_rng(0)
    cls = np.repeat(["tail", "unsolvable", "mid", "easy"], [90, 90, 60, 60])
    p_true = np.select([cls == "tail", cls == "mid", cls == "easy"], [0.03, 0.5, 0.95], 0.0)
    got = {c: [] for c in ("tail", "unsolvable", "mid", "easy")}
    for step in range(steps):
        ids = rng.choice(300, 60, replace=False)
        n = ctl.schedule(ids)
        assert n.sum() == 240 and n.min() >= 2
        if step >= steps - 20:
            for c in got:
                got[c] += list(n[cls[ids] == c])
        rp = np.repeat(ids, n)
        ctl.observe(rp, rng.random(len(rp)) < p_true[rp], response_length=np.full(len(rp), 10))
    return {c: float(np.mean(v)) for c, v in got.items()}


def test_the_tail_gets_more_than_n_mean_under_failure_weighted_and_less_under_sqrt():
    fw, sqrt = _tail_population("failure_weighted"), _tail_population("sqrt")
    assert fw["tail"] > 4 > sqrt["tail"]
    assert fw["easy"] < 3  # paid for by the solved prompts
    assert fw["unsolvable"] < fw["tail"]  # 40-odd failed rollouts in the window: its claim has decayed
    # the control cannot tell a rare success from none: both share the larger count, mid and easy pay
    control = _tail_population("fixed_tail_share")
    assert min(control["tail"], control["unsolvable"]) > 4 and max(control["mid"], control["easy"]) < 2.1


def test_fixed_tail_share_gives_the_tail_its_factor_at_the_exact_budget():
    k = np.array([0, 2, 0, 5, 9, 10, 0, 3])
    m = np.array([20, 20, 0, 10, 10, 10, 8, 30])  # p̂ 0, .1, unseen, .5, .9, 1, 0, .1
    n = fixed_tail_share(k, m, 0.1, 2.0, 4, 2, 12)
    # tail: p̂ < .1 (.1 is not; unseen never is) gets 2 n̄; the others share 16 within one, lowest p̂ first
    assert n.tolist() == [8, 3, 2, 3, 3, 2, 8, 3]
    # a tail too large for the factor: the others at n_min, the tail shares the rest (within one)
    n = fixed_tail_share(np.zeros(8), np.full(8, 10.0), 0.1, 2.0, 4, 2, 12)
    assert np.all(n == 4)  # all tail: uniform
    k = np.array([0, 0, 0, 0, 0, 9, 9, 9])
    n = fixed_tail_share(k, np.full(8, 10.0), 0.1, 3.0, 4, 2, 12)
    assert n.sum() == 32 and np.all(n[5:] == 2) and sorted(n[:5]) == [5, 5, 5, 5, 6]
    # the factor is capped at n_max; a fractional share is split within one, lowest p̂ first
    n = fixed_tail_share(np.array([1, 0, 5, 5, 5]), np.full(5, 10.0), 0.2, 10.0, 4, 2, 7)
    assert n.tolist() == [7, 7, 2, 2, 2]
    n = fixed_tail_share(np.array([1, 0, 5, 5, 5]), np.full(5, 10.0), 0.2, 1.5, 4, 2, 12)
    assert n.tolist() == [6, 6, 3, 3, 2]
