"""The GDRO trainer's resume side, as functions of verl's ``trainer`` config: where a resume comes from, the
controller state restored from it (and recorded), the metrics file rewound or moved aside, and the lines of
verl's file log a resume keeps (verl's ``FileLogger`` truncates its file on open)."""

from __future__ import annotations

import json
import logging
import os
import time

from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from recipe.gdro.checkpoints import GDRO_RESUME_RECORD, GDRO_STATE_FILE, checkpoint_folders
from recipe.gdro.results.metrics_io import rewind_metrics_jsonl
from recipe.gdro.startup.environment import VERL_FILE_LOGGER_PATH_ENV, VERL_FILE_LOGGER_ROOT_ENV
from recipe.gdro.startup.resume import (
    DATASET_STATE_KEY,
    INFLIGHT_STATE_KEY,
    RESTART_CONTROLLER_KEY,
    changed_settings,
    read_saved_state,
)
from verl_ext import gdro_config_to_dict
from verl_ext.controller import state_fingerprint

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


def checkpoint_root(trainer_config) -> str:
    """``trainer.default_local_dir`` as verl's ``_load_checkpoint`` resolves it."""
    root = str(trainer_config.default_local_dir)
    return root if os.path.isabs(root) else os.path.join(os.getcwd(), root)


def resume_folder(trainer_config) -> str | None:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumed from (None if none)."""
    mode = trainer_config.resume_mode
    if mode == "auto":
        return find_latest_ckpt_path(checkpoint_root(trainer_config))
    if mode == "resume_path":
        folder = str(trainer_config.resume_from_path)
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)
    return None


def log_kept_checkpoints(root: str, step: int) -> None:
    """One line naming the checkpoints on disk newer than the resume point: another branch, or the
    steps a fresh start will pass. Retention never deletes them (not this process's saves)."""
    newer = [p for s, p in sorted(checkpoint_folders(root).items()) if s > step]
    if newer:
        logger.warning(
            "GDRO: this run starts after step %d; the newer checkpoints %s are kept (retention deletes only this "
            "run's saves; a save of this run at one of those steps writes into that folder)",
            step,
            ", ".join(os.path.basename(p) for p in newer),
        )


def move_aside_metrics_file(metrics_path: str | None) -> None:
    """A fresh run: a metrics file left in the folder by an earlier run is moved aside, so the file only ever
    holds this run's steps."""
    if metrics_path and os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0:
        backup = f"{metrics_path}.{time.strftime('%Y%m%d-%H%M%S')}.bak"
        os.replace(metrics_path, backup)
        logger.warning("GDRO: fresh run; moved the existing metrics file %s to %s", metrics_path, backup)


def rewind_metrics(metrics_path: str | None, step: int) -> None:
    """Drop the metrics file's lines after the resume step (a resumed run writes them again)."""
    if metrics_path:
        dropped = rewind_metrics_jsonl(metrics_path, step)
        if dropped:
            logger.info("GDRO: dropped %d metrics lines after step %d from %s", dropped, step, metrics_path)


def restore_controller(controller, gdro_config, trainer_config, step: int, restart: bool, schedule=None) -> None:
    """verl resumed at ``step`` (> 0): restore the controller from the resume folder's ``gdro_state.pkl`` (and
    ``schedule``, the trainer's groups in flight, when the file holds them), warn about changed settings and a
    step mismatch, and record what was restored (:func:`record_restored_state`). With ``restart``
    (``gdro.restart_controller``) the controller starts afresh; one warning says so (the groups in flight are
    still restored: verl re-issues them with the counts they were scheduled)."""
    folder = resume_folder(trainer_config)
    path = os.path.join(folder, GDRO_STATE_FILE) if folder else None
    if schedule is not None and path is not None and os.path.exists(path):
        inflight = read_saved_state(path).get(INFLIGHT_STATE_KEY)
        if inflight is not None:
            schedule.load_state_dict(inflight)
    if restart:
        logger.warning(
            "GDRO: %s=true: resumed verl's checkpoint %s at step %d; the GDRO controller starts afresh (its saved "
            "state is not restored)",
            RESTART_CONTROLLER_KEY,
            folder,
            step,
        )
        return
    if path is None or not os.path.exists(path):
        raise RuntimeError(
            f"GDRO: resuming from {folder} (global step {step}) but {GDRO_STATE_FILE} is missing "
            "there, so the binner and adversary state cannot be restored. Resume from a checkpoint written "
            f"by the GDRO recipe with GDRO enabled, start a fresh run (trainer.resume_mode=disable), or set "
            f"{RESTART_CONTROLLER_KEY}=true to resume the model with a fresh controller"
        )
    state = read_saved_state(path)
    controller.load_state_dict(state)
    # against the config stored in the checkpoint (the controller's own config is the launch's)
    changed = changed_settings(state["config"], gdro_config_to_dict(gdro_config))
    if changed:
        logger.warning("GDRO: resumed state was saved with different settings: %s", "; ".join(changed))
    if controller.step != step:
        logger.warning(
            "GDRO: restored controller has observed %d steps but verl resumes at global step %d", controller.step, step
        )
    logger.info("GDRO state restored from %s (controller step %d)", path, controller.step)
    inflight = schedule.state_dict() if schedule is not None and INFLIGHT_STATE_KEY in state else None
    record_restored_state(
        controller, state.get(DATASET_STATE_KEY), path, step, trainer_config.default_local_dir, inflight
    )


def record_restored_state(
    controller, saved_dataset: dict | None, path: str, step: int, root: str, inflight: dict | None = None
) -> None:
    """Append to ``<default_local_dir>/gdro_resume.jsonl`` what was restored: the step, the file and a
    digest of every field of the controller state as loaded and of the training prompts' facts saved with
    it (verl_ext.controller.state_fingerprint), so a restore can be checked field by field against the
    pickle it came from."""
    restored = controller.state_dict()
    if saved_dataset is not None:  # the training prompts' facts saved with it
        restored[DATASET_STATE_KEY] = saved_dataset
    if inflight is not None:  # the groups in flight, as the trainer's schedule holds them now
        restored[INFLIGHT_STATE_KEY] = inflight
    record = {"resumed_at_step": int(step), "state_file": path, "fields": state_fingerprint(restored)}
    os.makedirs(root, exist_ok=True)  # may not exist yet (resumed from a path elsewhere)
    with open(os.path.join(root, GDRO_RESUME_RECORD), "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def verl_file_log_lines(trainer_config, last_step: int) -> bytes:
    """The lines of verl's file log (``trainer.logger`` with ``file``) whose step is at most ``last_step``,
    as bytes; the file is where verl's ``FileLogger`` writes: ``VERL_FILE_LOGGER_PATH``, else
    ``VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``. Empty when the logger is off or the file absent."""
    backends = trainer_config.get("logger", None) or []
    if "file" not in ([backends] if isinstance(backends, str) else list(backends)):
        return b""
    path = os.getenv(VERL_FILE_LOGGER_PATH_ENV) or os.path.join(
        os.path.expanduser(os.getenv(VERL_FILE_LOGGER_ROOT_ENV) or "."),
        str(trainer_config.project_name),
        f"{trainer_config.experiment_name}.jsonl",
    )
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines(keepends=True)
    except OSError:
        return b""
    kept = []
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a torn last line of a killed run
        if isinstance(step, int) and step <= last_step:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    return b"".join(kept)


def restore_verl_file_log(tracking, kept: bytes, step: int) -> None:
    """verl's ``FileLogger`` (``trainer.logger`` with ``file``) opens its file with ``"wb"``: a resumed run would
    truncate the lines of the steps it resumes after. ``kept`` (read by :func:`verl_file_log_lines` before ``fit``
    opened the file) goes back in front of what this run has written so far, through the open file of verl's
    ``Tracking`` object (``tracking.logger["file"].fp``)."""
    file_logger = getattr(tracking, "logger", {}).get("file") if kept else None
    fp = getattr(file_logger, "fp", None)
    if fp is None:
        return
    with open(fp.name, "rb") as f:
        written = f.read()
    fp.seek(0)
    fp.write(kept + written)
    fp.truncate()
    logger.info("GDRO: kept the %d lines of verl's file log up to step %d in %s", kept.count(b"\n"), step, fp.name)
