"""The paper's Table 1 from real runs' GDRO metrics files.

    python -m recipe.gdro.lab.results.table RUN [RUN ...] [--step best|last|N] [--csv FILE]
    python -m recipe.gdro.lab.results.table RUN [RUN ...] --list-sets      # the sets each run validated on

``RUN`` is a run's metrics file (``<trainer.default_local_dir>/gdro_metrics.jsonl``) or the folder
holding it. The trainer writes one validation line per validation (``{"val_step": N, ...}``, see
:mod:`recipe.gdro.results.metrics_io`); this command picks one validation step per run and prints, as a
Markdown table (and optionally CSV), accuracy in percent:

* one column per benchmark: verl's ``val-core/<set>/acc/mean@k`` (k = ``val_kwargs.n``, 8 in the
  paper) for the ``data_source`` names ``data_prep/eval_sets.py`` writes; **AIME** is the mean of
  ``aime2024`` and ``aime2025``;
* **pass@k**, pooled over all seven sets: the prompt-weighted mean of the per-set pass@k, i.e. the
  fraction of all evaluation prompts solved by at least one of k responses. Per set it takes the exact
  pass@k the trainer writes (``gdro/val/<set>/acc/pass@k``) weighted by the prompt count it writes
  (``gdro/val/<set>/prompts``); for a line without them it falls back to verl's bootstrap estimate
  ``val-core/<set>/acc/best@k/mean`` weighted by the published set sizes, and says so in the
  ``pass_source`` column of the CSV.

``--step best`` (default) takes the validation step with the highest **unweighted mean of the six
benchmark columns** (ties: the earlier step), as the paper reports the best validation step;
``last`` the last validation; an integer that step.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import re
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from recipe.gdro.results.metrics_io import VAL_STEP_KEY, MetricsFileWarning, read_validation_jsonl
from verl_ext.atomic import atomic_replace

METRICS_FILE = "gdro_metrics.jsonl"

# Table 1's columns: (header, data sources averaged into it). Names as written by data_prep/eval_sets.py.
COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("MATH500", ("math500",)),
    ("AIME", ("aime2024", "aime2025")),
    ("AMC", ("amc23",)),
    ("Minerva", ("minerva",)),
    ("Olympiad", ("olympiadbench",)),
    ("GPQA", ("gpqa_diamond",)),
]
DATA_SOURCES = [s for _, sources in COLUMNS for s in sources]
# Published sizes of the sets (prompts), used to pool verl's best@k when a line has no prompt counts.
SET_SIZES = {
    "math500": 500,
    "aime2024": 30,
    "aime2025": 30,
    "amc23": 40,
    "minerva": 272,
    "olympiadbench": 675,
    "gpqa_diamond": 198,
}


class ResultsTableError(ValueError):
    """A metrics file that cannot give Table 1 (no validation lines, a missing benchmark, a bad step)."""


@dataclass
class Row:
    run: str
    step: int
    k: int
    columns: dict[str, float]  # header -> accuracy in [0, 1]
    pass_at_k: float
    pass_source: str  # "exact" or "verl-bootstrap"

    @property
    def benchmark_mean(self) -> float:
        return sum(self.columns.values()) / len(self.columns)


def metrics_path(run: str) -> str:
    path = os.path.join(run, METRICS_FILE) if os.path.isdir(run) else run
    if not os.path.exists(path):
        raise ResultsTableError(f"{run}: no such metrics file (expected a {METRICS_FILE} or the folder holding it)")
    return path


def _mean_at(record: dict, source: str, where: str) -> tuple[float, int]:
    """``val-core/<source>/acc/mean@k`` of one validation line (the largest k if several)."""
    pattern = re.compile(rf"^val-core/{re.escape(source)}/acc/mean@(\d+)$")
    found = [(int(m.group(1)), key) for key in record if (m := pattern.match(key))]
    if not found:
        sources = sorted({key.split("/")[1] for key in record if key.startswith("val-core/")})
        raise ResultsTableError(
            f"{where}: benchmark {source!r} is missing (no val-core/{source}/acc/mean@k); the line has "
            f"data sources {sources}. Validate on all seven sets written by data_prep/eval_sets.py "
            "(--list-sets shows what a run has)"
        )
    k, key = max(found)
    value = record[key]
    if not isinstance(value, (int, float)) or math.isnan(value):
        raise ResultsTableError(f"{where}: {key} is not a number ({value!r})")
    return float(value), k


def _pass_at(record: dict, source: str, k: int, where: str) -> tuple[float, float, str]:
    """(pass@k, weight, source of the figure) of one set in one validation line."""
    exact, prompts = record.get(f"gdro/val/{source}/acc/pass@{k}"), record.get(f"gdro/val/{source}/prompts")
    if isinstance(exact, (int, float)) and isinstance(prompts, (int, float)) and not math.isnan(exact):
        return float(exact), float(prompts), "exact"
    boot = record.get(f"val-core/{source}/acc/best@{k}/mean")
    if isinstance(boot, (int, float)) and not math.isnan(boot):
        return float(boot), float(SET_SIZES[source]), "verl-bootstrap"
    raise ResultsTableError(
        f"{where}: no pass@{k} for {source!r} (neither gdro/val/{source}/acc/pass@{k} "
        f"nor val-core/{source}/acc/best@{k}/mean)"
    )


def table_row(run: str, record: dict) -> Row:
    """Table 1's row of one validation line."""
    step = int(record[VAL_STEP_KEY])
    where = f"{run} (validation at step {step})"
    means = {s: _mean_at(record, s, where) for s in DATA_SOURCES}
    ks = {k for _, k in means.values()}
    if len(ks) != 1:
        raise ResultsTableError(f"{where}: the sets were validated with different numbers of responses {sorted(ks)}")
    k = ks.pop()
    columns = {header: sum(means[s][0] for s in sources) / len(sources) for header, sources in COLUMNS}
    passes = [_pass_at(record, s, k, where) for s in DATA_SOURCES]
    total = sum(w for _, w, _ in passes)
    pooled = sum(p * w for p, w, _ in passes) / total
    kinds = sorted({kind for _, _, kind in passes})
    return Row(run, step, k, columns, pooled, "+".join(kinds))


