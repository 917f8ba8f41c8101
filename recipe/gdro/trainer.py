"""The GDRO trainer: verl 0.9.1's v1 PPO trainer plus the two adversaries.

:class:`GDROTrainerMixin` goes in front of a trainer registered in verl's registry (a subclass of verl's
``PPOTrainer``); verl's ``fit`` / ``step`` loop is used unchanged. :class:`GDROTrainerSync` puts it on
``PPOTrainerSync`` (registered as ``gdro_sync``) and holds the one sync-only fact: a group not back by the end
of the step that fetched it never arrives. :class:`GDROAsyncMixin` puts it on verl's ``colocate_async`` and
``separate_async`` trainers (``gdro_colocate_async``, ``gdro_separate_async``) and adds the actor update's
optimizer-step count (``_get_required_batch_multiple``, ``_update_actor``). The mixin overrides ``__init__``,
verl's ``trainer_mode`` (a property: verl's mode, while the config holds the registry key) and 13 of verl's
methods: the 3 public hooks ``on_init_end``, ``on_validate_begin``, ``on_train_begin`` and 10 private methods no
public hook replaces:

``_init_dataloader``
    after verl builds the datasets, validates the training prompts' ``extra_info.index`` (unique
    integers) and builds the :class:`verl_ext.GDROController` with ``num_prompts = max id + 1``.
``_build_replay_buffer``
    on an asynchronous loop, every group verl's replay buffer evicts (stale, failed) is handed over before
    TransferQueue forgets it (:func:`~recipe.gdro.trainer_step.observe_evictions`): it leaves the schedule, its
    size checked, and is observed once with the next trained batch (:meth:`GDROTrainerMixin._gdro_on_evict`).
``_next_train_batch``
    after verl fetches prompts (and gives each a fresh ``uid``), asks the controller for each prompt's
    rollout count, writes it to the per-prompt ``__rollout_n__`` field that verl's ``AgentLoopWorkerTQ``
    reads, and records ``uid -> (prompt id, count, fetch step, visit)`` in a :class:`GroupSchedule` that lives
    until the group is trained or evicted (or, on sync, lost: :meth:`GDROTrainerMixin._gdro_lost_groups`). Each
    dispatch (a step's batch, verl's warm-up window or refill) has Σ n = k · n̄ exactly, so on sync
    ``_balance_batch`` adds no padding. A prompt fetched twice in one step (verl restarts the
    dataloader at an epoch boundary inside the step when ``data.gen_batch_size`` < ``train_batch_size``) is
    two visits: two uids, each scheduled, weighted and recorded.
``_compute_advantage``
    builds the step's :class:`GDROStep` (one TransferQueue get of ``extra_fields`` for each response's ``acc``;
    each group's realised size checked against its count), then runs verl's advantage stage with the step's
    hook inside it (:func:`inside_verl_advantage`): it reads each row's score and each response's token count
    from the local batch (``gdro/per_prompt/*``, ``gdro/tokens/*``, the length state, ``rollout.budget=tokens``,
    Prompt-GDRO's token-weighted mass); with an adversary on, a group of one response gets advantage 0; with
    Prompt-GDRO on, the controller observes the step (with |A| per response) and each response's advantage is
    multiplied by its weight before verl's single TransferQueue put: the recipe adds no write. Otherwise the
    controller observes after verl's stage. Padding rows (``is_padding``) are skipped.
``_save_checkpoint`` / ``_load_checkpoint``
    the complete controller state and the groups in flight are saved atomically as ``global_step_N/gdro_state.pkl``
    next to verl's own checkpoint and restored by verl's resume (:mod:`recipe.gdro.gdro_state`). After each save, verl's
    ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` are applied to the ``global_step_K``
    folders this process saved; the folder it resumed from and every other folder on disk are never deleted,
    and a failed delete is logged, never raised (:mod:`recipe.gdro.checkpoints`). On a resume, verl's file log
    keeps its lines up to the resume step (read at load, written back at the first ``on_validate_begin`` /
    ``on_train_begin``: verl's ``FileLogger`` truncates its file on open).
``_compute_metrics`` / ``_dump_generations``
    the step's ``gdro/*`` metrics (also logged through verl's Tracking) as one JSON line in
    ``<trainer.default_local_dir>/<gdro.metrics_file>``; verl's rollout dump gains ``gdro_multiplier``.
``on_init_end``
    bounds each weight sync by ``GDRO_WEIGHT_SYNC_TIMEOUT`` seconds (:mod:`recipe.gdro.weight_sync`).
``_validate`` / ``_val_metrics_update``
    at each validation, verl's ``val-core`` / ``val-aux`` metrics (plus, per data source, the prompt count
    and the exact pass@k) go to the same file as a ``{"val_step": N, ...}`` line (the paper's Table 1).

With both adversaries disabled the advantages and rollout counts are verl's, untouched. By default
(``gdro.observe=true``) the binner still observes every step and the ``gdro/*`` metrics, JSONL file
and checkpointed state are written, so a GRPO baseline is comparable with the GDRO runs bin by bin;
when GDRO does not run (:attr:`GDROTrainerMixin.gdro_runs` false) every override returns verl's result untouched.
"""

