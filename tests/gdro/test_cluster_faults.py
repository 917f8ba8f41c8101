"""Launches that meet a shared folder, a full disk, a wrong Ray address or a cluster they cannot use: each
ends in one line (no traceback) before any training actor starts, and nothing of another run is touched.

* Two CPU-backend launches into one output folder: the second exits 2 naming the first's pid and host, the
  first trains to its end untouched (issue 44 item 1).
* A launch whose first checkpoint does not fit its disk (a 2 MiB tmpfs): exit 1, one line naming ENOSPC and
  the step folder, which is gone; no ``.tmp`` file and no marker left (issue 44 item 3).
* A garbage or dead ``RAY_ADDRESS``: exit 2 in one line within 30 s (issue 44 item 4).
* Against a one-node cluster started with ``run_scripts/ray_node.sh head`` (token authentication, 16 CPUs, no
  GPU): a launch without the token is refused in one line (``ray.init`` would retry for ever); SIGTERM while
  ``ray.init`` waits on it ends the process in seconds with exit 143 and the one line; the CPU backend joins
  it with the token (no ``num_cpus`` passed) and trains; verl's path, which needs a GPU the cluster lacks, is
  refused in one line naming ``ray start --num-gpus`` before its TaskRunner starts (issue 42 item 2).

Costs (measured on 2 cores at load ~4, --durations): two launches 75 s, the full disk 27 s, the addresses 18 and
21 s, the four against the cluster 9-25 s each (~90 s with the cluster's start and stop): ~4.5 min in all.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from recipe_helpers.paths import REPO
from recipe_helpers.small_disk import small_disk

from recipe.gdro.startup.folder_lock import folder_holder

pytestmark = pytest.mark.slow
PY = sys.executable
CPU_SCRIPT = REPO / "run_scripts" / "cpu_backend_tiny.sh"
RAY_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return {**env, **extra}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    subprocess.run(
        [PY, "-m", "data_prep.arith", "--local_dir", str(folder), "--num_train", "128", "--num_val", "32"],
        cwd=REPO,
        env=_env(),
        check=True,
        capture_output=True,
    )
    return folder


def cpu_launch(data: Path, out: Path, *overrides: str, **env: str) -> list[str]:
    """``cpu_backend_tiny.sh`` (joint GDRO) into ``out``, no validation; returns the argv (env: :func:`cpu_env`)."""
    return ["bash", str(CPU_SCRIPT), "trainer.val_before_train=false", "trainer.test_freq=-1", *overrides]


def cpu_env(data: Path, out: Path, **extra: str) -> dict:
    return _env(DATA_DIR=str(data), OUT_DIR=str(out), METHOD="joint_gdro", **extra)


def error_lines(stderr: str) -> list[str]:
    """The launch's own lines on stderr (library warnings aside): what it prints on a refusal or a failure."""
    return [line for line in stderr.splitlines() if line.startswith(("gdro:", "gdro dry run:", "main_gdro:"))]


