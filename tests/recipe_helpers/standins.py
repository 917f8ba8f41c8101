"""In-process stand-ins for the parts of verl 0.9.1's v1 trainer that need a GPU.

Everything else runs for real: ``PPOTrainerSync.fit`` / ``step``, TransferQueue, the replay
buffer, ``_balance_batch``, verl's GRPO advantage, verl's ``AgentLoopWorkerTQ`` (``generate_sequences``,
``_run_prompt`` -- which reads ``__rollout_n__`` -- and ``_agent_loop_postprocess``, which writes
trajectories and tags into TransferQueue), verl's reward path (``AgentLoopWorker._compute_score`` ->
``RewardLoopWorker.compute_score`` -> ``NaiveRewardManager`` -> ``math_dapo``).

Replaced:

* the LLM server + agent loop: :class:`ScriptedAgentLoopWorker._run_agent_loop` returns a scripted
  text response per (prompt index, session, step) -- correct (``Answer: <ground truth>``) with a
  per-prompt solve rate -- tokenised with a tiny byte-level tokenizer built offline;
* the actor / reference worker group (:class:`FakeActorWorkerGroup`): log-probs = the rollout
  log-probs, ``update_actor`` records what reached it (advantages, mini-batch size);
* the checkpoint engine manager and the resource pool manager (no-ops);
* the Ray actor boundary of the agent loop worker: it runs on an event loop in a thread of the
  test process (TransferQueue's async client keys its sockets by event loop).
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transfer_queue as tq
from tensordict import TensorDict

from recipe.gdro.lab.backends.cpu_rollout import generate_and_drain
from recipe.gdro.lab.backends.cpu_workers import InProcessReplicas, install_in_process_workers

SPECIAL_TOKENS = ["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# ---------------------------------------------------------------------------------------- tokenizer
def build_tiny_tokenizer():
    """A byte-level tokenizer (one token per byte, no merges) built offline, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---------------------------------------------------------------------------------------- data
def math_rows(answers: list[int], index: list[Any] | None = None) -> list[dict]:
    """DAPO-format rows (data_source math_dapo); ``index[i]`` None leaves extra_info.index out."""
    index = list(range(len(answers))) if index is None else index
    rows = []
    for k, (answer, idx) in enumerate(zip(answers, index, strict=True)):
        extra = {"split": "train"}
        if idx is not None:
            extra["index"] = idx
        rows.append(
            {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": f"Problem {k}: what is {answer - 3} + 3?"}],
                "ability": "MATH",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": extra,
            }
        )
    return rows


def eval_rows(specs: list[tuple[str, str, int]]) -> list[dict]:
    """Rows of the given (data_source, ground truth, extra_info.index): math sets take an integer answer,
    ``gpqa_diamond`` a letter A-D (as data_prep/eval_sets.py writes them)."""
    rows = []
    for source, truth, idx in specs:
        if source == "gpqa_diamond":
            question = f"Which option? {idx}"
        else:
            question = f"Problem {idx}: what is {int(truth) - 3} + 3?"
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": question}],
                "ability": "science" if source == "gpqa_diamond" else "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": "test", "index": idx},
            }
        )
    return rows


