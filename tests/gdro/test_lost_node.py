"""main_gdro's lost-node watch (``_LostNodeWatch``): a step can wait on a dead node far longer than the
run's own error path takes to see it (a TransferQueue storage unit on it makes every put retry until its
timeout: the two-node test once waited > 180 s), so once Ray lists a node of the run dead and the run has
not ended ``grace`` s later, the watch ends it with the one lost-node line. Ray's node list and the exit
are replaced here; tests/gdro/test_two_nodes.py runs the real thing."""

from __future__ import annotations

import threading
import time

import pytest
from omegaconf import OmegaConf

import recipe.gdro.launch as launch


@pytest.fixture
def watched(monkeypatch, tmp_path):
    nodes = [
        {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1"},
        {"NodeID": "b" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.2"},
        {"NodeID": "c" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.3"},  # lost before this run
    ]
    ended: list[tuple[str, int]] = []
    monkeypatch.setattr("ray.nodes", lambda: [dict(n) for n in nodes])
    monkeypatch.setattr(launch, "end_process", lambda line, code: ended.append((line, code)))
    (tmp_path / "gdro_metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    config = OmegaConf.create(
        {"trainer": {"default_local_dir": str(tmp_path)}, "gdro": {"metrics_file": "gdro_metrics.jsonl"}}
    )
    return config, nodes, ended


def _wait(ended: list, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_node_of_the_run_lost_ends_the_run_after_the_grace(watched):
    config, nodes, ended = watched
    watch = launch._LostNodeWatch(config, {"a" * 56, "b" * 56}, poll=0.01, grace=0.2)
    time.sleep(0.1)
    assert ended == []  # the node lost before the run ("c") is not this run's
    nodes[1]["Alive"] = False
    t0 = time.monotonic()
    _wait(ended, 5.0)
    assert time.monotonic() - t0 >= 0.2  # the run's own error path had its grace
    [(line, code)] = ended
    assert code == 1 and line.startswith(f"main_gdro: error: lost Ray node {'b' * 12} (10.0.0.2) during step 3 ("), line
    assert "did not stop within" in line and f"no complete checkpoint in {config.trainer.default_local_dir}" in line
    assert watch.claim() is False  # the run's error path, arriving now, leaves the reporting to the watch


def test_a_run_that_ends_within_the_grace_is_left_to_report_itself(watched):
    config, nodes, ended = watched
    watch = launch._LostNodeWatch(config, {"a" * 56, "b" * 56}, poll=0.01, grace=0.5)
    nodes[0]["Alive"] = False
    time.sleep(0.2)
    assert watch.claim() is True  # the run's error path reports the lost node itself
    time.sleep(0.6)
    assert ended == []


def test_an_error_on_several_nodes_waits_for_ray_to_name_the_lost_node(watched, monkeypatch):
    """The surviving FSDP rank's collective fails ('Connection reset by peer', a plain RuntimeError) seconds
    before Ray's GCS marks the killed node dead: on several nodes any error waits for that (before: no
    lost-node line, Hydra's traceback and exit 1, seen in CI on a kill during the update)."""
    _, nodes, _ = watched
    monkeypatch.setattr("ray.is_initialized", lambda: True)
    error = RuntimeError("gloo: Read error: Connection reset by peer")
    t0 = time.monotonic()
    assert launch._lost_nodes(error, {"a" * 56}, wait=0.5) == []  # one node: reported at once, as it is
    assert time.monotonic() - t0 < 0.5

    def mark_dead():
        time.sleep(0.3)
        nodes[1]["Alive"] = False

    threading.Thread(target=mark_dead).start()
    lost = launch._lost_nodes(error, {"a" * 56, "b" * 56}, wait=5.0)
    assert [n["NodeID"] for n in lost] == ["b" * 56]
