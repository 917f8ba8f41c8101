"""A ``global_step_N`` folder as a launch with given overrides saves it: verl's FSDP shard names for the
launch's world size and the GDRO trainer's ``gdro_state.pkl``, written by the recipe's own save
(:func:`recipe.gdro.startup.resume.save_gdro_state`) from a real controller built from those overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from recipe.gdro.checkpoints import GDRO_STATE_FILE
from recipe.gdro.startup.checks import build_gdro_config, check_train_prompt_ids
from recipe.gdro.startup.cli import compose_config
from recipe.gdro.startup.resume import save_gdro_state
from verl_ext import GDROController

MARKER = "latest_checkpointed_iteration.txt"


def write_saved_state(path: Path, argv: Sequence[str], num_prompts: int, *, with_dataset: bool = True) -> Path:
    """The GDRO state a launch with ``argv`` saves at ``path`` for ``num_prompts`` prompt ids (with the
    training files' fingerprint when ``with_dataset`` and they exist)."""
    config = compose_config(list(argv))
    dataset: Optional[dict] = check_train_prompt_ids(config).dataset if with_dataset else None
    path.parent.mkdir(parents=True, exist_ok=True)
    save_gdro_state(GDROController(build_gdro_config(config), num_prompts), str(path), dataset)
    return path


def write_checkpoint(
    root: Path,
    step: int,
    argv: Sequence[str] = (),
    *,
    num_prompts: int = 256,
    world_size: int = 8,
    complete: bool = True,
) -> Path:
    """``global_step_N`` as verl and the trainer write it (a crash mid-save stops before ``data.pt``); with
    ``argv`` the GDRO state is a real one of that launch, else a placeholder."""
    folder = root / f"global_step_{step}"
    (folder / "actor").mkdir(parents=True)
    for rank in range(world_size):
        (folder / "actor" / f"model_world_size_{world_size}_rank_{rank}.pt").write_bytes(b"weights")
    if argv:
        write_saved_state(folder / GDRO_STATE_FILE, argv, num_prompts)
    else:
        (folder / GDRO_STATE_FILE).write_bytes(b"state")
    if complete:
        (folder / "data.pt").write_bytes(b"dataloader")
        (root / MARKER).write_text(str(step))
    return folder
