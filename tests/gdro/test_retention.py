"""Checkpoint retention deletes only what this process saved (issue 32 items 1 and 4, ``recipe/gdro/checkpoints.py``).

Every tree here is written by the trainer's own save path: :meth:`GDROTrainerSync._save_checkpoint` runs,
it writes the GDRO state of a real :class:`verl_ext.GDROController` and calls verl 0.9.1's
``_save_checkpoint`` unchanged (``actor/``, ``data.pt``, the marker), with one stand-in: the actor worker
group, which writes a shard and applies verl's own in-memory retention (``BaseCheckpointManager``'s
``ensure_checkpoint_capacity`` / ``register_checkpoint``, verl's code, run on the stand-in) as verl's FSDP
checkpoint manager does. A restart is a new trainer object: verl's ``_load_checkpoint`` then the recipe's.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
from omegaconf import OmegaConf
from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

from recipe.gdro.checkpoints import GDRO_STATE_FILE, keep_limit, keep_limits
from recipe.gdro.startup.checks import Checked
from recipe.gdro.trainer import GDROTrainerSync
from recipe.gdro.trainer_step import GroupSchedule
from verl_ext import GDROConfig, GDROController, gdro_config_from_dict

COMPLETE = ["actor", "data.pt", GDRO_STATE_FILE]
SHARD = "model_world_size_1_rank_0.pt"


class VerlActorGroup:
    """The actor worker group as verl's FSDP checkpoint manager saves: room first, a shard, then the
    in-memory list of this process's saves, each step verl's own method."""

    ensure_checkpoint_capacity = BaseCheckpointManager.ensure_checkpoint_capacity
    register_checkpoint = BaseCheckpointManager.register_checkpoint
    remove_previous_save_local_path = BaseCheckpointManager.remove_previous_save_local_path

    def __init__(self):
        self.previous_saved_paths: list[str] = []
        self.loaded: list[str] = []

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.ensure_checkpoint_capacity(max_ckpt_to_keep)
        os.makedirs(local_path, exist_ok=True)
        with open(os.path.join(local_path, SHARD), "w") as f:
            f.write(f"weights of step {global_step}")
        self.register_checkpoint(local_path, max_ckpt_to_keep)

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loaded.append(local_path)


class Loader:
    """The dataloader's state as verl saves and restores it (``data.pt``)."""

    def __init__(self):
        self.state = {"consumed": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def launch(
    root, *, keep=None, keep_critic=None, resume_mode="auto", resume_from=None, gdro_config=None
) -> GDROTrainerSync:
    """A trainer process as far as checkpoints go (verl's fields its save and load read), then verl's
    resume (``_load_checkpoint``), as ``fit`` does at start."""
    trainer = object.__new__(GDROTrainerSync)
    trainer.config = OmegaConf.create(
        {
            "trainer": {
                "default_local_dir": str(root),
                "default_hdfs_dir": None,
                "max_actor_ckpt_to_keep": keep,
                "max_critic_ckpt_to_keep": keep_critic,
                "resume_mode": resume_mode,
                "resume_from_path": None if resume_from is None else str(resume_from),
                "del_local_ckpt_after_load": False,
            },
            "actor_rollout_ref": {"actor": {"checkpoint": {}}},
            "gdro": {"metrics_file": ""},
        }
    )
    trainer.actor_rollout_wg = VerlActorGroup()
    trainer.use_critic = False
    trainer.trainer_mode = "sync"
    trainer.train_dataloader = Loader()
    trainer.checkpoint_callback = build_checkpoint_callback(trainer.config)
    # what the launch hands over: GDRO runs, gdro.metrics_file above, gdro.restart_controller's default, and no
    # training files here (no prompts' fingerprint to save)
    trainer.gdro_checked = Checked(gdro_config or GDROConfig(), "", True, restart_controller=False, dataset={})
    trainer.gdro = GDROController(trainer.gdro_config, 8)
    trainer._gdro_schedule = GroupSchedule()  # the groups in flight, saved with the controller
    trainer._load_checkpoint()
    return trainer


def save(trainer: GDROTrainerSync, *steps: int) -> None:
    """The saves ``fit`` makes at those steps."""
    for step in steps:
        trainer.global_steps = step
        trainer.gdro.step = step  # the controller has observed every step up to the save
        trainer._save_checkpoint()


def contents(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def snapshot(root) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def earlier_run(root, *steps: int) -> dict[str, bytes]:
    """An earlier process saved ``steps`` (no limit); returns the tree's bytes."""
    save(launch(root, resume_mode="disable"), *steps)
    return snapshot(root)


def step_folders(root) -> list[str]:
    return sorted((p.name for p in root.glob("global_step_*")), key=lambda n: int(n.rsplit("_", 1)[1]))


def test_a_marker_naming_a_missing_folder_keeps_the_earlier_runs_steps(tmp_path):
    """Issue 32 scenario 1. The marker says 7, global_step_7 is gone: verl starts fresh. Before, the first
    save at keep 1 deleted the earlier run's complete steps 2-5; now they are not this run's, so they stay
    byte for byte, while the run's own saves are still retired by the limit."""
    before = earlier_run(tmp_path, 2, 3, 4, 5)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    trainer = launch(tmp_path, keep=1)
    assert trainer.global_steps == 0  # verl: "Checkpoint does not exist", training from scratch
    save(trainer, 10)
    kept = {k: v for k, v in snapshot(tmp_path).items() if not k.startswith(("global_step_10", "latest"))}
    assert kept == {k: v for k, v in before.items() if not k.startswith("latest")}
    save(trainer, 20)
    assert step_folders(tmp_path) == [f"global_step_{s}" for s in (2, 3, 4, 5, 20)]
    assert contents(tmp_path / "global_step_20") == COMPLETE


def test_resume_from_an_older_step_keeps_the_newer_branch_and_says_so(tmp_path, caplog):
    """Issue 32 scenario 2. Steps 1-3 and 8-10 on disk; the user resumes from 3 on purpose, keep 2. The
    newer 8-10 (another branch) and the older 1-2 are never deleted, the resumed-from 3 neither; a log
    line at start names 8, 9, 10 as kept; the run's own oldest save (4) is the one retired."""
    before = earlier_run(tmp_path, 1, 2, 3, 8, 9, 10)
    with caplog.at_level(logging.WARNING, logger="recipe.gdro.trainer"):
        trainer = launch(tmp_path, keep=2, resume_mode="resume_path", resume_from=tmp_path / "global_step_3")
    assert trainer.global_steps == 3
    kept_lines = [r.getMessage() for r in caplog.records if "are kept" in r.getMessage()]
    assert len(kept_lines) == 1, kept_lines
    named = kept_lines[0].split("checkpoints ", 1)[1].split(" are kept", 1)[0]
    assert named == "global_step_8, global_step_9, global_step_10" and "step 3" in kept_lines[0]
    save(trainer, 4, 5, 6)
    assert step_folders(tmp_path) == [f"global_step_{s}" for s in (1, 2, 3, 5, 6, 8, 9, 10)]
    after = snapshot(tmp_path)
    for name, data in before.items():
        if not name.startswith("latest"):
            assert after[name] == data, name
    assert contents(tmp_path / "global_step_5") == contents(tmp_path / "global_step_6") == COMPLETE
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_a_folder_without_actor_is_not_this_runs_and_stays(tmp_path):
    """Issue 32 scenario 3. The user moved the weights out of global_step_2; resuming from 3 at keep 5,
    the save at 4 leaves its data.pt and gdro_state.pkl where they are (before, both were deleted)."""
    earlier_run(tmp_path, 1, 2, 3)
    shutil.move(tmp_path / "global_step_2" / "actor", tmp_path / "exported_actor_2")
    trainer = launch(tmp_path, keep=5)
    assert trainer.global_steps == 3
    save(trainer, 4)
    assert contents(tmp_path / "global_step_2") == ["data.pt", GDRO_STATE_FILE]
    assert all(contents(tmp_path / f"global_step_{s}") == COMPLETE for s in (1, 3, 4))


def test_a_restarted_run_owns_only_what_it_saves_from_then_on(tmp_path):
    """keep 1 across two processes: the first retires its own saves down to one (verl retires actor/, the
    recipe the state and data.pt beside it); the second, resumed from that one, never deletes it."""
    first = launch(tmp_path, keep=1)
    save(first, 1, 2, 3)
    assert step_folders(tmp_path) == ["global_step_3"]
    second = launch(tmp_path, keep=1)
    assert second.global_steps == 3
    save(second, 4, 5)
    assert step_folders(tmp_path) == ["global_step_3", "global_step_5"]
    assert contents(tmp_path / "global_step_3") == COMPLETE


def test_a_failed_delete_is_logged_and_the_next_folders_are_still_processed(tmp_path, monkeypatch, caplog):
    """global_step_1/actor cannot be deleted (the tests may run as root, where chmod stops nothing, so the
    refusal is raised where the file system would raise it: shutil.rmtree, for verl's delete and the
    recipe's alike). Each save still completes, one log line names the folder and the error, and the
    later folders are retired as the limit says."""
    real_rmtree = shutil.rmtree
    protected = str(tmp_path / "global_step_1" / "actor")

    def rmtree(path, ignore_errors=False, **kw):
        if os.path.abspath(path) == protected:
            if ignore_errors:  # what rmtree(ignore_errors=True) does with an undeletable folder
                return
            raise PermissionError(13, "Permission denied", protected)
        return real_rmtree(path, ignore_errors=ignore_errors, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    trainer = launch(tmp_path, keep=1)
    with caplog.at_level(logging.WARNING, logger="recipe.gdro.checkpoints"):
        save(trainer, 1, 2, 3, 4)
    failed = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert failed and all(protected in m and "PermissionError" in m for m in failed), failed
    assert len(failed[0].splitlines()) == 1
    # the rest of step 1 went (its resume files), and steps 2 and 3 were retired whole
    assert contents(tmp_path / "global_step_1") == ["actor"]
    assert step_folders(tmp_path) == ["global_step_1", "global_step_4"]
    assert contents(tmp_path / "global_step_4") == COMPLETE
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_a_zero_padded_folder_name_is_not_that_step(tmp_path, caplog):
    """verl names folders global_step_{step}: a copy named global_step_03 is no checkpoint of verl's. It
    does not stand in for step 3 and is never deleted, with one warning naming it."""
    earlier_run(tmp_path, 1, 2, 3)
    shutil.copytree(tmp_path / "global_step_3", tmp_path / "global_step_03")
    (tmp_path / "global_step_03" / "notes.txt").write_text("my copy")
    with caplog.at_level(logging.WARNING):
        trainer = launch(tmp_path, keep=1)
        save(trainer, 4, 5)
    assert trainer.actor_rollout_wg.loaded == [str(tmp_path / "global_step_3" / "actor")]
    assert contents(tmp_path / "global_step_03") == sorted([*COMPLETE, "notes.txt"])
    assert step_folders(tmp_path) == [
        "global_step_1",
        "global_step_2",
        "global_step_03",
        "global_step_3",
        "global_step_5",
    ]
    warned = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "/global_step_03" in r.getMessage()
    ]
    assert len(warned) == 1 and warned[0].startswith(f"GDRO: ignoring {tmp_path / 'global_step_03'}:"), warned


def test_only_what_verl_would_delete_goes_and_a_users_file_stays(tmp_path):
    """Of this run's retired saves go actor/ and the resume files beside it; a user's file keeps its folder."""
    trainer = launch(tmp_path, keep=1)
    save(trainer, 10)
    (tmp_path / "global_step_10" / "eval_notes.md").write_text("keep me")
    save(trainer, 20, 30)
    assert contents(tmp_path / "global_step_10") == ["eval_notes.md"]
    assert not (tmp_path / "global_step_20").exists()
    assert contents(tmp_path / "global_step_30") == COMPLETE


def test_no_limit_deletes_nothing(tmp_path):
    trainer = launch(tmp_path, keep=None)
    save(trainer, 1, 2, 3)
    assert step_folders(tmp_path) == ["global_step_1", "global_step_2", "global_step_3"]


def test_limits():
    assert keep_limit(OmegaConf.create({"max_actor_ckpt_to_keep": 3})) == 3
    assert keep_limits(OmegaConf.create({"max_actor_ckpt_to_keep": 3, "max_critic_ckpt_to_keep": 1})) == (3, 1)
    assert keep_limits(OmegaConf.create({"max_actor_ckpt_to_keep": None})) == (None, None)
    assert keep_limits(OmegaConf.create({"max_actor_ckpt_to_keep": 0})) == (None, None)
    assert keep_limits(OmegaConf.create({"max_actor_ckpt_to_keep": 5, "remove_previous_ckpt_in_save": True})) == (1, 1)


@pytest.mark.parametrize("keep_critic", [1])
def test_critic_has_its_own_limit(tmp_path, keep_critic):
    """With a critic (verl writes critic/ through its own worker group) keep 2 actors, 1 critic."""
    trainer = launch(tmp_path, keep=2, keep_critic=keep_critic)
    trainer.use_critic = True
    trainer.critic_wg = VerlActorGroup()
    save(trainer, 1, 2, 3)
    assert step_folders(tmp_path) == ["global_step_2", "global_step_3"]
    assert contents(tmp_path / "global_step_2") == COMPLETE  # its critic/ is beyond the critic limit
    assert contents(tmp_path / "global_step_3") == sorted([*COMPLETE, "critic"])


def test_a_resume_with_other_settings_warns_naming_each_against_the_saved_config(tmp_path, caplog):
    """Issue 44 item 3. A run saved with the defaults (Prompt-GDRO off, eta 0.1) is resumed with Prompt-GDRO on
    and another eta: the restore warns naming both, compared with the config stored in gdro_state.pkl. Before,
    the trainer compared the controller's config with itself after load(), so the warning never fired."""
    save(launch(tmp_path, resume_mode="disable"), 2)
    changed = gdro_config_from_dict({"prompt": {"enable": True, "eta": 0.3}})
    with caplog.at_level(logging.WARNING, logger="recipe.gdro.trainer"):
        launch(tmp_path, gdro_config=changed)
    lines = [r.getMessage() for r in caplog.records if "saved with different settings" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    default_eta = GDROConfig().prompt.eta
    assert "gdro.prompt.enable: False -> True" in lines[0] and f"gdro.prompt.eta: {default_eta!r} -> 0.3" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recipe.gdro.trainer"):
        launch(tmp_path)  # the settings it was saved with: no warning
    assert not [r for r in caplog.records if "different settings" in r.getMessage()]
