"""The per-step GDRO metrics file: one JSON object per line.

Format (read by ``python -m recipe.gdro.lab.results.plot RUN_METRICS.jsonl --out DIR``)::

    {"step": 7, "gdro/mu": 0.0123, "gdro/bin_03/data_share": 0.25, "gdro/binner/unseen_in_batch": null, ...}

* ``step`` is verl's ``global_steps`` (1-based, the step the metrics belong to);
* every other key is a ``gdro/...`` metric name, its value a float; NaN and ±inf are written as
  ``null`` (strict JSON; keys whose value is missing in a step are simply absent).

The trainer appends one line after each step. At each validation it also appends a **validation
line**, keyed ``val_step`` instead of ``step`` (so a reader of training lines can never mistake it
for one)::

    {"val_step": 50, "val-core/math500/acc/mean@8": 0.61, ..., "gdro/val/math500/prompts": 500,
     "gdro/val/math500/acc/pass@8": 0.83, ...}

holding verl's ``val-core/...`` / ``val-aux/...`` dict of that validation plus, per data source, the
number of prompts and the exact pass@k (see :func:`validation_pass_at_k`). ``val_step`` is verl's
``global_steps`` when the validation ran (0 for the validation before training).

When a run resumes from ``global_step_N`` it first drops the lines of steps > N, training and
validation alike (:func:`rewind_metrics_jsonl`), so the file never holds a step twice;
:func:`read_metrics_jsonl` (training lines) and :func:`read_validation_jsonl` (validation lines)
additionally keep only the last line per step, so a file copied from an interrupted run still reads
cleanly. A file whose training steps go back to its first step holds two runs (a fresh start appended
to an old run's file) and is refused naming the line; a literal NaN / Infinity (this writer never
writes one) is read as missing, with a warning naming the file, line and field.

No verl import: the plotting tool reads these files without verl.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from verl_ext.atomic import atomic_replace

__all__ = [
    "VAL_STEP_KEY",
    "MetricsFileWarning",
    "NonFiniteValueWarning",
    "TruncatedLineWarning",
    "append_metrics_jsonl",
    "append_validation_jsonl",
    "metrics_record",
    "read_metrics_jsonl",
    "read_validation_jsonl",
    "rewind_metrics_jsonl",
    "validation_pass_at_k",
]

VAL_STEP_KEY = "val_step"  # the step key of a validation line
# verl's core validation figure of a data source (trainer_base._val_metrics_update): acc when the reward
# reports it, else reward; k = the most responses per prompt (val_kwargs.n)
_CORE_KEY = re.compile(r"^val-core/(?P<source>[^/]+)/(?P<var>acc|reward)/mean@(?P<k>\d+)$")


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


def metrics_record(step: int, metrics: Mapping[str, Any], step_key: str = "step") -> dict[str, Any]:
    """The dict one line holds: ``{step_key: step, **metrics}`` with NaN/inf as None."""
    if isinstance(step, bool) or int(step) != step:
        raise TypeError(f"metrics_jsonl: step must be an integer, got {step!r}")
    record: dict[str, Any] = {step_key: int(step)}
    for key, value in metrics.items():
        if key in ("step", VAL_STEP_KEY):
            raise ValueError(f"metrics_jsonl: {key!r} is reserved for the step number")
        record[str(key)] = _json_value(key, value)
    return record


def append_metrics_jsonl(path: str | os.PathLike, step: int, metrics: Mapping[str, Any]) -> None:
    """Append one line ``{"step": step, <metric>: value, ...}`` to ``path`` (created with its folder).

    NaN / ±inf are written as ``null``. The line is written with a single ``write`` call and
    flushed, so a reader never sees half a line from a live run.
    """
    _append_line(path, metrics_record(step, metrics))


def append_validation_jsonl(path: str | os.PathLike, step: int, metrics: Mapping[str, Any]) -> None:
    """Append one validation line ``{"val_step": step, "val-core/...": value, ...}`` (see the module doc)."""
    if not metrics:
        raise ValueError(f"metrics_jsonl: validation at step {step} produced no metrics")
    _append_line(path, metrics_record(step, metrics, step_key=VAL_STEP_KEY))


def _append_line(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one line; a write that fails (a full disk: ENOSPC) leaves the file as it was (cut back to its
    size before) and raises :class:`recipe.gdro.checkpoints.StorageFullError`, one line naming the errno and
    the file, which stops the run: the metrics file is the run's record, a run that went on without it would
    leave steps no file holds."""
    line = json.dumps(record, allow_nan=False, sort_keys=False) + "\n"
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    os.makedirs(folder, exist_ok=True)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
    except OSError as e:
        from recipe.gdro.checkpoints import STORAGE_ERRNOS, StorageFullError

        try:
            os.truncate(path, size)
        except OSError:
            pass
        name = STORAGE_ERRNOS.get(e.errno) or errno.errorcode.get(e.errno or 0, type(e).__name__)
        raise StorageFullError(
            f"writing the metrics file {path} failed: {name} ({e.strerror or e}); the file is left as it was, the "
            "run stops here (its last checkpoint stands). Free space and relaunch the same command to resume"
        ) from None