from __future__ import annotations

import logging
import math
import os
import time

import numpy as np
import transfer_queue as tq
import verl.trainer.ppo.v1.trainer_base as verl_trainer_base
from omegaconf import DictConfig
from tensordict import NonTensorData, NonTensorStack, TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from recipe.gdro import gdro_state
from recipe.gdro.checkpoints import GDRO_STATE_FILE, enforce_retention, keep_limits, report_full_disk, step_folder_name
from recipe.gdro.results.metrics_io import append_metrics_jsonl, append_validation_jsonl, validation_pass_at_k
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
from recipe.gdro.startup.resume import save_gdro_state
from recipe.gdro.trainer_step import (
    ROLLOUT_N_FIELD,
    GDROStep,
    GroupSchedule,
    PinnedExtraInfo,
    StepPlan,
    inside_verl_advantage,
    observe_evictions,
    rows_per_update,
)
from recipe.gdro.weight_sync import bounded_weight_sync, weight_sync_timeout
from verl_ext import GDROController, check_prompt_ids

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


class GDROTrainerMixin:
    """The GDRO controller on a verl v1 ``PPOTrainer`` (see the module docstring); relies on no sync-only fact."""

    verl_mode = SUPPORTED_TRAINER_MODE  # the verl mode whose loop the trainer runs (its registry key is verl's)

    @property
    def trainer_mode(self) -> str:
        """verl's mode whose loop this trainer runs (:attr:`verl_mode`). verl's base class branches on
        ``self.trainer_mode == "sync"`` (replay buffer, refill, checkpoint, re-issue) and reads
        ``trainer.v1.<mode>``; the config's ``trainer.v1.trainer_mode`` holds the recipe's registry key instead."""
        return self.verl_mode

    @trainer_mode.setter
    def trainer_mode(self, key: str) -> None:
        self.trainer_key = key  # PPOTrainer.__init__ assigns trainer.v1.trainer_mode, the registry key

    def __init__(self, config: DictConfig):
        """The GDRO config comes from ``config._gdro_checked``: what the launch (``main_gdro``) checked once
        before Ray (:func:`~recipe.gdro.startup.checks.hand_over`, as plain data, because ``run_ppo`` hands the
        Ray TaskRunner nothing but ``config``; :func:`~recipe.gdro.startup.checks.handed_over` converts it back
        with ``gdro_config_from_dict``, which re-runs only ``GDROConfig``'s own field checks on the launch's
        output; none of ``prepare``'s checks runs here). Built outside a launch (tests, preflight), without that
        key, the trainer builds and checks the ``gdro`` section itself."""
        super().__init__(config)
        self.gdro_checked: Checked = handed_over(config) or self._check_here(config)
        self.gdro: GDROController | None = None
        self._gdro_schedule = GroupSchedule()  # every group fetched and not yet observed, across steps
        self._gdro_step: GDROStep | None = None  # the last advantage stage's
        self._gdro_saved_steps: list[int] = []  # the global_step_K folders this process saved (retention)
        self._gdro_val_extra: dict[str, float] = {}  # the current validation's per-source pass@k, prompts
        self._verl_file_log_kept = b""  # verl's file-log lines up to the resume step (gdro_state)

    @staticmethod
    def _check_here(config: DictConfig) -> Checked:
        gdro = build_gdro_config(config)
        check_supported_modes(config, gdro)
        check_budget(config, gdro)
        recipe = build_recipe_config(config)
        return Checked(gdro, recipe.metrics_file, gdro_runs(config, gdro), restart_controller=recipe.restart_controller)

    @property
    def gdro_config(self):
        return self.gdro_checked.gdro

    @property
    def gdro_runs(self) -> bool:
        """The one "GDRO runs" predicate: the controller runs (an adversary on, or observe-only), as the
        launch's :func:`recipe.gdro.startup.checks.gdro_runs` decided it."""
        return self.gdro_checked.runs

    def gdro_metrics_path(self) -> str | None:
        name = self.gdro_checked.metrics_file  # a recipe key (startup/recipe_config.py)
        return os.path.join(self.config.trainer.default_local_dir, name) if name else None

    # ------------------------------------------------------------------ verl's public hooks
    def on_init_end(self):
        """After ``_setup``: bound every weight sync, then the base trainer's own hook (its first sync)."""
        bounded_weight_sync(self.checkpoint_manager, weight_sync_timeout())
        super().on_init_end()

    def on_validate_begin(self):
        """The first one runs right after ``fit`` opens verl's file logger."""
        self._restore_verl_file_log()
        super().on_validate_begin()

    def on_train_begin(self):
        """After ``fit`` opens its loggers (and the initial validation)."""
        self._restore_verl_file_log()
        super().on_train_begin()

    def _restore_verl_file_log(self) -> None:
        kept, self._verl_file_log_kept = self._verl_file_log_kept, b""
        gdro_state.restore_verl_file_log(getattr(self, "logger", None), kept, self.global_steps)

    # ------------------------------------------------------------------ the controller
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

    def _init_dataloader(self):
        """No public verl hook sees the datasets before training: this override builds the controller."""
        super()._init_dataloader()
        if not self.gdro_runs:
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
        if not self.gdro_runs:
            return batch
        start = time.perf_counter()
        pids = check_prompt_ids(
            [int(i) if i is not None else None for i in list(batch["index"])],
            num_prompts=self.gdro.binner.num_prompts,
            what="training batch extra_info.index",
            check_unique=False,  # a prompt twice in a step is two visits (dataset ids were checked unique)
        )
        counts = self.gdro.schedule(pids)
        if self.gdro_config.rollout.enable:
            batch[ROLLOUT_N_FIELD] = NonTensorStack.from_list([NonTensorData(int(c)) for c in counts])
        uids = [str(u) for u in list(batch["uid"])]
        self._gdro_schedule.add(uids, pids, counts, int(self.global_steps), self.gdro_config.rollout.n_mean)
        self._gdro_schedule.seconds += time.perf_counter() - start
        return batch

    def _build_replay_buffer(self):
        """verl's replay buffer; on an asynchronous loop, with every group it evicts handed to
        :meth:`_gdro_on_evict` first (sync evicts only groups with no trajectory, lost at the step's end)."""
        buffer = super()._build_replay_buffer()
        return buffer if self.verl_mode == SUPPORTED_TRAINER_MODE else observe_evictions(buffer, self._gdro_on_evict)

    def _gdro_on_evict(self, uids: set, keys: list, tags: list) -> None:
        """verl's replay buffer evicts ``uids`` (stale, failed; trajectories ``keys``): each group leaves the schedule
        here, its realised size checked, and its outcomes are observed with the next trained batch (|A| = 0, no
        multiplier: evidence of the prompt's difficulty, no gradient). A group with no trajectory is lost."""
        if not self.gdro_runs:
            return
        start = time.perf_counter()
        read = self._read_extra_fields("train")
        self._gdro_schedule.evict(uids, keys, tags, read, self.gdro_config.rollout.n_mean)
        self._gdro_schedule.seconds += time.perf_counter() - start

    @staticmethod
    def _read_extra_fields(partition_id: str):
        def read(keys: list[str]) -> list:
            data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["extra_fields"])
            return list(data["extra_fields"])

        return read

    def _gdro_lost_groups(self) -> list:
        """Scheduled groups that will not arrive any more, besides the evicted ones: none (every group leaves the
        schedule trained or evicted, so an in-flight group is never dropped). The sync trainer overrides it."""
        return []

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's advantage stage with the GDRO controller fed, and Prompt-GDRO's weights applied in it (no
        public verl hook runs inside the advantage stage): see the module docstring."""
        if not self.gdro_runs:
            return super()._compute_advantage(batch, metrics)
        start, config = time.perf_counter(), self.gdro_config
        read = self._read_extra_fields(batch.partition_id)
        plan = StepPlan.build(batch.keys, batch.tags, self._gdro_schedule, read, config.rollout.n_mean)
        adjust = config.prompt.enable or (config.enabled and bool(plan.session_singleton.any()))
        evicted, lost = self._gdro_schedule.take_evicted()
        lost = [*lost, *self._gdro_lost_groups()]
        step = GDROStep(
            plan, adjust, zero_singletons=config.enabled, lost=lost, evicted=evicted, train_step=int(self.global_steps)
        )
        step.seconds += time.perf_counter() - start
        with inside_verl_advantage(step.in_advantage_stage(self.gdro, config.prompt.enable)) as ran:
            batch = super()._compute_advantage(batch, metrics)
        if not ran[0] and (adjust or config.rollout.budget == "tokens"):
            raise RuntimeError(
                "GDRO: verl's _compute_advantage did not call compute_advantage_for_multi_trajectories, so "
                + (
                    "Prompt-GDRO's weights were not applied (an unsupported verl version or advantage estimator)"
                    if adjust
                    else "the response lengths gdro.rollout.budget=tokens needs were not read (an unsupported verl "
                    "version)"
                )
            )
        if step.multipliers is None:
            start = time.perf_counter()
            step.observe(self.gdro, None)
            step.seconds += time.perf_counter() - start
        self._gdro_step = step
        metrics.update(step.finish(self.gdro, *self._gdro_schedule.take_fetch_side()))
        inflight, bound = len(self._gdro_schedule.groups), self._gdro_inflight_bound()
        if bound is not None and inflight > bound:
            raise RuntimeError(
                f"GDRO: {inflight} dispatched groups were neither trained nor evicted (verl keeps at most {bound} in "
                "flight): a path removed groups from TransferQueue without verl's replay buffer"
            )
        metrics["gdro/recipe/inflight_groups"] = step.metrics["gdro/recipe/inflight_groups"] = float(inflight)
        return batch

    def _gdro_inflight_bound(self) -> int | None:
        return None

    def _dump_generations(self, inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path):
        """verl's rollout dump (``trainer.rollout_data_dir``) gains ``gdro_multiplier``: the factor GDRO applied
        to each response's GRPO advantage this step (Prompt-GDRO's weight, 0 for a singleton group; paper,
        Eq. 6). verl names each line by its batch key (``uid``); a validation dump (other keys) is left as is."""
        keys = reward_extra_infos_dict.get("uid") if reward_extra_infos_dict else None
        multiplier = self._gdro_step.row_multiplier_of_key() if self._gdro_step is not None else {}
        if keys and multiplier and all(k in multiplier for k in keys):
            reward_extra_infos_dict = {**reward_extra_infos_dict, "gdro_multiplier": [multiplier[k] for k in keys]}
        super()._dump_generations(inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path)

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        """No public verl hook receives the step's metrics (``on_step_end`` runs before they are computed)."""
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        step_metrics = self._gdro_step.take_metrics() if self.gdro_runs and self._gdro_step is not None else {}
        path = self.gdro_metrics_path() if step_metrics else None
        if path:
            append_metrics_jsonl(path, global_steps, step_metrics)

    # ------------------------------------------------------------------ validation
    def _val_metrics_update(
        self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns, expected_acc_counts=None
    ) -> dict[str, float]:
        """No public verl hook receives validation's per-sample records (``on_validate_end`` gets nothing)."""
        metrics = super()._val_metrics_update(
            data_sources, sample_uids, reward_extra_infos_dict, sample_turns, expected_acc_counts=expected_acc_counts
        )
        if self.gdro_runs:
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
        path = self.gdro_metrics_path() if self.gdro_runs else None
        if path and val_metrics:
            record = {k: v for k, v in val_metrics.items() if isinstance(v, (int, float, np.number))}
            record.update(self._gdro_val_extra)
            append_validation_jsonl(path, self.global_steps, record)
        self._gdro_val_extra = {}
        return val_metrics

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_root(self) -> str:
        """``trainer.default_local_dir`` as verl resolves it (also read by ``checkpoints.report_full_disk``)."""
        return gdro_state.checkpoint_root(self.config.trainer)

    @report_full_disk
    def _save_checkpoint(self):
        step, saved = self.global_steps, self._gdro_saved_steps
        folder = os.path.join(self._checkpoint_root(), step_folder_name(step))
        if step not in saved and os.path.isdir(folder) and os.listdir(folder):
            # Not deleted by retention, but verl's save writes into it: say so before its files change.
            logger.warning(
                "GDRO: saving step %d into %s, which holds files from before this run: verl overwrites the ones "
                "it writes",
                step,
                folder,
            )
        # The GDRO state goes first: verl writes latest_checkpointed_iteration.txt last, so a
        # checkpoint that resume can find always has its gdro_state.pkl.
        if self.gdro_runs:
            path = os.path.join(self.config.trainer.default_local_dir, step_folder_name(step), GDRO_STATE_FILE)
            if self._gdro_schedule.evicted or self._gdro_schedule.evicted_lost:
                logger.warning("GDRO: groups evicted since the last trained batch are not in the saved state")
            save_gdro_state(self.gdro, path, self._dataset_facts(), self._gdro_schedule.state_dict())
            logger.info("GDRO state saved to %s", path)
        super()._save_checkpoint()
        # From here the save is good: it is this process's (retention may delete it once the limit
        # passes it), and nothing below may fail the run.
        self._gdro_saved_steps = [*saved, step]
        keep_actor, keep_critic = keep_limits(self.config.trainer)
        if keep_actor is None and keep_critic is None:
            return
        try:
            root = self._checkpoint_root()
            enforce_retention(root, keep_actor, keep_critic, own_saves=self._gdro_saved_steps)
        except OSError as e:
            logger.warning("GDRO: checkpoint retention stopped (%s: %s); the save is complete", type(e).__name__, e)

    def _dataset_facts(self) -> dict | None:
        """The training prompts' fingerprint saved with the GDRO state: the launch's (handed over), else read
        from the training files once (a trainer built outside a launch); None when they cannot be read here."""
        if self.gdro_checked.dataset is None:
            try:
                self.gdro_checked.dataset = check_train_prompt_ids(self.config).dataset or {}
            except (GDRORecipeError, ValueError) as e:
                logger.warning("GDRO: the training prompts' fingerprint is not saved with the state (%s)", e)
                self.gdro_checked.dataset = {}
        return self.gdro_checked.dataset or None

    def _load_checkpoint(self):
        super()._load_checkpoint()
        # This process owns only what it saves from here on: the folder it resumed from and every other
        # folder on disk belong to earlier processes (or branches) and are never deleted.
        self._gdro_saved_steps = []
        step = self.global_steps
        gdro_state.log_kept_checkpoints(self._checkpoint_root(), step)
        if step > 0:
            self._verl_file_log_kept = gdro_state.verl_file_log_lines(self.config.trainer, step)
        if not self.gdro_runs:
            return
        if step == 0:
            gdro_state.move_aside_metrics_file(self.gdro_metrics_path())
            return
        restart = self.gdro_checked.restart_controller
        gdro_state.restore_controller(
            self.gdro, self.gdro_config, self.config.trainer, step, restart, self._gdro_schedule
        )
        gdro_state.rewind_metrics(self.gdro_metrics_path(), step)


