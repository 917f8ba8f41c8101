"""The study harness's evidence protocol: Holm's correction, equal-budget refusal, tokens-to-target
and the run cache (recipe/gdro/lab/results/stats.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from recipe.gdro.lab.results.stats import (
    BudgetMismatch,
    Comparison,
    RunCache,
    budget_to_reach,
    censored_budgets,
    check_equal_budgets,
    holm,
    minimum_detectable_effect,
    paired_ci,
    paired_t_power,
    paired_t_pvalue,
    plan_seeds,
    value_at_budget,
)


def test_holm_on_a_known_case():
    # Holm (1979)-style worked example: m = 4, alpha = 0.05; thresholds 0.0125, 0.0167, 0.025, 0.05.
    res = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert [res[k].rejected for k in "dacb"] == [True, True, False, False]
    # adjusted: d 4*0.005=0.02, a max(0.02, 3*0.01=0.03)=0.03, c max(0.03, 2*0.03)=0.06, b max(0.06, 0.04)=0.06
    assert [round(res[k].p_adjusted, 12) for k in "dacb"] == [0.02, 0.03, 0.06, 0.06]
    # 0.04 alone would pass at 0.05, but not after c failed: step-down stops at the first failure
    assert res["b"].p == 0.04 and not res["b"].rejected


def test_holm_stricter_than_unadjusted_and_never_above_one():
    res = holm({f"x{i}": 0.02 for i in range(5)})
    assert not any(r.rejected for r in res.values())  # 5 * 0.02 = 0.1 > 0.05
    assert all(r.p_adjusted == pytest.approx(0.1) for r in res.values())
    assert holm({"a": 0.6, "b": 0.9})["b"].p_adjusted == 1.0


def test_holm_counts_untestable_comparisons_in_the_family():
    res = holm({"a": 0.02, "b": float("nan")})
    assert res["a"].p_adjusted == pytest.approx(0.04) and res["a"].rejected
    assert math.isnan(res["b"].p_adjusted) and not res["b"].rejected
    with pytest.raises(ValueError, match="'c'"):
        holm({"c": 1.5})


def test_paired_t_pvalue():
    assert math.isnan(paired_t_pvalue([0.3]))
    assert paired_t_pvalue([0.0, 0.0, 0.0]) == 1.0
    # equal non-zero differences have no variance: the t-test cannot answer (NaN), never p = 0, so a
    # tie such as a worst-skill difference of +1/60 on every seed is not a Holm rejection
    assert math.isnan(paired_t_pvalue([1 / 60, 1 / 60, 1 / 60]))
    family = holm({"tie": paired_t_pvalue([1 / 60] * 3), "other": 0.5})
    assert not family["tie"].rejected and math.isnan(family["tie"].p_adjusted)
    # scipy's ttest_rel on (1, 2, 3) against 0: t = 2 / (1 / sqrt 3) = 3.464, df 2 -> p = 0.0742
    assert paired_t_pvalue([1.0, 2.0, 3.0]) == pytest.approx(0.0742, abs=1e-4)


def test_paired_ci_is_scipys_t_interval():
    mean, lo, hi, n = paired_ci([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert (mean, n) == (2.0, 3) and hi - mean == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert math.isnan(paired_ci([0.2, 0.2], [0.1, 0.1])[1])  # no variance: no interval


def test_power_plan_matches_a_simulation_of_the_paired_t_after_holm():
    """plan_seeds' seeds give >= 80% power; one fewer does not; and a Monte-Carlo run of the paired
    t-test under Holm (one real effect among m comparisons) rejects that often."""
    from scipy import stats

    plan = plan_seeds(sd=0.008, grpo_gain=0.06, family_size=3)
    assert plan.effect == pytest.approx(0.015) and not plan.capped  # max(0.01, 25% of 0.06)
    assert plan.power >= 0.8 > paired_t_power(plan.effect, 0.008, plan.n_seeds - 1, 0.05 / 3)
    assert paired_t_power(plan.mde, 0.008, plan.n_seeds, 0.05 / 3) == pytest.approx(0.8, abs=1e-6)
    assert plan.mde <= plan.effect
    # the report's observed MDE is the same function at the evaluation seeds' SD
    assert minimum_detectable_effect(0.008, plan.n_seeds, 0.05 / 3) == pytest.approx(plan.mde, abs=1e-9)
    assert minimum_detectable_effect(0.016, plan.n_seeds, 0.05 / 3) > plan.mde
    assert math.isinf(minimum_detectable_effect(0.008, 1, 0.05)) and minimum_detectable_effect(0.0, 3, 0.05) == 0
    rng = np.random.default_rng(0)
    trials, hits = 4000, 0
    for _ in range(trials):
        d = rng.normal(0.0, 0.008, size=(3, plan.n_seeds))
        d[0] += plan.effect
        res = holm({f"c{i}": float(stats.ttest_1samp(d[i], 0.0).pvalue) for i in range(3)})
        hits += res["c0"].rejected
    se = math.sqrt(plan.power * (1 - plan.power) / trials)
    assert hits / trials >= plan.power - 3 * se  # Holm's later steps can only add rejections


def test_power_plan_approaches_the_normal_closed_form_for_many_seeds():
    """For large n the paired t's MDE tends to (z_{1-a/2m} + z_{power}) * sd / sqrt(n)."""
    from scipy import stats

    plan = plan_seeds(sd=0.05, grpo_gain=0.0, family_size=4, max_seeds=400)  # effect 0.01 -> many seeds
    z = stats.norm.ppf(1 - 0.05 / 8) + stats.norm.ppf(0.8)
    assert plan.n_seeds == pytest.approx((z * 0.05 / 0.01) ** 2, rel=0.05)
    assert plan.mde == pytest.approx(z * 0.05 / math.sqrt(plan.n_seeds), rel=0.02)
    capped = plan_seeds(sd=0.05, grpo_gain=0.0, family_size=4, max_seeds=10)
    assert capped.capped and capped.n_seeds == 10 and capped.mde > 0.01
    with pytest.raises(ValueError, match="sd=nan"):
        plan_seeds(sd=float("nan"), grpo_gain=0.1, family_size=3)


