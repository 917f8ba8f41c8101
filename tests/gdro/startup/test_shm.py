"""startup/shm.py: the shared-memory segments a launch leaves behind are removed at its end, and only those."""

from __future__ import annotations

import mmap
import time

from recipe.gdro.startup.shm import ShmLeftovers


def _segment(folder, name: str, size: int = 4096):
    path = folder / name
    path.write_bytes(b"\0" * size)
    return path


def test_only_new_unmapped_segments_are_removed(tmp_path):
    before = _segment(tmp_path, "psm_before")
    leftovers = ShmLeftovers(tmp_path)
    left = _segment(tmp_path, "psm_left")  # what a killed vLLM process leaves: nobody maps it
    in_use = _segment(tmp_path, "psm_in_use")  # another program's, created meanwhile and mapped
    other = _segment(tmp_path, "not_a_segment")
    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        t0 = time.monotonic()
        removed = leftovers.remove(wait=0.6)
        assert time.monotonic() - t0 >= 0.5  # it waited for the mapping to go, then gave up on it
        assert mapped[0] == 0
    assert removed == ["psm_left"]
    assert not left.exists() and in_use.exists() and before.exists() and other.exists()
    assert leftovers.remove(wait=0) == ["psm_in_use"]  # unmapped now: a later call removes it


def test_nothing_new_returns_at_once(tmp_path):
    leftovers = ShmLeftovers(tmp_path / "missing")  # a machine without the folder
    t0 = time.monotonic()
    assert leftovers.remove(wait=5) == []
    assert time.monotonic() - t0 < 1


def test_a_segment_mapped_under_the_name_it_was_made_with_stays(tmp_path):
    """glibc's sem_open: made under a temporary name, mapped, linked to its real name (``sem.mp-*``), the
    temporary name unlinked; the mapping then names a deleted file. Another launch's live semaphore, made
    meanwhile, must stay (removed, its vLLM worker could not start: FileNotFoundError in SemLock._rebuild)."""
    leftovers = ShmLeftovers(tmp_path)
    made = _segment(tmp_path, "sem.tmpXYZ")
    with open(made, "r+b") as f, mmap.mmap(f.fileno(), 0):
        (tmp_path / "sem.mp-live").hardlink_to(made)
        made.unlink()
        assert leftovers.remove(wait=0) == []
        assert (tmp_path / "sem.mp-live").exists()
    assert leftovers.remove(wait=0) == ["sem.mp-live"]  # unmapped now: a later call removes it
