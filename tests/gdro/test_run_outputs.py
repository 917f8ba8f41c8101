"""What a run shows a person (issue 42, items 6 and 8): the validation at the last step, the closing summary,
the interrupt line, and library notices shown once. These are the cheap parts, each on the real code; the
launch itself was measured (not a test: ~3.5 min under the heavy lock): ``bash run_scripts/tiny_joint_gdro.sh
trainer.total_training_steps=10 launch.ckpt_root=<fresh> 2>&1 | wc -l`` counted 1,369 lines before (about
1,030 of them the TaskRunner's config dump) and 235 after, its last lines the summary; ``METHOD=joint_gdro bash
run_scripts/cpu_backend_tiny.sh`` 18,466 before (18,316 of them TransferQueue's thread warning, in two
formats) and 94 after. tests/gdro/test_real_path.py checks the SIGTERM line of a real run."""

from __future__ import annotations

import io
import logging
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from recipe_helpers.paths import REPO

from recipe.gdro.logs import drop_lines, install_log_filters, setup_ray_worker
from recipe.gdro.results.metrics_io import append_metrics_jsonl, append_validation_jsonl
from recipe.gdro.results.summary import interrupt_detail, run_summary_lines
from recipe.gdro.startup.cli import compose_config


@pytest.mark.parametrize("size", ["tiny", "1.7b", "4b", "8b"])
def test_every_size_validates_at_its_last_step(size):
    """verl 0.9.1's v1 loop (trainer_base.PPOTrainer.fit) validates after step t only when
    ``trainer.test_freq > 0`` and (t % test_freq == 0 or t is the last step). Before: size=tiny had
    test_freq=-1, so the real path printed ``Final validation metrics: None`` and never validated after
    step 0. The paper's sizes validate every 50 steps (and so at their last)."""
    config = compose_config([f"size={size}", "method=rollout_gdro"])
    assert config.trainer.test_freq > 0
    assert config.trainer.val_before_train
    if size != "tiny":
        assert config.trainer.test_freq == 50  # the paper's protocol: every 50 steps


def write_checkpoint(root: Path, step: int) -> Path:
    """A complete ``global_step_N`` as the trainer and verl write it (recipe.gdro.checkpoints.incomplete_reason)."""
    folder = root / f"global_step_{step}"
    (folder / "actor").mkdir(parents=True)
    (folder / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"weights")
    (folder / "data.pt").write_bytes(b"dataloader")
    return folder


@pytest.fixture
def run_config(tmp_path):
    root = tmp_path / "out" / "gdro" / "tiny_joint_gdro"
    config = compose_config(
        ["size=tiny", "method=joint_gdro", f"launch.ckpt_root={tmp_path / 'out'}", "trainer.total_training_steps=10"]
    )
    assert Path(config.trainer.default_local_dir) == root
    return config, root


def test_the_summary_names_the_final_validation_checkpoint_metrics_and_resume(run_config, monkeypatch):
    config, root = run_config
    metrics = root / "gdro_metrics.jsonl"
    for step in range(0, 11):
        if step:
            append_metrics_jsonl(metrics, step, {"gdro/mu": 0.1})
        if step % 5 == 0:
            append_validation_jsonl(
                metrics,
                step,
                {
                    "val-core/arith_add2/acc/mean@1": 0.5 + step / 100,
                    "val-core/arith_mul1x2/acc/mean@1": 0.25,
                    "gdro/val/arith_add2/prompts": 24.0,
                    "gdro/val/arith_mul1x2/prompts": 8.0,
                },
            )
    write_checkpoint(root, 5)
    write_checkpoint(root, 10)
    monkeypatch.setattr(sys, "argv", ["main_gdro.py", "size=tiny", "trainer.total_training_steps=10"])
    lines = run_summary_lines(config)
    assert lines[0] == "[gdro] run summary: gdro/tiny_joint_gdro, step 10 of 10"
    # (24 * 0.6 + 8 * 0.25) / 32 = 0.5125
    assert lines[1] == "  validation   step 10 (acc/mean@1): arith_add2 0.600, arith_mul1x2 0.250; all prompts 0.512"
    assert lines[2] == f"  checkpoints  {root} (newest complete: global_step_10)"
    assert lines[3].startswith(f"  metrics      {metrics} ")
    assert lines[4].endswith("-m recipe.gdro.main_gdro size=tiny trainer.total_training_steps=20")
    newest = root / "global_step_10"
    assert interrupt_detail(config) == (
        f"stopped; the last complete checkpoint is {newest}; relaunch the same command to resume from it"
    )