def write_parquet(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


class Script:
    """Which scripted responses are correct: prompt ``index`` is solved at rate ``rates[index]``.

    Deterministic in (index, session, step), so two runs (or a resumed run) see the same outcomes.
    ``fail`` lists (index, session, step) whose agent loop returns no output (a failed session: verl
    puts no trajectory for it). ``wrong_filler`` words of working precede a wrong answer, so failures
    run longer (the token-budget tests); 0 keeps every response the same length.
    """

    def __init__(self, rates: dict[int, float], fail: set[tuple[int, int, int]] | None = None, wrong_filler: int = 0):
        self.rates = dict(rates)
        self.fail = set(fail or ())
        self.wrong_filler = int(wrong_filler)

    def correct(self, index: int, session: int, step: int) -> bool:
        h = (index * 73856093) ^ (session * 19349663) ^ (step * 83492791)
        return (h % 1000) / 1000.0 < self.rates[int(index)]

    def response(self, ground_truth: str, correct: bool) -> str:
        if ground_truth in ("A", "B", "C", "D"):
            # Multiple choice: "Answer: (B) option text". Only a letter-aware scorer (data_prep.reward_fn's
            # GPQA path) reads B from it; math_dapo compares the whole line with "B" and says wrong.
            letter = ground_truth if correct else "ABCD"[("ABCD".index(ground_truth) + 1) % 4]
            return f"The option that fits is {letter}.\nAnswer: ({letter}) option {letter}"
        answer = ground_truth if correct else str(int(ground_truth) + 1)
        filler = "" if correct else "so, " * self.wrong_filler
        return f"{filler}Adding three gives {answer}.\nAnswer: {answer}"


# ---------------------------------------------------------------------------------------- agent loop
def _agent_loop_worker_tq_class():
    """verl's AgentLoopWorkerTQ class itself (the module exports it wrapped as a Ray actor class)."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    return AgentLoopWorkerTQ.__ray_metadata__.modified_class.__mro__[1]


def make_scripted_worker_cls():
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    base = _agent_loop_worker_tq_class()

    class ScriptedAgentLoopWorker(base):
        """verl's AgentLoopWorkerTQ with the LLM + agent loop replaced by a script."""

        async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
            try:
                index, session, step = int(kwargs["index"]), int(kwargs["session_id"]), int(kwargs["global_steps"])
                if (index, session, step) in self.script.fail and not trajectory["validate"]:
                    self.script_log.append(
                        {
                            "step": step,
                            "uid": str(kwargs["uid"]),
                            "index": index,
                            "session": session,
                            "correct": None,
                            "failed": True,
                        }
                    )
                    return await self._agent_loop_postprocess([], trajectory["validate"], **kwargs)
                messages = list(kwargs["raw_prompt"])
                prompt_text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                prompt_ids = self.tokenizer.encode(prompt_text, add_special_tokens=False)
                ground_truth = str(kwargs["reward_model"]["ground_truth"])
                correct = self.script.correct(index, session, step)
                text = self.script.response(ground_truth, correct)
                response_ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
                logprobs = [-0.05 - 0.01 * ((index + session + t) % 7) for t in range(len(response_ids))]
                version = step - 1  # sync trainer: weights of the previous step
                output = AgentLoopOutput(
                    prompt_ids=prompt_ids,
                    response_ids=response_ids,
                    response_mask=[1] * len(response_ids),
                    response_logprobs=logprobs,
                    num_turns=2,
                    metrics=AgentLoopMetrics(),
                    extra_fields={"global_steps": version, "min_global_steps": version, "max_global_steps": version},
                )
                output.extra_fields.update({"turn_scores": [], "tool_rewards": []})
                self.script_log.append(
                    {"step": step, "uid": str(kwargs["uid"]), "index": index, "session": session, "correct": correct}
                )
                return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)
            except BaseException as e:
                self.errors.append(repr(e))
                raise

    return ScriptedAgentLoopWorker


class _Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class RewardHandle:
    """Looks like a RewardLoopWorker Ray handle; runs verl's RewardLoopWorker.compute_score in-process."""

    def __init__(self, reward_worker):
        self.compute_score = _Remote(reward_worker.compute_score)