def select_row(run: str, records: list[dict], step: str) -> Row:
    if not records:
        raise ResultsTableError(
            f'{run}: no validation lines ({{"{VAL_STEP_KEY}": N, ...}}); the run never validated with the GDRO '
            "trainer (trainer.test_freq > 0 or trainer.val_before_train=true, and gdro.metrics_file set)"
        )
    if step == "last":
        return table_row(run, records[-1])
    if step == "best":
        rows = [table_row(run, r) for r in records]
        return max(rows, key=lambda r: (r.benchmark_mean, -r.step))
    try:
        wanted = int(step)
    except ValueError:
        raise ResultsTableError(f"--step must be best, last or an integer, got {step!r}") from None
    for record in records:
        if int(record[VAL_STEP_KEY]) == wanted:
            return table_row(run, record)
    steps = [int(r[VAL_STEP_KEY]) for r in records]
    raise ResultsTableError(f"{run}: no validation at step {wanted}; validated steps: {steps}")


_SOURCE_KEY = re.compile(r"^val-core/(?P<source>[^/]+)/acc/mean@(?P<k>\d+)$")


def list_sets(run: str) -> list[list[Any]]:
    """The evaluation sets (verl ``data_source`` names) a run validated on: one row per set with the
    validation steps that hold it, k of ``mean@k``, the prompt count the trainer wrote (last step) and
    the Table 1 column it feeds (``-`` for a set Table 1 does not use, e.g. a CPU run's skills)."""
    records = read_validation_jsonl(metrics_path(run))
    if not records:
        raise ResultsTableError(
            f'{run}: no validation lines ({{"{VAL_STEP_KEY}": N, ...}}); the run never validated with the GDRO trainer'
        )
    found: dict[str, dict[str, Any]] = {}
    for record in records:
        for key in record:
            m = _SOURCE_KEY.match(key)
            if m:
                entry = found.setdefault(m["source"], {"steps": [], "k": set(), "prompts": None})
                if not entry["steps"] or entry["steps"][-1] != record[VAL_STEP_KEY]:
                    entry["steps"].append(int(record[VAL_STEP_KEY]))
                entry["k"].add(int(m["k"]))
                prompts = record.get(f"gdro/val/{m['source']}/prompts")
                if isinstance(prompts, (int, float)) and not math.isnan(prompts):
                    entry["prompts"] = int(prompts)
    column_of = {source: header for header, sources in COLUMNS for source in sources}
    rows = []
    for source in sorted(found):
        e = found[source]
        steps = e["steps"]
        shown = ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}..{steps[-1]} ({len(steps)} validations)"
        ks = ", ".join(f"mean@{k}" for k in sorted(e["k"]))
        prompts = "-" if e["prompts"] is None else e["prompts"]
        rows.append([run_label(run), source, shown, ks, prompts, column_of.get(source, "-")])
    return rows


