"""Checkpoint retention across restarts (issue 27 item 1, ``recipe/gdro/checkpoints.py``).

Each folder is laid out as verl 0.9.1's ``_save_checkpoint`` and the GDRO trainer write it: ``actor/``,
optionally ``critic/``, ``data.pt``, ``gdro_state.pkl``, and the ``latest_checkpointed_iteration.txt``
marker. The calls are the ones the trainer makes after a save: its own saves since it started, the step
it resumed from.
"""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from recipe.gdro.checkpoints import (
    GDRO_STATE_FILE,
    enforce_retention,
    incomplete_reason,
    keep_limit,
    keep_limits,
    lineage_order,
)


def write_checkpoint(root, step: int, *, critic: bool = False, complete: bool = True):
    """A global_step_N folder in the order verl and the trainer write it (a crash stops before data.pt)."""
    folder = root / f"global_step_{step}"
    folder.mkdir(parents=True)
    (folder / GDRO_STATE_FILE).write_bytes(b"state")
    (folder / "actor").mkdir()
    (folder / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"weights")
    if critic:
        (folder / "critic").mkdir()
        (folder / "critic" / "model_world_size_1_rank_0.pt").write_bytes(b"critic")
    if complete:
        (folder / "data.pt").write_bytes(b"dataloader")
        (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return folder


def contents(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_resume_from_an_earlier_step_keeps_the_folder_resumed_from(tmp_path):
    """150 and 200 on disk; the run resumes from 150 (resume_path) at keep=2. The save at 160 keeps 160 and
    150 (the known-good checkpoint resumed from) and retires the abandoned 200; later saves never
    delete 150, and each retires the run's own oldest save, not the previous live one."""
    for step in (150, 200):
        write_checkpoint(tmp_path, step)
    write_checkpoint(tmp_path, 160)
    deleted = enforce_retention(str(tmp_path), 2, own_saves=[160], resumed=150, with_gdro_state=True)
    assert contents(tmp_path / "global_step_150") == ["actor", "data.pt", GDRO_STATE_FILE]
    assert contents(tmp_path / "global_step_160") == ["actor", "data.pt", GDRO_STATE_FILE]
    assert not (tmp_path / "global_step_200").exists()
    assert str(tmp_path / "global_step_200") in deleted
    for step, own in ((170, [160, 170]), (180, [160, 170, 180])):
        write_checkpoint(tmp_path, step)
        enforce_retention(str(tmp_path), 2, own_saves=own, resumed=150, with_gdro_state=True)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == [
        "global_step_150",
        "global_step_170",
        "global_step_180",
    ]


def test_a_partial_folder_is_neither_counted_nor_deleted(tmp_path, caplog):
    """A crash left global_step_300 without data.pt. At keep=1 the save at 210 (resumed from 200) must not
    count 300 as newest and delete the complete 200; 300 is left alone, and a log line says so."""
    write_checkpoint(tmp_path, 200)
    write_checkpoint(tmp_path, 300, complete=False)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("200")
    write_checkpoint(tmp_path, 210)
    with caplog.at_level(logging.WARNING, logger="recipe.gdro.checkpoints"):
        deleted = enforce_retention(str(tmp_path), 1, own_saves=[210], resumed=200, with_gdro_state=True)
    assert deleted == []
    assert contents(tmp_path / "global_step_200") == ["actor", "data.pt", GDRO_STATE_FILE]
    assert contents(tmp_path / "global_step_300") == ["actor", GDRO_STATE_FILE]
    ignored = [r.getMessage() for r in caplog.records if "incomplete" in r.getMessage()]
    assert len(ignored) == 1 and "global_step_300" in ignored[0] and "data.pt" in ignored[0]
    # A fresh run with the same leftovers: the partial folder is still ignored, the older complete one
    # goes only once the run has a save of its own to keep.
    assert incomplete_reason(str(tmp_path / "global_step_300")) == "no data.pt"
    assert incomplete_reason(str(tmp_path / "global_step_200"), with_gdro_state=True) is None


def test_only_what_verl_would_delete_goes_and_critic_has_its_own_limit(tmp_path):
    """keep 1 actor, 2 critics. Retiring a folder deletes its actor/ and resume files (GDRO state, data.pt)
    but not a user's file nor critic/ while the critic limit keeps it; a folder is removed only when it
    ends empty."""
    for step in (10, 20, 30):
        write_checkpoint(tmp_path, step, critic=True)
    (tmp_path / "global_step_10" / "eval_notes.md").write_text("keep me")
    deleted = enforce_retention(str(tmp_path), 1, 2, own_saves=[10, 20, 30], with_gdro_state=True)
    assert contents(tmp_path / "global_step_30") == ["actor", "critic", "data.pt", GDRO_STATE_FILE]
    assert contents(tmp_path / "global_step_20") == ["critic"]  # the critic limit (2) keeps it
    assert contents(tmp_path / "global_step_10") == ["eval_notes.md"]  # a user's file is never deleted
    assert str(tmp_path / "global_step_10" / "critic") in deleted
    # The next save: 20's critic goes too, and its folder, now empty, with it.
    write_checkpoint(tmp_path, 40, critic=True)
    enforce_retention(str(tmp_path), 1, 2, own_saves=[10, 20, 30, 40], with_gdro_state=True)
    assert not (tmp_path / "global_step_20").exists()
    assert contents(tmp_path / "global_step_30") == ["critic"]
    assert contents(tmp_path / "global_step_10") == ["eval_notes.md"]


def test_a_folder_whose_actor_verl_already_retired_loses_its_resume_files(tmp_path):
    """verl's in-process limit deletes global_step_K/actor only; the GDRO state and data.pt left beside it
    cannot be resumed from and go at the next retention."""
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step)
    import shutil

    shutil.rmtree(tmp_path / "global_step_1" / "actor")
    enforce_retention(str(tmp_path), 2, own_saves=[1, 2, 3], with_gdro_state=True)
    assert not (tmp_path / "global_step_1").exists()
    assert contents(tmp_path / "global_step_2") == ["actor", "data.pt", GDRO_STATE_FILE]


def test_lineage_order_and_limits():
    # own saves newest first, then the resumed step, its ancestors, then the abandoned branch
    assert lineage_order([100, 150, 160, 170, 200, 250], own_saves=[160, 170], resumed=150) == [
        170,
        160,
        150,
        100,
        250,
        200,
    ]
    assert lineage_order([1, 5, 3]) == [5, 3, 1]
    assert keep_limit(OmegaConf.create({"max_actor_ckpt_to_keep": 3})) == 3
    assert keep_limits(OmegaConf.create({"max_actor_ckpt_to_keep": 3, "max_critic_ckpt_to_keep": 1})) == (3, 1)
    assert keep_limits(OmegaConf.create({"max_actor_ckpt_to_keep": None})) == (None, None)
    assert keep_limits(OmegaConf.create({"max_actor_ckpt_to_keep": 0})) == (None, None)
    assert keep_limits(OmegaConf.create({"max_actor_ckpt_to_keep": 5, "remove_previous_ckpt_in_save": True})) == (1, 1)


@pytest.mark.parametrize("keep", [None])
def test_no_limit_deletes_nothing(tmp_path, keep):
    for step in (1, 2):
        write_checkpoint(tmp_path, step)
    assert enforce_retention(str(tmp_path), keep, keep, own_saves=[2]) == []
    assert len(list(tmp_path.glob("global_step_*"))) == 2
