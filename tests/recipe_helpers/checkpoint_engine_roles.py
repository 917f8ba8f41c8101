"""The processes of tests/gdro/test_cpu_checkpoint_engine.py (spawned: each is a fresh interpreter, as verl's actor
and rollout workers are): actor rank 0 or a rollout worker of the CPU checkpoint engine, driven through the calls
verl's ``CheckpointEngineManager.update_weights`` makes, in its order (verl/checkpoint_engine/base.py:422-554)."""

from __future__ import annotations

import asyncio
import os
import time


def sample_weights(version: int) -> dict:
    """Weights of several dtypes and shapes, one larger than the test's bucket (it is cut into chunks)."""
    import torch

    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(64, 48, generator=g),  # 12 KiB: 3 buckets of 4 KiB
        "layer.0.q.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layer.0.q.bias": torch.randn(15, generator=g).to(torch.bfloat16),  # 30 bytes: the next chunk starts unaligned
        "layer.0.norm.weight": torch.randn(7, generator=g),
        "step": torch.tensor([version, -version], dtype=torch.int64),
        "lm_head.weight": torch.randn(24, 40, generator=g),
    }


def run_role(role: str, bucket_size: int, inbox, outbox, timeout: float) -> None:
    """``role``: "master" (actor rank 0) or "receiver" (a rollout worker). For each sync the parent hands the
    topology through ``inbox`` with what to do: "sync" (send / receive sample_weights(version)) or "vanish"
    (the master joins the group, then exits without sending); the role answers on ``outbox``."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from recipe.gdro.cpu_checkpoint_engine import BACKEND, MODULE

    import_external_libs(MODULE)  # what verl's workers do with checkpoint_engine.custom_backend_module
    engine = CheckpointEngineRegistry.new(
        BACKEND, bucket_size=bucket_size, is_master=role == "master", timeout_seconds=timeout
    )
    while True:
        outbox.put(("prepared", engine.prepare()))
        plan, version, kwargs = inbox.get()
        engine.init_process_group(**kwargs)
        if role == "master" and plan == "vanish":
            os._exit(0)
        if role == "master":
            weights = iter(sample_weights(version).items())
            outbox.put(("sent", asyncio.run(engine.send_weights(weights, global_steps=version))))
        else:
            t0 = time.monotonic()
            try:
                outbox.put(("received", asyncio.run(receive_cloned(engine))))
            except Exception as e:  # noqa: BLE001 - the test reads what a receiver raises when its sender is gone
                outbox.put(("raised", (time.monotonic() - t0, f"{type(e).__name__}: {e}")))
                return
        engine.finalize()


async def receive_cloned(engine) -> list:
    """Each weight copied as it arrives: a received tensor is a view valid until the next is pulled."""
    return [(name, weight.clone()) async for name, weight in engine.receive_weights()]
