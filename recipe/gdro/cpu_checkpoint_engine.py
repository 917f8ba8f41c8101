"""A checkpoint engine for verl's ``separate_async`` trainer on a machine without an accelerator: the actor's
weights go to the standalone rollout replicas over a gloo process group (TCP), across processes and Ray nodes.

verl 0.9.1's ``PPOTrainerSeparateAsync.__init__`` asserts ``checkpoint_engine.backend != "naive"``
(verl/trainer/ppo/v1/trainer_separate_async.py:68) and every engine verl ships needs a device transport:
``nccl`` (cupy + CUDA buffers, nccl_checkpoint_engine.py:169-173), ``hccl`` (Ascend), ``nixl`` and
``mooncake`` (RDMA). This module registers one more in verl's ``CheckpointEngineRegistry``, loaded in every
verl process that builds an engine (the actor worker, verl/workers/engine_workers.py:685; the rollout's
``CheckpointEngineWorker``, verl/checkpoint_engine/base.py:336; the trainer's ``CheckpointEngineManager``,
base.py:417) by naming this module in ``checkpoint_engine.custom_backend_module``::

    actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=recipe.gdro.cpu_checkpoint_engine

The shape is verl's ``NCCLCheckpointEngine`` with single sender: actor rank 0 broadcasts, the other actor
ranks walk the weight generator (producing each weight is collective over the actor group) and sit out, the
rollout workers receive. Weights are cut into byte chunks and packed into buckets of at most
``update_weights_bucket_megabytes`` with verl's own ``split_weight_chunks`` / ``merge_weight_chunks``. Each
bucket is three gloo broadcasts: its metadata's length, its metadata (pickled ``TensorMeta``s), its bytes.
The group is a standalone ``torch.distributed.ProcessGroupGloo`` over a ``TCPStore`` that actor rank 0
hosts (port chosen by the OS, address from Ray): it never touches a process's default group (the FSDP group
on the actor, verl's gloo group on the rollout worker), which is why Ray's own GLOO collective
(``TorchGLOOGroup``: ``dist.new_group`` over the default group) cannot serve. Built at every sync
(``init_process_group``) and dropped at ``finalize``, as the manager calls them; a peer that dies makes the
others raise after ``timeout_seconds`` (``engine_kwargs.cpu_gloo.timeout_seconds``, default 600) instead
of waiting for ever. Buffers are allocated per bucket at the bucket's size, not ``bucket_size`` up front
(verl's default is 2048 MiB).

A receiver yields each weight as a view into the bucket just received; it is valid until the next weight
is pulled (verl's vLLM adapter copies it into its own buffer first: ``BucketedWeightSender``).

Only on a host where none of verl's accelerator platforms finds a device (the recipe's cpu platform runs
there; ``recipe.gdro.backends.cpu_platform.accelerator_present``), and only on verl 0.9.1, whose engine
interface and manager call order this follows: elsewhere the constructor raises
:class:`CPUCheckpointEngineRefused` with one line (use ``nccl`` on GPUs).
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.metadata as md
import logging
import pickle
from dataclasses import dataclass
from typing import AsyncGenerator, Generator

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)

logger = logging.getLogger(__name__)

BACKEND = "cpu_gloo"
MODULE = __name__
PINNED_VERL = "0.9.1"
DEFAULT_TIMEOUT_SECONDS = 600.0
ALIGNMENT = 16  # bytes: every chunk starts aligned, so a chunk viewed as its dtype is aligned


class CPUCheckpointEngineRefused(RuntimeError):
    """The CPU checkpoint engine was asked to run where it does not belong (a device, another verl)."""


def refusal(accelerator: bool | None = None, verl_version: str | None = None) -> str | None:
    """Why this engine must not run here (one line), or None. ``accelerator``: whether one of verl's built-in
    platforms (nvidia, npu, rocm) finds its device on this host (default: ask them, as the cpu platform
    plugin does); ``verl_version``: the installed verl's."""
    if verl_version is None:
        verl_version = md.version("verl")
    if verl_version != PINNED_VERL:
        return (
            f"checkpoint_engine.backend={BACKEND} ({MODULE}) follows verl=={PINNED_VERL}'s CheckpointEngine "
            f"interface, found verl=={verl_version}: install verl=={PINNED_VERL} or use another backend"
        )
    if accelerator is None:
        from verl.utils.device import get_device_name

        from recipe.gdro.backends.cpu_platform import accelerator_present

        # the cpu platform registers only where no accelerator is found: then no need to probe again
        accelerator = get_device_name() != "cpu" and accelerator_present()
    if accelerator:
        return (
            f"checkpoint_engine.backend={BACKEND} ({MODULE}) is for hosts without an accelerator, and verl finds "
            "one here: use checkpoint_engine.backend=nccl (hccl on Ascend)"
        )
    return None


@dataclass
class MasterAddress:
    """Where actor rank 0's TCPStore listens (the gloo group's rendezvous)."""

    host: str
    port: int


def node_ip() -> str:
    """This node's address as Ray reports it (the address other Ray nodes reach it by)."""
    import ray

    return ray.util.get_node_ip_address().strip("[]")


