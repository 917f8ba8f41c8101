"""The CPU backend's LLM server, LLM client and agent loop manager (in-process, no GPU).

verl's own agent loop runs unchanged on top of these: ``AgentLoopManagerTQ``'s job (dispatch a
batch to ``AgentLoopWorkerTQ``) is done by :class:`CPUAgentLoopManager`, which builds verl's
``AgentLoopWorkerTQ`` (its real ``__init__``: tokenizer from the model folder, agent-loop registry)
in this process on a background event loop. verl's ``_run_prompt`` then starts ``__rollout_n__``
sessions per prompt (``rollout.n`` / ``val_kwargs.n`` by default), each runs verl's
``SingleTurnAgentLoop`` (chat template, ``server_manager.generate``), verl's reward path
(``RewardLoopWorker.compute_score`` -> reward manager -> ``math_dapo``) and
``_agent_loop_postprocess``, which writes the trajectory and its tags into TransferQueue.

Replaced (verl has no CPU rollout engine):

* the vLLM / SGLang replica behind ``LLMServerClient``: :class:`CPURolloutServer` answers
  ``generate(prompt_ids, sampling_params)`` by sampling the tiny LM (``policy.sample``) with the
  request's temperature / top-p / top-k, up to ``rollout.response_length`` tokens, and returns
  verl's ``TokenOutput`` with the sampled tokens' log-probs and the weight version;
* the load balancer: :class:`CPULLMServerClient` (a ``LLMServerClient`` subclass) overrides only
  ``_acquire_server`` / ``_release_server``, so verl's ``generate`` (version tags) runs as is.

Batching and determinism: the sessions of a batch reach the server concurrently; the server
collects every request of the dispatched batch (the manager tells it how many to expect), orders
them canonically -- (position of the prompt in the dispatched batch, session id), read from the
``_run_agent_loop`` task that issued the request -- and samples them in one batched call with one
``torch.Generator``. A run is therefore a function of its seed, whatever order the event loop
happens to run the sessions in; that is what makes resume bit-exact.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

logger = logging.getLogger(__name__)


def agent_loop_worker_tq_class():
    """verl's ``AgentLoopWorkerTQ`` class itself (the module exports it wrapped as a Ray actor class)."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    meta = getattr(AgentLoopWorkerTQ, "__ray_metadata__", None)
    if meta is None:
        return AgentLoopWorkerTQ
    return meta.modified_class.__mro__[1]


def _session_identity() -> tuple[str, int] | None:
    """(uid, session_id) of the verl agent-loop session whose task is running now.

    verl's ``AgentLoopWorkerTQ._run_prompt`` starts each session as a task running
    ``_run_agent_loop(..., session_id=i, **prompt)``; this reads those keyword arguments from the
    task's coroutine. None when the caller is not such a task.
    """
    task = asyncio.current_task()
    coro = task.get_coro() if task is not None else None
    frame = getattr(coro, "cr_frame", None)
    if frame is None:
        return None
    kwargs = frame.f_locals.get("kwargs")
    if not isinstance(kwargs, dict) or "session_id" not in kwargs or "uid" not in kwargs:
        return None
    return str(kwargs["uid"]), int(kwargs["session_id"])


class _Request:
    __slots__ = ("prompt_ids", "params", "future", "order")

    def __init__(self, prompt_ids, params, future, order):
        self.prompt_ids = prompt_ids
        self.params = params
        self.future = future
        self.order = order


