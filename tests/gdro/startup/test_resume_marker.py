"""The resume point is checked before Ray (issue 32 item 2, issue 35 item 0, ``check_resume_point``).

Each case is the dry run a user runs (``python -m recipe.gdro.main_gdro gdro.dry_run=config ...``, through
:func:`recipe.gdro.main_gdro.cli`) against a checkpoint folder laid out as verl and the GDRO trainer write
it; a refusal is exit 2 with one ``gdro ...: error:`` line and no traceback. Before, verl read the marker
inside Ray: ``three`` was a ``ValueError`` traceback, a marker naming a missing folder (or no marker at
all) started over on top of the checkpoints, and ``resume_mode=disable`` overwrote them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_helpers.overrides import paper_overrides
from recipe_helpers.saved_state import MARKER, write_checkpoint

from recipe.gdro.main_gdro import cli


def launch_argv() -> list[str]:
    return [a for a in paper_overrides(Path("/nonexistent/dapo.parquet")) if a != "gdro.dry_run=true"]


@pytest.fixture
def root(tmp_path) -> Path:
    """A run's checkpoint folder: complete steps 2 and 4, an incomplete 5 (crashed mid-save), each with the
    GDRO state the launch saves."""
    folder = tmp_path / "ckpt"
    for step in (2, 4):
        write_checkpoint(folder, step, launch_argv())
    write_checkpoint(folder, 5, launch_argv(), complete=False)
    return folder


def dry_run(capsys, root: Path, *extra: str) -> tuple[int, str, str]:
    code = cli([*launch_argv(), "gdro.dry_run=config", f"trainer.default_local_dir={root}", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def refusal(capsys, root: Path, *extra: str) -> str:
    before = sorted(str(p) for p in root.rglob("*"))
    code, out, err = dry_run(capsys, root, *extra)
    assert code == 2, (out[-800:], err[-2000:])
    assert "Traceback" not in err and "dry run OK" not in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gdro"), err[-2000:]
    assert sorted(str(p) for p in root.rglob("*")) == before  # nothing written or removed
    return lines[0]


def resume_newest(root: Path) -> str:
    return f"trainer.resume_mode=resume_path trainer.resume_from_path={root / 'global_step_4'}"


def test_a_marker_holding_garbage_is_refused_naming_it_and_the_way_on(capsys, root):
    (root / MARKER).write_text("three")
    line = refusal(capsys, root, "trainer.resume_mode=auto")
    assert str(root / MARKER) in line and "'three'" in line and "not a step number" in line
    assert resume_newest(root) in line  # the newest complete folder, not the incomplete 5


def test_a_marker_naming_a_missing_folder_is_refused(capsys, root):
    (root / MARKER).write_text("7")
    line = refusal(capsys, root, "trainer.resume_mode=auto")
    assert str(root / MARKER) in line and "'7'" in line and f"{root / 'global_step_7'} does not exist" in line
    assert resume_newest(root) in line


def test_a_marker_naming_an_incomplete_folder_is_refused(capsys, root):
    (root / MARKER).write_text("5")
    line = refusal(capsys, root, "trainer.resume_mode=auto")
    assert f"{root / 'global_step_5'} is incomplete (no data.pt)" in line and resume_newest(root) in line


def test_a_missing_marker_beside_checkpoints_is_refused(capsys, root):
    (root / MARKER).unlink()
    line = refusal(capsys, root, "trainer.resume_mode=auto")
    assert f"{root / MARKER} is missing" in line and resume_newest(root) in line


def test_resume_mode_disable_into_a_folder_with_checkpoints_is_refused(capsys, root, tmp_path):
    line = refusal(capsys, root, "trainer.resume_mode=disable")
    assert f"would start over in {root}" in line and "global_step_2, global_step_4, global_step_5" in line
    for way_on in ("trainer.resume_mode=auto", "trainer.default_local_dir", "gdro.overwrite_checkpoints=true"):
        assert way_on in line, line
    # the explicit overwrite key lets it through; an empty or new folder needs none
    code, _, err = dry_run(capsys, root, "trainer.resume_mode=disable", "gdro.overwrite_checkpoints=true")
    assert code == 0, err
    code, _, err = dry_run(capsys, tmp_path / "new_run", "trainer.resume_mode=disable")
    assert code == 0, err


def test_a_resume_path_that_cannot_be_resumed_is_refused(capsys, root):
    line = refusal(
        capsys, root, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={root / 'global_step_5'}"
    )
    assert f"trainer.resume_from_path={root / 'global_step_5'} cannot be resumed from (no data.pt)" in line
    assert resume_newest(root) in line
    line = refusal(
        capsys, root, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={root / 'global_step_04'}"
    )
    assert "'04'" in line and "no leading zeros" in line and resume_newest(root) in line
    line = refusal(capsys, root, "trainer.resume_mode=resume_path")  # verl: an assert inside Ray
    assert "trainer.resume_mode=resume_path needs trainer.resume_from_path=" in line and "None" in line


def test_a_zero_padded_folder_is_not_the_step_the_marker_names(capsys, tmp_path):
    """Only global_step_03 on disk and a marker saying 3: verl would look for global_step_3 and start over;
    the check does not take global_step_03 for it."""
    root = tmp_path / "ckpt"
    write_checkpoint(root, 3).rename(root / "global_step_03")
    line = refusal(capsys, root, "trainer.resume_mode=auto")
    assert f"{root / 'global_step_3'} does not exist" in line and "no complete checkpoint is in" in line
    assert "trainer.resume_mode=disable" in line


def test_good_resume_points_pass(capsys, root, tmp_path):
    assert dry_run(capsys, root, "trainer.resume_mode=auto")[0] == 0  # marker 4: complete
    ok = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={root / 'global_step_2'}"]
    assert dry_run(capsys, root, *ok)[0] == 0
    assert dry_run(capsys, tmp_path / "fresh", "trainer.resume_mode=auto")[0] == 0  # nothing there yet
