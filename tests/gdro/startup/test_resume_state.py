"""What a resume point holds is checked before Ray (issue 42 items 3-4, issue 44 items 2-3,
``recipe/gdro/startup/resume.py``).

Each case is the dry run a user runs (``python -m recipe.gdro.main_gdro gdro.dry_run=true ...`` through
:func:`recipe.gdro.main_gdro.cli`) on 256 training prompts, resuming a checkpoint folder laid out as verl and
the GDRO trainer write it: FSDP shards named for the saving world size and a ``gdro_state.pkl`` written by the
recipe's own save from a real controller of the launch that saved it (tests/recipe_helpers/saved_state.py).
Before, the launch checked only that the files exist: each misfit below passed the dry run and the launch,
and ended minutes in, inside Ray, as an ``UnpicklingError`` / ``ValueError`` / ``FileNotFoundError`` traceback
(or, for other prompts under the same ids, not at all).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_helpers import standins as S
from recipe_helpers.overrides import paper_overrides
from recipe_helpers.saved_state import MARKER, write_checkpoint, write_saved_state

from recipe.gdro.checkpoints import GDRO_STATE_FILE
from recipe.gdro.main_gdro import check_launch, cli
from recipe.gdro.startup.cli import compose_config
from recipe.gdro.startup.cluster import SDPA_OVERRIDE

WAYS_ON = ("trainer.default_local_dir", "gdro.restart_controller=true")


@pytest.fixture
def data(tmp_path) -> Path:
    """256 prompts (ids 0..255), a batch of the paper's launch."""
    return Path(S.write_parquet(str(tmp_path / "train.parquet"), S.math_rows(list(range(10, 266)))))


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "run"


def launch_argv(data: Path, root: Path, *extra: str) -> list[str]:
    return [*paper_overrides(data), f"trainer.default_local_dir={root}", *extra]


def saved(root: Path, data: Path, *settings: str, num_prompts: int = 256, **kw) -> Path:
    """Step 4 of a run launched with ``settings`` (the marker names it); returns its gdro_state.pkl."""
    return (
        write_checkpoint(root, 4, launch_argv(data, root, *settings), num_prompts=num_prompts, **kw) / GDRO_STATE_FILE
    )


def dry_run(capsys, data: Path, root: Path, *extra: str) -> tuple[int, str, str]:
    code = cli(launch_argv(data, root, *extra))
    out = capsys.readouterr()
    return code, out.out, out.err


def refusal(capsys, data: Path, root: Path, *extra: str) -> str:
    code, out, err = dry_run(capsys, data, root, *extra)
    assert code == 2, (out[-800:], err[-2000:])
    assert "Traceback" not in err and "dry run OK" not in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gdro dry run: error:"), err[-2000:]
    return lines[0]


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[gdro] warning:")]


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_a_state_that_does_not_unpickle_is_refused_naming_the_file(capsys, data, root, damage):
    path = saved(root, data)
    whole = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": whole[: len(whole) // 2], "garbage": b"not a pickle\n"}[damage])
    line = refusal(capsys, data, root)
    assert str(path) in line and ("is empty" if damage == "empty" else "is not a complete GDRO state") in line
    assert all(way in line for way in WAYS_ON), line
    # the explicit key resumes the model with a fresh controller
    assert dry_run(capsys, data, root, "gdro.restart_controller=true")[0] == 0


@pytest.mark.parametrize(
    ("saved_with", "launched", "expected"),
    [
        (
            "gdro.binner.num_bins=10",
            "gdro.binner.num_bins=5",
            "gdro.binner.num_bins was 10 when it was saved, this launch has 5",
        ),
        (
            "gdro.binner.window=50",
            "gdro.binner.window=20",
            "gdro.binner.window was 50 when it was saved, this launch has 20",
        ),
        (
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.n was 4, now 8",
        ),
    ],
)
def test_a_state_saved_with_other_bins_or_arms_is_refused_naming_both_values(
    capsys, data, root, saved_with, launched, expected
):
    saved(root, data, saved_with)
    line = refusal(capsys, data, root, launched)
    assert expected in line and "relaunch with the old setting" in line, line
    assert all(way in line for way in WAYS_ON), line
    code, _, err = dry_run(capsys, data, root, launched, "gdro.restart_controller=true")
    assert code == 0, err


def test_a_state_saved_for_another_prompt_count_is_refused(capsys, data, root):
    saved(root, data, num_prompts=300)
    line = refusal(capsys, data, root)
    assert "the training prompt count" in line and "was 300 when it was saved, this launch has 256" in line, line


