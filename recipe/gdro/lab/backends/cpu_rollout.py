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
collects every request of the dispatched batch (the manager tells it how many sessions to expect;
a session that ends without generating is reported by :class:`CPUAgentLoopWorkerTQ`), orders them
canonically -- (position of the prompt in the dispatched batch, session id) -- and samples them in
one batched call with one ``torch.Generator``. Which requests share a batch never depends on timing,
so a run is a function of its seed, whatever order the event loop runs the sessions in; that is what
makes resume bit-exact and two runs of one seed equal.

Speed (verl's code paths, run cheaper; docs/cpu_backend.md has the measurements):
:class:`CPUAgentLoopWorkerTQ` (a subclass of verl's ``AgentLoopWorkerTQ``) builds verl's
``SingleTurnAgentLoop`` once and reuses it for every session (verl instantiates one per session
through ``hydra.utils.instantiate``; the single-turn loop keeps no per-session state), and the
manager's event loop runs ``run_in_executor`` calls (verl's chat-template and reward-scoring hops)
inline instead of in a thread pool.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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


# (uid, session id) of the verl agent-loop session running in the current task (set by CPUAgentLoopWorkerTQ)
_SESSION: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("cpu_agent_session", default=None)

SINGLE_TURN_TARGET = "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop"


@functools.cache
def cpu_agent_loop_worker_class():
    """:class:`CPUAgentLoopWorkerTQ`: verl's ``AgentLoopWorkerTQ`` with ``_run_agent_loop`` overridden:

    * it tells the rollout server which session is calling (``uid``, ``session_id``) and when a session
      ends, so the server batches by session, not by timing;
    * with ``reuse_agent_loops`` on, a registered agent loop whose class is verl's ``SingleTurnAgentLoop``
      (registry entry ``{"_target_": ...}`` only) is instantiated once per worker -- with the arguments
      verl's ``_run_agent_loop`` passes -- and reused: its ``run`` keeps every session's state in locals.
      Any other agent loop goes through verl's ``_run_agent_loop`` unchanged (one instance a session).
    """
    import hydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.rollout_trace import rollout_trace_attr

    class CPUAgentLoopWorkerTQ(agent_loop_worker_tq_class()):
        reuse_agent_loops = True
        session_listener: Callable[[str, int], None] | None = None  # called when a session ends

        def _reusable_agent_loop(self, agent_name: str):
            cache = self.__dict__.setdefault("_agent_loops", {})
            if agent_name not in cache:
                entry = _agent_loop_registry.get(agent_name)
                reusable = entry is not None and dict(entry) == {"_target_": SINGLE_TURN_TARGET}
                cache[agent_name] = (
                    hydra.utils.instantiate(
                        config=entry,
                        trainer_config=DictConfigWrap(config=self.config),
                        server_manager=self.llm_client,
                        tokenizer=self.tokenizer,
                        processor=self.processor,
                        hf_model_type=self.hf_model_type,
                        dataset_cls=self.dataset_cls,
                        data_config=DictConfigWrap(self.config.data),
                        tools=ToolListWrap(self.tools),
                    )
                    if reusable
                    else None
                )
            return cache[agent_name]

        async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
            ident = (str(kwargs.get("uid")), int(kwargs.get("session_id", 0)))
            token = _SESSION.set(ident)
            try:
                agent_loop = self._reusable_agent_loop(agent_name) if self.reuse_agent_loops else None
                if agent_loop is None:
                    return await super()._run_agent_loop(
                        sampling_params, trajectory, agent_name=agent_name, trace=trace, **kwargs
                    )
                with rollout_trace_attr(
                    step=trajectory["step"],
                    sample_index=trajectory["sample_index"],
                    rollout_n=trajectory["rollout_n"],
                    validate=trajectory["validate"],
                    name="agent_loop",
                    trace=trace,
                ):
                    output = await agent_loop.run(sampling_params, **kwargs)
                    return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)
            finally:
                _SESSION.reset(token)
                if self.session_listener is not None:
                    self.session_listener(*ident)

    return CPUAgentLoopWorkerTQ


