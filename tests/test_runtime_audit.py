"""Unit tests of the trainer's runtime checks that need no Ray: the controller's visits,
checkpoint retention, the CPU / KV-cache arithmetic, the rollout-count comparison, the storage marker."""

from __future__ import annotations

import numpy as np
import pytest

from verl_ext import GDROController, gdro_config_from_dict


# ------------------------------------------------------------------ a prompt twice in a step
def _controller(**prompt):
    cfg = gdro_config_from_dict({"prompt": {"enable": True, **prompt}, "rollout": {"n_mean": 4}})
    return GDROController(cfg, num_prompts=4)


def test_two_visits_of_one_prompt_are_two_observations():
    """Prompt 1 twice in one step (visits 1 and 3): both visits reach the binner, in visit order; the
    adversary sees each as its own group; each visit's responses get their own multipliers."""
    ctl = _controller()
    counts = ctl.schedule([0, 1, 2, 1])
    assert counts.tolist() == [4, 4, 4, 4]
    pid = [0] * 4 + [1] * 4 + [2] * 4 + [1] * 4
    visit = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    acc = [True, False, False, False] + [True] * 4 + [False] * 4 + [False, False, True, True]
    mult = ctl.observe(pid, np.array(acc), np.ones(16), response_visit_ids=visit)
    assert mult.shape == (16,)
    assert ctl.binner.visits_of([0, 1, 2, 3]).tolist() == [1, 2, 1, 0]
    # window of prompt 1 holds both visits: 4 + 2 correct of 8
    c, n = ctl.binner.window_sums([1])
    assert (int(c[0]), int(n[0])) == (6, 8)
    # the same visits recorded one step at a time give the same binner state
    ref = _controller()
    ref.binner.update([0, 1, 2], [1, 4, 0], [4, 4, 4])
    ref.binner.update([1], [2], [4])
    assert np.array_equal(ref.binner.state_dict()["ring"], ctl.binner.state_dict()["ring"])
    assert np.array_equal(ref.binner.state_dict()["meta"], ctl.binner.state_dict()["meta"])
    # without visit ids the two groups of prompt 1 would merge into one group of 8 responses
    merged = _controller()
    merged.schedule([0, 1, 2, 1])
    merged.observe(pid, np.array(acc), np.ones(16))
    assert merged.binner.visits_of([1]).tolist() == [1]


def test_visit_ids_must_not_mix_prompts():
    ctl = _controller()
    with pytest.raises(ValueError, match="visit 0 holds responses of more than one prompt id"):
        ctl.observe([0, 1], np.array([True, False]), np.ones(2), response_visit_ids=[0, 0])


# Checkpoint retention is tested in tests/gdro/test_retention.py.


# ------------------------------------------------------------------ no silent skips in CI
SKIPPING_TESTS = """
import pytest
ray = pytest.importorskip("no_such_module_gdro")
def test_never_runs():
    pass
"""
ALLOWED_SKIP_TEST = """
import pytest
@pytest.mark.skipif(True, reason="a GPU is visible")
def test_gpu_only():
    pass
def test_runs():
    pass
"""


def _run_pytest(tmp_path, body: str, ci: str | None):
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    # the conftest's Ray-state check lives beside it
    (tmp_path / "recipe_helpers").mkdir(exist_ok=True)
    shutil.copy(Path(__file__).parent / "recipe_helpers" / "ray_env.py", tmp_path / "recipe_helpers" / "ray_env.py")
    (tmp_path / "test_sample.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_module_level_importorskip_fails_the_run_in_ci(tmp_path):
    ci = _run_pytest(tmp_path, SKIPPING_TESTS, "true")
    assert ci.returncode == 1, ci.stdout
    assert "unexpected skips" in ci.stdout and "no_such_module_gdro" in ci.stdout
    local = _run_pytest(tmp_path, SKIPPING_TESTS, None)
    # outside CI a skip stays a skip (pytest's exit 5: every test of the run was skipped)
    assert local.returncode == 5 and "unexpected skips" not in local.stdout, local.stdout


def test_an_allowed_skip_passes_in_ci(tmp_path):
    ci = _run_pytest(tmp_path, ALLOWED_SKIP_TEST, "true")
    assert ci.returncode == 0, ci.stdout
    assert "1 passed, 1 skipped" in ci.stdout


# ------------------------------------------------------------------ shared storage marker
def test_shared_storage_marker_logic(tmp_path):
    from recipe.gdro.preflight import (
        PreflightError,
        check_shared_storage,
        read_storage_marker,
        write_storage_marker,
    )

    path, token = write_storage_marker(str(tmp_path / "ckpt"))
    seen = read_storage_marker(path)
    assert seen["content"] == token and seen["error"] == ""
    check_shared_storage({"node-a": seen, "node-b": dict(seen)}, token, str(tmp_path))  # every node sees it
    missing = read_storage_marker(str(tmp_path / "elsewhere" / "marker"))
    assert missing["content"] is None and "FileNotFoundError" in missing["error"]
    stale = {"host": "n3", "content": "an older token", "error": ""}
    with pytest.raises(PreflightError) as err:
        check_shared_storage({"node-a": seen, "node-bbbbbbbbbbbbbb": missing, "node-c": stale}, token, "/ckpt")
    text = str(err.value)
    assert "trainer.default_local_dir=/ckpt is not the same shared folder on every node" in text
    assert "node node-bbbbbbb" in text and "FileNotFoundError" in text and "not the driver's token" in text
    assert "node-a" not in text
