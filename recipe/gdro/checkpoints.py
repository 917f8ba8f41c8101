"""The trainer's checkpoint files and their retention across restarts (``trainer.max_actor_ckpt_to_keep``,
``trainer.max_critic_ckpt_to_keep``, ``MAX_CKPT_TO_KEEP``).

What a ``global_step_N`` folder holds. verl 0.9.1's ``_save_checkpoint``
(``verl/trainer/ppo/v1/trainer_base.py``) writes, in this order, ``actor/`` (the actor worker's
checkpoint manager), ``critic/`` (only when the run has a critic), ``data.pt`` (the dataloader state)
and, for the async trainer modes, ``transfer_queue/``; then ``latest_checkpointed_iteration.txt`` in the
experiment folder (the marker ``trainer.resume_mode=auto`` reads). The GDRO trainer writes
:data:`GDRO_STATE_FILE` into the folder *before* verl's save. A folder is **complete** when it holds
``actor/`` (not empty), ``data.pt`` and, when the run has them, ``critic/`` and the GDRO state: that is
every file a resume reads. Anything short of that (a crash mid-save) is **incomplete**: retention neither
counts it nor touches it, and says so in a log line.

Why the recipe does retention. verl deletes old ``global_step_K/actor`` (and ``critic``) folders from an
in-memory list of the checkpoints *this process* saved (``verl/utils/checkpoint/checkpoint_manager.py``,
``register_checkpoint``), so after a restart the checkpoints of earlier processes are never deleted, and
the rest of each folder (the GDRO state, the dataloader state) never is.

How it ranks. By lineage, not by step number: the run's own saves since it started or resumed (newest
first), then the folder it resumed from, then that folder's ancestors (lower steps, newest first), then
whatever else is on disk (e.g. the steps of an abandoned branch above the resume point, after resuming
from an earlier checkpoint). The folder the run resumed from is never deleted.

What it deletes. What verl's own retention would, each by its own limit: ``actor/`` beyond
``max_actor_ckpt_to_keep`` and ``critic/`` beyond ``max_critic_ckpt_to_keep``. With a folder's
``actor/`` go the resume files written beside it (:data:`GDRO_STATE_FILE`, ``data.pt``,
``transfer_queue/``): without the actor the folder cannot be resumed, and verl's marker never points at
it again. Anything else in the folder (a user's notes, an exported model) is left alone; a step folder is
removed only when it ends empty.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterable, Sequence

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

GDRO_STATE_FILE = "gdro_state.pkl"  # the controller state, saved by the trainer into global_step_N/
ACTOR_DIR = "actor"  # verl: os.path.join(global_step_folder, "actor")
CRITIC_DIR = "critic"  # verl: str(Role.Critic)
DATALOADER_FILE = "data.pt"  # verl: the dataloader state, written after the actor and critic
TRANSFER_QUEUE_DIR = "transfer_queue"  # verl: async trainer modes only
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # verl's latest marker, written last
# What goes with a folder's actor/ (the files only a resume from that folder reads).
RESUME_FILES = (GDRO_STATE_FILE, DATALOADER_FILE, TRANSFER_QUEUE_DIR)

_STEP_FOLDER = re.compile(r"^global_step_(\d+)$")


def checkpoint_folders(root: str) -> dict[int, str]:
    """``global_step_K`` folders directly under ``root``: step -> path."""
    if not os.path.isdir(root):
        return {}
    found = {}
    for name in os.listdir(root):
        m = _STEP_FOLDER.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            found[int(m.group(1))] = path
    return found


def _limit(value) -> int | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def keep_limit(trainer_config) -> int | None:
    """How many actor checkpoints verl is asked to keep (None = all), as verl's ``_save_checkpoint`` reads it."""
    return keep_limits(trainer_config)[0]


def keep_limits(trainer_config) -> tuple[int | None, int | None]:
    """(actor, critic) limits as verl's ``_save_checkpoint`` reads them: ``max_actor_ckpt_to_keep`` and
    ``max_critic_ckpt_to_keep`` (None or <= 0 = keep all), both 1 under the deprecated
    ``remove_previous_ckpt_in_save``."""
    if trainer_config.get("remove_previous_ckpt_in_save", False):
        return 1, 1
    return (
        _limit(trainer_config.get("max_actor_ckpt_to_keep", None)),
        _limit(trainer_config.get("max_critic_ckpt_to_keep", None)),
    )


def _nonempty_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


