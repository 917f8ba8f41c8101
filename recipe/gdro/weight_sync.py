"""A bound on verl's weight sync (actor -> rollout replicas): ``GDRO_WEIGHT_SYNC_TIMEOUT`` seconds, then
:class:`WeightSyncTimeout` (installed by the GDRO trainer's ``on_init_end``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from recipe.gdro.startup.environment import WEIGHT_SYNC_TIMEOUT_ENV, weight_sync_timeout

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = ["WeightSyncTimeout", "bounded_weight_sync", "weight_sync_timeout"]


class WeightSyncTimeout(RuntimeError):
    """A weight sync from the actor to the rollout replicas did not finish in the allowed time."""


def bounded_weight_sync(manager, timeout: float) -> None:
    """Make ``manager.update_weights`` (verl's ``CheckpointEngineManager``) raise :class:`WeightSyncTimeout`
    after ``timeout`` seconds instead of blocking forever.

    verl's sync (verl/checkpoint_engine/base.py, ``update_weights``) blocks in ``ray.get`` until every
    sender and receiver returns; when the receiver (the vLLM worker's ``update_weights_from_ipc``)
    fails, the sender waits for an acknowledgement that never comes (measured: > 20 minutes, then
    killed). Past the deadline the trainer raises, the task runner fails and Ray's shutdown ends the
    workers. The wrapped call's own exception, when it returns one, is raised unchanged."""
    original = manager.update_weights
    if getattr(original, "_gdro_bounded", False):
        return

    def update_weights(*args, **kwargs):
        # A concurrent.futures.Future carries the result or the exception and waits with a timeout. The call
        # runs in a daemon thread rather than a ThreadPoolExecutor's: a Python thread cannot be killed, so a
        # hung sync's thread lives on after the timeout, and an executor's (non-daemon) workers are joined at
        # interpreter exit, which would hang the process the timeout is there to end.
        future: Future = Future()

        def run():
            try:
                future.set_result(original(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by future.result()
                future.set_exception(e)

        t0 = time.monotonic()
        threading.Thread(target=run, name="gdro-weight-sync", daemon=True).start()
        try:
            value = future.result(timeout)
        except FutureTimeout:
            if future.done():
                raise  # the sync's own TimeoutError (the same class since Python 3.11), not the deadline
            raise WeightSyncTimeout(
                f"the weight sync from the actor to the rollout replicas did not finish within {timeout:g} s "
                f"({WEIGHT_SYNC_TIMEOUT_ENV}); the rollout worker's log above has the cause (on a CPU machine "
                f"without recipe.gdro.backends.cpu_platform's shim_vllm_cpu_weight_loader: vLLM-CPU's linear "
                f"layers have no weight_loader)"
            ) from None
        logger.debug("weight sync took %.2f s", time.monotonic() - t0)
        return value

    update_weights._gdro_bounded = True
    manager.update_weights = update_weights
