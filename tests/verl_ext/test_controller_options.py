"""Controller options of issue 9: advantage-mass normalisation, lagged weights, tiny groups,
unbiased learnability, always-updated v_b, first-observation scores, released bin edges."""

import numpy as np
import pytest

from verl_ext import (
    BinnerConfig,
    GDROController,
    OnlineDifficultyBinner,
    PromptGDRO,
    PromptGDROConfig,
    gdro_config_from_dict,
    prompt_loss,
)


def _grpo_abs_adv(prompt_ids, correct):
    """|A| of verl's GRPO outcome advantage (reward - group mean) / (group std + eps), per response."""
    pid = np.asarray(prompt_ids)
    r = np.asarray(correct, dtype=np.float64)
    out = np.zeros_like(r)
    for p in np.unique(pid):
        sel = pid == p
        out[sel] = np.abs(r[sel] - r[sel].mean()) / (r[sel].std(ddof=1) + 1e-6)
    return out


def _batch(rng, ids, p_true, n=4):
    rp = np.repeat(ids, n)
    acc = rng.random(len(rp)) < p_true[rp]
    return rp, acc, _grpo_abs_adv(rp, acc)


# ---------------------------------------------------------------- item 1: normalize
@pytest.mark.parametrize("cap", [15.0, 1.5, 1.0])
def test_advantage_mass_normalisation_is_exact_even_when_the_cap_binds(cap):
    pg = PromptGDRO(PromptGDROConfig(enable=True, weight_cap=cap), num_groups=4)
    pg.scores[:] = [5.0, 2.0, 0.0, -1.0]
    rng = np.random.default_rng(0)
    groups = rng.integers(1, 4, 400)
    groups[:3] = 0  # a few responses in the heaviest group: the cap binds for them
    a = rng.random(400) * (rng.random(400) < 0.6)  # 40% zero-advantage responses
    m = pg.response_multipliers(groups, abs_advantage=a)
    assert np.all(m > 0) and np.all(m <= cap + 1e-12)
    assert (a * m).sum() == pytest.approx(a.sum(), rel=1e-12)
    if cap == 15.0:  # the cap binds for group 0 and the rest are rescaled, keeping their ratios
        assert m[groups == 0].max() == cap
        ratio = m[groups == 1][0] / m[groups == 2][0]
        assert ratio == pytest.approx(pg.group_probabilities()[1] / pg.group_probabilities()[2])


def test_zero_advantage_mass_gives_all_ones():
    pg = PromptGDRO(PromptGDROConfig(enable=True), num_groups=3)
    pg.scores[:] = [3.0, 0.0, 1.0]
    assert np.array_equal(pg.response_multipliers(np.array([0, 1, 2, 2]), abs_advantage=np.zeros(4)), np.ones(4))


def test_advantage_mass_ratio_metric_all_modes():
    """all_responses inflates Σ|A·m|/Σ|A| when zero-advantage groups exist; advantage_mass keeps it 1."""
    ratios = {}
    for mode in ("all_responses", "advantage_mass"):
        ctl = GDROController(gdro_config_from_dict({"prompt": {"enable": True, "normalize": mode}}), 400)
        rng = np.random.default_rng(1)
        # Bimodal difficulty: many all-correct / all-wrong groups (zero advantage) at low weight.
        p_true = np.where(rng.random(400) < 0.5, rng.choice([0.0, 1.0], 400), 0.5)
        for _ in range(30):
            rp, acc, a = _batch(rng, rng.choice(400, 64, replace=False), p_true)
            m = ctl.observe(rp, acc, a)
            assert ctl.metrics()["gdro/prompt/advantage_mass_ratio"] == pytest.approx((a * m).sum() / a.sum())
        ratios[mode] = ctl.metrics()["gdro/prompt/advantage_mass_ratio"]
    assert ratios["advantage_mass"] == pytest.approx(1.0)
    assert ratios["all_responses"] > 1.2
    off = GDROController(gdro_config_from_dict({}), 10)
    off.observe([1, 1, 2, 2], [True, False, True, True], [0.7, 0.7, 0.0, 0.0])
    assert off.metrics()["gdro/prompt/advantage_mass_ratio"] == 1.0