class MetricsFileWarning(UserWarning):
    """Something in a metrics file the readers passed over (the message names the file and line)."""


class TruncatedLineWarning(MetricsFileWarning):
    """A metrics file's last line was cut (a run killed mid-write): that record is skipped."""


def _read_text(path: str | os.PathLike) -> str:
    """A metrics file's text; a parquet file or a byte that is not UTF-8 is a ValueError naming file and line."""
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:4] == b"PAR1":
        raise ValueError(f"{path}: is a parquet file, not a JSON-lines metrics file (e.g. gdro_metrics.jsonl)")
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line = blob[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}: line {line}: not UTF-8 text (byte 0x{blob[e.start]:02x}); expected a JSON-lines metrics file"
        ) from None


class NonFiniteValueWarning(MetricsFileWarning):
    """A metrics file holds a literal NaN / Infinity (this format writes ``null``): read as missing."""


def _read_records(path: str | os.PathLike, step_key: str) -> list[dict[str, Any]]:
    lines = _read_text(path).split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    last = len(lines) - 1
    first_step = previous = None  # of the training lines: (step, line number)
    non_finite: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number - 1 >= last - 1 and not line.endswith("}"):
                warnings.warn(
                    f"{path}: line {number} is cut (a run stopped mid-write?); that record is skipped",
                    TruncatedLineWarning,
                    stacklevel=3,
                )
                continue  # a partial final line
            raise ValueError(f"{path}: line {number} is not JSON: {e}") from None
        if not isinstance(record, dict) or ("step" not in record and VAL_STEP_KEY not in record):
            raise ValueError(f"{path}: line {number} has neither 'step' nor '{VAL_STEP_KEY}'")
        _check_types(path, number, record)
        non_finite += [f"line {number} field {k!r} = {v}" for k, v in record.items() if _is_non_finite(v)]
        if "step" in record:
            step = int(record["step"])
            # A resume rewinds the file (rewind_metrics_jsonl); a copy that missed the rewind repeats steps
            # after the resume point, never the file's first step. Back at the first step is a second run.
            if previous is not None and step <= first_step[0] < previous[0]:
                raise ValueError(
                    f"{path}: line {number}: step {step} again after step {previous[0]} (line {previous[1]}): the "
                    f"file holds two runs (the first from line {first_step[1]}); keep one run per file (split it "
                    f"at line {number})"
                )
            first_step = first_step or (step, number)
            previous = (step, number)
        if step_key not in record:
            continue  # the other kind of line
        step = int(record[step_key])
        by_step[step] = {k: (float("nan") if v is None or _is_non_finite(v) else v) for k, v in record.items()}
        by_step[step][step_key] = step
    if non_finite:
        warnings.warn(
            f"{path}: {len(non_finite)} literal NaN/Infinity value(s) ({non_finite[0]}"
            f"{', ...' if len(non_finite) > 1 else ''}); this format writes null for a missing value: read as missing",
            NonFiniteValueWarning,
            stacklevel=3,
        )
    return [by_step[s] for s in sorted(by_step)]


def _is_non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _check_types(path: str | os.PathLike, number: int, record: dict[str, Any]) -> None:
    """A line's step is a whole number and every metric a number or null; else a ValueError naming the
    file, the line and the field (not ``int()``'s "invalid literal")."""
    for key in ("step", VAL_STEP_KEY):
        if key in record:
            value = record[key]
            whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            if isinstance(value, bool) or not whole or value < 0:
                raise ValueError(f"{path}: line {number}: field {key!r} is {value!r}; expected a whole number >= 0")
    for key, value in record.items():
        if key in ("step", VAL_STEP_KEY) or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: line {number}: field {key!r} is {value!r}; expected a number or null")


def read_metrics_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All training records, sorted by step, keeping the last line for a step written twice.

    Validation lines (``val_step``) are skipped: see :func:`read_validation_jsonl`. ``null`` values
    come back as ``float('nan')``. A truncated last line (a run killed mid-write) is skipped; any other
    malformed line raises ``ValueError`` naming the line number.
    """
    return _read_records(path, "step")


def read_validation_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All validation records (``{"val_step": N, ...}``), sorted by step, the last line per step."""
    return _read_records(path, VAL_STEP_KEY)