class _InlineExecutor(ThreadPoolExecutor):
    """An event loop's default executor that runs each call at once in the calling thread.

    verl's agent loop sends the chat template and the reward manager its decode and scoring through
    ``loop.run_in_executor(None, ...)``; on a 2-core machine the thread-pool hop costs more than the
    call (asyncio requires a ``ThreadPoolExecutor`` as the default executor, hence the base class)."""

    def __init__(self):
        super().__init__(max_workers=1)

    def submit(self, fn, /, *args, **kwargs):
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - delivered to the awaiting coroutine
            future.set_exception(e)
        return future


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
        stall_flush_s: float = 30.0,
    ):
        self.model = model.eval()
        self.response_length = int(response_length)
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.version = 0  # weight version (global step of the actor weights loaded)
        self.stall_flush_s = stall_flush_s
        self.generate = _RemoteMethod(self._generate)
        self._pending: list[_Request] = []
        self._expected = 0  # sessions of the dispatched batches that have neither requested nor ended
        self._requested: set[tuple[str, int]] = set()  # sessions whose request arrived (this batch)
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

    def session_ended(self, uid: str, session_id: int) -> None:
        """A session of the batch ended; one that never requested no longer counts as expected."""
        if (uid, session_id) in self._requested:
            self._requested.discard((uid, session_id))
            return
        self._expected = max(0, self._expected - 1)
        if self._pending and len(self._pending) >= self._expected:
            self._flush()

    async def _generate(self, request_id=None, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if kwargs.get("image_data") or kwargs.get("video_data") or kwargs.get("audio_data"):
            raise ValueError("the CPU rollout server generates text only")
        loop = asyncio.get_running_loop()
        ident = _SESSION.get()
        if ident is None:
            order = (1 << 30, 0, self._arrival)
        else:
            order = (self._positions.get(ident[0], 1 << 29), ident[1], self._arrival)
            self.requests_by_uid[ident[0]] += 1
            self._requested.add(ident)
        self._arrival += 1
        req = _Request(list(map(int, prompt_ids)), dict(sampling_params), loop.create_future(), order)
        self._pending.append(req)
        self._last_arrival = time.perf_counter()
        if len(self._pending) >= self._expected:
            self._flush()
        elif self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush_when_stalled())
        tokens, log_probs, version = await req.future
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": version},
        )

    async def _flush_when_stalled(self):
        """Guard only (a run never needs it): an agent loop that requests more or less than once a
        session would otherwise wait forever. Flushing on a timer makes batching timing-dependent."""
        while self._pending:
            await asyncio.sleep(self.stall_flush_s / 4)
            if self._pending and time.perf_counter() - self._last_arrival >= self.stall_flush_s:
                logger.warning(
                    "CPU rollout: %d requests waited %.0f s for %d more sessions; sampling them now",
                    len(self._pending),
                    self.stall_flush_s,
                    self._expected - len(self._pending),
                )
                self._flush()

    def _flush(self) -> None:
        requests = sorted(self._pending, key=lambda r: r.order)
        self._pending = []
        flusher = self._flusher
        if flusher is not None and not flusher.done() and flusher is not asyncio.current_task():
            flusher.cancel()
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
        from recipe.gdro.lab.tinylm import policy

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
    ``reuse_agent_loops`` / ``inline_executor`` off give verl's per-session path exactly (one agent-loop
    object a session, a thread-pool hop per ``run_in_executor``): the benchmark's baseline.
    """

    def __init__(
        self, config, server: CPURolloutServer, *, reuse_agent_loops: bool = True, inline_executor: bool = True
    ):
        self.config = config
        self.server = server
        self.reuse_agent_loops = reuse_agent_loops
        self.loop = asyncio.new_event_loop()
        if inline_executor:
            self.loop.set_default_executor(_InlineExecutor())
        self.thread = threading.Thread(target=self.loop.run_forever, name="cpu-agent-loop", daemon=True)
        self.thread.start()
        self.positions: dict[str, int] = {}  # uid -> position in its dispatched batch (canonical order)
        self.dispatched: list[dict] = []  # per generate_sequences call: step, uids, scheduled counts
        self.generate_s = 0.0
        self.num_threads = torch.get_num_threads()  # OpenMP's setting is per thread: repeat it on the loop's
        self.worker = self._call(self._build())

    def _call(self, coro, timeout: float = 3600.0):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:  # Ctrl-C in the waiting thread: the coroutine must not run on unobserved
            future.cancel()
            raise

    @staticmethod
    async def _cancel_pending() -> None:
        """Cancel every task on the loop and let each finish: a task dropped while pending is reported
        ("Task was destroyed but it is pending") and its context-variable resets fail at collection."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _build(self):
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

        torch.set_num_threads(self.num_threads)
        reward_worker = RewardLoopWorker(self.config, reward_router_address=None)
        client = CPULLMServerClient(self.config, self.server)
        self.reward = _RewardHandle(reward_worker)
        worker = cpu_agent_loop_worker_class()(self.config, client, None, [self.reward])
        worker.reuse_agent_loops = self.reuse_agent_loops
        worker.session_listener = self.server.session_ended
        return worker

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
            try:
                asyncio.run_coroutine_threadsafe(self._cancel_pending(), self.loop).result(10)
            except (Exception, KeyboardInterrupt):  # noqa: BLE001 - closing anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


def sampling_summary(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={params.get(k)}" for k in ("temperature", "top_p", "top_k"))