def test_advantage_mass_without_abs_advantage_names_the_key_and_leaves_state_alone():
    ctl = GDROController(gdro_config_from_dict({"prompt": {"enable": True}}), 10)
    with pytest.raises(ValueError, match=r"gdro\.prompt\.normalize"):
        ctl.observe([1, 1, 2, 2], [True, False, True, True])
    assert ctl.step == 0 and ctl.binner.seen_fraction() == 0.0 and not ctl.prompt.observed.any()


# ---------------------------------------------------------------- item 6: lagged
def test_lagged_weights_use_scores_before_the_update():
    cfg = {"prompt": {"enable": True, "normalize": "all_responses"}}
    live = GDROController(gdro_config_from_dict(cfg), 200)
    lag = GDROController(gdro_config_from_dict({"prompt": {**cfg["prompt"], "lagged": True}}), 200)
    rng = np.random.default_rng(2)
    p_true = rng.random(200)
    for _ in range(8):
        rp, acc, a = _batch(rng, rng.choice(200, 32, replace=False), p_true)
        groups = lag.binner.groups_of(rp)
        q_before = lag.prompt.group_probabilities()
        m_lag = lag.observe(rp, acc, a)
        m_live = live.observe(rp, acc, a)
        raw = q_before[groups]
        q_after = live.prompt.group_probabilities()
        np.testing.assert_allclose(m_lag, np.minimum(raw / raw.mean(), 15.0))
        live_raw = q_after[groups]
        np.testing.assert_allclose(m_live, np.minimum(live_raw / live_raw.mean(), 15.0))  # post-update q
        # Lagging changes which q scales the step, not what the adversary learns.
        np.testing.assert_allclose(lag.prompt.group_probabilities(), q_after)
    assert not np.allclose(m_lag, m_live)


# ---------------------------------------------------------------- item 2: tiny groups
def _tiny_bin_multiplier(k0):
    """31 prompts in bin 1 (loss 0.1), then a bin holding ONE prompt with the maximal loss 0.25."""
    pg = PromptGDRO(PromptGDROConfig(enable=True, min_group_prompts=k0, normalize="all_responses"), num_groups=3)
    big = np.ones(32, dtype=np.int64)
    for _ in range(20):
        pg.update(big, np.full(32, 0.1))
    groups = np.array([0] + [1] * 31)
    before = pg.scores.copy()
    pg.update(groups, np.array([0.25] + [0.1] * 31))
    mult = pg.response_multipliers(np.repeat(groups, 4))
    return pg, before, mult[0]


def test_a_one_prompt_bin_cannot_swing_its_weight():
    """Stated bound: a bin with c prompts moves its score by at most w (x - S_ref) at first sight,
    w = c/(c+k0), x = ℓ/q̂ <= ℓ_max/share_floor; its multiplier is then at most exp(η · that move)."""
    k0 = 8.0
    pg, before, m_tiny = _tiny_bin_multiplier(k0)
    cfg = pg.config
    x_max = 0.25 / max(1 / 32, cfg.share_floor)
    move_bound = (1 / (1 + k0)) * x_max
    assert pg.scores[0] - before[1] <= move_bound  # S_ref = bin 1's score before the step
    assert m_tiny <= np.exp(cfg.eta * move_bound) <= 2.5
    _, _, m_unbounded = _tiny_bin_multiplier(0.0)  # Eq. 14 as printed
    assert m_unbounded > 10 and m_tiny < m_unbounded / 4


