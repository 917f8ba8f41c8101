"""Start-up checks of the GDRO recipe: everything that can be refused before Ray or a GPU starts.

Each check raises :class:`GDRORecipeError` (or verl_ext's :class:`GDROConfigError` /
:class:`PromptIdError`) with a message naming the config key or data row at fault. The module
imports only omegaconf, numpy, pyarrow and verl_ext at import time; verl itself is imported inside
:func:`validate_verl_config` and :func:`probe_reward_acc` only.

The checks, in the order :func:`prepare` runs them:

0. verl keys users set, by type and range (:data:`VERL_KEYS`, :func:`check_verl_keys`: lr, steps,
   batch sizes, memory fraction, booleans, the run's names, ``trainer.logger``); verl keys that have
   no usable default, all named at once (:func:`check_required_keys`), and the GPU layout: rollout
   tensor parallelism against GPUs per node, token budgets against the longest sequence
   (:func:`check_layout`);
1. the ``gdro`` section -> :class:`verl_ext.GDROConfig` (unknown keys, wrong types, impossible
   values) and ``gdro.rollout.n_mean == actor_rollout_ref.rollout.n``; its recipe keys ->
   :class:`recipe.gdro.startup.recipe_config.RecipeConfig`; output paths that cannot be created
   (:func:`check_output_paths`); the resume point (:func:`check_resume_point`); on a real launch a
   local model folder and a Ray cluster for several nodes;
2. trainer modes the recipe cannot combine with GDRO are refused (:func:`check_supported_modes`);
3. with ``data_files``: the data files exist, are readable, have ``data.prompt_key`` and hold a
   batch (:func:`check_dry_run_data`); the rollout budget against batch / mini-batch / data-parallel
   sizes (:func:`check_budget`);
4. the training data's prompt ids: ``extra_info.index`` present, integer, unique, and small
   enough for the binner's arrays (:func:`check_train_prompt_ids`, :func:`check_id_range`);
5. the reward reports ``acc`` (:func:`probe_reward_acc`);
6. verl's own validation (``validate_config``, dataclass conversion of ``algorithm`` and
   ``actor_rollout_ref.rollout``, trainer class, advantage estimator, reward manager).
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from recipe.gdro.startup.environment import check_environment
from recipe.gdro.startup.errors import GDRORecipeError
from recipe.gdro.startup.recipe_config import RecipeConfig, recipe_config_from_dict, split_gdro_section
from verl_ext import (
    GDROConfig,
    GDROConfigError,
    PromptIdError,
    check_prompt_ids,
    gdro_config_from_dict,
    gdro_config_to_dict,
)
from verl_ext.atomic import blocking_file as _blocking_file
from verl_ext.config import LossSignal, Range

SUPPORTED_TRAINER_MODE = "sync"  # verl's loop the default GDRO trainer runs (PPOTrainerSync's; its key is "sync")
# verl's trainer registry (verl.trainer.ppo.v1.register_trainer): recipe.gdro.trainer registers the GDRO trainers
# under these keys, each running the loop of the verl mode it maps to; "gdro_sync" is the recipe's default
# trainer.v1.trainer_mode; the CPU backend registers "<key>_cpu" for the key it runs (recipe.gdro.lab.backends.cpu).
# Every other key is verl's own trainer.
GDRO_TRAINER_MODE = "gdro_sync"
GDRO_TRAINER_MODES = {
    GDRO_TRAINER_MODE: SUPPORTED_TRAINER_MODE,
    "gdro_colocate_async": "colocate_async",
    "gdro_separate_async": "separate_async",
}
CPU_MODE_SUFFIX = "_cpu"


def base_trainer_mode(mode) -> str:
    """The registry key without the CPU backend's suffix (``gdro_sync_cpu`` -> ``gdro_sync``)."""
    return str(mode).removesuffix(CPU_MODE_SUFFIX)


def is_gdro_trainer(config: DictConfig) -> bool:
    """``trainer.v1.trainer_mode`` selects one of the recipe's trainers (:data:`GDRO_TRAINER_MODES`, or a CPU
    variant)."""
    return base_trainer_mode(config.trainer.v1.trainer_mode) in GDRO_TRAINER_MODES


def verl_mode(config: DictConfig) -> str:
    """The verl mode whose loop ``trainer.v1.trainer_mode`` runs (``gdro_colocate_async`` -> ``colocate_async``)."""
    key = base_trainer_mode(config.trainer.v1.trainer_mode)
    return GDRO_TRAINER_MODES.get(key, key)


def verl_mode_section(config: DictConfig):
    """``trainer.v1.<mode>``, the section verl's base class reads for the mode its loop runs."""
    mode = verl_mode(config)
    return mode, config.trainer.v1.get(mode, None) or {}


