"""run_scripts/ray_node.sh, the one source of the multi-node commands: docs/cluster.md shows them and the
two-node helper runs them (tests/recipe_helpers/two_node_cluster.py; the launches against such a cluster:
tests/gdro/test_cluster_faults.py, tests/gdro/test_two_nodes.py). Its own refusals need no Ray: one line,
exit 2."""

from __future__ import annotations

import os
import subprocess

from recipe_helpers import two_node_cluster
from recipe_helpers.paths import REPO

SCRIPT = REPO / "run_scripts" / "ray_node.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env={**clean, **env})


def test_the_docs_show_the_commands_the_two_node_helper_runs():
    docs = (REPO / "docs" / "cluster.md").read_text(encoding="utf-8")
    assert "bash run_scripts/ray_node.sh head" in docs
    assert "bash run_scripts/ray_node.sh worker <head-ip>:6379" in docs
    assert "RAY_AUTH_MODE=token RAY_ADDRESS=<head-ip>:6379" in docs
    assert two_node_cluster.RAY_NODE == SCRIPT


def test_its_refusals_are_one_line_and_exit_2(tmp_path):
    for args, expected in (
        (("bogus",), "'bogus' is not head or worker"),
        (("worker",), "worker needs the head's <host>:<port>"),
        (("worker", "head-without-port"), "worker needs the head's <host>:<port>"),
    ):
        r = _run(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
        assert expected in r.stderr, r.stderr
    # a worker with token authentication on and no token anywhere (an empty HOME) is told where to get it
    r = _run("worker", "10.0.0.1:6379", HOME=str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "RAY_AUTH_MODE=token but no token here: copy the head's" in r.stderr