def test_leftover_unseen_prompts_stay_bounded():
    """After an epoch with the incomplete last batch dropped, the unseen prompts left over turn up
    one per batch in the next epoch: a one-prompt `unseen` group. Its score moves by at most
    β·c/(c+k0)·ℓ_max/q̂ per step (q̂ = max(c/B, share_floor))."""
    B, L = 128, 4
    P = 3 * B + L

    def run(k0):
        ctl = GDROController(gdro_config_from_dict({"prompt": {"enable": True, "min_group_prompts": k0}}), P)
        rng = np.random.default_rng(3)
        p_true = rng.random(P)
        order = rng.permutation(P)
        for s in range(3):  # epoch 1: the last L prompts are dropped with the incomplete batch
            ctl.observe(*_batch(rng, order[s * B : (s + 1) * B], p_true))
        unseen, moves, m_unseen = ctl.binner.unseen_group, [], []
        for left in order[3 * B :]:  # epoch 2: one leftover per batch, 2 of its 4 rollouts correct
            ids = np.concatenate([[left], rng.choice(order[: 3 * B], B - 1, replace=False)])
            rp, acc, _ = _batch(rng, ids, p_true)
            acc[:4] = [True, False, True, False]
            before = ctl.prompt.scores[unseen]
            m = ctl.observe(rp, acc, _grpo_abs_adv(rp, acc))
            moves.append(ctl.prompt.scores[unseen] - before)
            m_unseen.append(m[0])
        return ctl, max(moves), max(m_unseen)

    ctl, move, m_unseen = run(8.0)
    cfg = ctl.config.prompt
    bound = cfg.beta * (1 / (1 + 8.0)) * 0.25 / max(1 / B, cfg.share_floor)
    assert move <= bound + 1e-12
    _, move_old, m_old = run(0.0)
    assert m_unseen < 2.0 < m_old and move_old > 5 * bound


# ---------------------------------------------------------------- item 3: unbiased learnability
def test_unbiased_learnability_in_joint_mode():
    # Exact expectation over Binomial(n, p): the unbiased form equals p(1-p) for every n >= 2.
    from math import comb

    p = 0.3
    for n in (2, 3, 8):
        k = np.arange(n + 1)
        pmf = np.array([comb(n, int(i)) * p**i * (1 - p) ** (n - i) for i in k])
        biased = (pmf * prompt_loss("learnability", k, np.full(n + 1, n))).sum()
        unbiased = (pmf * prompt_loss("learnability", k, np.full(n + 1, n), unbiased=True)).sum()
        assert unbiased == pytest.approx(p * (1 - p)) and biased == pytest.approx(p * (1 - p) * (1 - 1 / n))
    # Joint mode uses it: one group, one prompt with 1 of 2 correct → score = ℓ = 0.25 · 2.
    for rollout_on, expected in ((True, 0.5), (False, 0.25)):
        cfg = gdro_config_from_dict({"prompt": {"enable": True}, "rollout": {"enable": rollout_on}})
        ctl = GDROController(cfg, 10)
        ctl.observe([3, 3], [True, False], [1.0, 1.0])
        assert ctl.prompt.scores[ctl.binner.unseen_group] == pytest.approx(expected)


# ---------------------------------------------------------------- item 4: v_b always updated
def test_bin_variance_is_updated_with_rollout_gdro_off():
    ctl = GDROController(gdro_config_from_dict({}), 10)  # observe-only GRPO baseline
    ctl.observe([1, 1, 1, 1, 2, 2, 2, 2], [True] * 4 + [True, False, True, False])
    # Both prompts were unseen: v = mean(0, 0.5·0.5·4/3) = 1/6, not the prior 0.25.
    assert ctl.metrics()["gdro/unseen/variance"] == pytest.approx(1 / 6)
    assert ctl.rollout.arm_scores.sum() == 0  # the allocator itself is untouched


# ---------------------------------------------------------------- item 5: first observation
def test_score_starts_from_a_bins_first_observation():
    pg = PromptGDRO(PromptGDROConfig(enable=True, min_group_prompts=0), num_groups=3)
    for _ in range(10):
        pg.update(np.zeros(20, dtype=np.int64), np.full(20, 0.1))
    assert pg.scores[0] == pytest.approx(0.1)  # first observation, not β · 0.1 growing
    pg.update(np.ones(20, dtype=np.int64), np.full(20, 0.2))  # bin 1 first seen at step 11
    assert pg.scores[1] == pytest.approx(0.2)
    assert pg.scores[2] == 0.0 and not pg.observed[2]


