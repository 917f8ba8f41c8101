"""Checkpoint retention across restarts (``trainer.max_actor_ckpt_to_keep``, ``MAX_CKPT_TO_KEEP``).

verl 0.9.1 deletes old ``global_step_K/actor`` folders from an in-memory list of the checkpoints it
saved in this process (``verl/utils/checkpoint/checkpoint_manager.py``, ``register_checkpoint``), so
after a restart the checkpoints of earlier processes are never deleted, and the rest of each
``global_step_K`` folder (``gdro_state.pkl``, the dataloader state) never is. The recipe enforces
the limit over the folders it finds on disk, on resume and after each save.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterable

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

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


def keep_limit(trainer_config) -> int | None:
    """How many checkpoints verl is asked to keep (None = all), as verl's ``_save_checkpoint`` reads it."""
    if trainer_config.get("remove_previous_ckpt_in_save", False):
        return 1
    keep = trainer_config.get("max_actor_ckpt_to_keep", None)
    if keep is None or not isinstance(keep, int) or keep <= 0:
        return None
    return keep


def enforce_retention(root: str, keep: int | None, protect: Iterable[int] = ()) -> list[str]:
    """Delete the oldest ``global_step_K`` folders under ``root`` beyond the newest ``keep``, whole
    (verl's checkpoint and the GDRO state in it). Folders of the steps in ``protect`` (the one resumed
    from, the one just saved) are never deleted. Returns the deleted paths, oldest first; each is logged.
    """
    if keep is None:
        return []
    folders = checkpoint_folders(root)
    protected = {int(p) for p in protect}
    newest = sorted(folders, reverse=True)[:keep]
    doomed = sorted(s for s in folders if s not in newest and s not in protected)
    deleted = []
    for step in doomed:
        path = folders[step]
        logger.warning("GDRO: checkpoint retention (keep %d): deleting %s", keep, path)
        shutil.rmtree(path)
        deleted.append(path)
    return deleted