@CheckpointEngineRegistry.register(BACKEND)
class CPUGlooCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine ``cpu_gloo`` (see the module docstring).

    Args:
        bucket_size: the most bytes one broadcast carries (``update_weights_bucket_megabytes`` << 20, from verl).
        is_master: actor rank 0, which hosts the rendezvous and sends (verl passes it on the actor only).
        timeout_seconds: how long a broadcast or the rendezvous waits for a peer before raising.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS):
        reason = refusal()
        if reason is not None:
            raise CPUCheckpointEngineRefused(reason)
        if bucket_size <= 0 or not timeout_seconds > 0:
            raise ValueError(
                f"{BACKEND}: bucket_size={bucket_size} and timeout_seconds={timeout_seconds} must be positive"
            )
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout = datetime.timedelta(seconds=float(timeout_seconds))
        self.rank: int | None = None
        self.world_size: int | None = None
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroupGloo | None = None

    # ------------------------------------------------------------------ topology (verl's call order)
    def prepare(self) -> MasterAddress | None:
        """Actor rank 0 opens the rendezvous (a TCPStore on a port the OS picks) and returns its address."""
        if not self.is_master:
            return None
        host = node_ip()
        self._store = dist.TCPStore(host, 0, None, True, timeout=self.timeout, wait_for_workers=False)
        return MasterAddress(host=host, port=self._store.port)

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        """Actor rank 0 is group rank 0; the other actor ranks get -1 (they sit out); rollout workers 1..N."""
        master = metadata[0]
        if not isinstance(master, MasterAddress):
            raise RuntimeError(f"{BACKEND}: actor rank 0 must be the checkpoint engine's master, got {master!r}")
        world_size = 1 + rollout_world_size
        actor_kwargs = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "master": [master] * actor_wg_world_size,
        }
        rollout_kwargs = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master": [master] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, master: MasterAddress):
        """Join the sync's gloo group (rank -1: not a member). Returns when every member has joined."""
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        if rank > 0:
            self._store = dist.TCPStore(master.host, master.port, None, False, timeout=self.timeout)
        self._group = dist.ProcessGroupGloo(self._store, rank, world_size, self.timeout)
        self._group.barrier().wait()  # every pair connected: the store's host may now leave without harm
        logger.info("%s: rank %d of %d joined %s:%d", BACKEND, rank, world_size, master.host, master.port)

    def finalize(self):
        """Drop the group and the rendezvous (rebuilt at the next sync)."""
        self._group = None
        self._store = None
        self.rank = self.world_size = None

    # ------------------------------------------------------------------ transport
    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()

    def _broadcast_bucket(self, bucket: torch.Tensor | None, meta: dict | None) -> tuple[torch.Tensor, dict]:
        """One bucket from rank 0 to every member: (bytes, {"bucket_meta": {name: TensorMeta}, "is_last": bool})."""
        header = pickle.dumps(meta) if self.rank == 0 else b""
        length = torch.tensor([len(header)], dtype=torch.int64)
        self._broadcast(length)
        raw = torch.frombuffer(bytearray(header), dtype=torch.uint8) if self.rank == 0 else None
        if raw is None:
            raw = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(raw)
        if self.rank != 0:
            meta = pickle.loads(raw.numpy().tobytes())
        if bucket is None:
            bucket = torch.empty(meta["length"], dtype=torch.uint8)
        if meta["length"]:
            self._broadcast(bucket)
        return bucket, meta

    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps=None):
        """Actor side: rank 0 broadcasts the weights bucket by bucket and returns the buckets and bytes it sent
        (as sync metrics); ranks -1 only walk the generator."""
        if self.rank is None or self.rank > 0:
            raise RuntimeError(f"{BACKEND}: send_weights on group rank {self.rank}; only actor ranks send")
        if self.rank < 0:
            for _ in weights:
                pass
            return {}
        parts: list[torch.Tensor] = []
        bucket_meta: dict[str, TensorMeta] = {}
        offset = buckets = 0

        sent = 0

        async def flush(is_last: bool):
            nonlocal parts, bucket_meta, offset, buckets, sent
            bucket = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
            meta = {"bucket_meta": bucket_meta, "is_last": is_last, "length": bucket.numel()}
            await asyncio.to_thread(self._broadcast_bucket, bucket, meta)
            parts, bucket_meta, offset, buckets, sent = [], {}, 0, buckets + 1, sent + bucket.numel()

        async for tensor_meta, chunk in split_weight_chunks(weights, self.bucket_size):
            pad = -offset % ALIGNMENT
            if bucket_meta and offset + pad + tensor_meta.chunk_size > self.bucket_size:
                await flush(is_last=False)
                pad = 0
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8))
                offset += pad
            tensor_meta.offset = offset
            bucket_meta[tensor_meta.name] = tensor_meta
            parts.append(chunk.detach().to("cpu", copy=True))
            offset += tensor_meta.chunk_size
        await flush(is_last=True)
        logger.info("%s: sent %d buckets, %d bytes", BACKEND, buckets, sent)
        # verl's CheckpointEngineManager merges what the senders return into the step's metrics
        return {f"{BACKEND}/buckets": float(buckets), f"{BACKEND}/bytes": float(sent)}

    @torch.no_grad()
    async def receive_weights(self, global_steps=None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Rollout side: ``(name, tensor)`` for every weight rank 0 sends, in its order."""
        async for name, weight in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, weight

    async def _receive_chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        if self.rank is None or self.rank <= 0:
            raise RuntimeError(f"{BACKEND}: receive_weights on group rank {self.rank}; only rollout workers receive")
        while True:
            bucket, meta = await asyncio.to_thread(self._broadcast_bucket, None, None)
            for tensor_meta in meta["bucket_meta"].values():
                yield tensor_meta, bucket[tensor_meta.offset : tensor_meta.offset + tensor_meta.chunk_size]
            if meta["is_last"]:
                return


def engine_overrides() -> list[str]:
    """The Hydra overrides that select this engine (its timeout: ``+actor_rollout_ref.rollout.checkpoint_engine.
    engine_kwargs.cpu_gloo.timeout_seconds=<s>``)."""
    prefix = "actor_rollout_ref.rollout.checkpoint_engine"
    return [f"{prefix}.backend={BACKEND}", f"{prefix}.custom_backend_module={MODULE}"]
