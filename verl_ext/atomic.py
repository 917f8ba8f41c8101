"""Atomic file replacement: a reader sees either the old file or the complete new one."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import IO, Iterator


@contextmanager
def atomic_replace(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Yield a temporary file beside ``path``; on success fsync it and rename it over ``path``.

    The temporary file lives in the same folder (same filesystem, so ``os.replace`` is atomic) and
    is removed if the block raises.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
