"""The CPU backend's actor / reference worker group and checkpoint engine (in-process, no GPU).

They replace verl's ``RayWorkerGroup`` of FSDP/Megatron engine workers and its
``CheckpointEngineManager``, with the interface verl's v1 trainer calls:

* ``compute_log_prob(batch)`` / ``compute_ref_log_prob(batch)``: read ``prompts`` / ``responses``
  from TransferQueue, compute the response tokens' log-probs at the batch's temperature with the
  actor (or the frozen reference) through :func:`recipe.gdro.lab.tinylm.policy.response_log_probs`, and
  write them back as ``log_probs`` (and ``entropy``) aligned over the whole sequence as verl's
  engine does (position ``p - 1 + t`` holds token ``p + t``; verl's ``response_from_nested`` cuts
  the response part out);
* ``update_actor(batch)``: reads advantages, old / reference log-probs and masks, and runs
  :func:`recipe.gdro.lab.tinylm.policy.ppo_update` (verl's policy loss from ``core_algos``, AdamW at
  ``actor.optim.lr``, gradient clipping at ``actor.optim.clip_grad``, mini-batches of the size verl
  passes -- ``ppo_mini_batch_size × rollout.n`` rows -- over ``ppo_epochs``, micro-batches of
  ``ppo_micro_batch_size_per_gpu``);
* ``save_checkpoint`` / ``load_checkpoint``: ``<global_step_N>/actor/cpu_actor.pt`` holds the actor
  weights, the optimizer state and every RNG the run draws from (the rollout server's sampling
  generator, torch, numpy, Python), so a resumed run continues bit for bit; the weights are also
  written in Hugging Face form under ``actor/huggingface`` (loadable with ``tinylm.load_model``);
* :class:`CPUCheckpointEngine`: ``update_weights(step)`` copies the actor's weights into the rollout
  server's model, as verl's sync trainer does after every step.

:class:`InProcessReplicas` and :func:`install_in_process_workers` are the parts of that replacement
that do not depend on the model; the recipe tests' stand-ins (tests/recipe_helpers/standins.py) use
them too.
"""

from __future__ import annotations

import copy
import os
import random
import time
from types import SimpleNamespace

import numpy as np
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

CHECKPOINT_FILE = "cpu_actor.pt"


def _nested_rows(nested: torch.Tensor) -> list[torch.Tensor]:
    values, offsets = nested.values(), nested.offsets()
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def pack_sequences(prompts: list[torch.Tensor], responses: list[torch.Tensor], pad_token_id: int):
    """verl's padded layout: prompts left-padded, responses right-padded; returns
    (input_ids [B, P+R], attention_mask [B, P+R], responses [B, R], response lengths)."""
    B = len(prompts)
    P = max(int(p.numel()) for p in prompts)
    R = max(1, max(int(r.numel()) for r in responses))
    input_ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    resp = torch.full((B, R), pad_token_id, dtype=torch.long)
    lengths = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        lp, lr = int(p.numel()), int(r.numel())
        input_ids[i, P - lp : P] = p
        attention_mask[i, P - lp : P] = 1
        input_ids[i, P : P + lr] = r
        attention_mask[i, P : P + lr] = 1
        resp[i, :lr] = r
        lengths.append(lr)
    return input_ids, attention_mask, resp, lengths


def pad_response_field(nested: torch.Tensor, width: int, dtype=torch.float32) -> torch.Tensor:
    rows = _nested_rows(nested)
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.to(dtype)
    return out


