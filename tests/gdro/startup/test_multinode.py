"""Multi-node readiness on CPU: a Ray node that cannot see the checkout gets the recipe shipped.

A Ray head is started (``ray start --head --block``, its own temp dir) whose processes cannot import
this repository: their ``PYTHONPATH`` holds only a ``sitecustomize`` that removes the editable
install's finder and the repository paths, as on a second node where the package is not installed.
The driver (this process) then connects the way verl's ``run_ppo`` does -- its runtime_env merged
with ``ray_kwargs.ray_init.runtime_env``, where :func:`recipe.gdro.startup.cluster.ship_code_to_workers`
puts ``py_modules`` -- and runs the preflight's import probe on the node.

Without shipping, the worker cannot even load the probe (``No module named 'recipe.gdro'``); with
it, ``recipe.gdro.trainer``, ``verl_ext`` and ``data_prep.reward_fn`` import there, from Ray's
runtime-resources copy, not from the checkout. The head's processes are stopped by pid at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from recipe_helpers.paths import REPO  # noqa: E402
from recipe_helpers.ray_env import ray_auth_mode  # noqa: E402

from recipe.gdro.preflight import PreflightError, probe_nodes, probe_shared_storage  # noqa: E402
from recipe.gdro.startup import cluster  # noqa: E402
from recipe.gdro.startup.cli import compose_config  # noqa: E402

RAY_BIN = Path(sys.executable).with_name("ray")
# The `ray` script next to the interpreter, else the same CLI as a module (a venv that sees ray through
# a shared site-packages has no script of its own).
RAY_CMD = [str(RAY_BIN)] if RAY_BIN.exists() else [sys.executable, "-m", "ray.scripts.scripts"]
MODULES = ("recipe.gdro.trainer", "verl_ext", "data_prep.reward_fn")

HIDE_SITECUSTOMIZE = """
import os, sys
# Hide this repository from the node: drop the editable install's finder and any path into it.
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
_hidden = [p for p in os.environ.get("GDRO_HIDE_PATHS", "").split(os.pathsep) if p]
def _hide(p):
    p = os.path.abspath(p or ".")
    # site-packages stay: a venv may see its dependencies through another venv's (shared) site-packages
    keep = p.startswith(sys.prefix) or os.sep + "site-packages" in p
    return not keep and any(p == h or p.startswith(h + os.sep) for h in _hidden)
sys.path[:] = [p for p in sys.path if not _hide(p)]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _our_processes(temp_dir: str, root_pid: int) -> list:
    """The head's processes: descendants of `ray start`, plus anything naming our own temp dir."""
    procs = {}
    try:
        for p in psutil.Process(root_pid).children(recursive=True):
            procs[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(temp_dir in arg for arg in (p.info["cmdline"] or [])):
                procs[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    procs.pop(os.getpid(), None)
    return list(procs.values())


@pytest.fixture()
def hidden_head(tmp_path):
    """A 2-CPU Ray head whose workers cannot import the checkout. Yields its address."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_SITECUSTOMIZE)
    node_cwd = tmp_path / "node"
    node_cwd.mkdir()
    temp_dir = tempfile.mkdtemp(prefix="gdro_mn_", dir="/tmp")  # short: Ray's socket paths must fit
    port = _free_port()
    hidden = {str(REPO), "/work/main"}
    home = tmp_path / "home"  # no ~/.ray/auth_token of another Ray on this machine
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": str(hide),
        "GDRO_HIDE_PATHS": os.pathsep.join(sorted(hidden)),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    head = subprocess.Popen(
        [
            *RAY_CMD,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ],
        cwd=node_cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 40
        while True:  # ready when the GCS port accepts connections
            if head.poll() is not None:
                pytest.fail(f"ray start exited: {head.stderr.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("Ray head not ready after 40 s")
                time.sleep(0.5)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        procs = _our_processes(temp_dir, head.pid)
        head.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            p.kill()
        try:
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture()
def no_auth():
    """This process talks to the head without a token, as the head has none. Set with ray_auth_mode, not
    monkeypatch: Ray caches the mode, and a restored variable over a stale cache broke the next ray.init."""
    with ray_auth_mode("disabled"):
        yield


def test_workers_without_the_checkout_import_the_shipped_recipe(hidden_head, no_auth, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", hidden_head)
    monkeypatch.chdir(tmp_path)

    # Control: the code is not shipped -> the node cannot load the recipe's probe at all.
    plain = compose_config([])
    assert cluster.ship_code_to_workers(plain, environ={"GDRO_SHIP_CODE": "0"}) == []
    with pytest.raises(PreflightError, match=r"No module named 'recipe\.gdro'|No module named 'recipe'"):
        probe_nodes(plain, MODULES, timeout=60)
    ray.shutdown()

    # Shipped through the runtime_env that verl's run_ppo passes to ray.init.
    shipped = compose_config([])
    added = cluster.ship_code_to_workers(shipped, environ={})
    assert sorted(Path(p).name for p in added) == ["data_prep", "recipe", "verl_ext"]
    results = probe_nodes(shipped, MODULES, timeout=120)
    # The preflight's storage check (issue 18 item 5) on the node: the marker the driver writes into
    # trainer.default_local_dir is read back by a Ray task there (one machine: the folder is shared).
    shipped.trainer.default_local_dir = str(tmp_path / "ckpt")
    storage = probe_shared_storage(shipped, timeout=60)
    assert list(storage) == list(results) and not storage[next(iter(storage))]["error"]
    assert not list((tmp_path / "ckpt").iterdir()), "the marker was not removed"
    ray.shutdown()
    assert len(results) == 1
    (result,) = results.values()
    for name in MODULES:
        module = result["modules"][name]
        assert module["ok"], (name, module)
        # imported from Ray's copy of the shipped package, not from the checkout or /work/main
        assert not module["file"].startswith(str(REPO)) and not module["file"].startswith("/work/main"), module
        assert "runtime_resources" in module["file"], module
