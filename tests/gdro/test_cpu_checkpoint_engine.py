"""The CPU checkpoint engine (recipe/gdro/cpu_checkpoint_engine.py) across processes: actor rank 0 and two rollout
workers, each a spawned interpreter (as verl's workers are) driven through verl's ``CheckpointEngineManager``
call order (prepare, build_topology, init_process_group, send / receive, finalize): two weight syncs, then a
third whose sender dies. Cost: three interpreters importing verl, 12-51 s on 2 cores (load 2-12)."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
import torch
from recipe_helpers.checkpoint_engine_roles import run_role, sample_weights

BUCKET = 4096  # bytes: the sample weights (~17 KiB) travel in several buckets, the largest cut into chunks
TIMEOUT = 20.0  # seconds a member waits for a peer (engine_kwargs.cpu_gloo.timeout_seconds)


def expect(outbox, kind: str, timeout: float = 300.0):
    got, value = outbox.get(timeout=timeout)
    assert got == kind, (got, value)
    return value


def test_weights_arrive_equal_bucketed_across_processes_and_a_lost_sender_fails_the_receivers():
    from recipe.gdro.cpu_checkpoint_engine import CPUGlooCheckpointEngine

    ctx = multiprocessing.get_context("spawn")
    roles = ["master", "receiver", "receiver"]  # actor rank 0; rollout world size 2
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in roles]
    procs = [
        ctx.Process(target=run_role, args=(role, BUCKET, inbox, outbox, TIMEOUT), daemon=True)
        for role, (inbox, outbox) in zip(roles, boxes, strict=True)
    ]
    for p in procs:
        p.start()
    try:
        for version, plan in ((1, "sync"), (2, "sync"), (3, "vanish")):
            metadata = [expect(outbox, "prepared") for _, outbox in boxes]
            actor_kwargs, rollout_kwargs = CPUGlooCheckpointEngine.build_topology(1, 2, metadata)
            kwargs = [{k: v[0] for k, v in actor_kwargs.items()}]
            kwargs += [{k: v[i] for k, v in rollout_kwargs.items()} for i in range(2)]
            assert [k["rank"] for k in kwargs] == [0, 1, 2]
            for (inbox, _), k in zip(boxes, kwargs, strict=True):
                inbox.put((plan, version, k))
            if plan == "vanish":
                break
            sent = expect(boxes[0][1], "sent")
            want = sample_weights(version)
            total = sum(w.nbytes for w in want.values())
            assert sent["cpu_gloo/buckets"] >= -(-total // BUCKET) > 1 and sent["cpu_gloo/bytes"] >= total
            for _, outbox in boxes[1:]:
                received = expect(outbox, "received")
                assert [name for name, _ in received] == list(want)  # every weight, once, in the sender's order
                for name, weight in received:
                    assert weight.dtype == want[name].dtype and weight.shape == want[name].shape, name
                    assert torch.equal(weight, want[name]), name
        # the sender died after joining the sync's group: each receiver raises, within the timeout, instead of
        # waiting for ever (verl's own sync waits > 20 min for a receiver that failed: docs/real_path.md)
        for _, outbox in boxes[1:]:
            seconds, error = expect(outbox, "raised")
            assert seconds < TIMEOUT + 10, (seconds, error)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_an_actor_rank_outside_the_group_walks_the_weights_and_sends_nothing():
    """Producing each weight is collective over the actor group (FSDP's full_tensor), so a rank that sits the
    broadcast out (rank -1) must still pull every weight."""
    from recipe.gdro.cpu_checkpoint_engine import CPUGlooCheckpointEngine, MasterAddress

    engine = CPUGlooCheckpointEngine(bucket_size=BUCKET)
    assert engine.prepare() is None  # not actor rank 0: no rendezvous of its own
    metadata = [MasterAddress("127.0.0.1", 1), None, None, None]
    topology, _ = CPUGlooCheckpointEngine.build_topology(3, 1, metadata)
    assert topology["rank"] == [0, -1, -1]
    engine.init_process_group(**{k: v[1] for k, v in topology.items()})
    pulled = []

    def weights():
        for name, w in sample_weights(1).items():
            pulled.append(name)
            yield name, w

    assert asyncio.run(engine.send_weights(weights())) == {}
    assert pulled == list(sample_weights(1))


@pytest.mark.parametrize(
    ("accelerator", "version", "says"),
    [
        (True, "0.9.1", "without an accelerator, and verl finds one here: use checkpoint_engine.backend=nccl"),
        (False, "0.9.2", "found verl==0.9.2: install verl==0.9.1"),
    ],
)
def test_refused_on_a_host_with_an_accelerator_and_on_another_verl_with_one_line(accelerator, version, says):
    from recipe.gdro.cpu_checkpoint_engine import refusal

    line = refusal(accelerator=accelerator, verl_version=version)
    assert says in line and "\n" not in line
    assert refusal(accelerator=False, verl_version="0.9.1") is None


def test_the_constructor_refuses_where_verl_finds_an_accelerator(monkeypatch):
    import recipe.gdro.backends.cpu_platform as cpu_platform
    from recipe.gdro.cpu_checkpoint_engine import CPUCheckpointEngineRefused, CPUGlooCheckpointEngine

    monkeypatch.setattr(cpu_platform, "accelerator_present", lambda: True)
    with pytest.raises(CPUCheckpointEngineRefused, match="use checkpoint_engine.backend=nccl"):
        CPUGlooCheckpointEngine(bucket_size=BUCKET)