class CPUActorWorkerGroup:
    """The actor (and reference) worker group on CPU; see the module docstring.

    ``model`` is trained in place; ``ref_model`` (a frozen copy of the initial weights) is built
    when the trainer uses a reference policy. ``server`` is the rollout server, whose sampling
    generator is part of the checkpoint.
    """

    def __init__(self, config, model: torch.nn.Module, *, pad_token_id: int, server=None, use_reference: bool):
        from recipe.gdro.lab.tinylm import policy

        self.config = config
        self.actor_config = config.actor_rollout_ref.actor
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.server = server
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if use_reference else None
        optim = self.actor_config.optim
        self.optimizer = policy.make_optimizer(
            model,
            lr=float(optim.lr),
            weight_decay=float(optim.get("weight_decay", 0.0)),
            betas=tuple(float(b) for b in optim.get("betas", (0.9, 0.999))),
        )
        # mini-batch order when actor.shuffle is on (verl's data_loader_seed); part of the checkpoint
        self.shuffle_generator = torch.Generator().manual_seed(int(self.actor_config.get("data_loader_seed", 42)))
        self._dispatch_info: dict = {}
        self.timing = {"log_prob_s": 0.0, "ref_s": 0.0, "update_s": 0.0}
        self.num_threads = torch.get_num_threads()  # re-applied before each computation (TransferQueue resets it)
        self.update_calls: list[dict] = []  # what each update_actor call trained on (rows, mini-batch size)

    # ------------------------------------------------------------------ verl's worker-group interface
    def _query_dispatch_info(self, role):
        return [0]  # one data-parallel rank

    def _read(self, batch, fields):
        import transfer_queue as tq

        return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)

    @torch.no_grad()
    def _log_probs(self, model, batch, with_entropy: bool):
        import transfer_queue as tq

        from recipe.gdro.lab.tinylm import policy

        data = self._read(batch, ["prompts", "responses"])
        prompts, responses = _nested_rows(data["prompts"]), _nested_rows(data["responses"])
        input_ids, attention_mask, resp, lengths = pack_sequences(prompts, responses, self.pad_token_id)
        temperature = float(batch.extra_info.get("temperature", 1.0))
        torch.set_num_threads(self.num_threads)
        was_training = model.training
        model.eval()
        if with_entropy:
            lp, ent = policy.response_log_probs(
                model, input_ids, attention_mask, resp, temperature, return_entropy=True
            )
        else:
            lp, ent = policy.response_log_probs(model, input_ids, attention_mask, resp, temperature), None
        model.train(was_training)
        log_probs, entropy = [], []
        for i, (p, r) in enumerate(zip(prompts, lengths, strict=True)):
            full = torch.zeros(int(p.numel()) + r, dtype=torch.float32)
            full[p.numel() - 1 : p.numel() - 1 + r] = lp[i, :r]
            log_probs.append(full)
            if ent is not None:
                e = torch.zeros_like(full)
                e[p.numel() - 1 : p.numel() - 1 + r] = ent[i, :r]
                entropy.append(e)
        fields = {"log_probs": torch.nested.as_nested_tensor(log_probs, layout=torch.jagged)}
        if ent is not None:
            fields["entropy"] = torch.nested.as_nested_tensor(entropy, layout=torch.jagged)
        fields = TensorDict(fields, batch_size=len(batch))
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        return batch

    def compute_log_prob(self, batch):
        start = time.perf_counter()
        calc_entropy = bool(batch.extra_info.get("calculate_entropy", True))
        out = self._log_probs(self.model, batch, with_entropy=calc_entropy)
        self.timing["log_prob_s"] += time.perf_counter() - start
        return out

    def compute_ref_log_prob(self, batch):
        if self.ref_model is None:
            raise RuntimeError("CPU backend: compute_ref_log_prob called but no reference model was built")
        start = time.perf_counter()
        out = self._log_probs(self.ref_model, batch, with_entropy=False)
        self.timing["ref_s"] += time.perf_counter() - start
        return out

    def training_batch(self, batch) -> dict[str, torch.Tensor]:
        """The padded batch (verl's key names) ``update_actor`` trains on."""
        fields = ["prompts", "responses", "response_mask", "old_log_probs", "advantages"]
        use_kl = bool(self.actor_config.use_kl_loss)
        if use_kl:
            fields.append("ref_log_prob")
        if bool(self.config.actor_rollout_ref.rollout.calculate_log_probs):
            fields.append("rollout_log_probs")
        data = self._read(batch, fields)
        prompts, responses = _nested_rows(data["prompts"]), _nested_rows(data["responses"])
        input_ids, attention_mask, resp, _ = pack_sequences(prompts, responses, self.pad_token_id)
        width = resp.shape[1]
        out = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": resp,
            "response_mask": pad_response_field(data["response_mask"], width, torch.float32),
            "old_log_probs": pad_response_field(data["old_log_probs"], width),
            "advantages": pad_response_field(data["advantages"], width),
        }
        for name in ("ref_log_prob", "rollout_log_probs"):
            if name in fields:
                out[name] = pad_response_field(data[name], width)
        return out

    def update_actor(self, batch):
        from recipe.gdro.lab.tinylm import policy

        start = time.perf_counter()
        info = dict(batch.extra_info)
        data = self.training_batch(batch)
        mini = int(info["mini_batch_size"])
        self.update_calls.append({"rows": len(batch), "mini_batch_size": mini})
        torch.set_num_threads(self.num_threads)
        self.model.train()
        metrics = policy.ppo_update(
            self.model,
            self.optimizer,
            data,
            actor_config=self.actor_config,
            mini_batch_size=mini,
            temperature=float(info.get("temperature", 1.0)),
            generator=self.shuffle_generator,
        )
        self.timing["update_s"] += time.perf_counter() - start
        # verl's _update_actor prefixes "actor/" itself and pops "mfu".
        metrics = {k.removeprefix("actor/"): [float(v)] for k, v in dict(metrics).items()}
        metrics.setdefault("mfu", [0.0])
        return {"metrics": metrics}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        state = {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }
        state["rng"]["shuffle"] = self.shuffle_generator.get_state()
        if self.server is not None:
            state["rng"]["rollout"] = self.server.generator.get_state()
        return state

    def save_checkpoint(self, local_path, remote_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        path = os.path.join(local_path, CHECKPOINT_FILE)
        tmp = path + ".tmp"
        torch.save(self.state_dict() | {"global_step": int(global_step)}, tmp)
        os.replace(tmp, path)
        if hasattr(self.model, "save_pretrained"):
            self.model.save_pretrained(os.path.join(local_path, "huggingface"), safe_serialization=True)

    def load_checkpoint(self, local_path, del_local_after_load=False):
        path = os.path.join(local_path, CHECKPOINT_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"CPU backend: resuming from {local_path} but {CHECKPOINT_FILE} is not there (a checkpoint written by "
                "another backend cannot be resumed on CPU)"
            )
        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.shuffle_generator.set_state(state["rng"]["shuffle"])
        if self.server is not None and "rollout" in state["rng"]:
            self.server.generator.set_state(state["rng"]["rollout"])


class InProcessReplicas:
    """The replica controls of verl's ``CheckpointEngineManager`` that its trainer calls around weight
    syncs and generation, as no-ops: an in-process rollout has no separate replicas to put to sleep,
    abort or resume."""

    def sleep_replicas(self):
        pass

    def abort_replicas(self):
        pass

    def resume_generation_replicas(self):
        pass


def install_in_process_workers(
    trainer, *, n_gpus: int, actor_wg, reward_handle: str, checkpoint_manager: InProcessReplicas
) -> None:
    """What ``PPOTrainer._setup`` builds on a cluster, set to in-process replacements.

    ``actor_wg`` serves the actor and, when the run uses a reference policy, the reference too;
    ``n_gpus`` is what throughput metrics divide by. The reward loop gets a non-None worker handle
    (``reward_handle`` names it): rewards are computed inside the agent loop, verl's streaming reward
    path, as on a cluster. No teacher, distillation or LLM server manager.
    """
    trainer.resource_pool_manager = SimpleNamespace(get_n_gpus=lambda: n_gpus)
    trainer.ref_in_actor = False
    trainer.actor_rollout_wg = actor_wg
    if trainer.use_reference_policy:
        trainer.ref_policy_wg = actor_wg
    trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=[reward_handle])
    trainer.teacher_model_manager = None
    trainer.distillation_config = None
    trainer.llm_server_manager = None
    trainer.checkpoint_manager = checkpoint_manager


class CPUCheckpointEngine(InProcessReplicas):
    """verl's ``CheckpointEngineManager`` on CPU: ``update_weights`` copies the actor's weights to the rollout."""

    def __init__(self, actor_wg: CPUActorWorkerGroup, server):
        self.actor_wg = actor_wg
        self.server = server
        self.versions: list = []
        self.sync_s = 0.0

    def update_weights(self, global_steps=None):
        start = time.perf_counter()
        version = int(global_steps) if global_steps is not None else self.server.version
        self.server.load_weights(self.actor_wg.model.state_dict(), version)
        self.versions.append(version)
        self.sync_s += time.perf_counter() - start


def actor_config_dict(config) -> dict:
    return OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True)
