"""The tiny-LM study harness (recipe/gdro/cpu/study.py): its declared protocol and its run cache."""

from __future__ import annotations

import json
import math

import pytest

from recipe.gdro.cpu import study
from recipe.gdro.sim.protocol import PRIMARY


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


def test_report_runs_nothing_and_names_the_missing_run(tmp_path, capsys):
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
    monkeypatch.setattr(study, "EXPLORE_ARMS", {"tokens": ("rollout_gdro", {"rollout": {"budget": "tokens"}})})
    assert study.main(["explore", "--out", str(out), "--jobs", "1"]) == 0
    assert len(list((out / "cache").iterdir())) == 8 + 4 * 2 + 1
    assert "| tokens |" in (out / "explore.md").read_text()
    # the long-horizon arm: its own shape, so its own runs
    monkeypatch.setattr(study, "LONG_SHAPE", {**study.STUDY_SHAPE, "steps": 4, "eval_every": 1})
    monkeypatch.setattr(study, "LONG_SEEDS", (100,))
    assert study.main(["long", "--out", str(out), "--jobs", "1"]) == 0
    assert len(list((out / "cache").iterdir())) == 8 + 4 * 2 + 1 + 2
    long = (out / "long.md").read_text()  # below: a header row and 2 method rows
    assert "| step 0 | step 2 | step 4 | final worst-skill |" in long and long.count("\n| ") == 1 + 2
    # a changed setting is a different run: the cache does not answer for it
    monkeypatch.setitem(study.STUDY_SHAPE, "steps", 3)
    assert study.main(["report", "--out", str(out)]) == 2


def test_the_direct_loop_names_an_unusable_device(capsys):
    import torch

    from recipe.gdro.cpu import direct

    assert direct.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert direct.main(["--device", "cuda", "--steps", "1"]) == 2
        assert "--device: device='cuda': CUDA is not available" in capsys.readouterr().err
    assert direct.main(["--device", "tpu9", "--steps", "1"]) == 2
