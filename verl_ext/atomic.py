"""Atomic file replacement: a reader sees either the old file or the complete new one."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, but brief)
    os.umask(mask)
    return mask


def blocking_file(path: str | os.PathLike) -> str | None:
    """The first existing ancestor of ``path`` (or ``path`` itself) that is not a directory, if any:
    a path below a plain file can be neither read nor created, and saying so beats "not found"."""
    p = os.path.abspath(os.path.expanduser(os.fspath(path)))
    while True:
        if os.path.exists(p):
            return None if os.path.isdir(p) else p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def _final_mode(path: str) -> int:
    """Permission bits for the new file: the replaced file's, else 0666 minus the umask (what
    ``open(path, "w")`` gives). ``mkstemp`` alone would leave 0600, unreadable by other users and by
    Ray workers running under other accounts on shared storage."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


@contextmanager
def atomic_replace(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Yield a temporary file beside ``path``; on success fsync it and rename it over ``path``.

    The temporary file lives in the same folder (same filesystem, so ``os.replace`` is atomic) and
    is removed if the block raises. The result has the permissions of the file it replaces, or for
    a new file the ones the umask gives (0644 under umask 022).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, _final_mode(path))
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