def test_a_last_validation_before_the_last_step_is_said(run_config):
    config, root = run_config
    metrics = root / "gdro_metrics.jsonl"
    append_validation_jsonl(metrics, 0, {"val-core/arith_add2/acc/mean@1": 0.5})
    append_metrics_jsonl(metrics, 1, {"gdro/mu": 0.1})
    config.trainer.test_freq = -1
    lines = run_summary_lines(config)
    assert (
        lines[1] == "  validation   step 0 (acc/mean@1): arith_add2 0.500 (not at the last step: trainer.test_freq=-1)"
    )
    assert lines[-1] == "  resume       not possible: no checkpoint to resume from"
    assert interrupt_detail(config) == f"stopped; no complete checkpoint in {root}: a relaunch starts from step 0"


def test_the_interrupt_line_is_asked_for_its_detail_at_exit(tmp_path):
    """``set_detail`` with a callable: the line names what exists when the signal arrives (here a checkpoint
    saved after the detail was set), on the real handler, in a process of its own."""
    script = (
        "import os, signal, time\n"
        "from verl_ext.interrupt import run_main, set_detail\n"
        "def main():\n"
        f"    set_detail(lambda: 'stopped; newest: ' + ','.join(sorted(os.listdir({str(tmp_path)!r}))))\n"
        f"    open(os.path.join({str(tmp_path)!r}, 'global_step_5'), 'w').close()\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(10)\n"
        "run_main('gdro', main)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 128 + signal.SIGINT
    assert r.stderr == "gdro: interrupted (SIGINT); stopped; newest: global_step_5\n"


def test_transfer_queue_thread_warning_is_shown_once_per_process():
    """TransferQueue logs ``target_num_threads 8 should not exceed ...`` at every put and get on a machine with
    fewer physical cores than TQ_NUM_THREADS (hundreds of lines a run on 2 cores). Its own function, called
    as a put calls it, three times: one warning. Other warnings of that logger still pass."""
    from transfer_queue.utils.common import limit_pytorch_auto_parallel_threads

    too_many = (psutil.cpu_count(logical=False) or 1) + 1
    logger = logging.getLogger("transfer_queue.utils.common")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    saved = list(logger.filters)
    try:
        install_log_filters()
        install_log_filters()  # idempotent: one filter
        for _ in range(3):
            with limit_pytorch_auto_parallel_threads(target_num_threads=too_many, info="put"):
                pass
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = saved
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len([m for m in warned if m.startswith(f"target_num_threads {too_many} should not exceed")]) == 1
    assert warned[-1] == "something else"


def test_ray_workers_drop_only_verls_optional_engine_notices():
    script = (
        "import warnings\n"
        "from recipe.gdro.logs import setup_ray_worker\n"
        "setup_ray_worker()\n"
        "warnings.warn('torchtitan engine is not available: ModuleNotFoundError()', UserWarning)\n"
        "warnings.warn('Disabled critic as algorithm.adv_estimator != gae', UserWarning)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "engine is not available" not in r.stderr and "Disabled critic" in r.stderr
    assert callable(setup_ray_worker)


def test_verls_raw_validation_dictionaries_are_kept_off_stdout(monkeypatch):
    """verl's fit pprints ``f"Initial validation metrics: {val_metrics}"``: a long string, which pprint prints
    as a parenthesised run of quoted lines (as in a real-path log), and ``Final validation metrics: ...``."""
    from pprint import pprint

    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    metrics = {f"val-core/arith_{i}/acc/mean@1": 0.5 for i in range(12)}
    with drop_lines():
        pprint(f"Initial validation metrics: {metrics}")
        print("step:1 - actor/entropy:0.1 (a step line)")
        sys.stdout.write("'Final validation")  # a line written in pieces
        sys.stdout.write(" metrics: None'\nthe summary")
    assert out.getvalue() == "step:1 - actor/entropy:0.1 (a step line)\nthe summary"
