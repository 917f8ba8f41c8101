"""The per-step GDRO metrics file: one JSON object per line.

Format (read by ``python -m recipe.gdro.plot RUN_METRICS.jsonl --out DIR``)::

    {"step": 7, "gdro/mu": 0.0123, "gdro/bin_03/data_share": 0.25, "gdro/binner/unseen_in_batch": null, ...}

* ``step`` is verl's ``global_steps`` (1-based, the step the metrics belong to);
* every other key is a ``gdro/...`` metric name, its value a float; NaN and ±inf are written as
  ``null`` (strict JSON; keys whose value is missing in a step are simply absent).

The trainer appends one line after each step. When a run resumes from ``global_step_N`` it first
drops the lines of steps > N (:func:`rewind_metrics_jsonl`) so the file never holds a step twice;
:func:`read_metrics_jsonl` additionally keeps only the last line per step, so a file copied from an
interrupted run still reads cleanly.

No verl import: the plotting tool reads these files without verl.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from verl_ext.atomic import atomic_replace

__all__ = ["append_metrics_jsonl", "read_metrics_jsonl", "rewind_metrics_jsonl", "metrics_record"]


def _json_value(key: str, value: Any) -> Any:
    if value is None:
        return None
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    raise TypeError(f"metrics_jsonl: metric {key!r} has non-numeric value {value!r}")


def metrics_record(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The dict one line holds: ``{"step": step, **metrics}`` with NaN/inf as None."""
    if isinstance(step, bool) or int(step) != step:
        raise TypeError(f"metrics_jsonl: step must be an integer, got {step!r}")
    record: dict[str, Any] = {"step": int(step)}
    for key, value in metrics.items():
        if key == "step":
            raise ValueError("metrics_jsonl: 'step' is reserved for the step number")
        record[str(key)] = _json_value(key, value)
    return record


def append_metrics_jsonl(path: str | os.PathLike, step: int, metrics: Mapping[str, Any]) -> None:
    """Append one line ``{"step": step, <metric>: value, ...}`` to ``path`` (created with its folder).

    NaN / ±inf are written as ``null``. The line is written with a single ``write`` call and
    flushed, so a reader never sees half a line from a live run.
    """
    line = json.dumps(metrics_record(step, metrics), allow_nan=False, sort_keys=False) + "\n"
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def read_metrics_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records, sorted by step, keeping the last line for a step written twice.

    ``null`` values come back as ``float('nan')``. A truncated last line (a run killed mid-write)
    is skipped; any other malformed line raises ``ValueError`` naming the line number.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    last = len(lines) - 1
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number - 1 >= last - 1 and not line.endswith("}"):
                continue  # a partial final line
            raise ValueError(f"{path}: line {number} is not JSON: {e}") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}: line {number} has no 'step'")
        step = int(record["step"])
        by_step[step] = {k: (float("nan") if v is None else v) for k, v in record.items()}
        by_step[step]["step"] = step
    return [by_step[s] for s in sorted(by_step)]


def rewind_metrics_jsonl(path: str | os.PathLike, last_step: int) -> int:
    """Drop the lines of steps > ``last_step`` (atomically); return how many were dropped.

    Used on resume from ``global_step_{last_step}``: those steps are about to be trained again.
    A missing file is not an error (returns 0).
    """
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    keep, dropped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            step = int(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            dropped += 1  # a partial line from a killed run
            continue
        if step > last_step:
            dropped += 1
        else:
            keep.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        with atomic_replace(path, "w") as f:
            f.writelines(keep)
    return dropped
