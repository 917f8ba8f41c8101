"""verl_ext.atomic.atomic_replace: all-or-nothing replacement with the umask's permissions."""

from __future__ import annotations

import os

import pytest

from verl_ext.atomic import atomic_replace, current_umask


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600), (0o000, 0o666)])
def test_new_file_gets_the_umask_permissions(tmp_path, umask, mask, expected):
    umask(mask)
    assert current_umask() == mask
    path = tmp_path / "sub" / "state.pkl"
    with atomic_replace(path, "wb") as f:
        f.write(b"abc")
    assert path.read_bytes() == b"abc"
    assert path.stat().st_mode & 0o777 == expected


def test_replacing_keeps_the_existing_files_permissions(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    path.chmod(0o640)
    with atomic_replace(path, "w") as f:
        f.write("new\n")
    assert path.read_text() == "new\n"
    assert path.stat().st_mode & 0o777 == 0o640


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path, umask):
    path = tmp_path / "state.pkl"
    path.write_bytes(b"old")
    with pytest.raises(OSError, match="No space left"):
        with atomic_replace(path, "wb") as f:
            f.write(b"half")
            raise OSError(28, "No space left on device")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.pkl"]