class StandInAgentLoopManager:
    """Replaces AgentLoopManagerTQ: one in-process ScriptedAgentLoopWorker on a background event loop.

    ``generate_sequences`` returns when every prompt of the batch has finished (the real manager
    returns at once and the replay buffer polls; waiting here keeps the test free of poll sleeps).
    """

    def __init__(self, config, tokenizer, script: Script, ignore_rollout_n: bool = False):
        self.ignore_rollout_n = ignore_rollout_n  # act like a verl whose worker ignores __rollout_n__
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="standin-agent-loop", daemon=True)
        self.thread.start()
        self.batches: list[dict] = []  # what verl's worker received, per generate_sequences call
        self.worker = self._call(self._build(config, tokenizer, script))

    def _call(self, coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _build(self, config, tokenizer, script):
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
        from verl.trainer.ppo.reward import load_reward_manager

        reward_worker = RewardLoopWorker.__new__(RewardLoopWorker)
        reward_worker.config = config
        reward_worker.reward_router_address = None
        reward_worker.input_tokenizer = tokenizer
        reward_worker.reward_model_tokenizer = None
        reward_worker.reward_manager = load_reward_manager(config, tokenizer)  # verl's naive manager + math_dapo
        reward_worker.loop = asyncio.get_running_loop()

        cls = make_scripted_worker_cls()
        worker = cls.__new__(cls)
        worker.config = config
        worker.llm_client = None
        worker.teacher_client = None
        worker.reward_loop_worker_handles = [RewardHandle(reward_worker)]
        worker.tokenizer = tokenizer
        worker.processor = None
        worker.hf_model_type = None
        worker.mm_processor_kwargs = {}
        worker.distillation_enabled = False
        worker.background_tasks = set()
        worker.script = script
        worker.script_log = []
        worker.errors = []
        return worker

    def generate_sequences(self, batch: TensorDict) -> None:
        record = {
            "step": int(batch["global_steps"]),
            "uid": [str(u) for u in list(batch["uid"])],
            "index": [int(i) for i in list(batch["index"])],
            "rollout_n": [int(n) for n in list(batch["__rollout_n__"])] if "__rollout_n__" in batch.keys() else None,
            "validate": bool(batch["validate"]) if "validate" in batch.keys() else False,
        }
        self.batches.append(record)
        if self.ignore_rollout_n and "__rollout_n__" in batch.keys():
            batch = batch.exclude("__rollout_n__")
        self._call(self._generate(batch))
        if self.worker.errors:
            raise RuntimeError(f"stand-in agent loop failed: {self.worker.errors}")

    async def _generate(self, batch):
        await generate_and_drain(self.worker, batch)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


# ---------------------------------------------------------------------------------------- workers
class FakeActorWorkerGroup:
    """Actor (and reference) worker group stand-in.

    ``compute_log_prob`` / ``compute_ref_log_prob`` write log-probs aligned like the real engine's
    output (the rollout log-probs, shifted by one into the full sequence); ``update_actor`` records
    every row that reached it.
    """

    def __init__(self, dp_size: int = 2):
        self.dp_size = dp_size
        self._dispatch_info: dict = {}
        self.trainer = None
        self.updates: list[dict] = []
        self.saved: list[str] = []
        self.loaded: list[str] = []

    def _query_dispatch_info(self, role):
        return list(range(self.dp_size))

    def _write_log_probs(self, batch, field: str, shift: float, with_entropy: bool):
        data = tq.kv_batch_get(
            keys=batch.keys,
            partition_id=batch.partition_id,
            select_fields=["prompts", "responses", "rollout_log_probs"],
        )
        p_lens = data["prompts"].offsets().diff().tolist()
        r_lens = data["responses"].offsets().diff().tolist()
        rollout = data["rollout_log_probs"]
        r_values, r_offsets = rollout.values(), rollout.offsets()
        log_probs, entropy = [], []
        for i, (p, r) in enumerate(zip(p_lens, r_lens, strict=True)):
            full = torch.zeros(p + r, dtype=torch.float32)
            full[p - 1 : p - 1 + r] = r_values[r_offsets[i] : r_offsets[i + 1]] - shift
            log_probs.append(full)
            entropy.append(torch.full((p + r,), 0.5, dtype=torch.float32))
        fields = {field: torch.nested.as_nested_tensor(log_probs, layout=torch.jagged)}
        if with_entropy:
            fields["entropy"] = torch.nested.as_nested_tensor(entropy, layout=torch.jagged)
        fields = TensorDict(fields, batch_size=len(batch))
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        return batch

    def compute_log_prob(self, batch):
        return self._write_log_probs(batch, "log_probs", 0.0, with_entropy=True)

    def compute_ref_log_prob(self, batch):
        return self._write_log_probs(batch, "log_probs", 0.01, with_entropy=False)

    def update_actor(self, batch):
        info = dict(batch.extra_info)
        data = tq.kv_batch_get(
            keys=batch.keys,
            partition_id=batch.partition_id,
            select_fields=["advantages", "response_mask", "rm_scores", "index", "uid", "session_id", "old_log_probs"],
        )
        adv, mask, scores = data["advantages"], data["response_mask"], data["rm_scores"]
        a_off, a_val = adv.offsets(), adv.values()
        s_off, s_val = scores.offsets(), scores.values()
        m_off, m_val = mask.offsets(), mask.values()
        rows = []
        for i, key in enumerate(batch.keys):
            a = a_val[a_off[i] : a_off[i + 1]]
            m = m_val[m_off[i] : m_off[i + 1]]
            rows.append(
                {
                    "key": key,
                    "uid": str(list(data["uid"])[i]),
                    "index": int(list(data["index"])[i]),
                    "session": int(list(data["session_id"])[i]),
                    "is_padding": bool(batch.tags[i].get("is_padding", False)),
                    "advantage": float(a[0]) if len(a) else 0.0,
                    "advantage_tokens": a.clone(),
                    "mask": m.clone(),
                    "score": float(s_val[s_off[i] : s_off[i + 1]].sum()),
                }
            )
        self.updates.append(
            {
                "step": int(self.trainer.global_steps),
                "num_rows": len(batch),
                "mini_batch_size": int(info["mini_batch_size"]),
                "rows": rows,
            }
        )
        return {"metrics": {"mfu": [0.0], "pg_loss": [0.0], "grad_norm": [1.0]}}

    def save_checkpoint(self, local_path, remote_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        with open(os.path.join(local_path, "standin_actor.txt"), "w") as f:
            f.write(str(global_step))
        self.saved.append(local_path)

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loaded.append(local_path)


class FakeCheckpointManager(InProcessReplicas):
    """Records the step of every weight sync; the replica controls are the CPU backend's no-ops."""

    def __init__(self):
        self.versions: list = []

    def update_weights(self, global_steps=None):
        self.versions.append(global_steps)


class StandInSetupMixin:
    """Replaces PPOTrainer._setup's GPU parts (worker groups, LLM servers, checkpoint engine)."""

    standin_tokenizer = None

    def _init_tokenizer(self):
        self.tokenizer = self.standin_tokenizer
        self.processor = None

    def _setup(self):
        self._init_tokenizer()
        self._init_dataloader()
        self._init_dump_executor()
        actor_wg = FakeActorWorkerGroup(dp_size=2)
        actor_wg.trainer = self
        install_in_process_workers(
            self,
            n_gpus=2,
            actor_wg=actor_wg,
            reward_handle="in-process stand-in",
            checkpoint_manager=FakeCheckpointManager(),
        )
        self.checkpoint_manager.sleep_replicas()
        self._load_checkpoint()


def standin_trainer_cls(base, tokenizer):
    """``base`` (a verl / recipe trainer class) with the GPU parts of ``_setup`` stood in."""
    return type(f"StandIn{base.__name__}", (StandInSetupMixin, base), {"standin_tokenizer": tokenizer})


def clear_transfer_queue():
    """Remove every key left in TransferQueue (so runs sharing one TQ cannot see each other's data)."""
    listing = tq.kv_list() or {}
    for partition, items in listing.items():
        if items:
            tq.kv_clear(keys=list(items), partition_id=partition)


def run_fit(trainer_cls, config, tokenizer, script, **manager_kwargs):
    """Build the trainer with stand-ins, run verl's fit, return (trainer, agent loop manager)."""
    clear_transfer_queue()
    manager = StandInAgentLoopManager(config, tokenizer, script, **manager_kwargs)
    try:
        trainer = standin_trainer_cls(trainer_cls, tokenizer)(config=config)
        trainer.init()
        trainer.fit(manager)
    finally:
        manager.close()
    return trainer, manager


def grpo_reference(rows: list[dict]) -> dict[str, float]:
    """verl's GRPO advantage (core_algos.compute_grpo_outcome_advantage) of recorded actor rows, by key."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    real = [r for r in rows if not r["is_padding"]]
    width = max(len(r["mask"]) for r in real)
    rewards = torch.zeros(len(real), width)
    mask = torch.zeros(len(real), width)
    for i, r in enumerate(real):
        n = len(r["mask"])
        mask[i, :n] = r["mask"].float()
        rewards[i, n - 1] = r["score"]
    adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=np.array([r["uid"] for r in real], dtype=object)
    )
    return {r["key"]: float(adv[i, 0]) for i, r in enumerate(real)}
