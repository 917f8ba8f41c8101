"""recipe/gdro/lab/experiments/quickstart.py's argument checks (the training itself: tests/run_scripts/test_signals.py
and the CPU backend's tests)."""

from __future__ import annotations

import pytest

from recipe.gdro.lab.experiments import quickstart


def test_runs_with_an_empty_item_is_refused_before_training(tmp_path, capsys):
    """Before: --runs '' trained nothing, then died with FileNotFoundError on learning_curves.png."""
    for runs in ("", "grpo,", ",joint_gdro", "grpo,,joint_gdro"):
        assert quickstart.main(["--runs", runs, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"quickstart: --runs {runs!r} has an empty item; name runs from grpo"), err
    assert not (tmp_path / "out").exists()


def previous_result(out):
    """A complete quick-start result as an earlier run left it: report, figure, a run's metrics (30 steps)."""
    (out / "grpo").mkdir(parents=True)
    lines = "".join(f'{{"step": {s}, "gdro/rollouts_per_prompt": 4.0}}\n' for s in range(1, 31))
    (out / "grpo" / "gdro_metrics.jsonl").write_text(lines)
    (out / "report.md").write_text("# Quick start\n30 steps\n")
    (out / "learning_curves.png").write_bytes(b"\x89PNG old")
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_a_failed_rerun_leaves_the_previous_result_as_it_was(tmp_path, capsys):
    """Before: a rerun deleted <out>/<run>/gdro_metrics.jsonl before training and wrote its partial lines there,
    while report.md still described the old run. Now it trains in <out>.partial and <out> is untouched.
    The rerun fails at its first run's start-up checks (an unknown key: exit 2 before Ray, ~15 s)."""
    out = tmp_path / "quickstart_out"
    before = previous_result(out)
    with pytest.raises(SystemExit, match="quickstart: grpo failed"):
        quickstart.main(["--out", str(out), "--runs", "grpo", "--steps", "1", "trainer.no_such_key=1"])
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert (tmp_path / "quickstart_out.partial" / "grpo" / "train.log").exists()


def test_an_out_folder_with_other_files_is_refused(tmp_path, capsys):
    """A complete run replaces the whole --out folder, so one that holds what a quick start does not write is
    refused before anything runs."""
    (tmp_path / "notes.txt").write_text("mine")
    assert quickstart.main(["--out", str(tmp_path), "--runs", "grpo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"quickstart: --out {tmp_path} holds 'notes.txt', which a quick start does not write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_complete_result_replaces_the_previous_one(tmp_path):
    out = tmp_path / "quickstart_out"
    previous_result(out)
    staging = tmp_path / "quickstart_out.partial"
    (staging / "joint_gdro").mkdir(parents=True)
    (staging / "report.md").write_text("new")
    quickstart.publish(staging, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quickstart_out"]
    assert sorted(p.name for p in out.iterdir()) == ["joint_gdro", "report.md"]


def test_the_progress_bar_says_what_a_run_does_before_its_first_step(tmp_path):
    """Before: the bar sat at 0/30 for about a minute with no word."""
    assert quickstart.startup_phase(tmp_path) == "checking the config and data"
    (tmp_path / "train.log").write_text("====\nGDRO recipe - start-up checks passed\n====\n")
    assert quickstart.startup_phase(tmp_path).startswith("starting Ray and TransferQueue")
    (tmp_path / "gdro_metrics.jsonl").write_text('{"val_step": 0, "val-core/add2/acc/mean@1": 0.5}\n')
    assert quickstart.startup_phase(tmp_path) == "step 1"
