"""recipe/gdro/experiments/quickstart.py's argument checks (the training itself: tests/run_scripts/test_signals.py
and the CPU backend's tests)."""

from __future__ import annotations

from recipe.gdro.experiments import quickstart


def test_runs_with_an_empty_item_is_refused_before_training(tmp_path, capsys):
    """Before: --runs '' trained nothing, then died with FileNotFoundError on learning_curves.png."""
    for runs in ("", "grpo,", ",joint_gdro", "grpo,,joint_gdro"):
        assert quickstart.main(["--runs", runs, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"quickstart: --runs {runs!r} has an empty item; name runs from grpo"), err
    assert not (tmp_path / "out").exists()
