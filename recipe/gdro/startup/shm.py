"""Shared-memory segments a launch leaves in ``/dev/shm``: found and removed when the launch ends.

vLLM's message queues are Python ``SharedMemory`` blocks (``/dev/shm/psm_*``, 160-240 MiB each for the
tiny real path), verl's weight sync a ``verl_weights_*`` buffer. Their creators unlink them on a clean
close, but Ray stops those processes with a signal, so every launch left them behind: RAM held until the
machine reboots.

:class:`ShmLeftovers` lists the segments (:data:`PREFIXES`) when the launch starts; at its end (normal, error,
signal, lost node) :meth:`ShmLeftovers.remove` unlinks the segments that are new since then, belong to
this user and that no process maps any more, after waiting up to ``wait`` s for the run's processes to
let go. A segment another program created meanwhile and still uses is mapped, so it stays. Only this
node's ``/dev/shm`` is seen: on a multi-node cluster the other nodes' segments are theirs to clean.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
# multiprocessing.shared_memory's blocks (vLLM's queues), verl's weight-sync buffer, multiprocessing's semaphores
PREFIXES = ("psm_", "verl_weights_", "sem.mp-")


def segments(folder: Path) -> set[str]:
    """Names of the segments (:data:`PREFIXES`) now in ``folder``; none when it cannot be read."""
    try:
        return {e.name for e in os.scandir(folder) if e.name.startswith(PREFIXES) and e.is_file(follow_symlinks=False)}
    except OSError:
        return set()


def mapped_segments(folder: Path) -> set[str]:
    """Names of the segments under ``folder`` that some readable process maps (``/proc/<pid>/maps``).

    Matched by inode, not by the path a mapping names: glibc's ``sem_open`` makes a semaphore under a
    temporary name, maps it, links it to its real name (``sem.mp-*``) and unlinks the temporary one, so the
    mapping of a semaphore in use names a deleted file. Matched by path, a launch ending beside another one
    removed that one's live semaphore and its vLLM worker could not start (``SemLock._rebuild``:
    FileNotFoundError, a full-suite run with two real-path launches at once).

    Not ``psutil.Process.memory_maps``: it reads ``/proc/<pid>/smaps`` (per-mapping RSS and swap), 25x
    slower here (1.32 s against 0.053 s over 115 processes, timed with both on ``/dev/shm``), and
    :meth:`ShmLeftovers.remove` repeats this walk every 0.5 s while it waits.
    """
    inodes: set[int] = set()
    prefix = f" {folder}/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if prefix in line:  # address perms offset dev inode path
                        inodes.add(int(line.split(maxsplit=5)[4]))
        except (OSError, ValueError, IndexError):  # gone, or another user's: its segments are not ours either
            continue
    mapped: set[str] = set()
    try:
        for entry in os.scandir(folder):
            try:
                if entry.inode() in inodes:
                    mapped.add(entry.name)
            except OSError:
                continue
    except OSError:
        pass
    return mapped


class ShmLeftovers:
    """The segments present at the start of a launch, to remove what it leaves (module docstring)."""

    def __init__(self, folder: Path = SHM_DIR):
        self.folder = Path(folder)
        self.before = segments(self.folder)
        self.uid = os.getuid()

    def _new_and_ours(self) -> set[str]:
        out = set()
        for name in segments(self.folder) - self.before:
            try:
                if (self.folder / name).stat().st_uid == self.uid:
                    out.add(name)
            except OSError:
                continue
        return out

    def remove(self, wait: float = 10.0) -> list[str]:
        """Unlink the new segments no process maps, waiting up to ``wait`` s for mappings to go; returns
        the names removed. Never raises: a segment that cannot be removed is left and named in the return
        of a later call."""
        deadline = time.monotonic() + wait
        removed: list[str] = []
        while True:
            new = self._new_and_ours()
            free = new - mapped_segments(self.folder)
            for name in sorted(free):
                try:
                    (self.folder / name).unlink()
                    removed.append(name)
                except OSError:
                    pass
            if not (new - free) or time.monotonic() >= deadline:
                return removed
            time.sleep(0.5)