class _RemoteMethod:
    """``handle.method.remote(...)`` for an in-process object (returns the coroutine to await)."""

    def __init__(self, fn: Callable):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class CPURolloutServer:
    """The rollout replica: samples the tiny LM for verl's agent loop (see the module docstring).

    ``model`` is the rollout's own copy of the policy; :meth:`load_weights` (the checkpoint
    engine's job) copies the actor's weights into it. ``response_length`` caps every response.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        response_length: int,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        idle_flush_s: float = 0.2,
    ):
        self.model = model.eval()
        self.response_length = int(response_length)
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.version = 0  # weight version (global step of the actor weights loaded)
        self.idle_flush_s = idle_flush_s
        self.generate = _RemoteMethod(self._generate)
        self._pending: list[_Request] = []
        self._expected = 0
        self._positions: dict[str, int] = {}
        self._arrival = 0
        self._flusher: asyncio.Task | None = None
        self._last_arrival = 0.0
        self.stats = {"generate_s": 0.0, "requests": 0, "tokens": 0, "batches": 0}
        self.num_threads = torch.get_num_threads()
        self.requests_by_uid: Counter = Counter()  # generate calls per prompt uid (= sessions verl ran)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.version = int(version)

    # ------------------------------------------------------------------ batching
    def expect(self, positions: dict[str, int], count: int) -> None:
        """The manager is about to dispatch a batch: ``count`` sessions of the prompts ``positions``."""
        self._positions.update(positions)
        self._expected += int(count)

    async def _generate(self, request_id=None, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if kwargs.get("image_data") or kwargs.get("video_data") or kwargs.get("audio_data"):
            raise ValueError("the CPU rollout server generates text only")
        loop = asyncio.get_running_loop()
        ident = _session_identity()
        if ident is None:
            order = (1 << 30, 0, self._arrival)
        else:
            order = (self._positions.get(ident[0], 1 << 29), ident[1], self._arrival)
            self.requests_by_uid[ident[0]] += 1
        self._arrival += 1
        req = _Request(list(map(int, prompt_ids)), dict(sampling_params), loop.create_future(), order)
        self._pending.append(req)
        self._last_arrival = time.perf_counter()
        if len(self._pending) >= self._expected:
            self._flush()
        elif self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush_when_idle())
        tokens, log_probs, version = await req.future
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": version},
        )

    async def _flush_when_idle(self):
        """Fallback when fewer requests arrive than expected (a session failed before generating)."""
        while self._pending:
            await asyncio.sleep(self.idle_flush_s)
            if self._pending and time.perf_counter() - self._last_arrival >= self.idle_flush_s:
                logger.warning("CPU rollout: %d of %d expected requests arrived", len(self._pending), self._expected)
                self._flush()

    def _flush(self) -> None:
        requests = sorted(self._pending, key=lambda r: r.order)
        self._pending = []
        self._expected = max(0, self._expected - len(requests))
        groups: dict[tuple, list[_Request]] = {}
        for r in requests:
            p = r.params
            key = (float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0)), int(p.get("top_k", -1)))
            groups.setdefault(key, []).append(r)
        for (temperature, top_p, top_k), group in groups.items():
            try:
                results = self._sample([r.prompt_ids for r in group], temperature, top_p, top_k)
            except BaseException as e:  # noqa: BLE001 - hand the failure to every waiting session
                for r in group:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r, (tokens, log_probs) in zip(group, results, strict=True):
                r.future.set_result((list(tokens), [float(x) for x in log_probs], self.version))

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], temperature: float, top_p: float, top_k: int):
        from recipe.gdro.cpu import policy

        # TransferQueue's client resets torch's thread count after every put (limit_pytorch_auto_parallel_threads
        # restores the value it saw at import), so the backend's setting is applied again before each batch.
        torch.set_num_threads(self.num_threads)
        start = time.perf_counter()
        out = policy.sample(
            self.model,
            prompts,
            max_new_tokens=self.response_length,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            generator=self.generator,
        )
        self.stats["generate_s"] += time.perf_counter() - start
        self.stats["requests"] += len(prompts)
        self.stats["tokens"] += sum(len(t) for t, _ in out)
        self.stats["batches"] += 1
        return out


class CPULLMServerClient:
    """verl's ``LLMServerClient`` with the load balancer replaced by the one in-process server."""

    def __new__(cls, config, server: CPURolloutServer):
        from verl.workers.rollout.llm_server import LLMServerClient

        class _Client(LLMServerClient):
            async def _acquire_server(self, request_id: str, **extra):
                return "cpu-0", self._cpu_server

            def _release_server(self, server_id: str, request_id: str | None = None) -> None:
                return None

        client = _Client(config=config, load_balancer_handle=None)
        client._cpu_server = server
        return client