def test_budget_to_target_keeps_censored_seeds():
    """Kaplan-Meier: seeds that never reach the target are censored at their budget, not dropped."""
    times = [100.0, math.inf, 300.0, math.inf]  # two seeds never reach the target
    s = censored_budgets(times, [500, 250, 500, 500])
    assert (s.n, s.reached, s.censored) == (4, 2, (False, True, False, True))
    # S(100) = 3/4; the censored seed at 250 leaves 2 at risk at 300: S(300) = 3/4 * 1/2 = 0.375
    assert s.km_median == 300.0 and s.budgets == (100.0, 250.0, 300.0, 500.0)
    assert math.isinf(censored_budgets([math.inf, math.inf, 10.0], [20, 30, 40]).km_median)


def test_comparison_family_is_checked():
    Comparison("c", "rollout_gdro", "grpo", "mean_accuracy")
    with pytest.raises(ValueError, match="family='primry'"):
        Comparison("c", "rollout_gdro", "grpo", "mean_accuracy", family="primry")


def test_unequal_budgets_are_refused_naming_the_methods():
    assert check_equal_budgets({"grpo": 256_000, "rollout_gdro": 256_000}, "rollouts") == 256_000
    with pytest.raises(BudgetMismatch, match="'grpo' used 1000.*'rollout_gdro' used 1100"):
        check_equal_budgets({"grpo": 1000, "rollout_gdro": 1100}, "tokens", rtol=0.05)
    assert check_equal_budgets({"grpo": 1000, "rollout_gdro": 1040}, "tokens", rtol=0.05) == 1040
    with pytest.raises(BudgetMismatch, match="'joint'.*positive"):
        check_equal_budgets({"grpo": 1000, "joint": float("nan")}, "tokens")
    with pytest.raises(BudgetMismatch, match="no runs"):
        check_equal_budgets({}, "tokens")


def test_curves_read_at_a_budget_and_to_a_target():
    tokens, acc = [0, 100, 200, 300], [0.5, 0.6, 0.7, 0.65]
    assert value_at_budget(tokens, acc, 150) == pytest.approx(0.65)
    assert math.isnan(value_at_budget(tokens, acc, 301))  # never extrapolated
    assert budget_to_reach(tokens, acc, 0.65) == pytest.approx(150)
    assert budget_to_reach(tokens, acc, 0.5) == 0
    assert budget_to_reach(tokens, acc, 0.71) == math.inf


def test_run_cache_never_reuses_a_run_whose_config_differs(tmp_path):
    cache = RunCache(tmp_path / "cache")
    config = {"method": "grpo", "lr": 3e-4, "seed": 0, "steps": 200, "model": {"hidden": 64}}
    assert cache.get(config) is None
    cache.put(config, {"mean_accuracy": 0.63})
    assert cache.get(dict(reversed(list(config.items())))) == {"mean_accuracy": 0.63}  # key order irrelevant
    for key, value in [("lr", 3.0001e-4), ("seed", 1), ("steps", 201), ("model", {"hidden": 65})]:
        assert cache.get({**config, key: value}) is None, key
    assert cache.get({**config, "extra": None}) is None  # a new key is a different config
    # a stored file whose config was edited (or a hash collision) is a miss, not a wrong result
    path = cache.path(config)
    stored = json.loads(open(path, encoding="utf-8").read())
    stored["config"]["lr"] = 1e-3
    open(path, "w", encoding="utf-8").write(json.dumps(stored))
    assert cache.get(config) is None
    open(path, "w", encoding="utf-8").write("{truncated")
    assert cache.get(config) is None