def list_sets_text(runs: Sequence[str]) -> str:
    lines = markdown_table(["run", "set", "validated at steps", "metric", "prompts", "Table 1 column"], [])
    notes = []
    for run in runs:
        rows = list_sets(run)
        lines += [markdown_row(r) for r in rows]
        present = {r[1] for r in rows}
        missing = [s for s in DATA_SOURCES if s not in present]
        notes.append(
            f"{run_label(run)}: Table 1 also needs {', '.join(missing)}"
            if missing
            else f"{run_label(run)}: has every set Table 1 needs"
        )
    return "\n".join([*lines, "", *notes])


def build_rows(runs: Sequence[str], step: str = "best") -> list[Row]:
    return [select_row(run, read_validation_jsonl(metrics_path(run)), step) for run in runs]


def run_label(run: str) -> str:
    path = os.path.abspath(run)
    if os.path.basename(path) == METRICS_FILE:
        path = os.path.dirname(path)
    return os.path.basename(path) or path


def markdown_row(cells: Sequence[Any]) -> str:
    """``| a | b |``: one row of a Markdown table."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The lines of a Markdown table: the header row, the separator, one line per row of cells.
    The one table writer of the results table and the simulator's reports."""
    return [markdown_row(columns), "|" + "---|" * len(columns), *(markdown_row(r) for r in rows)]


def markdown(rows: Sequence[Row]) -> str:
    ks = sorted({r.k for r in rows})
    pass_header = f"pass@{ks[0]}" if len(ks) == 1 else "pass@k"
    mean_note = f"mean@{ks[0]}" if len(ks) == 1 else "mean@k"
    headers = ["run", "step", *[h for h, _ in COLUMNS], pass_header]
    cells = [
        [run_label(r.run), r.step, *[f"{100 * r.columns[h]:.2f}" for h, _ in COLUMNS], f"{100 * r.pass_at_k:.2f}"]
        for r in rows
    ]
    comment = (
        f"<!-- accuracy (%): {mean_note} per set, AIME = mean of 2024 and 2025, {pass_header} pooled over the "
        "seven sets (prompt-weighted) -->"
    )
    return "\n".join([comment, *markdown_table(headers, cells)])


def write_csv(rows: Sequence[Row], path: str) -> None:
    """Write the rows as CSV atomically (a temporary file beside ``path``, then a rename)."""
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    writer.writerow(["run", "step", "k", *[h for h, _ in COLUMNS], "pass_at_k", "pass_source", "benchmark_mean"])
    for r in rows:
        writer.writerow(
            [
                r.run,
                r.step,
                r.k,
                *[f"{100 * r.columns[h]:.4f}" for h, _ in COLUMNS],
                f"{100 * r.pass_at_k:.4f}",
                r.pass_source,
                f"{100 * r.benchmark_mean:.4f}",
            ]
        )
    with atomic_replace(path, "wb") as f:
        f.write(buf.getvalue().encode("utf-8"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m recipe.gdro.lab.results.table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("runs", nargs="+", metavar="RUN", help=f"a run's {METRICS_FILE} or the folder holding it")
    ap.add_argument("--step", default="best", help="best (default), last, or a validated step number")
    ap.add_argument("--csv", metavar="FILE", help="also write the rows as CSV")
    ap.add_argument(
        "--list-sets",
        action="store_true",
        help="print the evaluation sets each run validated on (and which Table 1 needs) instead of the table",
    )
    args = ap.parse_args(argv)
    if args.list_sets:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MetricsFileWarning)
                print(list_sets_text(args.runs))
        except (ResultsTableError, ValueError, OSError) as e:
            print(f"results_table: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MetricsFileWarning)
            rows = build_rows(args.runs, args.step)
    except (ResultsTableError, ValueError, OSError) as e:
        print(f"results_table: error: {e}", file=sys.stderr)
        return 2
    for message in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, MetricsFileWarning)):
        print(f"results_table: warning: {message}", file=sys.stderr)
    for w in caught:
        if not issubclass(w.category, MetricsFileWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if args.csv:  # before the table is printed: a bad --csv path leaves no output at all
        if os.path.isdir(args.csv):
            print(f"results_table: error: --csv {args.csv} is a folder; give a file name", file=sys.stderr)
            return 2
        try:
            write_csv(rows, args.csv)
        except OSError as e:
            print(f"results_table: error: cannot write --csv {args.csv}: {e.strerror or e}", file=sys.stderr)
            return 2
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
