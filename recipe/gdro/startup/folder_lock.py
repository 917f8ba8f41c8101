"""One launch per output folder at a time: an OS lock on ``<trainer.default_local_dir>/.gdro_run.lock``.

Every launch (verl's path and the CPU backend alike) writes its checkpoints, ``gdro_metrics.jsonl`` and its
other outputs into ``trainer.default_local_dir``; two launches into one folder would move each other's
metrics aside, append to one file and overwrite each other's ``global_step_N`` folders. So a launch takes
an exclusive ``fcntl.flock`` on the folder's lock file after its start-up checks and before Ray starts,
and holds it for the life of its process. The kernel drops the lock when the process ends, however it
ends (a crash, ``kill -9``, a lost node), so a lock file left by a dead launch never blocks the next one.
The file holds the holder's pid, host and start time, which the refused launch names.

Where it cannot work. ``flock`` on a network file system is only as good as the file system's lock
service: Linux's NFS client turns it into an NFS byte-range lock (NFSv4, or NFSv3 with the NLM lock
daemon), which holds across the nodes that mount the folder; an NFS mount with ``nolock`` (or ``local_lock``)
keeps the lock on one machine, so two launches from two different nodes into one shared folder both
proceed. A file system that refuses locks (``ENOLCK``, ``EOPNOTSUPP``: some FUSE mounts) gets a one-line
warning and the launch runs unlocked. A remote folder (``scheme://``) is not locked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import IO, Optional

LOCK_FILE = ".gdro_run.lock"
_HELD: list[FolderLock] = []  # the locks this process holds: kept open (and so locked) until it ends


class FolderInUse(Exception):
    """Another live launch holds the output folder's lock (the message names its pid and host)."""


@dataclass
class FolderLock:
    folder: str
    path: str
    handle: Optional[IO]  # None: the file system refused the lock (see warning)
    warning: str = ""


def _holder(handle: IO) -> str:
    """What the lock file says about its holder: ``pid P on host H since T``."""
    handle.seek(0)
    try:
        info = json.loads(handle.read() or "{}")
    except ValueError:
        info = {}
    since = info.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}{when}"


def lock_output_folder(folder: str, key: str = "trainer.default_local_dir") -> FolderLock:
    """Create ``folder`` and take the exclusive lock of its :data:`LOCK_FILE` for the rest of this process.

    Raises :class:`FolderInUse` (one line: the folder, the holder's pid and host, the ways on) when a live
    process holds it. A file system without lock support returns an unlocked :class:`FolderLock` whose
    ``warning`` says so. Taking a lock this process already holds returns it again."""
    folder = os.path.abspath(os.path.expanduser(folder))
    for held in _HELD:
        if held.folder == folder:
            return held
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_FILE)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(handle)
        handle.close()
        raise FolderInUse(
            f"{key}={folder} is in use by another launch ({holder}; lock {path}): one run per folder at a "
            "time. Wait for it to end, or give this launch its own folder (trainer.default_local_dir / "
            "trainer.experiment_name)"
        ) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            handle.close()
            raise
        handle.close()
        lock = FolderLock(
            folder,
            path,
            None,
            f"[gdro] warning: {folder}'s file system refuses locks ({errno.errorcode.get(e.errno, e.errno)}): "
            "this launch runs without the one-run-per-folder lock; make sure no other launch writes here",
        )
        _HELD.append(lock)
        return lock
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "argv": sys.argv}))
    handle.flush()
    lock = FolderLock(folder, path, handle)
    _HELD.append(lock)
    return lock


def folder_holder(folder: str) -> Optional[str]:
    """Who holds ``folder``'s lock now (``pid P on host H since T``), or None (free, no lock file, or a file
    system without locks): a dry run reports it without taking the lock."""
    path = os.path.join(os.path.abspath(os.path.expanduser(folder)), LOCK_FILE)
    if any(h.path == path for h in _HELD):
        return None
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(handle)
        except OSError:
            return None
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return None


def release_all() -> None:
    """Drop every lock this process holds (a test, or a caller that runs several launches in one process)."""
    while _HELD:
        lock = _HELD.pop()
        if lock.handle is not None:
            lock.handle.close()


__all__ = ["LOCK_FILE", "FolderInUse", "FolderLock", "folder_holder", "lock_output_folder", "release_all"]
