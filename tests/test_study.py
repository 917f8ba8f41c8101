"""The tiny-LM study harness (recipe/gdro/experiments/study.py): its declared protocol and its run cache."""

from __future__ import annotations

import json
import math

import pytest

from recipe.gdro.experiments import study
from recipe.gdro.results.stats import PRIMARY


def _run(final: dict[str, float], curve: list[tuple[int, float]], mass: float, before=None) -> dict:
    before = before or {"add2": 0.9, "sub2": 0.4, "mul2x2": 0.01}
    return {
        "before": {**{k: {"pass1": v} for k, v in before.items()}, "all": {"pass1": 0.5}},
        "after": {**{k: {"pass1": v} for k, v in final.items() if k != "all"}, "all": {"pass1": final["all"]}},
        "curve": [{"tokens": t, "mean": m} for t, m in curve],
        "tokens": curve[-1][0],
        "weighted_adv_token_mass": mass,
    }


def test_the_primary_family_is_declared_in_code_and_complete():
    family = study.primary_comparisons()
    assert len(family) == 9 and {c.family for c in family} == {PRIMARY}
    assert {c.method for c in family} == {"prompt_gdro", "rollout_gdro", "joint"}
    assert {c.metric for c in family} == {"final_mean", "final_worst", "log_tokens_to_target"}
    assert [c.lower_is_better for c in family if c.metric == "log_tokens_to_target"] == [True] * 3


def test_seed_metrics_worst_skill_ignores_what_the_base_cannot_solve_and_tokens_are_relative():
    grpo = _run({"add2": 0.95, "sub2": 0.50, "mul2x2": 0.0, "all": 0.60}, [(0, 0.5), (100, 0.55), (200, 0.60)], 10.0)
    gdro = _run({"add2": 0.90, "sub2": 0.60, "mul2x2": 0.0, "all": 0.62}, [(0, 0.5), (100, 0.60), (210, 0.62)], 12.5)
    m = study.seed_metrics(gdro, grpo)
    # mul2x2 is below the base's SOLVABLE threshold: its 0.0 must not be the worst skill
    assert m["final_worst"] == pytest.approx(0.60) and study.solvable_skills(grpo["before"]) == ["add2", "sub2"]
    # GDRO reaches GRPO's final 0.60 at 100 tokens, GRPO at 200: log(100/200)
    assert m["log_tokens_to_target"] == pytest.approx(math.log(0.5))
    assert m["mean_at_grpo_tokens"] == pytest.approx(0.60 + (0.62 - 0.60) * 100 / 110)
    assert m["step_mass_ratio"] == pytest.approx(1.25)
    never = _run({"add2": 0.9, "sub2": 0.4, "mul2x2": 0.0, "all": 0.55}, [(0, 0.5), (200, 0.55)], 10.0)
    assert math.isnan(study.seed_metrics(never, grpo)["log_tokens_to_target"])  # not reached: untestable, not 0


def test_the_confirmatory_arm_is_the_largest_tuning_seed_gain_and_the_seeds_are_fresh(monkeypatch):
    arms = {
        "a": ("joint", {}, 1.0),
        "control": ("grpo", {}, 0.0),
        "b": ("rollout_gdro", {}, 1.0),
        "c": ("prompt_gdro", {}, 0.5),
    }
    monkeypatch.setattr(study, "EXPLORE_ARMS", arms)
    gains = {"a": [0.01, -0.03], "control": [0.05, 0.05], "b": [0.004, 0.0], "c": [-0.01, 0.012]}
    assert study.chosen_arm(gains) == "b"  # a GRPO control is never the arm confirmed
    assert study.chosen_arm({**gains, "a": [0.0, 0.0], "b": [0.0, 0.0], "c": [-0.1, 0.0]}) == "a"  # ties: first
    used = {*study.TUNING_SEEDS, *study.EVAL_SEEDS, *study.EXPLORE_SEEDS, *study.LONG_SEEDS}
    assert not used & set(study.CONFIRM_SEEDS) and len(study.CONFIRM_SEEDS) >= 5