def test_eq14_as_printed_with_score_init_zero():
    """score_init=zero, min_group_prompts=0: S_0 = 0, S_t(b) = (1-β) S_{t-1}(b) + β ℓ̄_t(b)/q̂_t(b) for
    the bins present (absent bins keep their score), q by Eq. 15-16, retraced by hand."""
    cfg = PromptGDROConfig(enable=True, min_group_prompts=0, score_init="zero")
    pg = PromptGDRO(cfg, num_groups=4)
    rng = np.random.default_rng(7)
    s = np.zeros(4)
    for t in range(12):
        groups = rng.choice([0, 1, 2] if t < 5 else [0, 1, 2, 3], size=64, p=None)
        losses = rng.random(64) * 0.25
        q = pg.update(groups, losses)
        for b in np.unique(groups):
            share = max(np.mean(groups == b), cfg.share_floor)
            s[b] = (1 - cfg.beta) * s[b] + cfg.beta * losses[groups == b].mean() / share
        np.testing.assert_allclose(pg.scores, s, rtol=1e-12, atol=1e-15)
        w = np.exp(cfg.eta * np.clip(s, -cfg.score_clip, cfg.score_clip))
        np.testing.assert_allclose(q, (1 - cfg.gamma) * w / w.sum() + cfg.gamma / 4, rtol=1e-12)
        if t == 5:  # bin 3 first seen at t = 5: one EMA step from 0, not its observation
            assert s[3] == pytest.approx(cfg.beta * losses[groups == 3].mean() / np.mean(groups == 3))
    # min_group_prompts=0 alone is not Eq. 14: the first observation sets the score.
    first = PromptGDRO(PromptGDROConfig(enable=True, min_group_prompts=0), num_groups=2)
    first.update(np.zeros(8, dtype=np.int64), np.full(8, 0.2))
    zero = PromptGDRO(cfg, num_groups=2)
    zero.update(np.zeros(8, dtype=np.int64), np.full(8, 0.2))
    assert first.scores[0] == pytest.approx(0.2) and zero.scores[0] == pytest.approx(cfg.beta * 0.2)


def test_score_init_is_validated():
    from verl_ext import GDROConfigError

    with pytest.raises(GDROConfigError, match=r"gdro\.prompt\.score_init"):
        gdro_config_from_dict({"prompt": {"score_init": "zeros"}})


# ---------------------------------------------------------------- item 7: released bin edges
RELEASED_EDGES = [0, 0.1, 0.2, 0.4, 0.6, 0.8, 0.9, 1]


def test_released_bin_edges_are_seven_bins_end_to_end():
    from omegaconf import OmegaConf

    section = OmegaConf.to_container(OmegaConf.from_dotlist(["binner.bin_edges=[0,.1,.2,.4,.6,.8,.9,1]"]))
    cfg = gdro_config_from_dict(section)
    assert cfg.binner.num_bins == 7 and cfg.binner.edges() == RELEASED_EDGES
    ctl = GDROController(cfg, 100)
    assert ctl.group_names() == [f"bin_{b:02d}" for b in range(7)] + ["unseen"]
    b = OnlineDifficultyBinner(BinnerConfig(bin_edges=RELEASED_EDGES), 20)
    acc = np.array([0.0, 0.05, 0.1, 0.15, 0.3, 0.5, 0.7, 0.85, 0.9, 0.95, 1.0])
    ids = np.arange(len(acc))
    b.update(ids, np.rint(acc * 20).astype(int), np.full(len(acc), 20))
    # Intervals are [a_k, a_{k+1}), the last one closed ([0.9, 1]).
    assert b.groups_of(ids).tolist() == [0, 0, 1, 1, 2, 3, 4, 5, 6, 6, 6]
    ctl.observe(np.repeat(ids, 4), np.ones(44, dtype=bool))
    assert "gdro/bin_06/data_share" in ctl.metrics() and "gdro/bin_07/data_share" not in ctl.metrics()


@pytest.mark.parametrize("edges", [[0, 0.5, 0.5, 1], [0, 0.6, 0.4, 1], [0.1, 1], [0, 0.5], [0]])
def test_bad_bin_edges_name_the_key(edges):
    from verl_ext import GDROConfigError

    with pytest.raises(GDROConfigError, match=r"binner\.bin_edges"):
        gdro_config_from_dict({"binner": {"bin_edges": edges}})
