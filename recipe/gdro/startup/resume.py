"""What a launch resumes from, read before Ray: verl's checkpoint layout, the saved GDRO state, the step.

:func:`recipe.gdro.startup.checks.check_resume_point` finds the folder (the marker's ``global_step_N``, or
``trainer.resume_from_path``) and checks it is complete; this module reads what is inside it, so that what
the trainer would find only after Ray, the workers and vLLM are up (minutes in, as a traceback) is one line,
exit 2, before any of them:

* :func:`check_saved_layout`: verl's FSDP checkpoint manager loads ``actor/model_world_size_{W}_rank_{r}.pt``
  for the launch's own world size ``W`` (``trainer.nnodes`` x ``trainer.n_gpus_per_node``) and FSDP version
  (``actor.strategy``); a checkpoint saved with another layout is refused, naming both layouts and the ways on;
* :func:`read_saved_state`: ``gdro_state.pkl`` unpickles to a controller state (an empty, truncated or
  foreign file is refused);
* :func:`check_state_fits`: the state fits the launch: the binner's edges, window, half-life and groups, the
  rollout arms (``n_min..n_max``), the prompt count and the training prompts themselves (a fingerprint of
  their ids and texts, :func:`dataset_fingerprint`, saved with the state by :func:`save_gdro_state`). A
  misfit is refused naming the setting, the saved and the launched value, and the ways on (the old
  setting, a new folder, or ``gdro.restart_controller=true``); a change the state can carry (an adversary
  switched on or off, another ``eta``) is a warning naming every setting that differs
  (:func:`changed_settings`, which the trainer's restore uses too);
* :func:`nothing_to_train`: a resume step at or past the run's last step trains nothing: the launch says so
  and exits 0 before Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf

from recipe.gdro.startup.errors import GDRORecipeError
from verl_ext import GDROConfig, gdro_config_to_dict

RESTART_CONTROLLER_KEY = "gdro.restart_controller"
DATASET_STATE_KEY = "dataset"  # what save_gdro_state adds to the controller's state_dict()
INFLIGHT_STATE_KEY = "inflight"  # and the trainer's groups in flight (trainer_step.GroupSchedule.state_dict())
_SHARD = re.compile(r"^model_world_size_([0-9]+)_rank_([0-9]+)\.pt$")  # verl's FsdpCheckpointManager
FSDP_VERSIONS = {"fsdp": 1, "fsdp2": 2}  # actor.strategy -> the FSDP_version verl writes to fsdp_config.json
MERGE_COMMAND = "python -m verl.model_merger merge --backend fsdp --local_dir {actor} --target_dir {target}"


# --------------------------------------------------------------------------------------- verl's layout
@dataclass(frozen=True)
class Layout:
    world_size: int
    fsdp_version: Optional[int] = None

    def describe(self) -> str:
        fsdp = f", FSDP{self.fsdp_version}" if self.fsdp_version else ""
        return f"world size {self.world_size}{fsdp}"


def saved_layout(folder: str) -> Optional[Layout]:
    """The layout verl's FSDP checkpoint manager saved ``folder/actor`` with: the world size in its shard
    names (and ``fsdp_config.json``), the FSDP version of that json. None when the folder holds no FSDP
    shards (another checkpoint format, e.g. the CPU backend's ``cpu_actor.pt``)."""
    actor = os.path.join(folder, "actor")
    try:
        names = os.listdir(actor)
    except OSError:
        return None
    sizes = {int(m.group(1)) for m in map(_SHARD.match, names) if m}
    if not sizes:
        return None
    version = None
    try:
        with open(os.path.join(actor, "fsdp_config.json")) as f:
            saved = json.load(f)
        version = int(saved["FSDP_version"]) if saved.get("FSDP_version") is not None else None
        sizes.add(int(saved.get("world_size", max(sizes))))
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return Layout(max(sizes), version)


def launch_layout(config: DictConfig) -> Layout:
    """The layout the launch's actor will load with: every GPU of the run is one FSDP rank."""
    world = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    strategy = OmegaConf.select(config, "actor_rollout_ref.actor.strategy", default=None)
    return Layout(world, FSDP_VERSIONS.get(str(strategy)))


def check_saved_layout(config: DictConfig, folder: str) -> Optional[Layout]:
    """Refuse a resume whose checkpoint verl cannot load with the launch's layout (module docstring).
    Returns the saved layout (None: no FSDP shards to compare)."""
    saved = saved_layout(folder)
    if saved is None:
        return None
    now = launch_layout(config)
    differs = saved.world_size != now.world_size or (
        saved.fsdp_version is not None and now.fsdp_version is not None and saved.fsdp_version != now.fsdp_version
    )
    if not differs:
        return saved
    actor = os.path.join(folder, "actor")
    merged = os.path.join(folder, "merged_hf")
    old = f"trainer.nnodes x trainer.n_gpus_per_node = {saved.world_size}"
    if saved.fsdp_version and saved.fsdp_version != now.fsdp_version:
        strategy = {v: k for k, v in FSDP_VERSIONS.items()}[saved.fsdp_version]
        old += f" and actor_rollout_ref.actor.strategy={strategy}"
    raise GDRORecipeError(
        f"{folder} was saved with {saved.describe()}, and this launch has {now.describe()} "
        f"(trainer.nnodes={config.trainer.nnodes} x trainer.n_gpus_per_node={config.trainer.n_gpus_per_node}): "
        f"verl loads each rank's own shard (actor/model_world_size_{now.world_size}_rank_<r>.pt), so it cannot "
        f"resume it. Relaunch with the old layout ({old}), or start a new run in a new trainer.default_local_dir; "
        f"to carry the weights over, merge them ({MERGE_COMMAND.format(actor=actor, target=merged)}) and start "
        f"the new run from actor_rollout_ref.model.path={merged} (the optimizer and the step start afresh)"
    )


# --------------------------------------------------------------------------------------- the GDRO state
def _ways_on(old: Optional[str] = None) -> str:
    """The ways on from a saved state that cannot be restored: the old setting (``old``, when one is at
    fault), a new folder, or the key that resumes the model alone."""
    old = f"relaunch with {old}, " if old else ""
    return (
        f"{old}start a new run in a new trainer.default_local_dir, or set {RESTART_CONTROLLER_KEY}=true to resume "
        "the model and start the GDRO controller afresh"
    )


def read_saved_state(path: str) -> dict:
    """The controller state ``path`` holds, unpickled; one line naming the file for anything else."""
    try:
        with open(path, "rb") as f:
            state = pickle.load(f)
    except OSError as e:
        raise GDRORecipeError(f"{path} cannot be read ({e.strerror})") from None
    except Exception as e:  # noqa: BLE001 - UnpicklingError, EOFError (truncated / empty), a foreign class, ...
        size = os.path.getsize(path)
        what = "is empty" if size == 0 else f"({size} bytes) is not a complete GDRO state"
        raise GDRORecipeError(
            f"{path} {what} ({type(e).__name__}: {str(e)[:80] or 'no data'}), so the GDRO controller cannot be "
            f"restored: resume from an earlier complete checkpoint (trainer.resume_mode=resume_path "
            f"trainer.resume_from_path=<folder>/global_step_N), {_ways_on()}"
        ) from None
    missing = [
        k for k in ("version", "config", "binner", "prompt", "rollout") if not isinstance(state, dict) or k not in state
    ]
    if missing:
        raise GDRORecipeError(
            f"{path} holds a {type(state).__name__} without the GDRO controller's {', '.join(missing)}, so it is "
            f"not a GDRO state: {_ways_on()}"
        )
    return state


def dataset_fingerprint(ids: np.ndarray, prompts: list) -> str:
    """SHA-256 (16 hex digits) of the training prompts, each id with its prompt text (``data.prompt_key``,
    JSON), in id order: two datasets agree exactly when the same ids hold the same prompts."""
    h = hashlib.sha256()
    for i in np.argsort(ids, kind="stable"):
        h.update(f"{int(ids[i])}\t".encode())
        h.update(json.dumps(prompts[i], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def save_gdro_state(controller, path: str, dataset: Optional[dict], inflight: Optional[dict] = None) -> None:
    """The controller's ``state_dict()`` with the training data's ``dataset`` facts (fingerprint, prompt
    count) and the trainer's ``inflight`` groups, written atomically as :meth:`verl_ext.GDROController.save`
    writes it."""
    from verl_ext.atomic import atomic_replace

    state = controller.state_dict()
    if dataset:
        state[DATASET_STATE_KEY] = dict(dataset)
    if inflight is not None:
        state[INFLIGHT_STATE_KEY] = inflight
    with atomic_replace(path, "wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)


def changed_settings(saved: dict, current: dict) -> list[str]:
    """``gdro.<section>.<key>: saved -> now`` for every controller setting that differs between the config
    stored in a state (``state["config"]``) and the launch's."""
    out = []
    for section in ("binner", "prompt", "rollout"):
        for key, value in current.get(section, {}).items():
            old = saved.get(section, {}).get(key, value)
            if old != value:
                out.append(f"gdro.{section}.{key}: {old!r} -> {value!r}")
    for key in ("observe",):
        if key in saved and key in current and saved[key] != current[key]:
            out.append(f"gdro.{key}: {saved[key]!r} -> {current[key]!r}")
    return out


def _edges_setting(saved_cfg: dict, gdro: GDROConfig) -> tuple[str, Any, Any]:
    binner = saved_cfg.get("binner", {})
    if binner.get("bin_edges") is None and gdro.binner.bin_edges is None:
        return "gdro.binner.num_bins", binner.get("num_bins"), gdro.binner.num_bins
    return "gdro.binner.bin_edges", binner.get("bin_edges"), gdro.binner.bin_edges


def check_state_fits(
    path: str,
    config: DictConfig,
    gdro: GDROConfig,
    *,
    num_prompts: Optional[int],
    dataset: Optional[dict],
) -> list[str]:
    """Refuse a saved state the launch's controller cannot continue (module docstring); return the warnings
    (settings that differ but carry over, a state saved without the dataset's fingerprint)."""
    from verl_ext.controller import STATE_VERSION

    state = read_saved_state(path)
    if state.get("version") != STATE_VERSION:
        raise GDRORecipeError(
            f"{path} is GDRO state version {state.get('version')!r}, this recipe continues version {STATE_VERSION} "
            f"only: resume with the recipe that wrote it, {_ways_on()}"
        )
    saved_cfg, binner = state["config"], state["binner"]

    def misfit(setting: str, saved: Any, launched: Any, what: str = "", old: str = "") -> GDRORecipeError:
        return GDRORecipeError(
            f"{path} does not fit this launch: {setting} was {saved} when it was saved, this launch has {launched}"
            f"{what}; {_ways_on(old or f'the old setting ({setting}={saved})')}"
        )

    saved_edges = np.asarray(binner.get("edges"), dtype=np.float64)
    if saved_edges.shape != (len(gdro.binner.edges()),) or not np.allclose(saved_edges, gdro.binner.edges()):
        raise misfit(*_edges_setting(saved_cfg, gdro), " (the binner's bin edges)")
    if int(binner.get("window", -1)) != gdro.binner.window:
        raise misfit("gdro.binner.window", binner.get("window"), gdro.binner.window)
    if binner.get("half_life") != gdro.binner.half_life:
        raise misfit("gdro.binner.half_life", binner.get("half_life"), gdro.binner.half_life)
    groups = len(gdro.binner.edges()) - 1 + (1 if gdro.binner.unseen == "own_bin" else 0)  # as OnlineDifficultyBinner
    saved_groups = np.asarray(state["prompt"].get("scores", ())).shape[0]
    if saved_groups != groups:
        raise misfit(
            "gdro.binner.unseen",
            saved_cfg.get("binner", {}).get("unseen"),
            gdro.binner.unseen.value,
            f" ({saved_groups} groups then, {groups} now)",
        )
    arms = np.asarray(state["rollout"].get("arm_scores", np.zeros((0, 0))))
    now_arms = gdro.rollout.n_max - gdro.rollout.n_min + 1
    if arms.ndim != 2 or arms.shape[1] != now_arms:
        old = saved_cfg.get("rollout", {})
        raise misfit(
            "gdro.rollout.n_min..n_max",
            f"{old.get('n_min')}..{old.get('n_max')}",
            f"{gdro.rollout.n_min}..{gdro.rollout.n_max}",
            f" (the rollout arms; actor_rollout_ref.rollout.n was {old.get('n_mean')}, now "
            f"{config.actor_rollout_ref.rollout.n})",
        )
    if num_prompts is not None and int(binner.get("num_prompts", -1)) != num_prompts:
        raise misfit(
            "the training prompt count (largest extra_info.index + 1 of data.train_files)",
            binner.get("num_prompts"),
            num_prompts,
            old="the training files it was saved with",
        )
    warnings = []
    saved_data = state.get(DATASET_STATE_KEY)
    if dataset and saved_data and saved_data.get("fingerprint") != dataset.get("fingerprint"):
        raise GDRORecipeError(
            f"{path} does not fit this launch: the training prompts (ids and texts of data.train_files) differ from "
            f"those it was saved with (fingerprint {saved_data.get('fingerprint')} then, {dataset.get('fingerprint')} "
            f"now), so the state's per-prompt histories would be read as other prompts'; "
            f"{_ways_on('the training files it was saved with')}"
        )
    if dataset and not saved_data:
        warnings.append(
            f"{path} was saved without a fingerprint of the training prompts (by an older recipe): that they are "
            "the prompts it was saved with cannot be checked (the prompt count matches); the next save records it"
        )
    changed = changed_settings(saved_cfg, gdro_config_to_dict(gdro))
    if changed:
        warnings.append(
            f"resuming the GDRO state of {os.path.dirname(path)} with settings that differ from those it was saved "
            f"with: {'; '.join(changed)}"
        )
    return warnings


# --------------------------------------------------------------------------------------- the step
def resume_step(folder: str) -> Optional[int]:
    name = os.path.basename(os.path.normpath(folder))
    return int(name.removeprefix("global_step_")) if re.fullmatch(r"global_step_[0-9]+", name) else None


def total_training_steps(config: DictConfig, train_rows: Optional[int]) -> Optional[int]:
    """The run's last step as verl 0.9.1 sets it: ``trainer.total_training_steps``, or the training rows //
    ``data.train_batch_size`` x ``trainer.total_epochs`` (None when the rows are not known). verl counts the
    rows after its own filtering, which only removes rows, so this is never below verl's figure."""
    total = OmegaConf.select(config, "trainer.total_training_steps", default=None)
    if total is not None:
        return int(total)
    if not train_rows:
        return None
    return train_rows // int(config.data.train_batch_size) * int(config.trainer.total_epochs)


def nothing_to_train(config: DictConfig, folder: Optional[str], train_rows: Optional[int]) -> Optional[str]:
    """The one line of a relaunch that would train nothing: its resume step is at or past the last step."""
    step = resume_step(folder) if folder else None
    total = total_training_steps(config, train_rows)
    if step is None or total is None or step < total:
        return None
    how = (
        f"trainer.total_training_steps={total}"
        if OmegaConf.select(config, "trainer.total_training_steps", default=None) is not None
        else f"{total} steps (trainer.total_epochs={config.trainer.total_epochs} of the training data)"
    )
    return (
        f"nothing to train: the run resumes at step {step} ({folder}) and ends at {how}; raise "
        "trainer.total_training_steps to train on from that checkpoint, or pick a new trainer.default_local_dir "
        "for a new run"
    )


__all__ = [
    "DATASET_STATE_KEY",
    "Layout",
    "RESTART_CONTROLLER_KEY",
    "changed_settings",
    "check_saved_layout",
    "check_state_fits",
    "dataset_fingerprint",
    "launch_layout",
    "nothing_to_train",
    "read_saved_state",
    "resume_step",
    "save_gdro_state",
    "saved_layout",
    "total_training_steps",
]
