"""Token accounting and the token budget (rollout.budget=tokens), on the controllers themselves."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_ext import GDROConfigError, GDROController, gdro_config_from_dict
from verl_ext.config import Allocator, RolloutGDROConfig
from verl_ext.rollout_gdro import RolloutGDRO, repair_to_budget, repair_to_token_budget, token_excess
from verl_ext.tokens import LengthTracker, token_weighted_loss


def _within_token_budget(n, cost, n_mean) -> bool:
    return token_excess(n, cost, n_mean) <= 1e-9 * float(np.sum(cost)) * n_mean


# ------------------------------------------------------------------------------------ both constraints
@settings(max_examples=150, deadline=None)
@given(
    B=st.integers(1, 60),
    n_mean=st.integers(2, 6),
    extra=st.integers(0, 8),
    allocator=st.sampled_from(Allocator.values()),
    seed=st.integers(0, 2**31 - 1),
    steps=st.integers(1, 4),
)
def test_every_allocator_keeps_both_budgets_exactly(B, n_mean, extra, allocator, seed, steps):
    rng = np.random.default_rng(seed)
    n_min, n_max = 2, n_mean + extra
    cfg = RolloutGDROConfig(enable=True, allocator=allocator, budget="tokens", n_mean=n_mean, n_min=n_min, n_max=n_max)
    r = RolloutGDRO(cfg, 5)
    r.variance = rng.uniform(0.0, 0.25, 5)
    for _ in range(steps):
        groups = rng.integers(0, 5, B)
        # lengths correlated with the bin (hard bins longer) plus noise: the constraint often binds
        cost = rng.uniform(50, 4000, 5)[groups] * rng.uniform(0.5, 1.5, B)
        accuracy = rng.uniform(0, 1, B)
        seen = rng.integers(0, 9, B)
        window = (rng.binomial(seen, accuracy), seen)
        n = r.allocate(groups, accuracy, prompt_cost=cost, window_counts=window)
        assert n.dtype.kind == "i" and n.sum() == B * n_mean
        assert n.min() >= n_min and n.max() <= n_max
        assert _within_token_budget(n, cost, n_mean), token_excess(n, cost, n_mean)


@settings(max_examples=200, deadline=None)
@given(B=st.integers(1, 80), n_mean=st.integers(2, 8), extra=st.integers(0, 10), seed=st.integers(0, 2**31 - 1))
def test_token_repair_of_any_proposal(B, n_mean, extra, seed):
    """Any in-bounds proposal is repaired to both budgets, and one already within them is left alone."""
    rng = np.random.default_rng(seed)
    n_min, n_max = 2, n_mean + extra
    v = rng.uniform(0.0, 0.3, B)
    cost = rng.choice([1.0, 7.0, 300.0, 2048.0], B) * rng.uniform(0.9, 1.1, B)
    proposal = repair_to_budget(rng.integers(n_min, n_max + 1, B), v, B * n_mean, n_min, n_max)
    n = repair_to_token_budget(proposal, v, cost, n_mean, n_min, n_max)
    assert n.sum() == B * n_mean and n.min() >= n_min and n.max() <= n_max
    assert _within_token_budget(n, cost, n_mean)
    if _within_token_budget(proposal, cost, n_mean):
        assert np.array_equal(n, proposal)
    else:
        assert not np.array_equal(n, proposal)


def test_equal_lengths_make_the_token_budget_the_rollout_budget():
    cfg = RolloutGDROConfig(enable=True, budget="tokens")
    r = RolloutGDRO(cfg, 3)
    r.variance = np.array([0.25, 0.1, 0.01])
    ref = RolloutGDRO(RolloutGDROConfig(enable=True), 3)
    ref.variance = r.variance.copy()
    groups = np.arange(30) % 3
    for _ in range(5):
        assert np.array_equal(r.allocate(groups, prompt_cost=np.full(30, 700.0)), ref.allocate(groups))
        assert r.token_price == 0.0


# ------------------------------------------------------------------------------------ the dual variable
def _run_price(cost_of_bin, steps=40):
    cfg = RolloutGDROConfig(enable=True, budget="tokens")
    r = RolloutGDRO(cfg, 3)
    r.variance = np.array([0.24, 0.12, 0.02])  # bin 0 wants the most rollouts
    groups = np.arange(96) % 3
    cost = np.asarray(cost_of_bin, dtype=np.float64)[groups]
    prices, ratios = [], []
    for _ in range(steps):
        n = r.allocate(groups, prompt_cost=cost)
        assert n.sum() == 96 * 4 and _within_token_budget(n, cost, 4)
        prices.append(r.token_price)
        ratios.append(r.last["token_proposal_ratio"])
    return np.array(prices), np.array(ratios), n, cost


def test_lambda_stays_zero_while_the_token_budget_is_slack():
    # The high-variance bin writes the SHORTEST responses: the square-root law already saves tokens.
    prices, ratios, n, cost = _run_price([300.0, 900.0, 2000.0])
    assert np.all(prices == 0.0)
    assert np.all(ratios < 1.0)
    assert token_excess(n, cost, 4) < 0  # strictly inside the token budget


def test_lambda_binds_when_the_token_budget_is_not_slack():
    # The high-variance bin writes the LONGEST responses: the plain law would exceed uniform's tokens.
    prices, ratios, n, cost = _run_price([3000.0, 900.0, 300.0], steps=200)
    assert ratios[0] > 1.05  # the first proposal (λ = 0) is over the token budget
    assert prices[-1] > 0.0 and np.all(np.diff(prices[:5]) > 0)  # λ rises while the proposal is over it
    assert abs(ratios[-20:].mean() - 1.0) < 0.03  # and settles where the proposal meets it
    assert abs(token_excess(n, cost, 4)) <= cost.max()  # the constraint is (integer-)tight
    # still the square-root law's direction: the high-variance bin gets more than the solved one
    assert n[0::3].mean() > n[2::3].mean()


# ------------------------------------------------------------------------------------ ĉ and the length state
def test_expected_lengths_fall_back_from_prompt_to_bin_to_batch_mean():
    t = LengthTracker(num_prompts=6, num_groups=3, beta=0.5)
    assert np.array_equal(t.expected_lengths([0, 1], [0, 1]), [1.0, 1.0])  # nothing known: all equal
    t.update(np.array([0, 1]), np.array([0, 0]), tokens=np.array([400.0, 1200.0]), rollouts=np.array([4.0, 2.0]))
    assert t.prompt_length[0] == 100.0 and t.prompt_length[1] == 600.0
    assert t.group_length[0] == 1600.0 / 6.0  # the bin's mean over its responses
    c = t.expected_lengths([0, 2, 3], [0, 0, 2])
    # prompt 0: its own; prompt 2 (unseen, bin 0): bin 0's; prompt 3 (bin 2 never seen): batch mean
    assert c[0] == 100.0 and c[1] == 1600.0 / 6.0 and c[2] == pytest.approx((100.0 + 1600.0 / 6.0) / 2)
    t.update(np.array([0]), np.array([1]), tokens=np.array([800.0]), rollouts=np.array([4.0]))
    assert t.prompt_length[0] == 0.5 * 100.0 + 0.5 * 200.0  # EMA over visits


def _controller(**rollout):
    cfg = gdro_config_from_dict({"prompt": {"enable": True}, "rollout": {"enable": True, **rollout}})
    return GDROController(cfg, 40, loss_agg_mode="token-mean", max_response_length=1000)


def _step(ctl, rng, t):
    ids = rng.choice(40, 8, replace=False)
    counts = ctl.schedule(ids)
    pid = np.repeat(ids, counts)
    p = (pid % 5) / 4.0
    acc = rng.random(len(pid)) < p
    lengths = np.where(acc, 200, 700) + (pid * 13 + t) % 50
    lengths[rng.random(len(pid)) < 0.1] = 1000  # some hit the limit
    abs_adv = rng.uniform(0, 1.5, len(pid))
    ctl.observe(pid, acc, abs_adv, response_length=lengths)
    return counts


def test_resume_restores_the_length_state_bit_for_bit(tmp_path):
    rng_a = np.random.default_rng(3)
    a = _controller(budget="tokens")
    for t in range(6):
        _step(a, rng_a, t)
    path = str(tmp_path / "state.pkl")
    a.save(path)
    b = _controller(budget="tokens")
    b.load(path)
    assert np.array_equal(b.lengths.prompt_length, a.lengths.prompt_length, equal_nan=True)
    assert np.array_equal(b.lengths.group_length, a.lengths.group_length, equal_nan=True)
    assert np.array_equal(b.lengths.prompt_weight, a.lengths.prompt_weight) and a.lengths.prompt_weight.any()
    assert b.rollout.token_price == a.rollout.token_price
    rng_b = pickle.loads(pickle.dumps(rng_a))
    for t in range(6, 12):
        assert np.array_equal(_step(a, rng_a, t), _step(b, rng_b, t))
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa["lengths"]) == ["group_length", "prompt_length", "prompt_weight"]
    for key in sa["lengths"]:
        assert np.array_equal(sa["lengths"][key], sb["lengths"][key], equal_nan=True)
    assert sa["rollout"]["token_price"] == sb["rollout"]["token_price"]
    assert a.metrics() == b.metrics()


# ------------------------------------------------------------------------------------ metrics
def test_token_metrics_of_one_step():
    cfg = gdro_config_from_dict({"binner": {"num_bins": 2}})  # observe-only GRPO
    ctl = GDROController(cfg, 4, max_response_length=100)
    ctl.schedule([0, 1])
    pid = [0, 0, 0, 0, 1, 1, 1, 1]
    acc = [1, 1, 0, 0, 0, 0, 0, 0]
    lengths = [10, 20, 100, 50, 100, 100, 80, 60]
    ctl.observe(pid, acc, response_length=lengths)
    m = ctl.metrics()
    assert m["gdro/tokens/generated"] == 520.0
    assert m["gdro/tokens/uniform_expected"] == 520.0 and m["gdro/tokens/ratio_to_uniform"] == 1.0
    assert m["gdro/tokens/truncation_rate"] == 3 / 8
    assert m["gdro/unseen/response_length"] == 65.0 and m["gdro/unseen/truncation_rate"] == 3 / 8
    ctl.schedule([0, 1])  # now prompt 0 is in a bin, prompt 1 in the hardest
    ctl.observe([0, 0, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0], response_length=[30, 30, 90, 90, 90, 90, 100, 50])
    m = ctl.metrics()
    # uniform (4 each) on the same prompts: 4 * 30 + 4 * 85 = 460; generated 60 + 510 = 570
    assert m["gdro/tokens/uniform_expected"] == 460.0 and m["gdro/tokens/generated"] == 570.0
    assert m["gdro/tokens/ratio_to_uniform"] == pytest.approx(570 / 460)
    assert m["gdro/bin_00/response_length"] == 85.0 and m["gdro/bin_00/truncation_rate"] == 1 / 6


# ------------------------------------------------------------------------------------ Prompt-GDRO's units
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "token-sum"]))
def test_token_weighted_advantage_mass_is_preserved(seed, mode):
    rng = np.random.default_rng(seed)
    cfg = gdro_config_from_dict({"prompt": {"enable": True, "min_group_prompts": 0.0}, "binner": {"num_bins": 4}})
    ctl = GDROController(cfg, 30, loss_agg_mode=mode)
    for _ in range(4):
        ids = rng.choice(30, 10, replace=False)
        ctl.schedule(ids)
        pid = np.repeat(ids, 4)
        acc = rng.random(len(pid)) < (pid % 4) / 3.0
        abs_adv = rng.uniform(0, 2, len(pid))
        lengths = rng.integers(1, 4000, len(pid)).astype(float)
        m = ctl.observe(pid, acc, abs_adv, response_length=lengths)
        mass = (abs_adv * lengths).sum()
        assert abs((abs_adv * m * lengths).sum() - mass) <= 1e-6 * mass
        assert ctl.metrics()["gdro/prompt/advantage_mass_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_per_response_mass_under_seq_mean_token_mean():
    rng = np.random.default_rng(0)
    cfg = gdro_config_from_dict({"prompt": {"enable": True, "min_group_prompts": 0.0}, "binner": {"num_bins": 4}})
    per_resp = GDROController(cfg, 30, loss_agg_mode="seq-mean-token-mean")
    per_tok = GDROController(cfg, 30, loss_agg_mode="token-mean")
    moved = False
    for _ in range(4):
        ids = rng.choice(30, 10, replace=False)
        pid = np.repeat(ids, 4)
        acc = rng.random(len(pid)) < (pid % 4) / 3.0
        abs_adv = rng.uniform(0, 2, len(pid))
        lengths = np.where(acc, 100.0, 3000.0)  # failures run longer
        m = per_resp.observe(pid, acc, abs_adv, response_length=lengths)
        assert (abs_adv * m).sum() == pytest.approx(abs_adv.sum(), rel=1e-9)
        mt = per_tok.observe(pid, acc, abs_adv, response_length=lengths)
        moved |= not np.allclose(m, mt)
    assert moved  # the units matter: the two modes give different multipliers


def test_token_weighted_mass_needs_lengths_and_unknown_modes_are_refused():
    cfg = gdro_config_from_dict({"prompt": {"enable": True}})
    ctl = GDROController(cfg, 4, loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="response_length"):
        ctl.observe([0, 0], [1, 0], [1.0, 1.0])
    with pytest.raises(ValueError, match="loss_agg_mode='tokens-mean'"):
        GDROController(cfg, 4, loss_agg_mode="tokens-mean")
    assert token_weighted_loss("token-mean") and not token_weighted_loss("seq-mean-token-mean")
    assert not token_weighted_loss(None)


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("value, hint", [("token", "did you mean tokens?"), ("rollout", "did you mean rollouts?")])
def test_bad_budget_is_refused_with_a_did_you_mean(value, hint):
    with pytest.raises(GDROConfigError, match="gdro.rollout.budget") as e:
        gdro_config_from_dict({"rollout": {"budget": value}})
    assert hint in str(e.value) and "('rollouts', 'tokens')" in str(e.value)


def test_token_budget_needs_the_lengths():
    r = RolloutGDRO(RolloutGDROConfig(enable=True, budget="tokens"), 2)
    with pytest.raises(ValueError, match="budget=tokens needs"):
        r.allocate(np.array([0, 1]))
