"""The GDRO trainer: verl 0.9.1's v1 synchronous PPO trainer plus the two adversaries.

:class:`GDROTrainerSync` subclasses :class:`verl.trainer.ppo.v1.PPOTrainerSync` and overrides
seven of its extension points; verl's ``fit`` / ``step`` loop is used unchanged.

``_init_dataloader``
    after verl builds the datasets, validates the training prompts' ``extra_info.index`` (unique
    integers) and builds the :class:`verl_ext.GDROController` with ``num_prompts = max id + 1``.
``_next_train_batch``
    after verl fetches a step's prompts (and gives each a fresh ``uid``), asks the controller for
    each prompt's rollout count, writes it to the per-prompt ``__rollout_n__`` field that verl's
    ``AgentLoopWorkerTQ`` reads, and records ``uid -> (prompt id, count)`` on the driver.
    Σ n = B · n̄ exactly, so ``_balance_batch`` adds no padding. A prompt fetched twice in one step
    (verl restarts the dataloader at an epoch boundary inside the step when ``data.gen_batch_size``
    < ``train_batch_size``) is two visits: two uids, each scheduled, weighted and recorded.
``_compute_advantage``
    before verl's advantage stage, reads each response's ``acc`` (verl's ``reward_extra_info``; one
    TransferQueue get of ``extra_fields``), maps it to its prompt id through the uid map and checks
    each prompt's realised group size against its scheduled count. verl's GRPO advantage function
    is wrapped for the duration of the call: the hook reads each row's score (for the
    ``gdro/per_prompt/*`` metrics) and each response's token count from the local batch's
    ``response_mask`` (no TransferQueue round trip) for the token accounting (``gdro/tokens/*``, the
    length state, ``rollout.budget=tokens`` and Prompt-GDRO's mass under a token-weighted
    ``actor.loss_agg_mode``); with an adversary on, a group of one response gets advantage 0;
    with Prompt-GDRO on, the controller observes the step (with |A| per response) and each
    response's advantage is multiplied by its weight before verl's single TransferQueue put: the
    recipe adds no write. Otherwise the controller observes after verl's stage. Padding rows
    (``is_padding``) are skipped.
``_save_checkpoint`` / ``_load_checkpoint``
    the complete controller state is saved atomically as ``global_step_N/gdro_state.pkl`` next
    to verl's own checkpoint, and restored by verl's resume (``trainer.resume_mode``).
    After each save, verl's ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` are applied
    to the ``global_step_K`` folders this process saved, as verl's own retention is; the folder it
    resumed from and every other folder on disk are never deleted, and a failed delete is logged, never
    raised (:mod:`recipe.gdro.checkpoints`). On a resume, verl's file log (``trainer.logger`` with ``file``)
    keeps the earlier lines up to the resume step: verl's ``FileLogger`` truncates its file on open, so
    they are read here and written back at the first ``on_validate_begin`` / ``on_train_begin``.
``_compute_metrics``
    appends the step's ``gdro/*`` metrics (also logged through verl's Tracking) as one JSON line to
    ``<trainer.default_local_dir>/<gdro.metrics_file>``.
``on_init_end`` (verl's public hook)
    after verl builds its workers and the checkpoint-engine manager, bounds each weight sync
    (actor -> rollout replicas) by ``GDRO_WEIGHT_SYNC_TIMEOUT`` seconds (default 900): a sync that
    does not finish ends the run with :class:`WeightSyncTimeout` naming the cause to look for,
    instead of verl waiting forever on a receiver that already failed (:func:`bounded_weight_sync`).
``_validate`` / ``_val_metrics_update``
    at each validation, appends verl's ``val-core`` / ``val-aux`` metrics (plus, per data source, the
    prompt count and the exact pass@k) to the same file as a ``{"val_step": N, ...}`` line, which
    ``python -m recipe.gdro.lab.results.table`` turns into the paper's Table 1.

With both adversaries disabled the advantages and rollout counts are verl's, untouched. By default
(``gdro.observe=true``) the binner still observes every step and the ``gdro/*`` metrics, JSONL file
and checkpointed state are written, so a GRPO baseline is comparable with the GDRO runs bin by bin;
with ``gdro.observe=false`` every override returns verl's result untouched.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
import verl.trainer.ppo.v1.trainer_base as verl_trainer_base
from omegaconf import DictConfig
from tensordict import NonTensorData, NonTensorStack, TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from recipe.gdro.checkpoints import (
    GDRO_RESUME_RECORD,
    GDRO_STATE_FILE,
    checkpoint_folders,
    enforce_retention,
    keep_limits,
    report_full_disk,
    step_folder_name,
)
from recipe.gdro.results.metrics_io import (
    append_metrics_jsonl,
    append_validation_jsonl,
    rewind_metrics_jsonl,
    validation_pass_at_k,
)
from recipe.gdro.startup.checks import (
    GDRO_TRAINER_MODE,
    SUPPORTED_TRAINER_MODE,
    Checked,
    GDRORecipeError,
    build_gdro_config,
    build_recipe_config,
    check_budget,
    check_supported_modes,
    check_train_prompt_ids,
    gdro_runs,
    handed_over,
    prompt_ids_of_table,
)
from recipe.gdro.startup.environment import (
    VERL_FILE_LOGGER_PATH_ENV,
    VERL_FILE_LOGGER_ROOT_ENV,
    WEIGHT_SYNC_TIMEOUT_ENV,
    weight_sync_timeout,
)
from recipe.gdro.startup.resume import (
    DATASET_STATE_KEY,
    RESTART_CONTROLLER_KEY,
    changed_settings,
    read_saved_state,
    save_gdro_state,
)
from verl_ext import GDROController, check_prompt_ids, gdro_config_to_dict
from verl_ext.controller import state_fingerprint

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


class WeightSyncTimeout(RuntimeError):
    """A weight sync from the actor to the rollout replicas did not finish in the allowed time."""


def bounded_weight_sync(manager, timeout: float) -> None:
    """Make ``manager.update_weights`` (verl's ``CheckpointEngineManager``) raise :class:`WeightSyncTimeout`
    after ``timeout`` seconds instead of blocking forever.

    verl's sync (verl/checkpoint_engine/base.py, ``update_weights``) blocks in ``ray.get`` until every
    sender and receiver returns; when the receiver (the vLLM worker's ``update_weights_from_ipc``)
    fails, the sender waits for an acknowledgement that never comes (measured: > 20 minutes, then
    killed). The sync runs in a daemon thread; past the deadline the trainer raises, the task runner
    fails and Ray's shutdown ends the workers. The wrapped call's own exception, when it returns one,
    is raised unchanged."""
    original = manager.update_weights
    if getattr(original, "_gdro_bounded", False):
        return

    def update_weights(*args, **kwargs):
        box: dict[str, Any] = {}

        def run():
            try:
                box["value"] = original(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e

        worker = threading.Thread(target=run, name="gdro-weight-sync", daemon=True)
        t0 = time.monotonic()
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise WeightSyncTimeout(
                f"the weight sync from the actor to the rollout replicas did not finish within {timeout:g} s "
                f"({WEIGHT_SYNC_TIMEOUT_ENV}); the rollout worker's log above has the cause (on a CPU machine "
                f"without recipe.gdro.backends.cpu_platform's shim_vllm_cpu_weight_loader: vLLM-CPU's linear "
                f"layers have no weight_loader)"
            )
        logger.debug("weight sync took %.2f s", time.monotonic() - t0)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    update_weights._gdro_bounded = True
    manager.update_weights = update_weights


ROLLOUT_N_FIELD = "__rollout_n__"  # the per-prompt rollout count verl's AgentLoopWorkerTQ reads


def verl_file_log_lines(trainer_config, last_step: int) -> bytes:
    """The lines of verl's file log (``trainer.logger`` with ``file``) whose step is at most ``last_step``,
    as bytes; the file is where verl's ``FileLogger`` writes: ``VERL_FILE_LOGGER_PATH``, else
    ``VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``. Empty when the logger is off or the file absent."""
    backends = trainer_config.get("logger", None) or []
    if "file" not in ([backends] if isinstance(backends, str) else list(backends)):
        return b""
    path = os.getenv(VERL_FILE_LOGGER_PATH_ENV) or os.path.join(
        os.path.expanduser(os.getenv(VERL_FILE_LOGGER_ROOT_ENV) or "."),
        str(trainer_config.project_name),
        f"{trainer_config.experiment_name}.jsonl",
    )
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines(keepends=True)
    except OSError:
        return b""
    kept = []
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a torn last line of a killed run
        if isinstance(step, int) and step <= last_step:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    return b"".join(kept)


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


@dataclass
class _StepPlan:
    """What the recipe knows about a training batch before verl computes its advantages."""

    keys: list[str]  # all batch keys, in verl's row order (padding included)
    row_session: np.ndarray  # batch row -> session number, -1 for padding rows
    session_final_row: np.ndarray  # session -> batch row of its final turn
    session_uids: list[str]
    session_pid: np.ndarray
    session_visit: np.ndarray  # fetch sequence number of each session's group (one visit of its prompt)
    acc: np.ndarray
    order: np.ndarray  # canonical (prompt id, visit, session) feeding order of the sessions
    padding_rows: int
    failed_sessions: int
    failed_groups: int
    session_singleton: np.ndarray  # session -> its group holds one response (the others failed)
    row_response_len: np.ndarray  # batch row -> verl's ``response_len`` tag (NaN if absent)


@contextmanager
def _scaled_advantages(hook: Callable[[Any, list[str]], None]) -> Iterator[None]:
    """Within the block, verl's v1 ``_compute_advantage`` calls ``hook(data, batch_keys)`` on the DataProto
    returned by ``compute_advantage_for_multi_trajectories`` (verl's GRPO advantages, broadcast over the
    response tokens), before it converts them to nested tensors and puts them into TransferQueue.

    The name is looked up in ``verl.trainer.ppo.v1.trainer_base`` at call time; the original is restored
    in ``finally``, so nothing outside this block (validation, other trainers) sees the wrapper.
    """
    original = verl_trainer_base.compute_advantage_for_multi_trajectories

    def wrapped(data, batch_keys, *args, **kwargs):
        out = original(data, batch_keys, *args, **kwargs)
        hook(out, batch_keys)
        return out

    verl_trainer_base.compute_advantage_for_multi_trajectories = wrapped
    try:
        yield
    finally:
        verl_trainer_base.compute_advantage_for_multi_trajectories = original


class GDROTrainerSync(PPOTrainerSync):
    """verl's synchronous v1 trainer driving a :class:`verl_ext.GDROController` (see module docstring).

    Registered in verl's trainer registry as ``gdro_sync`` (the recipe's ``trainer.v1.trainer_mode``) when this
    module is imported; the Ray TaskRunner's module (recipe.gdro.task_runner) imports it, so every process that
    looks the key up has it."""

    @property
    def trainer_mode(self) -> str:
        """verl's mode whose loop this trainer runs: ``sync``. verl's base class branches on
        ``self.trainer_mode == "sync"`` (replay buffer, refill, checkpoint) and reads ``trainer.v1.sync``;
        the config's ``trainer.v1.trainer_mode`` holds the registry key (``gdro_sync``) instead."""
        return SUPPORTED_TRAINER_MODE

    @trainer_mode.setter
    def trainer_mode(self, key: str) -> None:
        self.trainer_key = key  # PPOTrainer.__init__ assigns trainer.v1.trainer_mode, the registry key

    def __init__(self, config: DictConfig):
        """The GDRO config comes from ``config._gdro_checked``: the launch (``main_gdro``) checked the config
        once before Ray and wrote what :func:`recipe.gdro.startup.checks.prepare` built there
        (:func:`~recipe.gdro.startup.checks.hand_over`; plain data, because ``run_ppo`` hands the Ray
        TaskRunner nothing but ``config``). Nothing is re-checked here. Built outside a launch (tests,
        preflight), without that key, the trainer builds and checks the ``gdro`` section itself."""
        super().__init__(config)
        checked = handed_over(config)
        if checked is None:
            self.gdro_config = build_gdro_config(config)
            check_supported_modes(config, self.gdro_config)
            check_budget(config, self.gdro_config)
            recipe = build_recipe_config(config)
            checked = Checked(
                self.gdro_config,
                recipe.metrics_file,
                gdro_runs(config, self.gdro_config),
                restart_controller=recipe.restart_controller,
            )
        self.gdro_config = checked.gdro
        self._gdro_metrics_file = checked.metrics_file
        self._gdro_runs = checked.runs
        self._gdro_restart_controller = checked.restart_controller
        # the training prompts' fingerprint, saved with the state (startup.resume); None: computed at the first save
        self._gdro_dataset = checked.dataset
        self.gdro: GDROController | None = None
        # uid -> (prompt id, scheduled rollout count, global step of the fetch); insertion ordered.
        self._gdro_uid_map: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        # uid -> fetch sequence number: a prompt fetched twice in one step (an epoch restart inside the
        # step) is two visits, told apart and ordered by this number.
        self._gdro_uid_visit: dict[str, int] = {}
        self._gdro_fetches = 0
        self._gdro_pending: dict[str, float] = {}  # this step's schedule-side metrics
        self._gdro_step_metrics: dict[str, float] = {}  # this step's metrics (for the JSONL line)
        self._gdro_row_multiplier: dict[str, float] = {}  # this step's batch key -> advantage multiplier
        self._gdro_time = 0.0
        self._gdro_val_extra: dict[str, float] = {}  # the current validation's per-source pass@k, prompts
        self._verl_file_log_kept = b""  # verl's file-log lines up to the resume step (_restore_verl_file_log)

    def on_init_end(self):
        """verl's public hook after ``_setup``: bound every weight sync, then verl's first sync."""
        bounded_weight_sync(self.checkpoint_manager, weight_sync_timeout())
        super().on_init_end()

    def on_validate_begin(self):
        """verl's public hook; the first one runs right after ``fit`` opens verl's file logger."""
        self._restore_verl_file_log()
        super().on_validate_begin()

    def on_train_begin(self):
        """verl's public hook, after ``fit`` opens its loggers (and the initial validation)."""
        self._restore_verl_file_log()
        super().on_train_begin()

    def _restore_verl_file_log(self) -> None:
        """verl's ``FileLogger`` (``trainer.logger`` with ``file``) opens its file with ``"wb"``: a resumed run
        would truncate the lines of the steps it resumes after. :meth:`_load_checkpoint` read them before
        ``fit`` opened the file; they go back in front of what this run has written so far."""
        kept, self._verl_file_log_kept = self._verl_file_log_kept, b""
        file_logger = getattr(getattr(self, "logger", None), "logger", {}).get("file") if kept else None
        fp = getattr(file_logger, "fp", None)
        if fp is None:
            return
        with open(fp.name, "rb") as f:
            written = f.read()
        fp.seek(0)
        fp.write(kept + written)
        fp.truncate()
        logger.info(
            "GDRO: kept the %d lines of verl's file log up to step %d in %s",
            kept.count(b"\n"),
            self.global_steps,
            fp.name,
        )

    # ------------------------------------------------------------------ helpers
    @property
    def gdro_enabled(self) -> bool:
        """The controller runs: an adversary is on, or observe-only (see the module docstring)."""
        return self._gdro_runs

    def gdro_metrics_path(self) -> str | None:
        name = self._gdro_metrics_file  # a recipe key (startup/recipe_config.py)
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
        """No public verl hook sees the datasets before training: this override builds the controller."""
        super()._init_dataloader()
        if not self.gdro_enabled:
            return
        ids = self._dataset_prompt_ids()
        if len(ids) == 0:
            raise RuntimeError("GDRO: the training dataset is empty")
        num_prompts = int(ids.max()) + 1
        self.gdro = GDROController(
            self.gdro_config,
            num_prompts,
            loss_agg_mode=str(self.config.actor_rollout_ref.actor.loss_agg_mode),
            max_response_length=int(self.config.data.max_response_length),
        )
        logger.info(
            "GDRO: %d training prompts, ids in [0, %d); prompt adversary %s, rollout adversary %s",
            len(ids),
            num_prompts,
            "on" if self.gdro_config.prompt.enable else "off",
            "on" if self.gdro_config.rollout.enable else "off",
        )

    def _next_train_batch(self, num_prompts: int | None = None) -> TensorDict:
        """No public verl hook sees a fetched batch before rollout (``on_sample_*`` come after it)."""
        batch = super()._next_train_batch(num_prompts)
        if not self.gdro_enabled:
            return batch
        start = time.perf_counter()
        pids = check_prompt_ids(
            [int(i) if i is not None else None for i in list(batch["index"])],
            num_prompts=self.gdro.binner.num_prompts,
            what="training batch extra_info.index",
            check_unique=False,  # a prompt twice in a step is two visits (dataset ids were checked unique)
        )
        uids = [str(u) for u in list(batch["uid"])]
        counts = self.gdro.schedule(pids)
        if self.gdro_config.rollout.enable:
            batch[ROLLOUT_N_FIELD] = NonTensorStack.from_list([NonTensorData(int(c)) for c in counts])
        # Forget prompts of earlier steps that never produced a trajectory (a failed group).
        stale = [u for u, (_, _, step) in self._gdro_uid_map.items() if step < self.global_steps]
        for u in stale:
            self._gdro_forget(u)
        for uid, pid, n in zip(uids, pids.tolist(), counts.tolist(), strict=True):
            if "_" in uid:
                raise RuntimeError(f"uid {uid!r} contains '_', which breaks verl's trajectory keys")
            self._gdro_uid_map[uid] = (int(pid), int(n), int(self.global_steps))
            self._gdro_uid_visit[uid] = self._gdro_fetches
            self._gdro_fetches += 1
        p = self._gdro_pending
        p["gdro/recipe/prompts"] = p.get("gdro/recipe/prompts", 0.0) + float(len(pids))
        p["gdro/recipe/scheduled_rollouts"] = p.get("gdro/recipe/scheduled_rollouts", 0.0) + float(counts.sum())
        p["gdro/recipe/budget_target"] = p.get("gdro/recipe/budget_target", 0.0) + float(
            len(pids) * self.gdro_config.rollout.n_mean
        )
        p["gdro/recipe/scheduled_n_min"] = float(min(p.get("gdro/recipe/scheduled_n_min", math.inf), counts.min()))
        p["gdro/recipe/scheduled_n_max"] = float(max(p.get("gdro/recipe/scheduled_n_max", -math.inf), counts.max()))
        self._gdro_time += time.perf_counter() - start
        return batch

    def _gdro_forget(self, uid: str) -> None:
        self._gdro_uid_map.pop(uid, None)
        self._gdro_uid_visit.pop(uid, None)

    def _gdro_plan(self, batch: KVBatchMeta) -> _StepPlan:
        """Sessions, prompt ids, outcomes and group-size check of one training batch (before verl's advantage).

        Reads ``extra_fields`` only (one TransferQueue get) for each session's ``acc``.
        """
        # 1. real rows (skip _balance_batch's padding), grouped into sessions (one response each).
        is_real = [not tag.get("is_padding", False) for tag in batch.tags]
        rows = [i for i, real in enumerate(is_real) if real]
        keys = [batch.keys[i] for i in rows]
        session_of_row: list[int] = []
        session_index: dict[tuple[str, str], int] = {}
        session_final: list[tuple[int, int]] = []  # (turn, local row) of each session's final output
        for key in keys:
            uid, session_id, turn = split_trajectory_key(key)
            s = session_index.setdefault((uid, session_id), len(session_index))
            if s == len(session_final):
                session_final.append((turn, len(session_of_row)))
            elif turn > session_final[s][0]:
                session_final[s] = (turn, len(session_of_row))
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
        session_visit = np.array([self._gdro_uid_visit[u] for u in session_uids], dtype=np.int64)
        failed_sessions, failed_groups = self._check_group_sizes(session_uids)
        group_size = Counter(session_uids)
        session_singleton = np.array([group_size[u] == 1 for u in session_uids], dtype=bool)

        # 2. one TransferQueue read of extra_fields, for each session's final-turn acc.
        final_keys = [keys[local] for _, local in session_final]
        extra = []
        if final_keys:
            data = tq.kv_batch_get(keys=final_keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
            extra = list(data["extra_fields"])
        acc_raw = []
        for s, key in enumerate(final_keys):
            value, info_keys = _acc_value(extra[s])
            if value is _MISSING:
                raise RuntimeError(
                    f"GDRO: the reward of trajectory {key!r} (prompt id {int(session_pid[s])}) reports no "
                    f"'acc' in reward_extra_info (keys: {info_keys}); the difficulty binner needs a per-response "
                    "correctness. Use a reward function returning {'score': ..., 'acc': bool} (e.g. math_dapo)"
                )
            acc_raw.append(value)
        if all(isinstance(v, (bool, np.bool_)) for v in acc_raw):
            acc = np.asarray(acc_raw, dtype=bool)
        else:
            acc = np.array([np.nan if v is None else float(v) for v in acc_raw], dtype=np.float64)

        # Canonical feeding order (prompt id, visit, session): the controller's state does not depend on
        # TransferQueue's key order, so a resumed run reproduces the uninterrupted one bit for bit.
        session_numbers = np.array([_session_number(sid) for _, sid in sessions])
        order = np.lexsort((session_numbers, session_visit, session_pid))
        # batch row -> session (-1 for padding rows, which keep verl's advantage)
        row_session = np.full(len(batch), -1, dtype=np.int64)
        row_session[np.asarray(rows, dtype=np.int64)] = np.asarray(session_of_row, dtype=np.int64)
        return _StepPlan(
            keys=list(batch.keys),
            row_session=row_session,
            session_final_row=np.array([rows[local] for _, local in session_final], dtype=np.int64),
            session_uids=session_uids,
            session_pid=session_pid,
            session_visit=session_visit,
            acc=acc,
            order=order,
            padding_rows=len(batch) - len(rows),
            failed_sessions=failed_sessions,
            failed_groups=failed_groups,
            session_singleton=session_singleton,
            row_response_len=np.array([float(t.get("response_len", np.nan)) for t in batch.tags], dtype=np.float64),
        )

    def _check_group_sizes(self, session_uids: list[str]) -> tuple[int, int]:
        """Realised group size of each prompt against its scheduled count (issue 11 item 3).

        A group may come back smaller than scheduled only because sessions failed (verl leaves a
        failed session's trajectory out); those are counted. A group LARGER than its count means the
        rollout worker did not honour ``__rollout_n__``: since the counts of a step sum to exactly
        B·n̄, a worker ignoring them (every group gets ``actor_rollout_ref.rollout.n``) always makes
        some group exceed its count as soon as the counts differ, and the run stops here.

        Returns (failed sessions in groups that arrived, whole groups that did not arrive).
        """
        realised = Counter(session_uids)
        failed_sessions = 0
        for uid, got in realised.items():
            pid, scheduled, _ = self._gdro_uid_map[uid]
            if got > scheduled:
                raise RuntimeError(
                    f"GDRO: prompt id {pid} (uid {uid}) was scheduled {scheduled} rollouts but {got} responses reached "
                    f"the advantage stage. The rollout worker does not honour the per-prompt count "
                    f"`{ROLLOUT_N_FIELD}` (a verl without it gives every group "
                    f"actor_rollout_ref.rollout.n={self.gdro_config.rollout.n_mean}), so the Rollout-GDRO allocation "
                    "is not what was trained on. Use verl 0.9.1's AgentLoopWorkerTQ (trainer.use_v1=true)"
                )
            failed_sessions += scheduled - got
        step = int(self.global_steps)
        lost = [n for u, (_, n, s) in self._gdro_uid_map.items() if s == step and u not in realised]
        return failed_sessions + int(sum(lost)), len(lost)

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's advantage stage with the GDRO controller fed, and Prompt-GDRO's weights applied in it (no
        public verl hook runs inside the advantage stage).

        verl's ``compute_advantage_for_multi_trajectories`` (the GRPO advantage of each session's final
        output, broadcast over its tokens) is wrapped for the duration of this call. Right after it
        returns, the hook reads each row's score; with an adversary on, singleton groups get advantage 0;
        with Prompt-GDRO on, the controller observes the step (with |A| per response) and each response's
        advantage row is multiplied by its weight, A(x, i) × w(bin(x)) (paper, Eq. 6), before verl writes
        the advantages to TransferQueue in its single put. The recipe adds no write; its one extra read is
        ``extra_fields`` (for ``acc``).
        """
        if not self.gdro_enabled:
            return super()._compute_advantage(batch, metrics)
        start = time.perf_counter()
        plan = self._gdro_plan(batch)
        self._gdro_time += time.perf_counter() - start
        result: dict[str, np.ndarray] = {}
        must_adjust = self.gdro_config.prompt.enable or (
            self.gdro_config.enabled and bool(plan.session_singleton.any())
        )
        with _scaled_advantages(lambda data, keys: self._in_advantage_stage(plan, data, keys, result, must_adjust)):
            batch = super()._compute_advantage(batch, metrics)
        if must_adjust and "adjusted" not in result:
            raise RuntimeError(
                "GDRO: verl's _compute_advantage did not call compute_advantage_for_multi_trajectories, so "
                "Prompt-GDRO's weights were not applied (an unsupported verl version or advantage estimator)"
            )
        if "lengths" not in result and self.gdro_config.rollout.budget == "tokens":
            raise RuntimeError(
                "GDRO: verl's _compute_advantage did not call compute_advantage_for_multi_trajectories, so the "
                "response lengths gdro.rollout.budget=tokens needs were not read (an unsupported verl version)"
            )
        row_multiplier = result.get("row_multiplier", np.ones(len(plan.keys)))
        self._gdro_row_multiplier = dict(zip(plan.keys, row_multiplier.tolist(), strict=True))
        if "multipliers" not in result:
            start = time.perf_counter()
            result["multipliers"] = self._gdro_observe(plan, None, result.get("lengths"))
            self._gdro_time += time.perf_counter() - start
        self._gdro_finish_step(plan, result["multipliers"], metrics, self._gdro_per_prompt_metrics(plan, result))
        return batch

    def _gdro_observe(
        self, plan: _StepPlan, abs_adv: np.ndarray | None, lengths: np.ndarray | None = None
    ) -> np.ndarray:
        """Feed the controller in canonical order; return the per-session multipliers (canonical order)."""
        o = plan.order
        return self.gdro.observe(
            plan.session_pid[o],
            plan.acc[o],
            None if abs_adv is None else abs_adv[o],
            response_visit_ids=plan.session_visit[o],
            response_length=None if lengths is None else lengths[o],
        )

    @staticmethod
    def _session_lengths(plan: _StepPlan, data) -> np.ndarray:
        """Generated tokens per session: its rows' ``response_mask`` summed (all turns; padding skipped)."""
        row_tokens = data.batch["response_mask"].sum(dim=-1).double().numpy()
        real = plan.row_session >= 0
        return np.bincount(plan.row_session[real], weights=row_tokens[real], minlength=len(plan.session_uids))

    def _in_advantage_stage(self, plan: _StepPlan, data, batch_keys: list[str], result: dict, adjust: bool) -> None:
        """The hook inside verl's advantage stage: read each row's score (for the per-prompt metrics) and each
        session's token count, then, if an adversary needs it, zero singleton groups and apply Prompt-GDRO's
        weights."""
        if list(batch_keys) != plan.keys:
            raise RuntimeError("GDRO: verl computed advantages for other keys than the batch the recipe read")
        if "token_level_scores" in data.batch.keys():
            result["row_score"] = data.batch["token_level_scores"].sum(dim=-1).double().numpy()
        result["lengths"] = self._session_lengths(plan, data)
        if adjust:
            self._observe_and_scale(plan, data, result)

    def _observe_and_scale(self, plan: _StepPlan, data, result: dict) -> None:
        """Inside verl's advantage computation (keys already checked by the hook): zero singleton groups,
        observe with |A| and scale each response's advantage row by its Prompt-GDRO weight."""
        start = time.perf_counter()
        adv = data.batch["advantages"]
        real = plan.row_session >= 0
        singleton = self._singleton_factor(plan)
        row_mult = np.ones(len(plan.keys), dtype=np.float64)
        row_mult[real] = singleton[plan.row_session[real]]
        if self.gdro_config.prompt.enable:
            # GRPO gives one scalar per response, broadcast over its (masked) response tokens, so
            # |A| = max_t |A_t| (the inf-norm: one pass over the tensor, no temporary).
            row_abs = torch.linalg.vector_norm(adv, ord=float("inf"), dim=1)
            abs_adv = row_abs[torch.as_tensor(plan.session_final_row)].double().numpy()
            abs_adv = np.nan_to_num(abs_adv, nan=0.0) * singleton
            observed = self._gdro_observe(plan, abs_adv, result.get("lengths"))
            per_session = np.empty(len(observed), dtype=np.float64)
            per_session[plan.order] = observed
            row_mult[real] *= per_session[plan.row_session[real]]
            result["multipliers"] = observed
        # A new tensor (not in place): verl's ``returns`` is the same tensor and stays GRPO's.
        data.batch["advantages"] = adv * torch.from_numpy(row_mult).to(adv.dtype).unsqueeze(-1)
        result["row_multiplier"] = row_mult
        result["adjusted"] = True
        self._gdro_time += time.perf_counter() - start

    def _singleton_factor(self, plan: _StepPlan) -> np.ndarray:
        """Per session: 0 if its group holds a single response (with an adversary on), else 1.

        verl's GRPO gives a group of one mean 0 and std 1, so its advantage is the raw ±1 reward, not a
        baseline-corrected one; Prompt-GDRO could multiply it further. A failed session at n_min = 2 leaves
        such a group: its advantage is zeroed before weighting (counted in ``gdro/recipe/singleton_groups``).
        """
        if not self.gdro_config.enabled:
            return np.ones(len(plan.session_singleton))
        return np.where(plan.session_singleton, 0.0, 1.0)

    def _gdro_per_prompt_metrics(self, plan: _StepPlan, result: dict) -> dict[str, float]:
        """verl's ``critic/score/mean`` and ``response_length/mean`` average over responses, so under
        Rollout-GDRO a prompt with more rollouts counts more. These average each group (one visit of one
        prompt) first, then the groups: comparable across methods with different per-prompt counts."""
        rows = np.flatnonzero(plan.row_session >= 0)
        if len(rows) == 0:
            return {}
        uids = np.asarray(plan.session_uids, dtype=object)[plan.row_session[rows]]
        _, group = np.unique(uids.astype(str), return_inverse=True)
        size = np.bincount(group)

        def per_prompt_mean(values: np.ndarray) -> float:
            return float(np.mean(np.bincount(group, weights=values) / size))

        out = {}
        if "row_score" in result:
            out["gdro/per_prompt/score_mean"] = per_prompt_mean(result["row_score"][rows])
        lengths = plan.row_response_len[rows]
        if np.all(np.isfinite(lengths)):
            out["gdro/per_prompt/response_length_mean"] = per_prompt_mean(lengths)
        return out

    def _gdro_finish_step(
        self, plan: _StepPlan, observed: np.ndarray, metrics: dict, extra: dict[str, float] | None = None
    ) -> None:
        groups = dict.fromkeys(plan.session_uids)
        repeated = len(groups) - len({self._gdro_uid_map[u][0] for u in groups})
        for u in groups:
            self._gdro_forget(u)
        step = int(self.global_steps)
        for u in [u for u, (_, _, s) in self._gdro_uid_map.items() if s == step]:
            self._gdro_forget(u)  # a group that never arrived (counted in failed_groups)
        step_metrics = dict(self.gdro.metrics())
        step_metrics.update(self._gdro_pending)
        step_metrics["gdro/recipe/realised_rollouts"] = float(len(plan.session_uids))
        step_metrics["gdro/recipe/failed_sessions"] = float(plan.failed_sessions)
        step_metrics["gdro/recipe/failed_groups"] = float(plan.failed_groups)
        step_metrics["gdro/recipe/singleton_groups"] = float(plan.session_singleton.sum())
        step_metrics["gdro/recipe/padding_rows"] = float(plan.padding_rows)
        # groups whose prompt already has another group in this step (each is its own visit)
        step_metrics["gdro/recipe/repeated_prompts"] = float(repeated)
        # canonical order: bit-stable across resumes
        step_metrics["gdro/recipe/multiplier_mean"] = float(np.mean(observed)) if len(observed) else 1.0
        step_metrics["gdro/recipe/driver_ms"] = 1000.0 * self._gdro_time
        step_metrics.update(extra or {})
        self._gdro_pending = {}
        self._gdro_time = 0.0
        self._gdro_step_metrics = step_metrics
        metrics.update({k: v for k, v in step_metrics.items() if math.isfinite(v)})

    def _dump_generations(self, inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path):
        """verl's rollout dump (``trainer.rollout_data_dir``) gains ``gdro_multiplier``: the factor GDRO applied
        to each response's GRPO advantage this step (Prompt-GDRO's weight, 0 for a singleton group; paper,
        Eq. 6). verl names each line by its batch key (``uid``); a validation dump (other keys) is left as is."""
        keys = reward_extra_infos_dict.get("uid") if reward_extra_infos_dict else None
        if keys and self._gdro_row_multiplier and all(k in self._gdro_row_multiplier for k in keys):
            reward_extra_infos_dict = {
                **reward_extra_infos_dict,
                "gdro_multiplier": [float(self._gdro_row_multiplier[k]) for k in keys],
            }
        super()._dump_generations(inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path)

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        """No public verl hook receives the step's metrics (``on_step_end`` runs before they are computed)."""
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        if not self.gdro_enabled or not self._gdro_step_metrics:
            return
        path = self.gdro_metrics_path()
        if path:
            append_metrics_jsonl(path, global_steps, self._gdro_step_metrics)
        self._gdro_step_metrics = {}

    # ------------------------------------------------------------------ validation
    def _val_metrics_update(
        self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns, expected_acc_counts=None
    ) -> dict[str, float]:
        """No public verl hook receives validation's per-sample records (``on_validate_end`` gets nothing)."""
        metrics = super()._val_metrics_update(
            data_sources, sample_uids, reward_extra_infos_dict, sample_turns, expected_acc_counts=expected_acc_counts
        )
        if self.gdro_enabled:
            # Per data source: prompt count (for pooling) and the exact pass@k, for the metrics file only.
            self._gdro_val_extra = validation_pass_at_k(
                data_sources, sample_uids, reward_extra_infos_dict.get("acc"), expected_acc_counts
            )
        return metrics

    def _validate(self) -> dict[str, float]:
        """verl's validation; its ``val-core`` / ``val-aux`` dict is also written to the metrics file as a
        ``{"val_step": global_steps, ...}`` line (read by ``python -m recipe.gdro.lab.results.table``). No public
        verl hook receives the validation metrics (``on_validate_end`` gets nothing)."""
        self._gdro_val_extra = {}
        val_metrics = super()._validate()
        path = self.gdro_metrics_path() if self.gdro_enabled else None
        if path and val_metrics:
            record = {k: v for k, v in val_metrics.items() if isinstance(v, (int, float, np.number))}
            record.update(self._gdro_val_extra)
            append_validation_jsonl(path, self.global_steps, record)
        self._gdro_val_extra = {}
        return val_metrics

    # ------------------------------------------------------------------ checkpoints
    def _step_folder(self, step: int) -> str:
        return os.path.join(self.config.trainer.default_local_dir, step_folder_name(step))

    def _checkpoint_root(self) -> str:
        """``trainer.default_local_dir`` as verl's ``_load_checkpoint`` resolves it."""
        root = str(self.config.trainer.default_local_dir)
        return root if os.path.isabs(root) else os.path.join(os.getcwd(), root)

    @report_full_disk
    def _save_checkpoint(self):
        saved = getattr(self, "_gdro_saved_steps", [])
        folder = os.path.join(self._checkpoint_root(), step_folder_name(self.global_steps))
        if self.global_steps not in saved and os.path.isdir(folder) and os.listdir(folder):
            # Not deleted by retention, but verl's save writes into it: say so before its files change.
            logger.warning(
                "GDRO: saving step %d into %s, which holds files from before this run: verl overwrites the ones "
                "it writes",
                self.global_steps,
                folder,
            )
        # The GDRO state goes first: verl writes latest_checkpointed_iteration.txt last, so a
        # checkpoint that resume can find always has its gdro_state.pkl.
        if self.gdro_enabled:
            path = os.path.join(self._step_folder(self.global_steps), GDRO_STATE_FILE)
            save_gdro_state(self.gdro, path, self._dataset_facts())
            logger.info("GDRO state saved to %s", path)
        super()._save_checkpoint()
        # From here the save is good: it is this process's (retention may delete it once the limit
        # passes it), and nothing below may fail the run.
        self._gdro_saved_steps = [*saved, self.global_steps]
        try:
            self._enforce_checkpoint_retention()
        except OSError as e:
            logger.warning("GDRO: checkpoint retention stopped (%s: %s); the save is complete", type(e).__name__, e)

    def _dataset_facts(self) -> dict | None:
        """The training prompts' fingerprint saved with the GDRO state: the launch's (handed over), else read
        from the training files once (a trainer built outside a launch); None when they cannot be read here."""
        if self._gdro_dataset is None:
            try:
                self._gdro_dataset = check_train_prompt_ids(self.config).dataset or {}
            except (GDRORecipeError, ValueError) as e:
                logger.warning("GDRO: the training prompts' fingerprint is not saved with the state (%s)", e)
                self._gdro_dataset = {}
        return self._gdro_dataset or None

    def _enforce_checkpoint_retention(self) -> list[str]:
        """verl's actor / critic limits over the ``global_step_K`` folders this process saved (see
        :mod:`recipe.gdro.checkpoints`); every other folder on disk is left alone."""
        keep_actor, keep_critic = keep_limits(self.config.trainer)
        if keep_actor is None and keep_critic is None:
            return []
        return enforce_retention(
            self._checkpoint_root(), keep_actor, keep_critic, own_saves=getattr(self, "_gdro_saved_steps", [])
        )

    def _resume_folder(self) -> str | None:
        """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumed from (None if none)."""
        mode = self.config.trainer.resume_mode
        if mode == "auto":
            return find_latest_ckpt_path(self._checkpoint_root())
        if mode == "resume_path":
            folder = str(self.config.trainer.resume_from_path)
            return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)
        return None

    def _log_kept_checkpoints(self) -> None:
        """One line naming the checkpoints on disk newer than the resume point: another branch, or the
        steps a fresh start will pass. Retention never deletes them (not this process's saves)."""
        newer = [p for s, p in sorted(checkpoint_folders(self._checkpoint_root()).items()) if s > self.global_steps]
        if newer:
            logger.warning(
                "GDRO: this run starts after step %d; the newer checkpoints %s are kept (retention deletes only this "
                "run's saves; a save of this run at one of those steps writes into that folder)",
                self.global_steps,
                ", ".join(os.path.basename(p) for p in newer),
            )

    def _load_checkpoint(self):
        super()._load_checkpoint()
        # This process owns only what it saves from here on: the folder it resumed from and every other
        # folder on disk belong to earlier processes (or branches) and are never deleted.
        self._gdro_saved_steps = []
        self._log_kept_checkpoints()
        if self.global_steps > 0:
            self._verl_file_log_kept = verl_file_log_lines(self.config.trainer, self.global_steps)
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
        if self._gdro_restart_controller:
            logger.warning(
                "GDRO: %s=true: resumed verl's checkpoint %s at step %d; the GDRO controller starts afresh (its saved "
                "state is not restored)",
                RESTART_CONTROLLER_KEY,
                folder,
                self.global_steps,
            )
            self._rewind_metrics()
            return
        if path is None or not os.path.exists(path):
            raise RuntimeError(
                f"GDRO: resuming from {folder} (global step {self.global_steps}) but {GDRO_STATE_FILE} is missing "
                "there, so the binner and adversary state cannot be restored. Resume from a checkpoint written "
                f"by the GDRO recipe with GDRO enabled, start a fresh run (trainer.resume_mode=disable), or set "
                f"{RESTART_CONTROLLER_KEY}=true to resume the model with a fresh controller"
            )
        state = read_saved_state(path)
        self.gdro.load_state_dict(state)
        self._gdro_saved_dataset = state.get(DATASET_STATE_KEY)  # checked before Ray; recorded with the restore
        # against the config stored in the checkpoint (the controller's own config is the launch's)
        changed = changed_settings(state["config"], gdro_config_to_dict(self.gdro_config))
        if changed:
            logger.warning("GDRO: resumed state was saved with different settings: %s", "; ".join(changed))
        if self.gdro.step != self.global_steps:
            logger.warning(
                "GDRO: restored controller has observed %d steps but verl resumes at global step %d",
                self.gdro.step,
                self.global_steps,
            )
        self._rewind_metrics()
        logger.info("GDRO state restored from %s (controller step %d)", path, self.gdro.step)
        self._record_restored_state(path)

    def _rewind_metrics(self) -> None:
        """Drop the metrics file's lines after the resume step (a resumed run writes them again)."""
        metrics_path = self.gdro_metrics_path()
        if metrics_path:
            dropped = rewind_metrics_jsonl(metrics_path, self.global_steps)
            if dropped:
                logger.info(
                    "GDRO: dropped %d metrics lines after step %d from %s", dropped, self.global_steps, metrics_path
                )

    def _record_restored_state(self, path: str) -> None:
        """Append to ``<default_local_dir>/gdro_resume.jsonl`` what was restored: the step, the file and a
        digest of every field of the controller state as loaded and of the training prompts' facts saved with
        it (verl_ext.controller.state_fingerprint), so a restore can be checked field by field against the
        pickle it came from."""
        restored = self.gdro.state_dict()
        if getattr(self, "_gdro_saved_dataset", None) is not None:  # the training prompts' facts saved with it
            restored[DATASET_STATE_KEY] = self._gdro_saved_dataset
        record = {
            "resumed_at_step": int(self.global_steps),
            "state_file": path,
            "fields": state_fingerprint(restored),
        }
        root = self.config.trainer.default_local_dir  # may not exist yet (resumed from a path elsewhere)
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, GDRO_RESUME_RECORD), "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


# verl's registry (verl.trainer.ppo.v1.register_trainer): the recipe's trainer under its own key ("sync" is
# PPOTrainerSync's). Guarded: importing this module again (a reload) keeps the first registration.
if GDRO_TRAINER_MODE not in verl_trainer_base.TRAINER_REGISTRY:
    verl_trainer_base.register_trainer(GDRO_TRAINER_MODE)(GDROTrainerSync)