def test_report_runs_nothing_and_names_the_missing_run(tmp_path, capsys):
    assert study.main(["report", "--out", str(tmp_path)]) == 2  # no cache at all: nothing is created
    assert "no run cache" in capsys.readouterr().err and not (tmp_path / "cache").exists()
    (tmp_path / "cache").mkdir()
    assert study.main(["report", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not in the cache" in err and f"grpo lr={study.LR_GRID[0]:g} seed={study.TUNING_SEEDS[0]}" in err
    assert not any((tmp_path / "cache").iterdir())


def test_the_study_tunes_on_tuning_seeds_then_resumes_from_its_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        study, "STUDY_SHAPE", {"steps": 2, "prompts": 4, "n": 2, "num_train": 16, "num_val": 12, "eval_every": 1}
    )
    monkeypatch.setattr(study, "LR_GRID", (1e-4, 1e-3))
    monkeypatch.setattr(study, "TUNING_SEEDS", (100,))
    monkeypatch.setattr(study, "EVAL_SEEDS", (0, 1))
    out = tmp_path / "study"
    assert study.main(["tune", "--out", str(out), "--jobs", "1"]) == 0
    assert len(list((out / "cache").iterdir())) == 4 * 2  # methods x lrs x tuning seeds
    tuned = json.loads((out / "tuned_lr.json").read_text())
    for method, lr in tuned.items():  # the chosen lr is the best on the tuning seed
        scores = {
            g: study.RunCache(out / "cache").get(study.run_config(method, g, 100))["after"]["all"]["pass1"]
            for g in study.LR_GRID
        }
        assert scores[lr] == max(scores.values())
    assert study.main(["primary", "--out", str(out), "--jobs", "1"]) == 0
    first = (out / "report.md").read_text()
    assert len(list((out / "cache").iterdir())) == 8 + 4 * 2  # + methods x evaluation seeds
    assert "p (Holm)" in first and first.count("\n| ") >= 9
    capsys.readouterr()
    assert study.main(["report", "--out", str(out)]) == 0  # everything cached: runs nothing
    assert "0 to run" in capsys.readouterr().out and (out / "report.md").read_text() == first
    # the exploratory arms: GRPO's tuning-seed run is reused, the arm is one new run
    monkeypatch.setattr(study, "EXPLORE_SEEDS", (100,))
    monkeypatch.setattr(study, "EXPLORE_ARMS", {"tokens": ("rollout_gdro", {"rollout": {"budget": "tokens"}}, 1.0)})
    assert study.main(["explore", "--out", str(out), "--jobs", "1"]) == 0
    assert len(list((out / "cache").iterdir())) == 8 + 4 * 2 + 1
    assert "| tokens |" in (out / "explore.md").read_text()
    # the confirmatory run: the chosen arm and GRPO on fresh seeds, nothing else
    monkeypatch.setattr(study, "CONFIRM_SEEDS", (5, 6))
    assert study.main(["confirm", "--out", str(out), "--jobs", "1"]) == 0
    assert len(list((out / "cache").iterdir())) == 8 + 4 * 2 + 1 + 2 * 2
    confirmed = (out / "confirm.md").read_text()
    assert "'tokens'" in confirmed and "fresh seeds [5, 6]" in confirmed and "| final worst-skill |" in confirmed
    # the regimes: their own shapes, so their own runs (the small pool's shape differs in num_train)
    long_shape = {**study.STUDY_SHAPE, "steps": 8, "eval_every": 1}
    monkeypatch.setattr(study, "REGIMES", {"long": long_shape, "pool": {**study.STUDY_SHAPE, "num_train": 8}})
    monkeypatch.setattr(study, "LONG_SEEDS", (100, 101))
    assert study.main(["long", "--out", str(out), "--jobs", "1"]) == 0
    assert len(list((out / "cache").iterdir())) == 8 + 4 * 2 + 1 + 2 * 2 + 2 * 2 * 2
    long = (out / "long.md").read_text()  # per regime: a header row and 2 method rows
    head = "| step 0 | step 2 | step 4 | step 6 | step 8 | final vs GRPO (95% CI) | final worst-skill |"
    assert head in long and "long (8 steps, 16 training prompts)" in long and "pool (2 steps, 8" in long
    assert long.count("\n| ") == 2 * (1 + 2)
    # a changed setting is a different run: the cache does not answer for it
    monkeypatch.setitem(study.STUDY_SHAPE, "steps", 3)
    assert study.main(["report", "--out", str(out)]) == 2


def test_the_direct_loop_names_an_unusable_device(capsys):
    import torch

    from recipe.gdro.experiments import direct

    assert direct.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert direct.main(["--device", "cuda", "--steps", "1"]) == 2
        assert "--device: device='cuda': CUDA is not available" in capsys.readouterr().err
    assert direct.main(["--device", "tpu9", "--steps", "1"]) == 2
