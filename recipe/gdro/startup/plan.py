"""The dry run's one-screen plan: what a launch will do, from the composed config and the start-up
checks' results (:class:`recipe.gdro.startup.checks.Prepared`), and the resolved verl keys."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from recipe.gdro.startup.checks import GDRO_TRAINER_MODES, Prepared, base_trainer_mode, gdro_runs, observes_only
from verl_ext import gdro_config_to_dict
from verl_ext.config import _plain

# Resolved verl keys the dry run prints (one "key: value" line each, greppable by launch-script tests).
RESOLVED_KEYS = (
    "actor_rollout_ref.model.path",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.device",
    "trainer.use_v1",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.v1.trainer_mode",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.default_local_dir",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.logger",
    "data.train_files",
    "data.val_files",
    "data.train_batch_size",
    "data.gen_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.shuffle",
    "data.seed",
    "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_ctrl.kl_coef",
    "algorithm.filter_groups.enable",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.val_kwargs.do_sample",
    "actor_rollout_ref.rollout.val_kwargs.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p",
    "actor_rollout_ref.rollout.val_kwargs.top_k",
    "reward.reward_manager.name",
    "reward.custom_reward_function.path",
    "reward.custom_reward_function.name",
    "actor_rollout_ref.model.override_config.attn_implementation",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units",
    "ray_kwargs.ray_init.runtime_env.py_modules",
    "gdro.prompt.enable",
    "gdro.rollout.enable",
)


def _select(config: DictConfig, key: str) -> Any:
    try:
        value = OmegaConf.select(config, key, throw_on_missing=True, default="<absent>")
    except MissingMandatoryValue:
        return "???"
    except Exception as e:  # noqa: BLE001 - an interpolation that does not resolve
        return f"<unresolved: {e}>"
    if isinstance(value, DictConfig) or OmegaConf.is_list(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def resolved_keys_yaml(config: DictConfig, keys: Sequence[str] = RESOLVED_KEYS) -> str:
    """``key: value`` lines (YAML) for the given dotted keys, resolved."""
    lines = []
    for key in keys:
        flow = yaml.safe_dump([_select(config, key)], default_flow_style=True, width=10_000).strip()
        lines.append(f"{key}: {flow[1:-1]}")  # strip the enclosing [ ] of the one-element list
    return "\n".join(lines)


def format_plan(config: DictConfig, prepared: Prepared, state_file: str) -> str:
    """The one-screen plan a dry run prints (followed by the resolved keys and the gdro section)."""
    g, b = prepared.gdro, prepared.budget
    model = _select(config, "actor_rollout_ref.model.path")
    mode = _select(config, "trainer.v1.trainer_mode")
    if base_trainer_mode(mode) in GDRO_TRAINER_MODES:
        name = "".join(w.title() for w in GDRO_TRAINER_MODES[base_trainer_mode(mode)].split("_"))
        trainer_cls = f"recipe.gdro.trainer.GDROTrainer{name} (trainer.v1.trainer_mode={mode})"
    else:
        trainer_cls = f"verl's {mode} trainer (GDRO off)"
    steps = _select(config, "trainer.total_training_steps")
    epochs = _select(config, "trainer.total_epochs")
    rc = prepared.recipe
    title = "dry run (no Ray, no GPU, model not loaded)" if rc.is_dry_run else "start-up checks passed"
    if rc.is_dry_run and prepared.files is not None and prepared.files.notes:
        title = "dry run, configuration only (no Ray, no GPU, model not loaded; data not required)"
    out = ["=" * 78, f"GDRO recipe - {title}", "=" * 78]
    out.append(f"model        {model}")
    out.append(
        f"hardware     {b.n_gpus} GPU(s) = {_select(config, 'trainer.nnodes')} node(s) x "
        f"{_select(config, 'trainer.n_gpus_per_node')}; actor data-parallel size {b.dp_size}; "
        f"rollout engine {_select(config, 'actor_rollout_ref.rollout.name')} "
        f"(TP {_select(config, 'actor_rollout_ref.rollout.tensor_model_parallel_size')})"
    )
    out.append(
        f"trainer      {trainer_cls}; total_training_steps={steps}, total_epochs={epochs} (whichever ends first)"
    )
    out.append(
        f"batch        {b.train_batch_size} prompts/step x n̄={b.n_mean} -> {b.rows_per_step} responses/step "
        f"(exactly; Rollout-GDRO only redistributes them)"
    )
    out.append(
        f"actor        PPO mini-batch {b.mini_batch_prompts} prompts = {b.mini_batch_rows} rows -> "
        f"{b.updates_per_step} update(s)/step; padding rows/step: {b.padding_rows}; "
        f"lr {_select(config, 'actor_rollout_ref.actor.optim.lr')}, "
        f"clip [{_select(config, 'actor_rollout_ref.actor.clip_ratio_low')}, "
        f"{_select(config, 'actor_rollout_ref.actor.clip_ratio_high')}], "
        f"kl_loss {_select(config, 'actor_rollout_ref.actor.use_kl_loss')} "
        f"(coef {_select(config, 'actor_rollout_ref.actor.kl_loss_coef')})"
    )
    if g.rollout.enable:
        out.append(
            f"Rollout-GDRO ON   allocator={g.rollout.allocator}, n(x) in [{g.rollout.n_min}, {g.rollout.n_max}] per "
            f"prompt, sum = {b.rows_per_step} every step, mu_lr={g.rollout.mu_lr}"
        )
    else:
        out.append(f"Rollout-GDRO off  every prompt gets rollout.n = {b.n_mean} rollouts")
    if g.prompt.enable:
        out.append(
            f"Prompt-GDRO  ON   loss_signal={g.prompt.loss_signal}, eta={g.prompt.eta}, gamma={g.prompt.gamma}, "
            f"beta={g.prompt.beta}, weight_cap={g.prompt.weight_cap}, rollout_coupling={g.prompt.rollout_coupling}"
        )
    else:
        out.append("Prompt-GDRO  off  GRPO advantages are not reweighted")
    edges = g.binner.bin_edges if g.binner.bin_edges is not None else f"{g.binner.num_bins} equal-width bins"
    out.append(
        f"binner       {edges}, window {g.binner.window}, hysteresis {g.binner.hysteresis}, unseen={g.binner.unseen}"
        + (
            ""
            if g.enabled
            else "  (observe-only: metrics logged; advantages and rollout counts are verl's)"
            if observes_only(config, g)
            else "  (unused: GDRO disabled -> plain verl GRPO)"
        )
    )
    if prepared.data is not None:
        d = prepared.data
        if d.checked:
            out.append(
                f"data         {d.num_rows} training prompts, extra_info.index unique, ids < {d.num_prompts} "
                f"({', '.join(d.checked)})"
            )
        listed = {p for _, p in prepared.files.missing} if prepared.files is not None else set()
        for path in d.not_checked:
            if path not in listed:
                out.append(f"data         NOT CHECKED (not found locally / remote): {path}; checked again at start-up")
    if prepared.files is not None:
        f = prepared.files
        out.append(
            f"data files   {f.train_rows} training prompts in {len(f.train_found)} file(s); "
            f"{len(f.val_found)} validation file(s) found"
            + (f"; remote, not read: {', '.join(f.remote)}" if f.remote else "")
        )
        for note in f.notes:
            out.append(f"data note    {note}")
    if prepared.reward is not None:
        r = prepared.reward
        probed = "; ".join(f"{src}: {keys}" for src, keys in r.results.items()) or "not probed"
        out.append(f"reward       manager {r.manager}, {r.function}; acc probe: {probed}")
        for note in r.notes:
            out.append(f"             note: {note}")
    for note in b.notes:
        out.append(f"note         {note}")
    local_dir = _select(config, "trainer.default_local_dir")
    out.append(
        f"run          {_select(config, 'trainer.project_name')}/{_select(config, 'trainer.experiment_name')}; "
        f"logger {_select(config, 'trainer.logger')}"
    )
    if gdro_runs(config, g):
        metrics_file = f"{local_dir}/{rc.metrics_file}" if rc.metrics_file else "(disabled: gdro.metrics_file='')"
        out.append(f"checkpoints  {local_dir}/global_step_N/{state_file} with verl's checkpoint")
        out.append(f"metrics      gdro/* via verl's logger; JSONL {metrics_file}")
    else:
        out.append(f"checkpoints  {local_dir}/global_step_N (verl's)")
    out.append(f"verl checks  {', '.join(prepared.verl_checks) or 'skipped'}: passed")
    return "\n".join(out)


def print_dry_run(
    config: DictConfig, prepared: Prepared, state_file: str, stream=None, cluster_lines: Sequence[str] = ()
) -> None:
    stream = stream or sys.stdout
    print(format_plan(config, prepared, state_file), file=stream)
    for line in cluster_lines:
        print(line, file=stream)
    print("-" * 78, file=stream)
    print("resolved config (relevant keys):", file=stream)
    print(resolved_keys_yaml(config), file=stream)
    print("-" * 78, file=stream)
    print("resolved gdro section:", file=stream)
    recipe = {k: _plain(v) for k, v in dataclasses.asdict(prepared.recipe).items()}
    recipe["dry_run"] = {"true": True, "false": False}.get(recipe["dry_run"], recipe["dry_run"])
    section = yaml.safe_dump(
        {"gdro": {**gdro_config_to_dict(prepared.gdro), **recipe}}, sort_keys=False, default_flow_style=False
    )
    print(section, file=stream, end="")
    print("=" * 78, file=stream)
    print("dry run OK: configuration valid; exiting without starting Ray.", file=stream)
