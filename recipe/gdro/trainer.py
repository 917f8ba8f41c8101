"""The GDRO trainer: verl 0.9.1's v1 synchronous PPO trainer plus the two adversaries.

:class:`GDROTrainerSync` subclasses :class:`verl.trainer.ppo.v1.PPOTrainerSync` and overrides
five of its extension points; verl's ``fit`` / ``step`` loop is used unchanged.

``_init_dataloader``
    after verl builds the datasets, validates the training prompts' ``extra_info.index`` (unique
    integers) and builds the :class:`verl_ext.GDROController` with ``num_prompts = max id + 1``.
``_next_train_batch``
    after verl fetches a step's prompts (and gives each a fresh ``uid``), asks the controller for
    each prompt's rollout count, writes it to the per-prompt ``__rollout_n__`` field that verl's
    ``AgentLoopWorkerTQ`` reads, and records ``uid -> (prompt id, count)`` on the driver.
    Σ n = B · n̄ exactly, so ``_balance_batch`` adds no padding.
``_compute_advantage``
    after verl's GRPO advantages are in TransferQueue, reads each response's ``acc`` (verl's
    ``reward_extra_info``), maps it to its prompt id through the uid map, feeds the controller,
    and multiplies each response's advantage by its Prompt-GDRO weight (one TransferQueue get
    and, with Prompt-GDRO on, one put). Padding rows (``is_padding``) are skipped.
``_save_checkpoint`` / ``_load_checkpoint``
    the complete controller state is saved atomically as ``global_step_N/gdro_state.pkl`` next
    to verl's own checkpoint, and restored by verl's resume (``trainer.resume_mode``).
``_compute_metrics``
    appends the step's ``gdro/*`` metrics (also logged through verl's Tracking) as one JSON line to
    ``<trainer.default_local_dir>/<gdro.metrics_file>``.

With both adversaries disabled the advantages and rollout counts are verl's, untouched. By default
(``gdro.observe=true``) the binner still observes every step and the ``gdro/*`` metrics, JSONL file
and checkpointed state are written, so a GRPO baseline is comparable with the GDRO runs bin by bin;
with ``gdro.observe=false`` every override returns verl's result untouched.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import NonTensorData, NonTensorStack, TensorDict
from transfer_queue import KVBatchMeta

from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl_ext import GDROController, check_prompt_ids, gdro_config_to_dict

from recipe.gdro.checks import (
    GDRO_STATE_FILE,
    build_gdro_config,
    check_budget,
    check_supported_modes,
    check_train_prompt_ids,
    gdro_runs,
    prompt_ids_of_table,
)
from recipe.gdro.metrics_io import append_metrics_jsonl, rewind_metrics_jsonl

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

ROLLOUT_N_FIELD = "__rollout_n__"  # the per-prompt rollout count verl's AgentLoopWorkerTQ reads


def split_trajectory_key(key: str) -> tuple[str, str, int]:
    """``{uid}_{session_id}_{turn}`` -> (uid, session_id, turn) (verl's v1 trajectory key format)."""
    parts = key.rsplit("_", 2)
    if len(parts) != 3:
        raise ValueError(f"unexpected trajectory key {key!r}; expected '{{uid}}_{{session_id}}_{{turn}}'")
    return parts[0], parts[1], int(parts[2])


_MISSING = object()


def _session_number(session_id: str) -> int:
    try:
        return int(session_id)
    except ValueError:
        return 0


def _acc_value(extra_fields: Any) -> tuple[Any, list[str]]:
    """``reward_extra_info["acc"]`` of one trajectory's ``extra_fields`` (``_MISSING`` if absent)."""
    extra = getattr(extra_fields, "data", extra_fields)
    if not isinstance(extra, dict):
        return _MISSING, []
    info = extra.get("reward_extra_info") or {}
    if not isinstance(info, dict):
        return _MISSING, []
    return info.get("acc", _MISSING), sorted(info)


class GDROTrainerSync(PPOTrainerSync):
    """verl's synchronous v1 trainer driving a :class:`verl_ext.GDROController` (see module docstring)."""

    def __init__(self, config: DictConfig):
        super().__init__(config)
        self.gdro_config = build_gdro_config(config)
        check_supported_modes(config, self.gdro_config)
        check_budget(config, self.gdro_config)
        self._gdro_runs = gdro_runs(config, self.gdro_config)
        self.gdro: Optional[GDROController] = None
        # uid -> (prompt id, scheduled rollout count, global step of the fetch); insertion ordered.
        self._gdro_uid_map: "OrderedDict[str, tuple[int, int, int]]" = OrderedDict()
        self._gdro_pending: dict[str, float] = {}  # this step's schedule-side metrics
        self._gdro_step_metrics: dict[str, float] = {}  # this step's metrics (for the JSONL line)
        self._gdro_time = 0.0

    # ------------------------------------------------------------------ helpers
    @property
    def gdro_enabled(self) -> bool:
        """The controller runs: an adversary is on, or observe-only (see the module docstring)."""
        return self._gdro_runs

    def gdro_metrics_path(self) -> Optional[str]:
        name = self.gdro_config.metrics_file
        if not name:
            return None
        return os.path.join(self.config.trainer.default_local_dir, name)

    def _dataset_prompt_ids(self) -> np.ndarray:
        """Prompt ids of the loaded training dataset (after verl's filtering), validated."""
        frame = getattr(self.train_dataset, "dataframe", None)
        if frame is not None and hasattr(frame, "column_names"):
            if "extra_info" not in frame.column_names:
                from verl_ext import PromptIdError

                raise PromptIdError(
                    "training dataset: no `extra_info` column; GDRO keys prompts by extra_info.index "
                    "(a unique integer per prompt, written by data_prep)"
                )
            # with_format("arrow") honours verl's row filtering (an indices mapping over the files).
            table = frame.select_columns(["extra_info"]).with_format("arrow")[:]
            return prompt_ids_of_table(table, what="training dataset")
        # A custom dataset class without a HF dataframe: check the files themselves.
        data = check_train_prompt_ids(self.config, require_files=True)
        if data.not_checked:
            raise RuntimeError(f"GDRO cannot read extra_info.index of {data.not_checked}")
        return np.arange(data.num_prompts or 0)

    # ------------------------------------------------------------------ overrides
    def _init_dataloader(self):
        super()._init_dataloader()
        if not self.gdro_enabled:
            return
        ids = self._dataset_prompt_ids()
        if len(ids) == 0:
            raise RuntimeError("GDRO: the training dataset is empty")
        num_prompts = int(ids.max()) + 1
        self.gdro = GDROController(self.gdro_config, num_prompts)
        logger.info(
            "GDRO: %d training prompts, ids in [0, %d); prompt adversary %s, rollout adversary %s",
            len(ids),
            num_prompts,
            "on" if self.gdro_config.prompt.enable else "off",
            "on" if self.gdro_config.rollout.enable else "off",
        )

    def _next_train_batch(self, num_prompts: int | None = None) -> TensorDict:
        batch = super()._next_train_batch(num_prompts)
        if not self.gdro_enabled:
            return batch
        start = time.perf_counter()
        pids = check_prompt_ids(
            [int(i) if i is not None else None for i in list(batch["index"])],
            num_prompts=self.gdro.binner.num_prompts,
            what="training batch extra_info.index",
        )
        uids = [str(u) for u in list(batch["uid"])]
        counts = self.gdro.schedule(pids)
        if self.gdro_config.rollout.enable:
            batch[ROLLOUT_N_FIELD] = NonTensorStack.from_list([NonTensorData(int(c)) for c in counts])
        # Forget prompts of earlier steps that never produced a trajectory (a failed group).
        stale = [u for u, (_, _, step) in self._gdro_uid_map.items() if step < self.global_steps]
        for u in stale:
            del self._gdro_uid_map[u]
        for uid, pid, n in zip(uids, pids.tolist(), counts.tolist()):
            if "_" in uid:
                raise RuntimeError(f"uid {uid!r} contains '_', which breaks verl's trajectory keys")
            self._gdro_uid_map[uid] = (int(pid), int(n), int(self.global_steps))
        p = self._gdro_pending
        p["gdro/recipe/prompts"] = p.get("gdro/recipe/prompts", 0.0) + float(len(pids))
        p["gdro/recipe/scheduled_rollouts"] = p.get("gdro/recipe/scheduled_rollouts", 0.0) + float(counts.sum())
        p["gdro/recipe/budget_target"] = (
            p.get("gdro/recipe/budget_target", 0.0) + float(len(pids) * self.gdro_config.rollout.n_mean)
        )
        p["gdro/recipe/scheduled_n_min"] = float(min(p.get("gdro/recipe/scheduled_n_min", math.inf), counts.min()))
        p["gdro/recipe/scheduled_n_max"] = float(max(p.get("gdro/recipe/scheduled_n_max", -math.inf), counts.max()))
        self._gdro_time += time.perf_counter() - start
        return batch

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        batch = super()._compute_advantage(batch, metrics)
        if not self.gdro_enabled:
            return batch
        start = time.perf_counter()
        cfg = self.gdro_config

        # 1. real rows (skip _balance_batch's padding), grouped into sessions (one response each).
        rows = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        padding_rows = len(batch) - len(rows)
        keys = [batch.keys[i] for i in rows]
        session_of_row: list[int] = []
        session_index: dict[tuple[str, str], int] = {}
        session_final: list[tuple[int, int]] = []  # (turn, local row) of each session's final output
        for local, key in enumerate(keys):
            uid, session_id, turn = split_trajectory_key(key)
            s = session_index.setdefault((uid, session_id), len(session_index))
            if s == len(session_final):
                session_final.append((turn, local))
            elif turn > session_final[s][0]:
                session_final[s] = (turn, local)
            session_of_row.append(s)
        sessions = list(session_index)  # insertion order = session number s
        session_uids = [uid for uid, _ in sessions]
        missing = [u for u in dict.fromkeys(session_uids) if u not in self._gdro_uid_map]
        if missing:
            raise RuntimeError(
                f"GDRO: {len(missing)} prompt group(s) in the training batch were not scheduled by this trainer "
                f"(first uid {missing[0]!r}); a custom sampler or refill path bypassed _next_train_batch"
            )
        session_pid = np.array([self._gdro_uid_map[u][0] for u in session_uids], dtype=np.int64)

        # 2. one TransferQueue read: acc (and the advantages when they are needed).
        need_adv = cfg.prompt.enable  # observe-only and Rollout-GDRO read acc alone
        fields = ["extra_fields"] + (["advantages"] if need_adv else [])
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields) if keys else None
        extra = list(data["extra_fields"]) if keys else []
        acc_raw = []
        for s, (_, local) in enumerate(session_final):
            value, info_keys = _acc_value(extra[local])
            if value is _MISSING:
                raise RuntimeError(
                    f"GDRO: the reward of trajectory {keys[local]!r} (prompt id {int(session_pid[s])}) reports no "
                    f"'acc' in reward_extra_info (keys: {info_keys}); the difficulty binner needs a per-response "
                    "correctness. Use a reward function returning {'score': ..., 'acc': bool} (e.g. math_dapo)"
                )
            acc_raw.append(value)
        if all(isinstance(v, (bool, np.bool_)) for v in acc_raw):
            acc = np.asarray(acc_raw, dtype=bool)
        else:
            acc = np.array([np.nan if v is None else float(v) for v in acc_raw], dtype=np.float64)

        abs_adv = None
        if need_adv and keys:
            adv_nested = data["advantages"]
            values, offsets = adv_nested.values(), adv_nested.offsets()
            lengths = offsets.diff()
        if cfg.prompt.enable and cfg.prompt.loss_signal == "mean_abs_advantage" and keys:
            # GRPO gives one scalar per response, broadcast over its (masked) tokens: |A| = max_t |A_t|.
            row_abs = torch.segment_reduce(values.abs().float(), "max", lengths=lengths, unsafe=True, initial=0.0)
            row_abs = np.nan_to_num(row_abs.double().numpy(), nan=0.0)
            abs_adv = np.array([row_abs[local] for _, local in session_final])

        # 3. the controller: per-session (= per-response) multipliers. Responses are fed in a canonical
        #    (prompt id, session) order, so the state does not depend on TransferQueue's key order and a
        #    resumed run reproduces the uninterrupted one bit for bit.
        session_ids = np.array([_session_number(sid) for _, sid in sessions])
        order = np.lexsort((session_ids, session_pid))
        observed = self.gdro.observe(session_pid[order], acc[order], None if abs_adv is None else abs_adv[order])
        multipliers = np.empty(len(order), dtype=np.float64)
        multipliers[order] = observed
        row_mult = np.asarray(multipliers, dtype=np.float64)[np.asarray(session_of_row, dtype=np.int64)]

        # 4. Prompt-GDRO: scale the advantages the actor will read.
        if cfg.prompt.enable and keys:
            scale = torch.as_tensor(row_mult, dtype=values.dtype)
            new_values = values * torch.repeat_interleave(scale, lengths)
            scaled = torch.nested.nested_tensor_from_jagged(new_values, offsets)
            tq.kv_batch_put(
                keys=keys,
                partition_id=batch.partition_id,
                fields=TensorDict({"advantages": scaled}, batch_size=len(keys)),
            )

        # 5. consume the uid map, collect metrics.
        for u in dict.fromkeys(session_uids):
            self._gdro_uid_map.pop(u, None)
        self._gdro_time += time.perf_counter() - start
        step_metrics = dict(self.gdro.metrics())
        step_metrics.update(self._gdro_pending)
        step_metrics["gdro/recipe/realised_rollouts"] = float(len(session_final))
        step_metrics["gdro/recipe/padding_rows"] = float(padding_rows)
        step_metrics["gdro/recipe/multiplier_mean"] = float(np.mean(observed)) if len(observed) else 1.0  # canonical order: bit-stable
        step_metrics["gdro/recipe/driver_ms"] = 1000.0 * self._gdro_time
        self._gdro_pending = {}
        self._gdro_time = 0.0
        self._gdro_step_metrics = step_metrics
        metrics.update({k: v for k, v in step_metrics.items() if math.isfinite(v)})
        return batch

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        if not self.gdro_enabled or not self._gdro_step_metrics:
            return
        path = self.gdro_metrics_path()
        if path:
            append_metrics_jsonl(path, global_steps, self._gdro_step_metrics)
        self._gdro_step_metrics = {}

    # ------------------------------------------------------------------ checkpoints
    def _step_folder(self, step: int) -> str:
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{step}")

    def _save_checkpoint(self):
        # The GDRO state goes first: verl writes latest_checkpointed_iteration.txt last, so a
        # checkpoint that resume can find always has its gdro_state.pkl.
        if self.gdro_enabled:
            path = os.path.join(self._step_folder(self.global_steps), GDRO_STATE_FILE)
            self.gdro.save(path)
            logger.info("GDRO state saved to %s", path)
        super()._save_checkpoint()

    def _resume_folder(self) -> Optional[str]:
        """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumed from (None if none)."""
        mode = self.config.trainer.resume_mode
        if mode == "auto":
            folder = self.config.trainer.default_local_dir
            if not os.path.isabs(folder):
                folder = os.path.join(os.getcwd(), folder)
            return find_latest_ckpt_path(folder)
        if mode == "resume_path":
            folder = str(self.config.trainer.resume_from_path)
            return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)
        return None

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if not self.gdro_enabled:
            return
        if self.global_steps == 0:
            # A fresh run: a metrics file left in the folder by an earlier run is moved aside, so
            # the file only ever holds this run's steps.
            metrics_path = self.gdro_metrics_path()
            if metrics_path and os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0:
                backup = f"{metrics_path}.{time.strftime('%Y%m%d-%H%M%S')}.bak"
                os.replace(metrics_path, backup)
                logger.warning("GDRO: fresh run; moved the existing metrics file %s to %s", metrics_path, backup)
            return
        folder = self._resume_folder()
        path = os.path.join(folder, GDRO_STATE_FILE) if folder else None
        if path is None or not os.path.exists(path):
            raise RuntimeError(
                f"GDRO: resuming from {folder} (global step {self.global_steps}) but {GDRO_STATE_FILE} is missing "
                "there, so the binner and adversary state cannot be restored. Resume from a checkpoint written "
                "by the GDRO recipe with GDRO enabled, or start a fresh run (trainer.resume_mode=disable)"
            )
        self.gdro.load(path)
        saved = self.gdro.state_dict()["config"]
        current = gdro_config_to_dict(self.gdro_config)
        changed = sorted(
            f"{section}.{k}"
            for section in ("binner", "prompt", "rollout")
            for k in current[section]
            if saved.get(section, {}).get(k) != current[section][k]
        )
        if changed:
            logger.warning("GDRO: resumed state was saved with different settings for %s", ", ".join(changed))
        if self.gdro.step != self.global_steps:
            logger.warning(
                "GDRO: restored controller has observed %d steps but verl resumes at global step %d",
                self.gdro.step,
                self.global_steps,
            )
        metrics_path = self.gdro_metrics_path()
        if metrics_path:
            dropped = rewind_metrics_jsonl(metrics_path, self.global_steps)
            if dropped:
                logger.info("GDRO: dropped %d metrics lines after step %d from %s", dropped, self.global_steps, metrics_path)
        logger.info("GDRO state restored from %s (controller step %d)", path, self.gdro.step)
