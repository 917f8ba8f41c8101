"""The trainer's checkpoint files and their retention (``trainer.max_actor_ckpt_to_keep``,
``trainer.max_critic_ckpt_to_keep``).

What a ``global_step_N`` folder holds. verl 0.9.1's ``_save_checkpoint``
(``verl/trainer/ppo/v1/trainer_base.py``) writes, in this order, ``actor/`` (the actor worker's
checkpoint manager), ``critic/`` (only when the run has a critic), ``data.pt`` (the dataloader state)
and, for the async trainer modes, ``transfer_queue/``; then ``latest_checkpointed_iteration.txt`` in the
experiment folder (the marker ``trainer.resume_mode=auto`` reads). The GDRO trainer writes
:data:`GDRO_STATE_FILE` into the folder *before* verl's save. A folder is **complete** when it holds
``actor/`` (not empty), ``data.pt`` and, when the run has them, ``critic/`` and the GDRO state: that is
every file a resume reads. verl names a folder ``global_step_{step}`` (no leading zeros): a name such as
``global_step_03`` is not one of its checkpoints; it is ignored, with a warning, and never deleted.

Whose folders retention deletes. Only the ones this process saved, as verl's own retention does: verl
deletes old ``global_step_K/actor`` (and ``critic``) folders from an in-memory list of the checkpoints the
running process saved (``verl/utils/checkpoint/checkpoint_manager.py``, ``register_checkpoint``). The
recipe keeps the same list (:func:`enforce_retention`'s ``own_saves``) and adds what verl leaves behind in
those folders: the GDRO state and the dataloader state, which cannot be resumed from without the actor.
Everything else is never deleted: folders from before this process (the one it resumed from, older ones,
newer ones of another branch), folders whose ownership is unknown, incomplete folders. A run that
resumes owns only what it saves from then on, so a restart never widens what can be deleted; the price is
that each restart leaves up to ``max_actor_ckpt_to_keep`` folders of the earlier process on disk, for the
user to remove.

What it deletes, of this process's saves. What verl's own retention would, each by its own limit:
``actor/`` beyond ``max_actor_ckpt_to_keep`` (oldest save first) and ``critic/`` beyond
``max_critic_ckpt_to_keep``. With a folder's ``actor/`` go the resume files written beside it
(:data:`RESUME_FILES`). Anything else in the folder (a user's notes, an exported model) is left alone; a
step folder is removed only when it ends empty. A delete that fails (permissions, a busy file system) is
logged in one line and retention goes on with the next path: it never fails a run after a good save.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
from collections.abc import Sequence

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

GDRO_STATE_FILE = "gdro_state.pkl"  # the controller state, saved by the trainer into global_step_N/
GDRO_RESUME_RECORD = "gdro_resume.jsonl"  # one line a resume: the restored state's per-field digests
ACTOR_DIR = "actor"  # verl: os.path.join(global_step_folder, "actor")
CRITIC_DIR = "critic"  # verl: str(Role.Critic)
DATALOADER_FILE = "data.pt"  # verl: the dataloader state, written after the actor and critic
TRANSFER_QUEUE_DIR = "transfer_queue"  # verl: async trainer modes only
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # verl's latest marker, written last
# What goes with a folder's actor/ (the files only a resume from that folder reads).
RESUME_FILES = (GDRO_STATE_FILE, DATALOADER_FILE, TRANSFER_QUEUE_DIR)

STEP_PREFIX = "global_step_"
_STEP_FOLDER = re.compile(r"^global_step_(0|[1-9][0-9]*)$")  # what verl writes: f"global_step_{step}"
_STEP_LIKE = re.compile(r"^global_step_[0-9]+$")
_warned_names: set[str] = set()  # non-verl names already warned about (one line per folder per process)


def step_folder_name(step: int) -> str:
    """verl's name for step ``step``'s folder."""
    return f"{STEP_PREFIX}{step}"


def step_of(path: str) -> int | None:
    """The step of a folder verl would name ``global_step_{step}`` (None for any other name, e.g.
    ``global_step_03``, which verl never writes)."""
    m = _STEP_FOLDER.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def checkpoint_folders(root: str) -> dict[int, str]:
    """``global_step_K`` folders directly under ``root`` as verl names them: step -> path. A folder named
    like one but not as verl would write it (``global_step_03``) is not counted as step 3: it is left out,
    with one warning per folder."""
    if not os.path.isdir(root):
        return {}
    found = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        m = _STEP_FOLDER.match(name)
        if m:
            found[int(m.group(1))] = path
        elif _STEP_LIKE.match(name) and path not in _warned_names:
            _warned_names.add(path)
            logger.warning(
                "GDRO: ignoring %s: verl names checkpoints global_step_%d, so this folder is none of its "
                "checkpoints (never resumed from by the marker, never deleted)",
                path,
                int(name[len(STEP_PREFIX) :]),
            )
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
    if not os.path.isdir(folder):
        return "no such folder"
    missing = []
    if not _nonempty_dir(os.path.join(folder, ACTOR_DIR)):
        missing.append(f"{ACTOR_DIR}/")
    if not os.path.isfile(os.path.join(folder, DATALOADER_FILE)):
        missing.append(DATALOADER_FILE)
    if with_gdro_state and not os.path.isfile(os.path.join(folder, GDRO_STATE_FILE)):
        missing.append(GDRO_STATE_FILE)
    return f"no {', '.join(missing)}" if missing else None


def newest_complete(root: str, *, with_gdro_state: bool = False) -> str | None:
    """The complete checkpoint folder with the highest step under ``root`` (None if there is none)."""
    folders = checkpoint_folders(root)
    for step in sorted(folders, reverse=True):
        if incomplete_reason(folders[step], with_gdro_state=with_gdro_state) is None:
            return folders[step]
    return None


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
) -> list[str]:
    """Apply verl's checkpoint limits to the ``global_step_K`` folders under ``root`` that this process
    saved (module docstring).

    ``own_saves``: the steps this process saved, in the order it saved them. No other folder is looked
    at, whatever it holds. Of the saves beyond ``keep_actor`` (oldest first) go ``actor/`` and
    :data:`RESUME_FILES`, of those beyond ``keep_critic`` ``critic/``; a folder that ends empty goes too.
    A failed delete is logged (one line) and the next path is processed. Returns the deleted paths.
    """
    saves = list(dict.fromkeys(reversed(list(own_saves))))[::-1]  # unique, in save order (last save wins)
    deleted: list[str] = []

    def drop(step: int, names: Sequence[str], limit: int, what: str) -> None:
        folder = os.path.join(root, step_folder_name(step))
        removed = []
        for name in names:
            target = os.path.join(folder, name)
            try:
                gone = _remove(target)
            except OSError as e:
                logger.warning(
                    "GDRO: checkpoint retention (keep %d %s) could not delete %s (%s: %s); left it, going on",
                    limit,
                    what,
                    target,
                    type(e).__name__,
                    e,
                )
                continue
            if gone:
                removed.append(name)
                deleted.append(target)
        if removed:
            logger.warning(
                "GDRO: checkpoint retention (keep %d %s of this run): deleting %s from %s",
                limit,
                what,
                ", ".join(removed),
                folder,
            )

    retired: list[int] = []
    if keep_actor is not None:
        retired = saves[: max(len(saves) - keep_actor, 0)]
        for step in retired:
            drop(step, (ACTOR_DIR, *RESUME_FILES), keep_actor, "actor checkpoints")
    if keep_critic is not None:
        critics = [s for s in saves if os.path.isdir(os.path.join(root, step_folder_name(s), CRITIC_DIR))]
        for step in critics[: max(len(critics) - keep_critic, 0)]:
            drop(step, (CRITIC_DIR,), keep_critic, "critic checkpoints")
            retired.append(step)
    for step in sorted(set(retired)):
        folder = os.path.join(root, step_folder_name(step))
        try:
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)
                deleted.append(folder)
                logger.warning("GDRO: checkpoint retention: removed the empty folder %s", folder)
        except OSError as e:
            logger.warning(
                "GDRO: checkpoint retention could not remove the empty folder %s (%s: %s); left it, going on",
                folder,
                type(e).__name__,
                e,
            )
    return deleted


# --------------------------------------------------------------------------------------- a full disk
# errno names of a write that failed for want of room: the disk, the user's quota, the file-size limit
STORAGE_ERRNOS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT", errno.EFBIG: "EFBIG"}
_STORAGE_TEXT = {os.strerror(code): name for code, name in STORAGE_ERRNOS.items()}  # as a remote error prints it
FULL_BYTES = 1 << 20  # a file system with less free space than this is full (torch's writer names no errno)


class StorageFullError(RuntimeError):
    """A write of the run's outputs (a checkpoint, the metrics file) failed for want of room; the message is
    the one line the launch prints (:func:`recipe.gdro.main_gdro.run_from_config`)."""


def _error_chain(error: BaseException | None):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        cause = getattr(error, "cause", None)  # Ray's RayTaskError holds the remote exception here
        error = cause if isinstance(cause, BaseException) else (error.__cause__ or error.__context__)


def storage_full(error: BaseException, folder: str) -> str | None:
    """Why ``error``, raised while writing under ``folder``, is a full disk: the errno name in its chain
    (:data:`STORAGE_ERRNOS`, also as a remote worker's error text names it), or, for an error that names
    none (torch's zip writer: ``unexpected pos ...``), ``ENOSPC`` when ``folder``'s file system has less than
    :data:`FULL_BYTES` free. None when it is not."""
    for e in _error_chain(error):
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return f"{STORAGE_ERRNOS[e.errno]} ({os.strerror(e.errno)})"
        for text, name in _STORAGE_TEXT.items():
            if text in str(e):
                return f"{name} ({text})"
    try:
        stat = os.statvfs(_existing(folder))
    except OSError:
        return None
    free = stat.f_bavail * stat.f_frsize
    if free < FULL_BYTES:
        detail = f"{type(error).__name__}: {_first_line(error)}"
        return f"ENOSPC (the file system of {folder} has {free} bytes free; {detail})"
    return None


def read_marker(root: str) -> bytes | None:
    """verl's marker file under ``root`` as bytes (None when there is none)."""
    try:
        with open(os.path.join(root, TRACKER_FILE), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:160]


def discard_failed_save(root: str, step: int, *, folder_existed: bool, marker_before: bytes | None, why: str) -> str:
    """After a save of step ``step`` under ``root`` failed for want of room (``why``): put verl's marker
    (:data:`TRACKER_FILE`) back as it was if the failed save touched it, remove the step folder if this save
    made it (else only its ``*.tmp`` files: it holds files from before), and return the one line that says so."""
    folder = os.path.join(root, step_folder_name(step))
    marker = os.path.join(root, TRACKER_FILE)
    try:
        if marker_before is not None and read_marker(root) != marker_before:
            with open(marker, "wb") as f:
                f.write(marker_before)
    except OSError:
        pass
    if not folder_existed:
        shutil.rmtree(folder, ignore_errors=True)
        left = f"the incomplete {folder} was removed" if not os.path.exists(folder) else f"{folder} is incomplete"
    else:
        for base, _, files in os.walk(folder):
            for name in files:
                if name.endswith(".tmp"):
                    try:
                        os.remove(os.path.join(base, name))
                    except OSError:
                        pass
        left = f"{folder} held files from before this run and is left incomplete"
    newest = newest_complete(root)
    last = f"the last complete checkpoint is {newest}" if newest else f"no complete checkpoint is in {root}"
    return (
        f"no room to save the checkpoint of step {step}: {why} under {folder}; {left}; {TRACKER_FILE} is "
        f"unchanged ({last}). Free space (or lower trainer.max_actor_ckpt_to_keep) and relaunch the same command "
        "to resume"
    )


def report_full_disk(save):
    """Decorates a trainer's ``_save_checkpoint`` (a trainer with ``_checkpoint_root()`` and ``global_steps``):
    a save that fails for want of room (:func:`storage_full`, asked before the clean-up frees room) is cleaned
    up by :func:`discard_failed_save` and raised as :class:`StorageFullError`, the one line; any other error
    is raised as it was."""

    @functools.wraps(save)
    def guarded(trainer, *args, **kwargs):
        root, step = trainer._checkpoint_root(), trainer.global_steps
        folder = os.path.join(root, step_folder_name(step))
        existed = os.path.isdir(folder) and bool(os.listdir(folder))
        marker = read_marker(root)
        try:
            return save(trainer, *args, **kwargs)
        except Exception as e:
            full = storage_full(e, folder)
            if full is None:
                raise
            line = discard_failed_save(root, step, folder_existed=existed, marker_before=marker, why=full)
            raise StorageFullError(line) from None

    return guarded