class GDROTrainerSync(GDROTrainerMixin, PPOTrainerSync):
    """:class:`GDROTrainerMixin` on verl's synchronous v1 trainer, registered in verl's trainer registry as
    ``gdro_sync`` (the recipe's default ``trainer.v1.trainer_mode``) when this module is imported; the Ray
    TaskRunner's module (recipe.gdro.task_runner) imports it, so every process that looks the key up has it."""

    def _gdro_lost_groups(self) -> list:
        """Sync: every group is trained in the step that fetched it, so a group of this step (or an earlier one)
        not in this step's batch never arrives (its sessions all failed)."""
        return self._gdro_schedule.drop(int(self.global_steps))


class GDROAsyncMixin(GDROTrainerMixin):
    """:class:`GDROTrainerMixin` on one of verl's asynchronous trainers (``colocate_async``, ``separate_async``):
    a trained batch is ``train_batch_size`` groups that finished, dispatched at earlier steps, so its rows are not
    B·n̄. Each dispatch still schedules Σn = k·n̄ (:meth:`GroupSchedule.add` refuses any other), and each actor
    update keeps uniform GRPO's number of optimizer steps, K = ``train_batch_size / ppo_mini_batch_size`` per
    epoch, each over 1/K of the batch's rows, whatever they are (verl cuts ``ppo_mini_batch_size · rollout.n``
    rows a mini-batch, so its count would follow the rows). Padding: verl's ``_balance_batch`` pads the rows to a
    multiple of dp · K (· the micro-batch size without dynamic batching) instead of lcm(dp,
    ``ppo_mini_batch_size · rollout.n``); ``gdro/recipe/padding_rows`` logs it. The groups in flight are bounded by
    what verl keeps in flight (the warm-up window and a step's dispatch); a larger schedule is a bookkeeping error
    and stops the run."""

    def _gdro_optimizer_steps(self) -> int:
        """K: the actor updates of a step per epoch, as uniform GRPO's (``train_batch_size / ppo_mini_batch_size``)."""
        return int(self.config.data.train_batch_size) // int(self.config.actor_rollout_ref.actor.ppo_mini_batch_size)

    def _get_required_batch_multiple(self, dp_size: int) -> int:
        """dp · K, times the micro-batches verl's own batch would fill whole on each rank: the actor's micro-batch
        (of GRPO's ``ppo_mini_batch_size · n̄ / dp`` rows) in each of the K mini-batches, the log-prob passes' (of
        its ``train_batch_size · n̄ / dp``); without dynamic batching only, as verl's engine cuts by them."""
        if not self.gdro_runs or self.use_critic:
            return super()._get_required_batch_multiple(dp_size)
        ref, n = self.config.actor_rollout_ref, int(self.config.actor_rollout_ref.rollout.n)
        grpo_mini = int(ref.actor.ppo_mini_batch_size) * n // dp_size
        grpo_batch = int(self.config.data.train_batch_size) * n // dp_size
        per_rank = self._gdro_optimizer_steps()
        if not ref.actor.use_dynamic_bsz:
            per_rank *= math.gcd(int(ref.actor.ppo_micro_batch_size_per_gpu), grpo_mini)
        for section in (ref.rollout, ref.ref):
            micro = section.get("log_prob_micro_batch_size_per_gpu")
            if micro and not section.get("log_prob_use_dynamic_bsz", False):
                per_rank = math.lcm(per_rank, math.gcd(int(micro), grpo_batch))
        return dp_size * per_rank

    def _update_actor(self, batch, metrics: dict):
        """verl's actor update with the rows of each of the K mini-batches set to 1/K of the batch (the one
        :class:`~recipe.gdro.trainer_step.PinnedExtraInfo` seam; verl builds and sends everything else)."""
        if not self.gdro_runs:
            return super()._update_actor(batch, metrics)
        steps = self._gdro_optimizer_steps()
        rows = rows_per_update(len(batch), steps)
        batch.extra_info = PinnedExtraInfo(batch.extra_info, {"mini_batch_size": rows, "global_batch_size": rows})
        try:
            batch = super()._update_actor(batch, metrics)
        finally:
            batch.extra_info = dict(batch.extra_info)
        done = {
            "gdro/recipe/optimizer_steps": float(steps * int(self.config.actor_rollout_ref.actor.ppo_epochs)),
            "gdro/recipe/rows_per_optimizer_step": float(rows),
        }
        metrics.update(done)
        if self._gdro_step is not None:
            self._gdro_step.metrics.update(done)
        return batch

    def _gdro_inflight_bound(self) -> int | None:
        """What verl keeps in flight after a trained batch left: the warm-up window and one step's dispatch."""
        B = int(self.config.data.train_batch_size)
        warmup = float(self.config.trainer.v1.get(self.trainer_mode, {}).get("num_warmup_batches", 0) or 0)
        return (math.ceil(warmup) + 2) * B


class GDROTrainerColocateAsync(GDROAsyncMixin, PPOTrainerColocateAsync):
    """:class:`GDROAsyncMixin` on verl's ``colocate_async`` trainer (``gdro_colocate_async``)."""

    verl_mode = "colocate_async"


class GDROTrainerSeparateAsync(GDROAsyncMixin, PPOTrainerSeparateAsync):
    """:class:`GDROAsyncMixin` on verl's ``separate_async`` trainer (``gdro_separate_async``)."""

    verl_mode = "separate_async"


# verl's registry (verl.trainer.ppo.v1.register_trainer): the recipe's trainers under their own keys (verl's own
# "sync", "colocate_async", "separate_async" are verl's). Guarded: importing this module again keeps the first.
for _key, _cls in (
    (GDRO_TRAINER_MODE, GDROTrainerSync),
    ("gdro_colocate_async", GDROTrainerColocateAsync),
    ("gdro_separate_async", GDROTrainerSeparateAsync),
):
    if _key not in verl_trainer_base.TRAINER_REGISTRY:
        verl_trainer_base.register_trainer(_key)(_cls)