def incomplete_reason(folder: str, *, with_gdro_state: bool = False) -> str | None:
    """Why ``folder`` is not a complete checkpoint (None if it is): it needs ``actor/`` (not empty),
    ``data.pt`` (verl writes it after the actor and the critic, so it also vouches for ``critic/``) and,
    when ``with_gdro_state``, the GDRO state."""
    missing = []
    if not _nonempty_dir(os.path.join(folder, ACTOR_DIR)):
        missing.append(f"{ACTOR_DIR}/")
    if not os.path.isfile(os.path.join(folder, DATALOADER_FILE)):
        missing.append(DATALOADER_FILE)
    if with_gdro_state and not os.path.isfile(os.path.join(folder, GDRO_STATE_FILE)):
        missing.append(GDRO_STATE_FILE)
    return f"no {', '.join(missing)}" if missing else None


def lineage_order(steps: Iterable[int], own_saves: Sequence[int] = (), resumed: int | None = None) -> list[int]:
    """``steps`` ranked most-worth-keeping first: this run's saves (newest first), the step it resumed
    from, that step's ancestors (lower steps, newest first), then the rest (newest first)."""
    steps = set(steps)
    order = [s for s in dict.fromkeys(reversed(list(own_saves))) if s in steps]
    if resumed is not None and resumed in steps and resumed not in order:
        order.append(resumed)
    rest = sorted(steps - set(order), reverse=True)
    if resumed is not None:
        order += [s for s in rest if s < resumed] + [s for s in rest if s > resumed]
    else:
        order += rest
    return order


def _remove(path: str) -> bool:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
        return True
    if os.path.lexists(path):
        os.remove(path)
        return True
    return False


def enforce_retention(
    root: str,
    keep_actor: int | None,
    keep_critic: int | None = None,
    *,
    own_saves: Sequence[int] = (),
    resumed: int | None = None,
    with_gdro_state: bool = False,
) -> list[str]:
    """Apply verl's checkpoint limits to every ``global_step_K`` folder under ``root`` (module docstring).

    ``own_saves``: the steps this process saved, in order; ``resumed``: the step it resumed from (never
    deleted); ``with_gdro_state``: whether a complete folder of this run holds :data:`GDRO_STATE_FILE`.
    A folder whose ``actor/`` is gone but whose ``data.pt`` or ``critic/`` is there had its actor retired
    (by verl's in-process limit or an earlier call): its resume files go, its ``critic/`` is ranked by the
    critic limit. Returns the deleted paths (files, sub-folders, and step folders that ended empty), each logged.
    """
    if keep_actor is None and keep_critic is None:
        return []
    folders = checkpoint_folders(root)
    complete, retired = [], []
    for step in sorted(folders):
        path = folders[step]
        reason = incomplete_reason(path, with_gdro_state=with_gdro_state)
        if reason is None or step == resumed:
            complete.append(step)  # what the run resumed from counts as a checkpoint, whatever it holds
        elif not os.path.isdir(os.path.join(path, ACTOR_DIR)) and (
            os.path.exists(os.path.join(path, DATALOADER_FILE)) or os.path.isdir(os.path.join(path, CRITIC_DIR))
        ):
            retired.append(step)  # verl writes actor/ first: data.pt or critic/ without it = actor retired
        else:
            logger.warning(
                "GDRO: checkpoint retention ignores the incomplete %s (%s): neither counted nor deleted", path, reason
            )
    deleted: list[str] = []

    def drop(step: int, names: Sequence[str], limit: int, what: str) -> None:
        removed = []
        for name in names:
            target = os.path.join(folders[step], name)
            if _remove(target):
                removed.append(name)
                deleted.append(target)
        if removed:
            logger.warning(
                "GDRO: checkpoint retention (keep %d %s): deleting %s from %s",
                limit,
                what,
                ", ".join(removed),
                folders[step],
            )

    if keep_actor is not None:
        beyond = lineage_order(complete, own_saves, resumed)[keep_actor:]
        for step in sorted([s for s in beyond if s != resumed] + retired):
            drop(step, (ACTOR_DIR, *RESUME_FILES), keep_actor, "actor checkpoints")
    if keep_critic is not None:
        critics = [s for s in complete + retired if os.path.isdir(os.path.join(folders[s], CRITIC_DIR))]
        beyond = lineage_order(critics, own_saves, resumed)[keep_critic:]
        for step in sorted(s for s in beyond if s != resumed):
            drop(step, (CRITIC_DIR,), keep_critic, "critic checkpoints")
    for step in sorted(set(complete + retired)):
        path = folders[step]
        if os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)
            deleted.append(path)
            logger.warning("GDRO: checkpoint retention: removed the empty folder %s", path)
    return deleted