def validation_pass_at_k(
    data_sources: Sequence[Any],
    sample_uids: Sequence[Any],
    acc: Sequence[Any] | None,
    expected_counts: Mapping[tuple[str, str], int] | None = None,
) -> dict[str, float]:
    """Per data source: the number of prompts and the exact pass@k, k = the most responses of a prompt.

    ``data_sources`` / ``sample_uids`` / ``acc`` are per response, as verl's v1 ``_validate`` collects
    them (``acc`` from ``reward_extra_info``; None entries are ignored). A prompt with fewer responses
    than ``expected_counts[(source, uid)]`` (failed sessions) has the missing ones counted as wrong,
    as verl does for ``mean@n``. pass@k of a prompt with n responses, c of them correct, is the unbiased
    estimator 1 - C(n-c, k)/C(n, k) (Chen et al., 2021); for n = k it is 1 if any response is correct.
    Unlike verl's ``best@k/mean`` (a bootstrap with replacement), this is exact.

    Returns ``{"gdro/val/<source>/prompts": P, "gdro/val/<source>/acc/pass@k": value, ...}`` for the
    sources that report ``acc``.
    """
    if acc is None:
        return {}
    if not (len(data_sources) == len(sample_uids) == len(acc)):
        raise ValueError(
            f"validation_pass_at_k: {len(data_sources)} data sources, {len(sample_uids)} uids, {len(acc)} acc values"
        )
    outcomes: dict[str, dict[str, list[bool]]] = {}
    for source, uid, value in zip(data_sources, sample_uids, acc, strict=True):
        if value is None:
            continue
        outcomes.setdefault(str(source), {}).setdefault(str(uid), []).append(float(value) > 0)
    for (source, uid), expected in (expected_counts or {}).items():
        if str(source) in outcomes:
            got = outcomes[str(source)].setdefault(str(uid), [])
            got.extend([False] * max(int(expected) - len(got), 0))
    result: dict[str, float] = {}
    for source, by_uid in sorted(outcomes.items()):
        groups = [g for g in by_uid.values() if g]
        if not groups:
            continue
        k = max(len(g) for g in groups)
        values = []
        for g in groups:
            n, c = len(g), sum(g)
            values.append(1.0 - math.comb(n - c, k) / math.comb(n, k) if n >= k else float(c > 0))
        result[f"gdro/val/{source}/prompts"] = float(len(groups))
        result[f"gdro/val/{source}/acc/pass@{k}"] = float(sum(values) / len(values))
    return result


def validation_by_source(record: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """``{source: (value, metric)}`` of one validation line: verl's ``val-core/<source>/acc/mean@k``
    (largest k; ``reward/mean@k`` for a source without ``acc``), ``metric`` naming which (``acc/mean@8``)."""
    found: dict[str, tuple[int, int, float, str]] = {}
    for key, value in record.items():
        m = _CORE_KEY.match(key)
        if m is None or not isinstance(value, (int, float)) or math.isnan(value):
            continue
        rank = (int(m["var"] == "acc"), int(m["k"]))
        if m["source"] not in found or rank > found[m["source"]][:2]:
            found[m["source"]] = (*rank, float(value), f"{m['var']}/mean@{m['k']}")
    return {source: (v, metric) for source, (_, _, v, metric) in sorted(found.items())}


def pooled_accuracy(record: dict[str, Any]) -> float | None:
    """The sources' figures of one validation line weighted by their prompt counts (the fraction of all
    validation prompts answered correctly), or None when a source has no prompt count."""
    total = weighted = 0.0
    for source, (value, _) in validation_by_source(record).items():
        prompts = record.get(f"gdro/val/{source}/prompts")
        if not isinstance(prompts, (int, float)) or math.isnan(prompts) or prompts <= 0:
            return None
        total += prompts
        weighted += prompts * value
    return weighted / total if total else None


def rewind_metrics_jsonl(path: str | os.PathLike, last_step: int) -> int:
    """Drop the lines (training and validation) of steps > ``last_step`` (atomically); return how many.

    Used on resume from ``global_step_{last_step}``: those steps are about to be trained again. The
    validation line of step ``last_step`` itself is kept (verl validates after saving that step's
    checkpoint). A missing file is not an error (returns 0).
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
            record = json.loads(line)
            step = int(record["step"] if "step" in record else record[VAL_STEP_KEY])
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