class _RewardHandle:
    """Looks like a ``RewardLoopWorker`` Ray handle; runs verl's ``compute_score`` in-process.

    ``seconds`` sums the durations of the scoring function itself (e.g. ``math_dapo.compute_score``,
    which verl's reward manager runs in a thread pool)."""

    def __init__(self, worker):
        self.seconds = 0.0
        self.compute_score = _RemoteMethod(worker.compute_score)
        manager = getattr(worker, "reward_manager", None)
        score_fn = getattr(manager, "compute_score", None)
        if score_fn is not None and not asyncio.iscoroutinefunction(score_fn):

            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return score_fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            manager.compute_score = timed


async def generate_and_drain(worker, batch) -> None:
    """verl's ``AgentLoopWorkerTQ.generate_sequences`` returns while the sessions it started (and the
    TransferQueue puts they make) still run as background tasks: wait until none is left, so the batch
    is whole in TransferQueue when the trainer reads it."""
    await worker.generate_sequences(batch)
    pending = [t for t in worker.background_tasks if not t.done()]
    while pending:
        await asyncio.gather(*pending)
        pending = [t for t in worker.background_tasks if not t.done()]


class CPUAgentLoopManager:
    """Stands in for ``AgentLoopManagerTQ``: verl's ``AgentLoopWorkerTQ`` in-process on an event-loop thread.

    ``generate_sequences`` tells the server how many sessions the batch holds, dispatches the batch
    to verl's worker and returns when every session has been written to TransferQueue (the real
    manager returns at once and the replay buffer polls; waiting keeps the sync loop free of sleeps).
    """

    def __init__(self, config, server: CPURolloutServer):
        self.config = config
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cpu-agent-loop", daemon=True)
        self.thread.start()
        self.positions: dict[str, int] = {}  # uid -> position in its dispatched batch (canonical order)
        self.dispatched: list[dict] = []  # per generate_sequences call: step, uids, scheduled counts
        self.generate_s = 0.0
        self.num_threads = torch.get_num_threads()  # OpenMP's setting is per thread: repeat it on the loop's
        self.worker = self._call(self._build())

    def _call(self, coro, timeout: float = 3600.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _build(self):
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

        torch.set_num_threads(self.num_threads)
        reward_worker = RewardLoopWorker(self.config, reward_router_address=None)
        client = CPULLMServerClient(self.config, self.server)
        cls = agent_loop_worker_tq_class()
        self.reward = _RewardHandle(reward_worker)
        return cls(self.config, client, None, [self.reward])

    def generate_sequences(self, batch: TensorDict) -> None:
        validate = bool(batch["validate"]) if "validate" in batch.keys() else False
        uids = [str(u) for u in list(batch["uid"])]
        rollout = self.config.actor_rollout_ref.rollout
        default_n = int(rollout.val_kwargs.n if validate else rollout.n)
        if "__rollout_n__" in batch.keys() and not validate:
            counts = [int(n) for n in list(batch["__rollout_n__"])]
        else:
            counts = [default_n] * len(uids)
        positions = {u: i for i, u in enumerate(uids)}
        self.positions = positions
        step = int(batch["global_steps"]) if "global_steps" in batch.keys() else -1
        self.dispatched.append({"step": step, "validate": validate, "uids": uids, "counts": counts})
        self.server.expect(positions, sum(counts))
        start = time.perf_counter()
        self._call(self._generate(batch))
        self.generate_s += time.perf_counter() - start

    async def _generate(self, batch):
        await generate_and_drain(self.worker, batch)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def sampling_summary(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={params.get(k)}" for k in ("temperature", "top_p", "top_k"))