def test_other_prompts_under_the_same_ids_are_refused(capsys, data, root, tmp_path):
    """Another dataset reusing ids 0..255: before, the old prompts' histories went to the new ones silently."""
    saved(root, data)
    other = Path(S.write_parquet(str(tmp_path / "other.parquet"), S.math_rows(list(range(500, 756)))))
    line = refusal(capsys, other, root)
    assert "the training prompts (ids and texts of data.train_files) differ" in line and "fingerprint" in line
    assert "relaunch with the training files it was saved with" in line and all(way in line for way in WAYS_ON)
    assert dry_run(capsys, data, root)[0] == 0  # the prompts it was saved with


def test_a_legal_change_warns_naming_every_setting_against_the_saved_config(capsys, data, root):
    saved(root, data)
    code, out, err = dry_run(capsys, data, root, "gdro.prompt.enable=true", "gdro.prompt.eta=0.3")
    assert code == 0, err
    (line,) = warnings_of(err)
    assert "gdro.prompt.enable: False -> True" in line and "-> 0.3" in line and "gdro.prompt.eta" in line
    assert not warnings_of(dry_run(capsys, data, root)[2])  # the settings it was saved with


def test_a_state_saved_without_the_fingerprint_warns(capsys, data, root):
    path = saved(root, data)
    write_saved_state(path, launch_argv(data, root), 256, with_dataset=False)
    code, _, err = dry_run(capsys, data, root)
    assert code == 0, err
    (line,) = warnings_of(err)
    assert "saved without a fingerprint of the training prompts" in line


def test_a_checkpoint_of_another_world_size_is_refused_naming_both_layouts(capsys, data, root):
    """Issue 42 item 3: a world-size-1 checkpoint resumed on 8 GPUs died 208 s in with FileNotFoundError
    model_world_size_8_rank_0.pt."""
    saved(root, data, world_size=1)
    line = refusal(capsys, data, root)
    assert "was saved with world size 1" in line and "this launch has world size 8" in line, line
    assert "trainer.nnodes=1 x trainer.n_gpus_per_node=8" in line
    assert "trainer.nnodes x trainer.n_gpus_per_node = 1" in line and "trainer.default_local_dir" in line
    assert "python -m verl.model_merger merge --backend fsdp" in line
    code, _, err = dry_run(capsys, data, root, "trainer.n_gpus_per_node=1", "data.train_batch_size=256")
    assert "world size" not in err


def test_a_checkpoint_of_another_fsdp_version_is_refused(capsys, data, root):
    folder = saved(root, data).parent
    (folder / "actor" / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 8}')
    line = refusal(capsys, data, root)  # the launch's actor.strategy is fsdp (FSDP1)
    assert "world size 8, FSDP2" in line and "world size 8, FSDP1" in line
    assert "actor_rollout_ref.actor.strategy=fsdp2" in line
    assert dry_run(capsys, data, root, "actor_rollout_ref.actor.strategy=fsdp2")[0] == 0


@pytest.mark.parametrize(
    ("total", "done"),
    [
        ("trainer.total_training_steps=4", True),
        ("trainer.total_training_steps=5", False),
        ("trainer.total_training_steps=null", False),
    ],
)
def test_a_relaunch_at_its_last_step_trains_nothing_and_says_so(capsys, data, root, total, done):
    """Issue 42 item 4: a finished run relaunched spent 144 s (Ray, workers, a validation) and exited 0 with no
    word. The launch's checks (main_gdro.check_launch, before Ray) now end it with one line, exit 0. Without
    total_training_steps verl's own count applies: 256 rows // 256 a step x 30 epochs = 30 steps."""
    saved(root, data)
    argv = [a for a in launch_argv(data, root, total, SDPA_OVERRIDE) if a != "gdro.dry_run=true"]
    checked = check_launch(compose_config(argv))
    out = capsys.readouterr().out
    if done:
        assert checked == 0
        (line,) = [x for x in out.splitlines() if "nothing to train" in x]
        assert "resumes at step 4" in line and "trainer.total_training_steps=4" in line
        assert "raise trainer.total_training_steps" in line
    else:
        assert isinstance(checked, tuple) and "nothing to train" not in out
    assert (root / MARKER).read_text() == "4"
    code, out, _ = dry_run(capsys, data, root, total)  # the dry run of the same command says it too
    assert code == 0 and ("gdro dry run: nothing to train" in out) == done