def startup_warning(message: str) -> None:
    """One line on stderr for what the start-up checks let through but the user should know."""
    print(f"[gdro] warning: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- verl keys
@dataclass(frozen=True)
class VerlKey:
    """One verl key the recipe's users set (through the scripts or by hand), with its type and range.

    verl reads these as plain YAML and fails late (``int('lots')`` deep in the trainer) or never
    (a learning rate of -1e-6 trains backwards, a memory fraction of 2.0 is "fits"); the table
    refuses them before anything starts, naming the key.
    """

    key: str
    kind: type  # int, float or bool
    range: Range | None = None  # verl_ext's Range, the GDRO config's and the scenario's vocabulary
    nullable: bool = False
    also: tuple = ()  # other accepted values (e.g. -1 = never)

    def describe(self) -> str:
        want = {int: "an integer", float: "a number", bool: "true or false"}[self.kind]
        if self.range is not None:
            two_sided = self.range.lo is not None and self.range.hi is not None
            want += f" {'in ' if two_sided else ''}{self.range.text()}"
        extra = [repr(v) for v in self.also] + (["null"] if self.nullable else [])
        return want + (f" (or {' / '.join(extra)})" if extra else "")

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if value in self.also and not isinstance(value, bool):
            return True
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        return (self.range or Range()).violation(value) is None


_POS_INT = {"kind": int, "range": Range(lo=1, integer=True)}
VERL_KEYS: tuple[VerlKey, ...] = (
    VerlKey("data.train_batch_size", **_POS_INT),
    VerlKey("data.gen_batch_size", **_POS_INT, nullable=True),
    VerlKey("data.max_prompt_length", **_POS_INT),
    VerlKey("data.max_response_length", **_POS_INT),
    VerlKey("actor_rollout_ref.rollout.n", **_POS_INT),
    VerlKey("actor_rollout_ref.actor.optim.lr", float, Range(lo=0)),  # 0: a run that only evaluates or resaves
    VerlKey("actor_rollout_ref.actor.optim.weight_decay", float, Range(lo=0)),
    VerlKey("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", float, Range(0, 1)),
    VerlKey("actor_rollout_ref.actor.ppo_mini_batch_size", **_POS_INT),
    VerlKey("actor_rollout_ref.actor.ppo_epochs", **_POS_INT),
    VerlKey("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", **_POS_INT, nullable=True),
    VerlKey("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", **_POS_INT),
    VerlKey("actor_rollout_ref.actor.use_dynamic_bsz", bool),
    VerlKey("actor_rollout_ref.actor.use_kl_loss", bool),
    VerlKey("actor_rollout_ref.actor.kl_loss_coef", float, Range(lo=0)),
    VerlKey("actor_rollout_ref.actor.clip_ratio_low", float, Range(lo=0)),
    VerlKey("actor_rollout_ref.actor.clip_ratio_high", float, Range(lo=0)),
    VerlKey("actor_rollout_ref.actor.fsdp_config.param_offload", bool),
    VerlKey("actor_rollout_ref.actor.fsdp_config.optimizer_offload", bool),
    VerlKey("actor_rollout_ref.ref.fsdp_config.param_offload", bool),
    VerlKey("actor_rollout_ref.rollout.gpu_memory_utilization", float, Range(0, 1, lo_open=True)),
    VerlKey("actor_rollout_ref.rollout.tensor_model_parallel_size", **_POS_INT),
    VerlKey("actor_rollout_ref.rollout.temperature", float, Range(lo=0)),
    VerlKey("actor_rollout_ref.rollout.top_p", float, Range(0, 1, lo_open=True)),
    VerlKey("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", bool),
    VerlKey("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", **_POS_INT, nullable=True),
    VerlKey("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", **_POS_INT),
    VerlKey("actor_rollout_ref.rollout.val_kwargs.n", **_POS_INT),
    VerlKey("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", bool),
    VerlKey("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", **_POS_INT, nullable=True),
    VerlKey("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", **_POS_INT),
    VerlKey("trainer.nnodes", **_POS_INT),
    VerlKey("trainer.n_gpus_per_node", **_POS_INT),
    VerlKey("trainer.total_epochs", **_POS_INT),
    VerlKey("trainer.total_training_steps", **_POS_INT, nullable=True),
    VerlKey("trainer.save_freq", **_POS_INT, also=(-1, 0)),
    VerlKey("trainer.test_freq", **_POS_INT, also=(-1, 0)),
    VerlKey("trainer.max_actor_ckpt_to_keep", **_POS_INT, nullable=True),
    VerlKey("trainer.val_before_train", bool),
    VerlKey("transfer_queue.backend.SimpleStorage.num_data_storage_units", **_POS_INT),
)
NAME_KEYS = ("trainer.project_name", "trainer.experiment_name")
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")


def check_verl_keys(config: DictConfig, table: tuple[VerlKey, ...] = VERL_KEYS) -> None:
    """Refuse a wrongly typed or out-of-range value of a verl key users set (:data:`VERL_KEYS`), the
    run's names (letters, digits, ``._-``: they name its folder) and ``trainer.logger``, naming each.

    Runs first, so a bad value is blamed on the key the user set, not on a check downstream of it
    (``actor_rollout_ref.rollout.n=0`` is not reported as ``gdro.rollout.n_min > n_mean``).
    """
    bad = []
    for spec in table:
        try:
            value = OmegaConf.select(config, spec.key, default="<absent>", throw_on_missing=True)
        except Exception:  # noqa: BLE001 - ??? (check_required_keys names it) or a broken interpolation
            continue
        if isinstance(value, str) and value == "<absent>":
            continue
        if not spec.accepts(value):
            bad.append(f"{spec.key}={value!r} must be {spec.describe()}")
    for key in NAME_KEYS:
        value = OmegaConf.select(config, key, default=None)
        if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
            bad.append(f"{key}={value!r} may use letters, digits, '.', '_' and '-' only (it names the run's folder)")
    bad.extend(_logger_problems(config))
    if bad:
        raise GDRORecipeError("; ".join(bad))


def _logger_problems(config: DictConfig) -> list[str]:
    from verl.utils.tracking import Tracking

    value = OmegaConf.select(config, "trainer.logger", default=None)
    loggers = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    known = list(Tracking.supported_backend)
    if any(not isinstance(x, str) or x not in known for x in loggers):  # [] is verl's "no tracking"
        shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
        return [f"trainer.logger={shown!r} must be a list of {', '.join(known)} (e.g. trainer.logger=[console,wandb])"]
    return []


# --------------------------------------------------------------------------------------- required keys
def _unset(config: DictConfig, key: str) -> bool:
    return OmegaConf.select(config, key, default=None, throw_on_missing=False) is None


def _micro_batch_keys(config: DictConfig) -> list[tuple[str, str]]:
    """(section, dynamic-batch flag) of each micro-batched pass this config runs."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    with warnings.catch_warnings():  # need_critic warns that GRPO disables the critic, on every call
        warnings.simplefilter("ignore", UserWarning)
        critic = need_critic(config)
    out = [
        ("actor_rollout_ref.actor", "use_dynamic_bsz"),
        ("actor_rollout_ref.rollout", "log_prob_use_dynamic_bsz"),
    ]
    if need_reference_policy(config):
        out.append(("actor_rollout_ref.ref", "log_prob_use_dynamic_bsz"))
    if critic:
        out.append(("critic", "use_dynamic_bsz"))
    return out


def check_required_keys(config: DictConfig) -> None:
    """Name every verl key the run needs that is unset (``???`` or a null micro-batch size), at once.

    verl's own validation stops at the first (micro-batch sizes, then ``rollout.name``, ...), so a
    config written from scratch would fail one key per attempt. Sections the run does not use (the
    reward model's rollout when ``reward.reward_model.enable`` is false, the critic without GAE)
    are not asked for.
    """
    inactive = []
    if not OmegaConf.select(config, "reward.reward_model.enable", default=False):
        inactive.append("reward.reward_model.")
    if not any(section == "critic" for section, _ in _micro_batch_keys(config)):
        inactive.append("critic.")
    missing = [
        f"{key} (no default)"
        for key in sorted(OmegaConf.missing_keys(config))
        if not any(key.startswith(prefix) for prefix in inactive)
    ]
    for section, dynamic in _micro_batch_keys(config):
        if OmegaConf.select(config, f"{section}.{dynamic}", default=False):
            continue
        names = ("ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu")
        if section.endswith(("rollout", "ref")):
            names = ("log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu")
        if all(_unset(config, f"{section}.{name}") for name in names):
            missing.append(f"{section}.{names[1]} (needed while {section}.{dynamic}=false)")
    if missing:
        raise GDRORecipeError(
            f"{len(missing)} required key(s) not set: "
            + "; ".join(missing)
            + ". Set them, or start from the paper's settings: size=1.7b|4b|8b method=grpo|prompt_gdro|"
            "rollout_gdro|joint_gdro (recipe/gdro/config/size/, method/)"
        )


def check_layout(config: DictConfig) -> None:
    """Refuse a GPU layout that cannot run: rollout tensor parallelism that does not tile a node, or
    a per-GPU token budget (dynamic batch size) smaller than one prompt + response."""
    rollout = config.actor_rollout_ref.rollout
    tp = int(rollout.get("tensor_model_parallel_size", 1) or 1)
    gpus = int(config.trainer.n_gpus_per_node)
    if tp < 1 or gpus % tp:
        raise GDRORecipeError(
            f"trainer.n_gpus_per_node={gpus} is not divisible by the rollout tensor-parallel size "
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"
        )
    seq = int(config.data.max_prompt_length) + int(config.data.max_response_length)
    short = []
    for section, dynamic in _micro_batch_keys(config):
        if not OmegaConf.select(config, f"{section}.{dynamic}", default=False):
            continue
        trains = section.endswith(("actor", "critic"))
        name = "ppo_max_token_len_per_gpu" if trains else "log_prob_max_token_len_per_gpu"
        budget = OmegaConf.select(config, f"{section}.{name}", default=None)
        if budget is not None and int(budget) < seq:
            short.append(f"{section}.{name}={budget}")
    if short:
        raise GDRORecipeError(
            f"token budgets per GPU must hold one full sequence (data.max_prompt_length + "
            f"data.max_response_length = {seq} tokens): " + ", ".join(short)
        )


# --------------------------------------------------------------------------------------- gdro section
def build_gdro_config(config: DictConfig) -> GDROConfig:
    """The validated :class:`GDROConfig` of a composed recipe config.

    Raises :class:`GDROConfigError` for unknown keys / wrong types / impossible values, and
    :class:`GDRORecipeError` when ``gdro.rollout.n_mean`` differs from ``actor_rollout_ref.rollout.n``.
    """
    if "gdro" not in config:
        raise GDRORecipeError(
            "the config has no `gdro` section; launch with `python -m recipe.gdro.main_gdro` "
            "(config recipe/gdro/config/gdro_trainer.yaml), not verl's main_ppo"
        )
    section = OmegaConf.to_container(config.gdro, resolve=True)
    gdro = gdro_config_from_dict(split_gdro_section(section)[0])
    n = config.actor_rollout_ref.rollout.n
    if gdro.rollout.n_mean != n:
        raise GDRORecipeError(
            f"gdro.rollout.n_mean={gdro.rollout.n_mean} differs from actor_rollout_ref.rollout.n={n}: "
            "rollout.n is the mean rollout budget n̄ per prompt. Set actor_rollout_ref.rollout.n and leave "
            "gdro.rollout.n_mean at its default (${actor_rollout_ref.rollout.n})"
        )
    return gdro


def build_recipe_config(config: DictConfig) -> RecipeConfig:
    """The validated recipe keys of the ``gdro`` section (``dry_run``, ``metrics_file``, ``backend``)."""
    section = OmegaConf.to_container(config.gdro, resolve=True) if "gdro" in config else {}
    return recipe_config_from_dict(split_gdro_section(section)[1])


# --------------------------------------------------------------------------------------- output paths
def _nearest_existing(path: str) -> str:
    p = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def check_output_paths(config: DictConfig, recipe: RecipeConfig, *, launch: bool) -> list[str]:
    """Refuse output paths that cannot be created: ``trainer.default_local_dir`` (checkpoints) below a
    plain file, or ``gdro.metrics_file`` naming a directory or below a plain file. With ``launch``
    (a real launch, on the machine that trains) the nearest existing folder must also be writable;
    a dry run on another machine does not ask that. Remote (``scheme://``) folders are not checked.
    Returns the paths checked."""
    local_dir = OmegaConf.select(config, "trainer.default_local_dir", default=None)
    if not isinstance(local_dir, str) or not local_dir or "://" in local_dir:
        return []
    checked = [local_dir]
    blocker = _blocking_file(local_dir)
    if blocker is not None:
        raise GDRORecipeError(
            f"trainer.default_local_dir={local_dir}: {blocker} is a file, not a folder, so the checkpoint folder "
            "cannot be created there"
        )
    if recipe.metrics_file:
        target = os.path.join(os.path.expanduser(local_dir), recipe.metrics_file)
        checked.append(target)
        if os.path.isdir(target):
            raise GDRORecipeError(
                f"gdro.metrics_file={recipe.metrics_file!r}: {target} is a directory; name a file (or '' to disable)"
            )
        blocker = _blocking_file(os.path.dirname(target))
        if blocker is not None:
            raise GDRORecipeError(
                f"gdro.metrics_file={recipe.metrics_file!r}: {blocker} is a file, not a folder, so {target} cannot be "
                "created"
            )
    if launch:
        base = _nearest_existing(local_dir)
        if not os.access(base, os.W_OK | os.X_OK):
            raise GDRORecipeError(
                f"trainer.default_local_dir={local_dir}: {base} is not writable by this user, so the checkpoint "
                "folder cannot be created"
            )
    return checked


# --------------------------------------------------------------------------------------- resume point
# The checkpoint folder's resume marker and the resume mode, read before Ray (issue 32 item 2, issue 35
# item 0): verl's ``find_latest_ckpt_path`` int()s the marker inside Ray (a traceback on garbage) and,
# when the folder it names is gone, starts over on top of the run's checkpoints without a word.
OVERWRITE_CHECKPOINTS_KEY = "gdro.overwrite_checkpoints"
_VERL_STEP = re.compile(r"0|[1-9][0-9]*")


def _verl_abspath(path: str) -> str:
    """``path`` as verl's ``_load_checkpoint`` resolves it (relative to the working directory, no ``~``)."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _resume_from(newest: Optional[str], root: str, has_folders: bool) -> str:
    """The one override that goes on from what is on disk."""
    if newest is not None:
        return (
            f"the newest complete checkpoint is {newest}: resume from it with trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={newest}"
        )
    fresh = "trainer.resume_mode=disable" + (f" {OVERWRITE_CHECKPOINTS_KEY}=true" if has_folders else "")
    return f"no complete checkpoint is in {root}: start over with {fresh}"


def check_resume_point(config: DictConfig, recipe: RecipeConfig, *, with_gdro_state: bool = False) -> Optional[str]:
    """What the launch resumes from, checked as verl will read it; returns that folder (None: a fresh start).

    ``trainer.resume_mode=auto``: ``<trainer.default_local_dir>/latest_checkpointed_iteration.txt``, when
    present, must hold a step number whose ``global_step_N`` folder exists and is complete
    (:func:`recipe.gdro.checkpoints.incomplete_reason`; with ``with_gdro_state`` it holds the GDRO state);
    a missing marker beside complete checkpoints is refused too (verl would start over on top of them).
    ``resume_path``: ``trainer.resume_from_path`` must be such a folder. ``disable``: a folder that holds
    ``global_step_N`` folders is refused unless ``gdro.overwrite_checkpoints=true``. Each refusal is one
    line naming the marker or folder, what it holds, and the override that goes on from what is on disk.
    Remote (``scheme://``) folders are not checked."""
    from recipe.gdro.checkpoints import TRACKER_FILE, checkpoint_folders, incomplete_reason, newest_complete

    mode = OmegaConf.select(config, "trainer.resume_mode", default="auto")
    local_dir = OmegaConf.select(config, "trainer.default_local_dir", default=None)
    root = _verl_abspath(local_dir) if isinstance(local_dir, str) and local_dir and "://" not in local_dir else None
    if mode == "resume_path":
        path = OmegaConf.select(config, "trainer.resume_from_path", default=None)
        if isinstance(path, str) and "://" in path:
            return None
        if not isinstance(path, str) or not path:
            raise GDRORecipeError(
                f"trainer.resume_mode=resume_path needs trainer.resume_from_path=<folder>/global_step_N (got {path!r})"
            )
        folder = _verl_abspath(path)
        parent = os.path.dirname(folder.rstrip(os.sep)) or os.sep
        newest = newest_complete(parent, with_gdro_state=with_gdro_state)
        if "global_step_" not in path:
            raise GDRORecipeError(
                f"trainer.resume_from_path={path} names no global_step_N folder (verl reads the step from that name); "
                f"{_resume_from(newest, parent, bool(checkpoint_folders(parent)))}"
            )
        step = path.split("global_step_")[-1]
        if not _VERL_STEP.fullmatch(step):
            raise GDRORecipeError(
                f"trainer.resume_from_path={path}: verl reads the step from the text after 'global_step_' "
                f"({step!r}), which must be a step number as verl names its folders (global_step_N, no leading "
                f"zeros or trailing '/'); {_resume_from(newest, parent, bool(checkpoint_folders(parent)))}"
            )
        reason = incomplete_reason(folder, with_gdro_state=with_gdro_state)
        if reason is not None:
            raise GDRORecipeError(
                f"trainer.resume_from_path={path} cannot be resumed from ({reason}); "
                f"{_resume_from(newest, parent, bool(checkpoint_folders(parent)))}"
            )
        return folder
    if root is None:
        return None
    folders = checkpoint_folders(root)
    marker = os.path.join(root, TRACKER_FILE)
    if mode == "disable":
        if (folders or os.path.isfile(marker)) and not recipe.overwrite_checkpoints:
            held = ", ".join(os.path.basename(folders[s]) for s in sorted(folders)) or TRACKER_FILE
            raise GDRORecipeError(
                f"trainer.resume_mode=disable would start over in {root}, which holds checkpoints ({held}): resume "
                "with trainer.resume_mode=auto, pick a new trainer.default_local_dir, or set "
                f"{OVERWRITE_CHECKPOINTS_KEY}=true to start over there (its saves overwrite those steps' folders)"
            )
        return None
    if mode != "auto":
        return None  # verl's validate_config names an unknown mode
    newest = newest_complete(root, with_gdro_state=with_gdro_state)
    if not os.path.exists(marker):
        if newest is not None:
            raise GDRORecipeError(
                f"trainer.resume_mode=auto: {marker} is missing, so verl would start over on top of the checkpoints "
                f"in {root}; {_resume_from(newest, root, True)}"
            )
        return None
    try:
        with open(marker, "rb") as f:
            content = f.read(64).decode("utf-8", errors="replace")
    except OSError as e:
        raise GDRORecipeError(f"trainer.resume_mode=auto: {marker} cannot be read ({e.strerror})") from None
    text = content.strip()
    if not _VERL_STEP.fullmatch(text.lstrip("0") or "0"):
        raise GDRORecipeError(
            f"trainer.resume_mode=auto: {marker} holds {content[:40]!r}, not a step number, so verl cannot read "
            f"it; {_resume_from(newest, root, bool(folders))}"
        )
    folder = os.path.join(root, f"global_step_{int(text)}")
    reason = incomplete_reason(folder, with_gdro_state=with_gdro_state)
    if reason is not None:
        state = "does not exist" if reason == "no such folder" else f"is incomplete ({reason})"
        raise GDRORecipeError(
            f"trainer.resume_mode=auto: {marker} holds {content[:40]!r}, but {folder} {state}, so verl would start "
            f"over on top of the checkpoints; {_resume_from(newest, root, bool(folders))}"
        )
    return folder


# --------------------------------------------------------------------------------------- launch only
def check_local_model(config: DictConfig) -> Optional[str]:
    """A real launch from a local model folder (``actor_rollout_ref.model.path`` starting with ``/``, ``.``
    or ``~``): it must hold a ``config.json`` here (and at the same path on every node). A hub id is
    not checked (verl downloads it). A dry run does not call this (the model may live on the cluster
    only). Returns the folder checked, if any."""
    path = OmegaConf.select(config, "actor_rollout_ref.model.path", default=None)
    if not isinstance(path, str) or not path.startswith(("/", ".", "~")):
        return None
    folder = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise GDRORecipeError(
            f"actor_rollout_ref.model.path={path}: no config.json in {folder} (a local model folder must exist, at "
            "the same path on every node)"
        )
    return folder


def check_ray_cluster(config: DictConfig, environ=None) -> Optional[str]:
    """A real launch on ``trainer.nnodes`` > 1 needs a running Ray cluster to join (``ray start`` on every
    node, or ``RAY_ADDRESS``); otherwise verl starts a one-node Ray and waits for nodes that never come."""
    environ = os.environ if environ is None else environ
    nnodes = int(config.trainer.nnodes)
    if nnodes <= 1 or environ.get("RAY_ADDRESS"):
        return None
    try:
        from ray._private.services import find_gcs_addresses

        running = bool(find_gcs_addresses())
    except Exception:  # noqa: BLE001 - a Ray without this helper: let ray.init decide
        return None
    if not running:
        raise GDRORecipeError(
            f"trainer.nnodes={nnodes} needs a running Ray cluster: 'bash run_scripts/ray_node.sh head' on this node "
            "and 'bash run_scripts/ray_node.sh worker <head>:6379' on the others (docs/cluster.md, \"Multi-node\"), "
            "or set RAY_ADDRESS"
        )
    return "running"


def join_existing_cluster(config: DictConfig, joins: bool) -> list[str]:
    """A launch that joins a running Ray cluster (``joins``: :attr:`recipe.gdro.startup.ray_address.RayAddress.joins`,
    the one decision, which also reads ``local``, ``auto`` and a cluster ``ray start`` recorded here) must not pass
    ``num_cpus`` / ``num_gpus`` to ``ray.init`` (Ray refuses: "When connecting to an existing cluster, num_cpus
    and num_gpus must not be provided"); the cluster's nodes declare their own. Clears them in ``config`` and
    returns one line per key it cleared (none when it starts its own Ray)."""
    ray_init = OmegaConf.select(config, "ray_kwargs.ray_init")
    if ray_init is None or not joins:
        return []
    cleared = []
    for key in ("num_cpus", "num_gpus"):
        value = ray_init.get(key, None)
        if value is not None:
            OmegaConf.update(config, f"ray_kwargs.ray_init.{key}", None, merge=False)
            cleared.append(
                f"[gdro] joining a running Ray cluster: ray_kwargs.ray_init.{key}={value} not passed to ray.init "
                "(the cluster's nodes declare their resources)"
            )
    return cleared


# --------------------------------------------------------------------------------------- modes
def observes_only(config: DictConfig, gdro: GDROConfig) -> bool:
    """Observe-only mode: both adversaries off and ``gdro.observe``, in a run whose every group the
    binner sees (the v1 sync trainer, no DAPO group filtering); elsewhere the recipe is plain verl."""
    if gdro.enabled or not gdro.observe or not config.trainer.get("use_v1", True):
        return False
    if not is_gdro_trainer(config):
        return False
    filter_groups = config.algorithm.get("filter_groups", None)
    return not (filter_groups is not None and filter_groups.get("enable", False))


def gdro_runs(config: DictConfig, gdro: GDROConfig) -> bool:
    """Whether the recipe drives a GDRO controller at all (an adversary on, or observe-only)."""
    return gdro.enabled or observes_only(config, gdro)


def check_use_v1(config: DictConfig) -> None:
    """Refuse ``trainer.use_v1=false`` in every mode (GDRO on, observe-only and the GRPO baseline).

    The recipe's TaskRunner builds verl's v1 trainer whatever ``trainer.use_v1`` says, so ``false``
    would be silently ignored: the run would not be the legacy RayPPOTrainer run it asks for.
    """
    if not config.trainer.get("use_v1", True):
        raise GDRORecipeError(
            "trainer.use_v1=false is not supported: the GDRO recipe always runs verl's v1 trainer (its "
            "TaskRunner is modelled on TaskRunnerV1), with or without an adversary, so the legacy "
            "RayPPOTrainer would be silently replaced. Set trainer.use_v1=true (verl 0.9.1's default), or "
            "run the legacy trainer with verl's own python -m verl.trainer.main_ppo"
        )


def check_parameter_sync_step(config: DictConfig, gdro: GDROConfig) -> None:
    """Refuse ``trainer.v1.<mode>.parameter_sync_step`` > 1 whenever the GDRO controller runs.

    verl's ``step`` then runs ``_step_once`` k times on B/k groups each, so one global step reaches
    ``_compute_advantage`` k times: the controller would observe (and Prompt-GDRO update) k times per
    step on partial batches, and Rollout-GDRO's Σ n = B·n̄ would no longer hold per update.
    """
    if not gdro_runs(config, gdro) or not is_gdro_trainer(config):
        return  # verl's own trainers are refused with GDRO on (check_supported_modes), or are plain verl
    mode, section = verl_mode_section(config)
    k = section.get("parameter_sync_step", 1)
    if k is not None and int(k) != 1:
        raise GDRORecipeError(
            f"trainer.v1.{mode}.parameter_sync_step={k} is not supported by the GDRO recipe: verl would run "
            f"_step_once {k} times per step on data.train_batch_size/{k} groups each, so the controller would "
            "observe partial batches several times per step. Use parameter_sync_step=1, or run plain verl "
            "(both adversaries off and gdro.observe=false)"
        )


def check_supported_modes(config: DictConfig, gdro: GDROConfig) -> None:
    """Refuse verl modes that would combine with GDRO into wrong statistics.

    * ``trainer.use_v1=false`` (legacy RayPPOTrainer), in every mode: see :func:`check_use_v1`.
    * ``parameter_sync_step`` > 1 whenever the controller runs: see :func:`check_parameter_sync_step`.
    * ``trainer.v1.trainer_mode`` one of verl's own keys (``sync``, ``colocate_async``, ``separate_async``): they
      have no adversary; the recipe's are ``gdro_sync``, ``gdro_colocate_async``, ``gdro_separate_async``.
    * ``gdro.prompt.loss_signal=mean_abs_advantage`` on an asynchronous trainer: the groups verl evicts are
      observed without advantages (|A| = 0), which that signal would read as a loss of 0.
    * ``algorithm.filter_groups.enable`` (DAPO dynamic sampling): evicts exactly the all-correct /
      all-wrong groups the binner must see and refills with singly-scheduled prompts.
    * ``trainer.v1.sampler.sync_refill_failed_groups`` with Rollout-GDRO: failed groups are
      replaced by prompts scheduled outside the step's budget.
    * ``algorithm.adv_estimator`` other than ``grpo``: Prompt-GDRO reweights GRPO advantages and
      Rollout-GDRO relies on GRPO's per-uid groups of any size.
    """
    check_use_v1(config)
    check_parameter_sync_step(config, gdro)
    if not gdro.enabled:
        return
    mode = config.trainer.v1.trainer_mode
    if not is_gdro_trainer(config):
        own = {v: k for k, v in GDRO_TRAINER_MODES.items()}.get(base_trainer_mode(mode))
        raise GDRORecipeError(
            f"trainer.v1.trainer_mode={mode!r} is verl's own trainer, which has no GDRO adversary: with "
            "gdro.prompt.enable / gdro.rollout.enable use "
            + (f"trainer.v1.trainer_mode={own}" if own else f"one of {', '.join(GDRO_TRAINER_MODES)}")
            + " (the recipe's; gdro_sync is the default), or disable both adversaries"
        )
    B, mini = config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_mini_batch_size
    if verl_mode(config) == "separate_async" and B != mini:
        raise GDRORecipeError(
            f"trainer.v1.trainer_mode={mode} with actor_rollout_ref.actor.ppo_mini_batch_size={mini}: the GDRO "
            "trainer runs separate_async with parameter_sync_step=1 (the controller observes once a step) and verl "
            f"requires train_batch_size = parameter_sync_step x ppo_mini_batch_size: set ppo_mini_batch_size={B} "
            "(mode=separate_async sets it)"
        )
    reads_advantage = gdro.prompt.enable and gdro.prompt.loss_signal == LossSignal.mean_abs_advantage
    if verl_mode(config) != SUPPORTED_TRAINER_MODE and reads_advantage:
        raise GDRORecipeError(
            f"gdro.prompt.loss_signal=mean_abs_advantage is not supported with trainer.v1.trainer_mode={mode}: the "
            "groups verl evicts as stale or failed are observed without advantages, which that signal would read "
            "as a loss of 0. Use gdro.prompt.loss_signal=learnability (the default) or failure_rate"
        )
    filter_groups = config.algorithm.get("filter_groups", None)
    if filter_groups is not None and filter_groups.get("enable", False):
        raise GDRORecipeError(
            "algorithm.filter_groups.enable=true (DAPO dynamic sampling) is not supported with GDRO enabled: "
            "it evicts the all-correct and all-wrong groups, which are exactly the outcomes the difficulty "
            "binner must record, and refills the batch with prompts scheduled one at a time outside the "
            "step's rollout budget. Disable one of the two"
        )
    if gdro.rollout.enable and config.trainer.v1.sampler.get("sync_refill_failed_groups", False):
        raise GDRORecipeError(
            "trainer.v1.sampler.sync_refill_failed_groups=true is not supported with gdro.rollout.enable=true: "
            "replacement prompts would be scheduled outside the step's budget (Σ n = B·n̄). Disable one of the two"
        )
    estimator = str(config.algorithm.adv_estimator)
    if estimator != "grpo":
        raise GDRORecipeError(
            f"algorithm.adv_estimator={estimator!r} is not supported with GDRO enabled: Prompt-GDRO reweights "
            "GRPO advantages and Rollout-GDRO relies on GRPO's per-prompt groups. Use algorithm.adv_estimator=grpo"
        )


# --------------------------------------------------------------------------------------- budget
@dataclass
class BudgetPlan:
    train_batch_size: int
    n_mean: int
    rows_per_step: int  # Σ n(x) = B · n̄
    mini_batch_prompts: int
    mini_batch_rows: int
    updates_per_step: int
    n_gpus: int
    dp_size: int
    required_multiple: int  # what verl's _balance_batch pads the step's rows to
    padding_rows: int
    gen_batch_size: int
    notes: list[str] = field(default_factory=list)


def _actor_dp_size(config: DictConfig, n_gpus: int) -> int:
    actor = config.actor_rollout_ref.actor
    if str(actor.get("strategy", "fsdp")) == "megatron" and "megatron" in actor:
        m = actor.megatron
        model_parallel = (
            int(m.get("tensor_model_parallel_size", 1))
            * int(m.get("pipeline_model_parallel_size", 1))
            * int(m.get("context_parallel_size", 1))
        )
    else:
        model_parallel = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    return max(n_gpus // max(model_parallel, 1), 1)


def check_budget(config: DictConfig, gdro: GDROConfig) -> BudgetPlan:
    """Check that a step's Σ n(x) = B · n̄ rows split into whole PPO mini-batches and DP shards.

    verl's ``_balance_batch`` pads a step to a multiple of lcm(dp, ppo_mini_batch_size · rollout.n)
    rows and ``update_actor`` cuts ``ppo_mini_batch_size · rollout.n`` rows per mini-batch whatever
    the per-prompt counts. With Rollout-GDRO enabled a step that needs padding is refused.
    """
    B = int(config.data.train_batch_size)
    n = int(config.actor_rollout_ref.rollout.n)
    mini = int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
    n_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    if B < 1:
        raise GDRORecipeError(f"data.train_batch_size={B} must be >= 1")
    if n < 1:
        raise GDRORecipeError(f"actor_rollout_ref.rollout.n={n} must be >= 1")
    if mini < 1:
        raise GDRORecipeError(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} must be >= 1")
    gen = config.data.get("gen_batch_size", None) or B
    dp = _actor_dp_size(config, n_gpus)
    rows = B * n
    required = math.lcm(dp, mini * n)
    padding = (-rows) % required
    plan = BudgetPlan(
        train_batch_size=B,
        n_mean=n,
        rows_per_step=rows,
        mini_batch_prompts=mini,
        mini_batch_rows=mini * n,
        updates_per_step=max(rows // (mini * n), 1) * int(config.actor_rollout_ref.actor.get("ppo_epochs", 1)),
        n_gpus=n_gpus,
        dp_size=dp,
        required_multiple=required,
        padding_rows=padding,
        gen_batch_size=int(gen),
    )
    if not gdro.enabled:
        return plan
    if B % int(gen) != 0:
        raise GDRORecipeError(
            f"data.gen_batch_size={gen} does not divide data.train_batch_size={B}: a step's prompts are "
            "fetched in whole gen_batch_size chunks"
        )
    if gdro.rollout.enable:
        if B % mini != 0:
            raise GDRORecipeError(
                f"Rollout-GDRO budget: data.train_batch_size={B} is not a multiple of "
                f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}: the step's Σ n = B·n̄ = {rows} rows do not "
                f"split into whole PPO mini-batches of ppo_mini_batch_size·n̄ = {mini * n} rows, so verl would pad "
                "the step with dummy rows"
            )
        if padding:
            raise GDRORecipeError(
                f"Rollout-GDRO budget: the step's Σ n = data.train_batch_size·rollout.n = {B}·{n} = {rows} rows is "
                f"not a multiple of lcm(actor data-parallel size {dp}, ppo_mini_batch_size·n̄ = {mini * n}) = "
                f"{required}; verl would pad {padding} dummy rows. Change data.train_batch_size, "
                "actor_rollout_ref.actor.ppo_mini_batch_size or trainer.n_gpus_per_node"
            )
        if gdro.rollout.n_max > rows:
            plan.notes.append(f"gdro.rollout.n_max={gdro.rollout.n_max} exceeds the step's whole budget {rows}")
    elif padding:
        plan.notes.append(
            f"verl pads each step with {padding} dummy rows (B·n̄={rows} vs multiple {required}); GDRO skips them"
        )
    return plan


# --------------------------------------------------------------------------------------- data
def train_files(config: DictConfig) -> list[str]:
    files = config.data.train_files
    if isinstance(files, (list, tuple, ListConfig)):
        return [str(f) for f in files]
    return [str(files)]


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local_path(path: str) -> str:
    return os.path.expanduser(path[len("file://") :] if path.startswith("file://") else path)


def _read_table(path: str, columns: list[str]):
    """A pyarrow Table with the requested columns that exist in the file (parquet / json / jsonl)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.endswith(".parquet"):
        try:
            names = set(pq.read_schema(path).names)
            return pq.read_table(path, columns=[c for c in columns if c in names])
        except (pa.ArrowException, OSError) as e:
            raise GDRORecipeError(
                f"data.train_files: {path} is not a readable parquet file: {type(e).__name__}: {e}"
            ) from None
    if path.endswith(".json") or path.endswith(".jsonl"):
        frame = _read_json(path, "data.train_files")
        return pa.Table.from_pandas(frame[[c for c in columns if c in frame.columns]], preserve_index=False)
    raise GDRORecipeError(
        f"data.train_files: {path} is not a parquet, json or jsonl file (verl's RLHFDataset reads those, by file "
        "suffix); data_prep/dapo.py writes parquet"
    )


def _read_json(path: str, key: str):
    """A JSON / JSON-lines file as pandas reads it for verl, or :class:`GDRORecipeError` naming it."""
    import pandas as pd

    try:
        return pd.read_json(path, lines=path.endswith(".jsonl"))
    except Exception as e:  # noqa: BLE001 - UnicodeDecodeError (a parquet named .jsonl), ValueError, ...
        raise GDRORecipeError(
            f"{key}: {path} is not a readable {'JSON-lines' if path.endswith('.jsonl') else 'JSON'} file "
            f"(verl picks the reader by file suffix): {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from None


# The binner keeps dense per-prompt arrays indexed by extra_info.index (verl_ext.binner: a ring of
# `window` visits x (correct, rollouts) uint16 plus 4 int32 of metadata), so the largest id sets its
# memory. Ids are refused when those arrays would pass this bound; data_prep numbers prompts 0..N-1.
MAX_BINNER_BYTES = 1 << 30
# Ids this many times sparser than the prompts (largest id + 1 against the count) are warned about, with the
# memory the arrays take (every gdro_state.pkl holds them too), once that passes SPARSE_IDS_MIN_BYTES.
SPARSE_IDS_FACTOR = 4
SPARSE_IDS_MIN_BYTES = 64 << 20


def binner_bytes(num_prompts: int, window: int) -> int:
    """Bytes of the binner's per-prompt arrays for ids in [0, num_prompts)."""
    return int(num_prompts) * (4 * int(window) + 16)


def check_id_range(ids: np.ndarray, window: int, what: str) -> None:
    """Refuse ids whose largest value would size the binner's arrays beyond :data:`MAX_BINNER_BYTES`; warn,
    with the memory they take, when ids sparser than :data:`SPARSE_IDS_FACTOR` x the prompt count make those
    arrays pass :data:`SPARSE_IDS_MIN_BYTES`."""
    if not len(ids):
        return
    top = int(ids.max())
    need = binner_bytes(top + 1, window)
    if need > MAX_BINNER_BYTES:
        row = int(np.argmax(ids == top))
        raise PromptIdError(
            f"{what}: row {row} has extra_info.index {top}; the binner sizes its arrays by the largest id "
            f"({need / 2**30:,.0f} GiB for {len(ids)} prompts at gdro.binner.window={window}, bound "
            f"{MAX_BINNER_BYTES / 2**30:g} GiB). Number the prompts 0..N-1 (data_prep does)"
        )
    dense = binner_bytes(len(ids), window)
    if top + 1 > SPARSE_IDS_FACTOR * len(ids) and need > SPARSE_IDS_MIN_BYTES:
        startup_warning(
            f"{what}: the largest extra_info.index is {top} for {len(ids)} prompts, and the GDRO controller sizes its "
            f"per-prompt arrays by the largest id: {need / 2**20:,.0f} MiB (in memory and in every gdro_state.pkl) "
            f"instead of {dense / 2**20:,.1f} MiB. Number the prompts 0..N-1 (data_prep does)"
        )


def prompt_ids_of_table(table, what: str) -> np.ndarray:
    """``extra_info.index`` of every row of a table, validated (missing / non-integer / duplicate)."""
    if "extra_info" not in table.column_names:
        raise PromptIdError(
            f"{what}: no `extra_info` column; GDRO keys prompts by extra_info.index (a unique integer per "
            "prompt, written by data_prep)"
        )
    column = table.column("extra_info").combine_chunks()
    import pyarrow as pa

    if pa.types.is_struct(column.type):
        if column.type.get_field_index("index") < 0:
            raise PromptIdError(f"{what}: extra_info has no `index` field; every prompt needs extra_info.index")
        ids = column.field("index").to_pylist()
        # A null struct means no extra_info at all in that row.
        valid = column.is_valid().to_pylist()
        ids = [i if ok else None for i, ok in zip(ids, valid, strict=True)]
    else:
        ids = [(row or {}).get("index") if isinstance(row, dict) else None for row in column.to_pylist()]
    return check_prompt_ids(ids, what=f"{what} extra_info.index")


@dataclass
class DataCheck:
    num_prompts: Optional[int]  # max id + 1 over the checked files; None if nothing was checked
    num_rows: int
    checked: list[str]
    not_checked: list[str]  # remote or missing files (checked again by the trainer at start-up)
    data_sources: dict[str, dict]  # data_source -> one sample row (ground truth, extra_info) for the reward probe
    # the training prompts' fingerprint and count (recipe.gdro.startup.resume.dataset_fingerprint), saved with the
    # GDRO state; None when a file was not read here
    dataset: Optional[dict] = None


def check_train_prompt_ids(config: DictConfig, *, require_files: bool = False) -> DataCheck:
    """Validate ``extra_info.index`` of the training files: present, integer, unique across files.

    ``num_prompts`` (the binner's capacity) is ``max id + 1``. Remote files (hdfs://...) and, unless
    ``require_files``, missing local files are listed in ``not_checked``: the trainer checks the
    loaded dataset again at start-up, before any worker is created. When every file was read, ``dataset``
    holds the fingerprint of the prompts (ids and ``data.prompt_key`` texts), and one prompt text under
    several ids is warned about (GDRO tracks each id as its own prompt).
    """
    checked, not_checked, all_ids, all_prompts = [], [], [], []
    data_sources: dict[str, dict] = {}
    prompt_key = str(OmegaConf.select(config, "data.prompt_key", default="prompt"))
    for path in train_files(config):
        local = _local_path(path)
        if not _is_local(path) or not os.path.exists(local):
            if require_files and _is_local(path):
                raise GDRORecipeError(f"data.train_files: {path} does not exist")
            not_checked.append(path)
            continue
        table = _read_table(local, ["extra_info", "data_source", "reward_model", prompt_key])
        ids = prompt_ids_of_table(table, what=f"train file {path}")
        all_ids.append(ids)
        all_prompts.extend(
            table.column(prompt_key).to_pylist() if prompt_key in table.column_names else [None] * len(ids)
        )
        checked.append(path)
        if "data_source" in table.column_names:
            sources = table.column("data_source").to_pylist()
            first: dict[str, int] = {}
            for row, src in enumerate(sources):
                first.setdefault(str(src), row)
            for src, row in first.items():
                if src in data_sources:
                    continue
                sample = table.slice(row, 1).to_pylist()[0]
                sample.pop(prompt_key, None)
                data_sources[src] = {"file": path, "row": row, **sample}
    if not all_ids:
        return DataCheck(None, 0, checked, not_checked, data_sources)
    ids = np.concatenate(all_ids)
    if len(checked) > 1:
        check_prompt_ids(ids, what=f"train files {checked} (concatenated) extra_info.index")
    window = OmegaConf.select(config, "gdro.binner.window", default=50)
    check_id_range(ids, window if isinstance(window, int) and window > 0 else 50, f"train file(s) {', '.join(checked)}")
    num_prompts = int(ids.max()) + 1 if len(ids) else None
    _warn_duplicate_prompts(ids, all_prompts, prompt_key, checked)
    dataset = None
    if not not_checked:
        from recipe.gdro.startup.resume import dataset_fingerprint

        dataset = {"fingerprint": dataset_fingerprint(ids, all_prompts), "num_rows": len(ids)}
    return DataCheck(num_prompts, len(ids), checked, not_checked, data_sources, dataset)


def _warn_duplicate_prompts(ids: np.ndarray, prompts: list, prompt_key: str, files: list[str]) -> None:
    """One warning when a prompt text appears under more than one ``extra_info.index``."""
    import json

    first: dict[str, int] = {}
    repeated: list[tuple[int, int]] = []
    for pid, prompt in zip(ids.tolist(), prompts, strict=True):
        if prompt is None:
            continue
        text = json.dumps(prompt, sort_keys=True, default=str)
        if text in first:
            repeated.append((first[text], pid))
        else:
            first[text] = pid
    if repeated:
        a, b = repeated[0]
        startup_warning(
            f"train file(s) {', '.join(files)}: {len(repeated)} prompt(s) repeat the {prompt_key} text of another "
            f"extra_info.index (e.g. ids {a} and {b}); GDRO tracks each id as its own prompt, so a repeated prompt's "
            "difficulty history is split between its ids and it is drawn more often. Deduplicate the data"
        )


# --------------------------------------------------------------------------------------- reward
@dataclass
class RewardProbe:
    function: str
    manager: str
    results: dict[str, Any]  # data_source -> keys returned (or "float")
    notes: list[str] = field(default_factory=list)


FLOAT_ACC_MANAGERS = ("naive", "dapo")  # managers that store acc = score when compute_score returns a float


def probe_reward_acc(config: DictConfig, data: DataCheck) -> RewardProbe:
    """Call the configured ``compute_score`` once per training data_source and check it reports ``acc``.

    verl's naive / dapo reward managers copy every key of a dict result into ``reward_extra_info``
    (and set ``acc = score`` for a float result). GDRO's binner reads ``acc`` per response, so a
    dict result without ``acc`` is refused here, before any GPU time.
    """
    reward = config.reward
    manager = str(reward.reward_manager.get("name", "naive"))
    custom = reward.get("custom_reward_function") or {}
    if custom.get("path"):
        from verl.trainer.ppo.reward import get_custom_reward_fn

        try:
            fn = get_custom_reward_fn(config)
        except Exception as e:  # noqa: BLE001 - surface any load error with the key
            raise GDRORecipeError(
                f"reward.custom_reward_function.path={custom.get('path')!r} name={custom.get('name')!r} "
                f"cannot be loaded: {type(e).__name__}: {e}"
            ) from None
        fn_name = f"{custom.get('path')}:{custom.get('name')}"
    else:
        from verl.utils.reward_score import default_compute_score as fn

        fn_name = "verl.utils.reward_score.default_compute_score"
    probe = RewardProbe(function=fn_name, manager=manager, results={})
    if reward.get("reward_model", {}).get("enable", False) and not custom.get("path"):
        probe.notes.append(
            "reward.reward_model.enable=true: acc comes from the reward model; checked at the first step"
        )
        return probe
    if manager not in FLOAT_ACC_MANAGERS:
        probe.notes.append(f"reward manager {manager!r}: `acc` in reward_extra_info is checked at the first step")
    if not data.data_sources:
        probe.notes.append("no local training file: reward not probed (checked at the first step)")
        return probe
    for source, sample in data.data_sources.items():
        rm = sample.get("reward_model") or {}
        ground_truth = rm.get("ground_truth") if isinstance(rm, dict) else None
        extra = sample.get("extra_info") if isinstance(sample.get("extra_info"), dict) else {}
        solution = f"The answer is \\boxed{{{ground_truth}}}.\nAnswer: {ground_truth}"
        try:
            result = fn(data_source=source, solution_str=solution, ground_truth=ground_truth, extra_info=dict(extra))
            if inspect.isawaitable(result):
                result = asyncio.run(result)
        except Exception as e:  # noqa: BLE001
            raise GDRORecipeError(
                f"reward probe: {fn_name} fails for data_source={source!r} (train file {sample['file']}, row "
                f"{sample['row']}): {type(e).__name__}: {e}"
            ) from None
        if isinstance(result, dict):
            if "acc" not in result:
                raise GDRORecipeError(
                    f"reward probe: {fn_name} returns keys {sorted(result)} for data_source={source!r} without "
                    "'acc'; GDRO's difficulty binner needs a per-response correctness. Return "
                    "{'score': ..., 'acc': bool} (verl's math_dapo does), or set reward.custom_reward_function.*"
                )
            probe.results[source] = sorted(result)
        elif isinstance(result, (int, float, np.number)) and not isinstance(result, bool):
            if manager in FLOAT_ACC_MANAGERS:
                probe.results[source] = f"float (the {manager} manager stores acc = score; score > 0 counts as correct)"
            else:
                probe.results[source] = "float"
        else:
            raise GDRORecipeError(
                f"reward probe: {fn_name} returns {type(result).__name__} for data_source={source!r}; expected a "
                "dict with 'score' and 'acc', or a float"
            )
    return probe


# --------------------------------------------------------------------------------------- verl
def validate_verl_config(config: DictConfig) -> list[str]:
    """verl's own start-up validation plus conversions that catch what ``validate_config`` lets through.

    Never builds the model config (that would load from the hub), never starts Ray. Returns the
    list of checks run.
    """
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.device import auto_set_device

    ran = []
    auto_set_device(config)
    try:
        validate_config(
            config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )
    except Exception as e:  # noqa: BLE001 - verl asserts, raises ValueError / TypeError / Hydra errors
        message = " ".join(str(e).split()) or type(e).__name__
        raise GDRORecipeError(f"verl refuses the config ({type(e).__name__}): {message[:500]}") from None
    ran.append("verl validate_config")
    for key in ("algorithm", "actor_rollout_ref.rollout"):
        try:
            omega_conf_to_dataclass(OmegaConf.select(config, key))
        except Exception as e:  # noqa: BLE001
            raise GDRORecipeError(f"{key}: verl rejects it: {type(e).__name__}: {e}") from None
        ran.append(f"{key} -> dataclass")

    from verl.trainer.ppo import core_algos

    estimator = str(config.algorithm.adv_estimator)
    known = {e.value for e in core_algos.AdvantageEstimator}
    if estimator not in known:
        try:
            core_algos.get_adv_estimator_fn(estimator)
        except Exception as e:  # noqa: BLE001
            raise GDRORecipeError(f"algorithm.adv_estimator={estimator!r}: {e}") from None
    ran.append("advantage estimator")

    if config.trainer.get("use_v1", True):
        from verl.trainer.ppo.v1 import get_trainer_cls

        try:
            get_trainer_cls(config.trainer.v1.trainer_mode)
        except ValueError as e:
            raise GDRORecipeError(f"trainer.v1.trainer_mode: {e}") from None
        ran.append("trainer class")

    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    try:
        resolve_reward_manager_cls(config)
    except Exception as e:  # noqa: BLE001
        raise GDRORecipeError(
            f"reward.reward_manager (source={config.reward.reward_manager.get('source')!r}, "
            f"name={config.reward.reward_manager.get('name')!r}): {type(e).__name__}: {e}"
        ) from None
    ran.append("reward manager")
    return ran


# --------------------------------------------------------------------------------------- dry-run data
def val_files(config: DictConfig) -> list[str]:
    files = config.data.get("val_files", None)
    if files is None:
        return []
    if isinstance(files, (list, tuple, ListConfig)):
        return [str(f) for f in files]
    return [str(files)]


@dataclass
class DataFiles:
    """What a dry run found of ``data.train_files`` / ``data.val_files`` (local files only)."""

    train_rows: int
    train_found: list[str]
    val_found: list[str]
    missing: list[tuple[str, str]]  # (config key, path)
    remote: list[str]
    notes: list[str] = field(default_factory=list)


def count_rows(path: str, key: str, columns: tuple[str, ...] = ()) -> int:
    """Rows of a local data file as verl's RLHFDataset reads it (parquet, json or jsonl, by suffix),
    after checking it has ``columns`` (e.g. ``data.prompt_key``).

    A file of another kind, one that does not parse, or one without a required column is a
    :class:`GDRORecipeError` naming the file (and the column).
    """
    local = _local_path(path)
    if local.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(local)
            names, rows = meta.schema_arrow.names, meta.metadata.num_rows
        except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, ...
            raise GDRORecipeError(f"{key}: {path} is not a readable parquet file: {type(e).__name__}: {e}") from None
    elif local.endswith((".json", ".jsonl")):
        frame = _read_json(local, key)
        names, rows = list(frame.columns), len(frame)
    else:
        names = None
    if names is not None:
        missing = [c for c in columns if c not in names]
        if missing:
            raise GDRORecipeError(
                f"{key}: {path} has no column {', '.join(repr(c) for c in missing)} (data.prompt_key); its columns: "
                f"{', '.join(map(str, names)) or 'none'}"
            )
        return rows
    raise GDRORecipeError(
        f"{key}: {path} is not a parquet, json or jsonl file (verl's RLHFDataset reads those, by file suffix); "
        "data_prep/dapo.py and data_prep/eval_sets.py write parquet"
    )


def _refuse_link_loop(key: str, path: str) -> None:
    """A path that "does not exist" because a symbolic link on it points back at itself (``DATA_DIR``
    linked in a loop) is refused naming the link, not reported as data still to prepare."""
    local = os.path.abspath(_local_path(path))
    try:
        os.stat(local)
    except OSError as e:
        if e.errno != errno.ELOOP:
            return
        part = local
        while os.path.dirname(part) != part:  # the shortest prefix of the path that loops: the link at fault
            parent = os.path.dirname(part)
            try:
                os.stat(parent)
            except OSError:
                part = parent
                continue
            break
        raise GDRORecipeError(f"{key}: {path}: {part} is a symbolic link loop (it resolves back to itself)") from None


def check_dry_run_data(config: DictConfig, *, config_only: bool) -> DataFiles:
    """The data half of a dry run: every local training and validation file exists and is readable,
    and the training files hold at least ``data.train_batch_size`` prompts (verl's v1 trainer drops
    the last partial batch: with fewer prompts an epoch has no step).

    ``config_only`` (``gdro.dry_run=config``) turns a missing file or a too-small training set into
    a printed note; an unreadable or non-parquet file that exists is refused either way. Remote
    files (``hdfs://...``) are listed, not read.
    """
    found = DataFiles(train_rows=0, train_found=[], val_found=[], missing=[], remote=[])
    for key, paths in (("data.train_files", train_files(config)), ("data.val_files", val_files(config))):
        for path in paths:
            if not _is_local(path):
                found.remote.append(path)
                continue
            if not os.path.exists(_local_path(path)):
                _refuse_link_loop(key, path)
                found.missing.append((key, path))
                continue
            rows = count_rows(path, key, columns=(str(config.data.get("prompt_key", "prompt")),))
            if key == "data.train_files":
                found.train_rows += rows
                found.train_found.append(path)
            else:
                found.val_found.append(path)
    hint = (
        "Prepare the data with `python data_prep/dapo.py --local_dir DIR` and `python data_prep/eval_sets.py "
        "--local_dir DIR/eval`, point data.train_files / data.val_files at it, or check the configuration alone "
        "with gdro.dry_run=config"
    )
    if found.missing:
        listed = "; ".join(f"{key}: {path}" for key, path in found.missing)
        if not config_only:
            raise GDRORecipeError(f"missing data file(s): {listed}. {hint}")
        found.notes.append(f"not found (config-only dry run): {listed}")
    batch = int(config.data.train_batch_size)
    every_train_file_read = len(found.train_found) == len(train_files(config))
    if every_train_file_read and found.train_rows < batch:
        message = (
            f"data.train_files hold {found.train_rows} prompt(s) ({', '.join(found.train_found)}), fewer than "
            f"data.train_batch_size={batch}: verl's trainer drops the partial batch, so an epoch would have no "
            "training step"
        )
        if not config_only:
            raise GDRORecipeError(f"{message}. Use more data or a smaller data.train_batch_size")
        found.notes.append(message)
    return found


# --------------------------------------------------------------------------------------- all
@dataclass
class Prepared:
    gdro: GDROConfig
    budget: BudgetPlan
    data: Optional[DataCheck]
    reward: Optional[RewardProbe]
    verl_checks: list[str]
    files: Optional[DataFiles] = None  # set when prepare() checked the data files (dry run, launch)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    resume_folder: Optional[str] = None  # the global_step_N folder the launch resumes from (None: a fresh start)
    nothing_to_train: Optional[str] = None  # the line of a relaunch whose resume step is its last (exit 0)


DATA_REQUIRED = "required"  # every local data file must exist and hold >= data.train_batch_size prompts
DATA_LISTED = "listed"  # missing files and a too-small training set are notes (gdro.dry_run=config)


def prepare(
    config: DictConfig,
    *,
    require_files: bool = False,
    run_verl_checks: bool = True,
    data_files: Optional[str] = None,
    launch: bool = False,
) -> Prepared:
    """Run every start-up check (see the module docstring); raise on the first failure.

    ``data_files`` (:data:`DATA_REQUIRED` or :data:`DATA_LISTED`) also checks the data files
    (:func:`check_dry_run_data`) before the budget, so a batch larger than the data is reported as
    too little data. ``launch`` (a real launch, on the machine that trains) adds the checks a dry run
    on another machine cannot make: a writable checkpoint folder, a local model folder that holds a
    model, a running Ray cluster for several nodes.
    """
    check_environment()
    check_verl_keys(config)
    check_required_keys(config)
    check_layout(config)
    recipe = build_recipe_config(config)
    gdro = build_gdro_config(config)
    from recipe.gdro.checkpoints import GDRO_STATE_FILE
    from recipe.gdro.startup.resume import check_saved_layout, check_state_fits, nothing_to_train

    check_output_paths(config, recipe, launch=launch)
    restores_state = gdro_runs(config, gdro) and not recipe.restart_controller
    resume_folder = check_resume_point(config, recipe, with_gdro_state=restores_state)
    if resume_folder is not None:
        check_saved_layout(config, resume_folder)
    if launch:
        check_local_model(config)
        check_ray_cluster(config)
    check_supported_modes(config, gdro)
    data = reward = None
    if gdro_runs(config, gdro):
        data = check_train_prompt_ids(config, require_files=require_files)
    files = check_dry_run_data(config, config_only=data_files == DATA_LISTED) if data_files else None
    finished = nothing_to_train(config, resume_folder, files.train_rows if files is not None else None)
    if resume_folder is not None and restores_state and finished is None:
        state_path = os.path.join(resume_folder, GDRO_STATE_FILE)
        for line in check_state_fits(
            state_path,
            config,
            gdro,
            num_prompts=data.num_prompts if data else None,
            dataset=data.dataset if data else None,
        ):
            startup_warning(line)
    budget = check_budget(config, gdro)
    if data is not None:
        reward = probe_reward_acc(config, data)
    verl_checks = validate_verl_config(config) if run_verl_checks else []
    return Prepared(
        gdro=gdro,
        budget=budget,
        data=data,
        reward=reward,
        verl_checks=verl_checks,
        files=files,
        recipe=recipe,
        resume_folder=resume_folder,
        nothing_to_train=finished,
    )


# --------------------------------------------------------------------------------------- handed over
CHECKED_KEY = "_gdro_checked"  # private top-level key of the launch config: what prepare() built, as plain data


@dataclass
class Checked:
    """What the trainer needs of a checked launch: the GDRO config, the metrics file, whether GDRO runs."""

    gdro: GDROConfig
    metrics_file: str
    runs: bool
    restart_controller: bool = False  # gdro.restart_controller: a resume does not restore gdro_state.pkl
    dataset: Optional[dict] = None  # the training prompts' fingerprint, saved with the GDRO state


def hand_over(config: DictConfig, prepared: Prepared) -> DictConfig:
    """Write what :func:`prepare` built into ``config[CHECKED_KEY]`` (plain, picklable data), so the trainer,
    built from ``config`` inside verl's Ray TaskRunner (``run_ppo`` passes nothing else), uses it as is."""
    with open_dict(config):
        config[CHECKED_KEY] = {
            "gdro": gdro_config_to_dict(prepared.gdro),
            "metrics_file": prepared.recipe.metrics_file,
            "runs": gdro_runs(config, prepared.gdro),
            "restart_controller": prepared.recipe.restart_controller,
            "dataset": prepared.data.dataset if prepared.data is not None else None,
        }
    return config


def handed_over(config: DictConfig) -> Optional[Checked]:
    """The :class:`Checked` a launch wrote with :func:`hand_over`, or None (a trainer built outside a launch).

    The dict is the checked config's own ``gdro_config_to_dict``; ``gdro_config_from_dict`` converts it back."""
    section = config.get(CHECKED_KEY, None)
    if section is None:
        return None
    data = OmegaConf.to_container(section, resolve=True)
    return Checked(
        gdro=gdro_config_from_dict(data["gdro"]),
        metrics_file=data["metrics_file"],
        runs=data["runs"],
        restart_controller=bool(data.get("restart_controller", False)),
        dataset=data.get("dataset"),
    )


__all__ = [
    "CHECKED_KEY",
    "CPU_MODE_SUFFIX",
    "GDRO_TRAINER_MODE",
    "GDRO_TRAINER_MODES",
    "base_trainer_mode",
    "join_existing_cluster",
    "is_gdro_trainer",
    "Checked",
    "hand_over",
    "handed_over",
    "GDROConfigError",
    "GDRORecipeError",
    "Prepared",
    "PromptIdError",
    "build_gdro_config",
    "build_recipe_config",
    "check_id_range",
    "check_local_model",
    "check_output_paths",
    "check_ray_cluster",
    "check_resume_point",
    "check_verl_keys",
    "VERL_KEYS",
    "DATA_LISTED",
    "DATA_REQUIRED",
    "check_budget",
    "check_supported_modes",
    "check_dry_run_data",
    "check_layout",
    "check_parameter_sync_step",
    "check_required_keys",
    "check_train_prompt_ids",
    "check_use_v1",
    "count_rows",
    "gdro_runs",
    "observes_only",
    "prepare",
    "probe_reward_acc",
    "prompt_ids_of_table",
    "train_files",
    "val_files",
    "validate_verl_config",
]
