"""The throughput command's arithmetic and refusals (recipe/gdro/lab/bench_trainer_modes.py), on run folders written
here in the shape a launch writes them (verl's file log, the resolved config); no launch. Its real output is in
docs/real_path.md with the command."""

from __future__ import annotations

import json

import pytest

from recipe.gdro.lab import bench_trainer_modes as bench


def write_run(run, steps: list[dict]):
    run.mkdir(parents=True)
    (run / "resolved_config.yaml").write_text(
        "data:\n  train_batch_size: 16\nactor_rollout_ref:\n  rollout:\n    n: 4\n"
    )
    with open(run / "verl_metrics.jsonl", "w") as f:
        for i, data in enumerate(steps, start=1):
            f.write(json.dumps({"step": i, "data": data}) + "\n")
    return run


def test_step_one_is_not_timed_and_rates_come_from_verls_step_timer(tmp_path):
    run = write_run(
        tmp_path / "a",
        [{"timing_s/step": 100.0}, {"timing_s/step": 4.0}, {"timing_s/step": 6.0}],  # step 1: warm-up, ignored
    )
    r = bench.measure(bench.Result("sync", "grpo", 300.0), run)
    assert r.steps == 3 and r.error is None
    assert r.steps_per_minute == pytest.approx(60 * 2 / 10.0)
    assert r.rollouts_per_second == pytest.approx(2 * 16 * 4 / 10.0)  # B x n a step for verl's GRPO
    assert r.gdro_share is None


def test_gdro_rows_use_its_realised_rollouts_and_driver_time(tmp_path):
    step = {"timing_s/step": 5.0, "gdro/recipe/realised_rollouts": 60.0, "gdro/recipe/driver_ms": 50.0}
    run = write_run(tmp_path / "b", [step, step])
    r = bench.measure(bench.Result("sync", "joint_gdro", 100.0), run)
    assert r.rollouts_per_second == pytest.approx(60 / 5.0)
    assert r.gdro_share == pytest.approx(0.05 / 5.0)
    assert "| sync | joint_gdro | 12.00 | 12.00 | 1.00 % |" in bench.table([r], 2)


def test_a_mode_that_cannot_run_is_a_row_saying_so_not_a_number(tmp_path):
    (tmp_path / "c").mkdir()
    r = bench.measure(
        bench.Result("separate_async", "joint_gdro", 3.0, error="exit 2: unknown trainer"), tmp_path / "c"
    )
    row = bench.table([r], 6).splitlines()[-1]
    assert row.startswith("| separate_async | joint_gdro | cannot run: exit 2: unknown trainer |")
    # the launch's own refusal, the last line naming an error, cut to fit a table cell
    line = bench.last_error("Ray started\ngdro: error: trainer.v1.trainer_mode=" + "x" * 200 + "\nbye")
    assert line.startswith("gdro: error: trainer.v1.trainer_mode=xx") and line.endswith("...") and len(line) == 64


def test_both_methods_select_the_mode_group_and_grpo_swaps_in_verls_trainer():
    grpo = bench.launch_overrides("separate_async", "grpo", 4)
    assert grpo[0] == "mode=separate_async"
    assert "trainer.v1.trainer_mode=separate_async" in grpo and "gdro.observe=false" in grpo
    gdro = bench.launch_overrides("colocate_async", "joint_gdro", 4)
    assert gdro[0] == "mode=colocate_async" and not any("trainer_mode" in o or "observe" in o for o in gdro)


def test_the_tiny_wiring_adds_separate_asyncs_cpu_layout_with_the_recipes_engine():
    """run_scripts/tiny_real_path_env.sh gives ``mode=separate_async`` its CPU layout (what the bench and
    tests/gdro/test_real_path_separate_async.py rely on), naming the engine as the engine module does."""
    from recipe.gdro.cpu_checkpoint_engine import engine_overrides

    script = (bench.REPO / "run_scripts" / "tiny_real_path_env.sh").read_text()
    for override in (*engine_overrides(), "actor_rollout_ref.hybrid_engine=false", "ray_kwargs.ray_init.num_gpus=2"):
        assert override in script, override


def test_an_existing_folder_bad_names_and_too_few_steps_are_refused_before_any_launch(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--steps", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"bench_trainer_modes: error: --out {tmp_path} exists: give a new folder (nothing is overwritten)"
    )
    assert bench.main(["--out", str(tmp_path / "new"), "--steps", "1"]) == 2
    capsys.readouterr()
    assert bench.main(["--out", str(tmp_path / "new"), "--modes", "sync,fast"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bench_trainer_modes: error: --modes 'sync,fast': expected some of sync, colocate_async, separate_async"
    )
    assert not (tmp_path / "new").exists()
