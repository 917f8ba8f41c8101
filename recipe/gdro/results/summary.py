"""How a run ends on the console: a short summary instead of verl's raw metrics dictionary.

:func:`print_run_summary` (called by ``recipe.gdro.main_gdro`` once the run returned) prints, as the run's
last lines::

    [gdro] run summary: gdro/tiny_joint_gdro, step 10 of 10
      validation   step 10 (acc/mean@1): arith_add2 0.625, arith_mul1x2 0.125, ...; all prompts 0.406
      checkpoints  /path/gdro/tiny_joint_gdro (newest complete: global_step_10)
      metrics      /path/gdro/tiny_joint_gdro/gdro_metrics.jsonl (side by side: python -m recipe.gdro.lab.results.compare)
      resume       /path/python -m recipe.gdro.main_gdro ... trainer.total_training_steps=20

from the run's own files: the last validation line and the last training step of its metrics file
(``gdro.metrics_file`` in ``trainer.default_local_dir``), the newest complete checkpoint there. Before the
run, :func:`before_training` has an interrupt (Ctrl-C, SIGTERM) end on the same facts: the last complete
checkpoint and the relaunch that resumes from it, as the lost-node line does.
"""  # noqa: E501 - the example line above is the summary as printed

from __future__ import annotations

import os
import shlex
import sys
import warnings

from omegaconf import DictConfig, OmegaConf

from recipe.gdro.results.metrics_io import pooled_accuracy, validation_by_source

STEPS_KEY = "trainer.total_training_steps"


def _metrics_path(config: DictConfig) -> str | None:
    name = OmegaConf.select(config, "gdro.metrics_file", default=None)
    return os.path.join(str(config.trainer.default_local_dir), str(name)) if name else None


def _read(path: str | None) -> tuple[list[dict], list[dict]]:
    """(training lines, validation lines) of the run's metrics file; empty when it has none (yet)."""
    from recipe.gdro.results.metrics_io import read_metrics_jsonl, read_validation_jsonl

    if not path or not os.path.isfile(path):
        return [], []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return read_metrics_jsonl(path), read_validation_jsonl(path)
    except (OSError, ValueError):
        return [], []


def _newest_checkpoint(config: DictConfig) -> str | None:
    from recipe.gdro.checkpoints import newest_complete

    root = str(config.trainer.default_local_dir)
    return newest_complete(root) if os.path.isdir(root) else None


def relaunch_command(config: DictConfig, total_steps: int | None = None) -> str:
    """The command that launched this run (``python -m recipe.gdro.main_gdro`` and its overrides), with
    ``trainer.total_training_steps`` set to ``total_steps`` when given."""
    args = list(sys.argv[1:])
    if total_steps is not None:
        args = [a for a in args if not a.lstrip("+").startswith(f"{STEPS_KEY}=")] + [f"{STEPS_KEY}={total_steps}"]
    return shlex.join([sys.executable, "-m", "recipe.gdro.main_gdro", *args])


def validation_line(record: dict) -> str:
    """``step N (acc/mean@k): source value, ...; all prompts value`` of one validation line."""
    by_source = validation_by_source(record)
    metrics = sorted({metric for _, metric in by_source.values()})
    parts = ", ".join(f"{source} {value:.3f}" for source, (value, _) in by_source.items())
    pooled = pooled_accuracy(record)
    tail = f"; all prompts {pooled:.3f}" if pooled is not None and len(by_source) > 1 else ""
    return f"step {int(record['val_step'])} ({', '.join(metrics) or 'no val-core figure'}): {parts or '-'}{tail}"


def run_summary_lines(config: DictConfig) -> list[str]:
    """The summary (module docstring) of the run ``config`` describes, from its files."""
    path = _metrics_path(config)
    training, validation = _read(path)
    total = OmegaConf.select(config, STEPS_KEY, default=None)
    last = int(training[-1]["step"]) if training else None
    name = f"{config.trainer.project_name}/{config.trainer.experiment_name}"
    lines = [f"[gdro] run summary: {name}, step {last if last is not None else 0} of {total}"]
    if validation:
        record = validation[-1]
        note = ""
        if last is not None and int(record["val_step"]) < last:
            test_freq = OmegaConf.select(config, "trainer.test_freq", default=None)
            note = f" (not at the last step: trainer.test_freq={test_freq})"
        lines.append(f"  validation   {validation_line(record)}{note}")
    else:
        lines.append("  validation   none in the metrics file")
    root = str(config.trainer.default_local_dir)
    newest = _newest_checkpoint(config)
    saved = f"newest complete: {os.path.basename(newest)}" if newest else "no complete checkpoint"
    if not newest and (OmegaConf.select(config, "trainer.save_freq", default=0) or 0) <= 0:
        saved += f" (trainer.save_freq={OmegaConf.select(config, 'trainer.save_freq')})"
    lines.append(f"  checkpoints  {root} ({saved})")
    if path:
        lines.append(f"  metrics      {path} (side by side: python -m recipe.gdro.lab.results.compare)")
    else:
        lines.append("  metrics      none (gdro.metrics_file is empty)")
    if newest:
        more = (last or 0) + max(last or 0, 1)
        lines.append(f"  resume       {relaunch_command(config, more)}")
        lines.append(
            "               (any trainer.total_training_steps above the step reached; or the launch script with it)"
        )
    else:
        lines.append("  resume       not possible: no checkpoint to resume from")
    return lines


def print_run_summary(config: DictConfig, stream=None) -> None:
    """Print :func:`run_summary_lines` (nothing for a dry run, which trains nothing)."""
    if OmegaConf.select(config, "gdro.dry_run", default=False) not in (False, None, "false"):
        return
    stream = stream or sys.stdout
    try:
        lines = run_summary_lines(config)
    except Exception as e:  # noqa: BLE001 - the run is over; a summary that fails must not turn it into a failure
        lines = [f"[gdro] run summary unavailable: {type(e).__name__}: {e}"]
    print("\n".join(lines), file=stream, flush=True)


def interrupt_detail(config: DictConfig) -> str:
    """What the interrupt line says after ``stopped``: the newest complete checkpoint and the relaunch."""
    newest = _newest_checkpoint(config)
    root = str(config.trainer.default_local_dir)
    if not newest:
        return f"stopped; no complete checkpoint in {root}: a relaunch starts from step 0"
    return f"stopped; the last complete checkpoint is {newest}; relaunch the same command to resume from it"


def before_training(config: DictConfig) -> None:
    """Set up what a run prints (``recipe.gdro.logs``) and the interrupt line (:func:`interrupt_detail`)."""
    from recipe.gdro.logs import quiet_ray_workers
    from verl_ext.interrupt import set_detail

    quiet_ray_workers(config)
    set_detail(lambda: interrupt_detail(config))