def assert_one_line(result, code: int, *expected: str) -> str:
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def steps_of(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"step"' in line]


# ------------------------------------------------------------------ one run per folder
def test_a_second_launch_into_a_running_launchs_folder_is_refused_and_the_first_finishes_untouched(data, tmp_path):
    out = tmp_path / "run"
    argv = cpu_launch(data, out, "trainer.total_training_steps=8")
    with open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen(argv, cwd=REPO, env=cpu_env(data, out), stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 300
            while folder_holder(str(out)) is None:
                assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
                assert time.monotonic() < deadline, "the first launch never took its folder's lock"
                time.sleep(0.5)
            second = subprocess.run(argv, cwd=REPO, env=cpu_env(data, out), capture_output=True, text=True, timeout=300)
            still_running = first.poll() is None
            first.wait(timeout=900)
        finally:
            if first.poll() is None:
                first.kill()
    assert_one_line(second, 2, f"is in use by another launch (pid {first.pid} on host {socket.gethostname()}")
    assert still_running, "the first launch ended before the second was refused: nothing was tested"
    assert first.returncode == 0, (tmp_path / "first.err").read_text()[-3000:]
    assert steps_of(out / "gdro_metrics.jsonl") == list(range(1, 9))  # one run's steps, once each, in order
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("gdro_metrics")) == ["gdro_metrics.jsonl"]


# ------------------------------------------------------------------ a full disk
def test_a_checkpoint_that_does_not_fit_is_one_line_and_leaves_nothing_half_written(data, tmp_path):
    with small_disk(tmp_path / "disk", "2m") as out:
        argv = cpu_launch(data, out, "trainer.total_training_steps=2", "trainer.save_freq=1")
        result = subprocess.run(argv, cwd=REPO, env=cpu_env(data, out), capture_output=True, text=True, timeout=900)
        line = assert_one_line(result, 1, "ENOSPC", str(out))
        assert line.startswith("gdro: error: no room to save the checkpoint of step 1: ENOSPC"), line
        assert not (out / "global_step_1").exists()
        assert not (out / "latest_checkpointed_iteration.txt").exists()
        assert not [str(p) for p in out.rglob("*.tmp")]


# ------------------------------------------------------------------ Ray addresses
@pytest.mark.parametrize("address", ["not-an-address", "127.0.0.1:{port}"])
def test_a_garbage_or_dead_ray_address_is_one_line_within_30_s(data, tmp_path, address):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = address.format(port=port)
    out = tmp_path / "run"
    t0 = time.monotonic()
    result = subprocess.run(
        cpu_launch(data, out), cwd=REPO, env=cpu_env(data, out, RAY_ADDRESS=address), capture_output=True, text=True
    )
    seconds = time.monotonic() - t0
    assert_one_line(result, 2, f"RAY_ADDRESS={address!r}" if ":" not in address else f"RAY_ADDRESS={address}:")
    assert seconds < 30, seconds
    dry = subprocess.run(
        cpu_launch(data, out, "gdro.dry_run=true"),
        cwd=REPO,
        env=cpu_env(data, out, RAY_ADDRESS=address),
        capture_output=True,
        text=True,
    )
    if ":" in address:  # the dry run reports the address and what the probe found
        assert dry.returncode == 0, dry.stderr[-2000:]
        assert f"ray          joins {address} (RAY_ADDRESS): no Ray GCS answers" in dry.stdout


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A one-node cluster (16 logical CPUs, no GPU) started by run_scripts/ray_node.sh head, token authentication on."""
    from recipe_helpers.two_node_cluster import Cluster

    base = tmp_path_factory.mktemp("cluster")
    with open(base / "nodes.log", "w") as log:
        cluster = Cluster(base, log, node_args=("--num-cpus=16", "--num-gpus=0"), workers=0, dashboard=False)
        try:
            yield cluster
        finally:
            cluster.shutdown()


def test_a_launch_without_the_clusters_token_is_refused_in_one_line(data, tmp_path, token_cluster):
    out = tmp_path / "run"
    env = cpu_env(data, out, RAY_ADDRESS=token_cluster.address)
    t0 = time.monotonic()
    result = subprocess.run(cpu_launch(data, out), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert_one_line(result, 2, "uses token authentication", "export RAY_AUTH_MODE=token")
    assert time.monotonic() - t0 < 60


SIGTERM_IN_RAY_INIT = (
    "import sys\n"
    "from verl_ext.interrupt import run_main\n"
    "def main():\n"
    "    from recipe.gdro.startup.cli import compose_config\n"
    "    from recipe.gdro.task_runner import run_cpu\n"
    "    config = compose_config(['gdro.backend=cpu'])\n"
    "    print('ray.init', flush=True)\n"
    "    run_cpu(config, ray_address=sys.argv[1])\n"
    "run_main('gdro', main)\n"
)


def test_sigterm_while_ray_init_waits_on_the_cluster_ends_the_launch_in_seconds(tmp_path, token_cluster):
    """Without the token ``ray.init`` retries the GCS for ever, inside Ray's C++ code, where Python's signal
    handlers do not run (measured before: SIGTERM ended such a launch 40 s later, exit 15, no message)."""
    proc = subprocess.Popen(
        [PY, "-c", SIGTERM_IN_RAY_INIT, token_cluster.address],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ray.init"
        time.sleep(8)  # into ray.init's retries
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "gdro: interrupted (SIGTERM) while ray.init was connecting to Ray; no training had started"
    )
    assert seconds < 10, seconds


def test_the_cpu_backend_joins_a_cluster_and_trains(data, tmp_path, token_cluster):
    out = tmp_path / "run"
    env = cpu_env(data, out, RAY_ADDRESS=token_cluster.address, **token_cluster.join_env)
    argv = cpu_launch(data, out, "trainer.total_training_steps=2")
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"joins {token_cluster.address} (RAY_ADDRESS): a Ray GCS answers" in result.stdout
    assert steps_of(out / "gdro_metrics.jsonl") == [1, 2]


def test_verls_path_on_a_cluster_without_the_gpu_it_needs_is_one_line_naming_ray_start(tmp_path, token_cluster):
    """The resource check runs on the driver after ray.init joins, before verl's TaskRunner actor: before, its
    message reached the user inside a RayTaskError traceback with exit 1."""
    from recipe_helpers.real_path import launch_command, require_venv

    require_venv()
    argv, env = launch_command(
        "grpo", tmp_path / "out", env={"RAY_ADDRESS": token_cluster.address, **token_cluster.join_env}
    )
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert_one_line(result, 2, "0 of the Ray nodes do (CPU 16, GPU 0)", "ray start --num-gpus=1")
