"""A small real file system for the full-disk tests: a tmpfs of a given size mounted on a temporary folder
(``mount -t tmpfs -o size=...``, which needs root or CAP_SYS_ADMIN; where it is refused the test is skipped with
that reason). Writes there fail with ENOSPC exactly as on a full disk."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path) -> None:
    """Fill the file system of ``folder`` to the last byte (unbuffered writes, 64 KiB then 1 byte at a time)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        for chunk in (b"\0" * 65536, b"\0"):
            try:
                while f.write(chunk):
                    pass
            except OSError:
                pass
