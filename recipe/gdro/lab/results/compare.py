"""Runs side by side: validation per data source and GDRO figures, as a table and as curves.

    python -m recipe.gdro.lab.results.compare RUN [RUN ...] [--out compare.md] [--plot compare.png]

``RUN`` is anything the recipe wrote: a run's metrics file (``gdro_metrics.jsonl``), the folder holding
it (``trainer.default_local_dir``: a real-path, CPU-backend or cluster run), or a folder whose
subfolders hold runs (a quick start's ``--out``, a ``<launch.ckpt_root>/<project>`` folder): every run
found there. Runs are labelled by their folder's name (the parent's name too when two runs share one).

Printed (stdout, and the same Markdown in ``--out``):

* **validation**, one row per data source (verl's ``data_source``: an evaluation set, or a skill of the
  tiny LM's arithmetic) and one pair of columns per run: the **final** validation (the run's last
  validation line) and the **best** one with its step. The figure is verl's ``val-core/<source>/acc/mean@k``
  (k = ``val_kwargs.n``; ``reward/mean@k`` for a reward without ``acc``); a last row ``all prompts``
  pools the sources weighted by their prompt counts (``gdro/val/<source>/prompts``) when every run wrote
  them;
* **GDRO**, one row per run from its training lines: steps trained, mean rollouts per prompt, the range of
  per-bin mean rollouts (Rollout-GDRO's allocation), the range of Prompt-GDRO's advantage multipliers, the
  final shadow price μ, the mean standard-error-proxy reduction against uniform, generated tokens
  (``-`` where a run has no such metric: GRPO has no μ).

The figure (``--plot``; default ``compare.png`` beside ``--out``, else in the current folder) has one
panel per data source (validation accuracy against step, every run, shared axes; with more than twelve
sources, the pooled accuracy only) and one of each run's per-prompt training score
(``gdro/per_prompt/score_mean``).

Bad input (a path that holds no metrics file, a file that is not one) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from recipe.gdro.lab.results.table import METRICS_FILE, markdown_table
from recipe.gdro.results.metrics_io import (
    VAL_STEP_KEY,
    MetricsFileWarning,
    pooled_accuracy,
    read_metrics_jsonl,
    read_validation_jsonl,
    validation_by_source,
)
from verl_ext.atomic import atomic_replace

PROG = "python -m recipe.gdro.lab.results.compare"
MAX_SOURCE_PANELS = 12
POOLED = "all prompts"
SCORE_KEY = "gdro/per_prompt/score_mean"


class CompareError(ValueError):
    """An input ``compare`` cannot read (the message names the path and what it expected)."""


@dataclass
class Run:
    """One run's metrics file, read: its label, training lines and validation lines."""

    label: str
    path: str
    training: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)

    def curve(self, source: str) -> tuple[list[int], list[float]]:
        """Validation figure of ``source`` (or the pooled accuracy, :data:`POOLED`) against step."""
        steps, values = [], []
        for record in self.validation:
            if source == POOLED:
                value = pooled_accuracy(record)
            else:
                value = validation_by_source(record).get(source, (None,))[0]
            if value is not None:
                steps.append(int(record[VAL_STEP_KEY]))
                values.append(value)
        return steps, values

    def sources(self) -> list[str]:
        return sorted({s for record in self.validation for s in validation_by_source(record)})

    def training_points(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of the training lines that hold ``key`` (a number, not NaN)."""
        held = [r for r in self.training if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        return [int(r["step"]) for r in held], [float(r[key]) for r in held]

    def training_values(self, key: str) -> list[float]:
        return self.training_points(key)[1]


def find_runs(paths: Sequence[str]) -> list[tuple[str, str]]:
    """``(path given, metrics file)`` of every run under ``paths`` (module docstring), in order."""
    found = []
    for path in paths:
        if os.path.isfile(path):
            found.append((path, path))
            continue
        if not os.path.isdir(path):
            raise CompareError(f"{path}: no such file or folder")
        own = os.path.join(path, METRICS_FILE)
        if os.path.isfile(own):
            found.append((path, own))
            continue
        nested = sorted(
            os.path.join(path, name, METRICS_FILE)
            for name in os.listdir(path)
            if os.path.isfile(os.path.join(path, name, METRICS_FILE))
        )
        if not nested:
            raise CompareError(
                f"{path}: no {METRICS_FILE} in it or in its subfolders; give a run's folder "
                "(trainer.default_local_dir, e.g. tiny_real_path_out/<project>/<experiment>) or its metrics file"
            )
        found += [(os.path.dirname(f), f) for f in nested]
    return found


def run_labels(metrics_files: Sequence[str]) -> list[str]:
    """Each run's folder name; where two runs share one, the parent's name is prefixed (``a/grpo``)."""
    folders = [os.path.dirname(os.path.abspath(f)) for f in metrics_files]
    labels = [os.path.basename(f) for f in folders]
    for depth in (2, 3):
        if len(set(labels)) == len(labels):
            break
        labels = [
            "/".join(f.split(os.sep)[-depth:]) if labels.count(label) > 1 else label
            for f, label in zip(folders, labels, strict=True)
        ]
    return labels


def read_runs(paths: Sequence[str]) -> list[Run]:
    """Every run under ``paths``, read; a file without a single training or validation line is refused."""
    files = [f for _, f in find_runs(paths)]
    runs = []
    for label, path in zip(run_labels(files), files, strict=True):
        run = Run(label, path, read_metrics_jsonl(path), read_validation_jsonl(path))
        if not run.training and not run.validation:
            raise CompareError(f"{path}: holds no metrics lines (the run wrote nothing yet?)")
        runs.append(run)
    return runs


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _final_and_best(run: Run, source: str) -> tuple[str, str]:
    steps, values = run.curve(source)
    if not values:
        return "-", "-"
    best = max(range(len(values)), key=lambda i: (values[i], -steps[i]))  # ties: the earlier step
    return f"{values[-1]:.3f} (step {steps[-1]})", f"{values[best]:.3f} (step {steps[best]})"


def validation_table(runs: Sequence[Run]) -> list[str]:
    sources = sorted({s for run in runs for s in run.sources()})
    metrics = sorted({m for run in runs for r in run.validation for _, m in validation_by_source(r).values()})
    rows = [[s, *(cell for run in runs for cell in _final_and_best(run, s))] for s in sources]
    if sources and all(run.validation and pooled_accuracy(run.validation[-1]) is not None for run in runs):
        rows.append([POOLED, *(cell for run in runs for cell in _final_and_best(run, POOLED))])
    head = ["data source", *(f"{run.label} {what}" for run in runs for what in ("final", "best"))]
    note = f"Validation ({', '.join(metrics) or 'no validation lines'}; verl's val-core figure per data source)"
    return [note, "", *markdown_table(head, rows)]


def _range(values: Sequence[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if values else "-"


def gdro_row(run: Run) -> list[str]:
    """The GDRO figures of one run's training lines (module docstring)."""
    steps = [int(r["step"]) for r in run.training]
    per_bin = [
        v for r in run.training for k, v in r.items() if re.fullmatch(r"gdro/bin_\d+/rollouts_per_prompt", k) and v == v
    ]
    multipliers = run.training_values("gdro/multiplier_min") + run.training_values("gdro/multiplier_max")
    mu = run.training_values("gdro/mu")
    reduction = run.training_values("gdro/se_proxy_reduction")
    rollouts = run.training_values("gdro/rollouts_per_prompt")
    tokens = run.training_values("gdro/tokens/generated")
    return [
        run.label,
        str(max(steps)) if steps else "0",
        str(len(run.validation)),
        _fmt(sum(rollouts) / len(rollouts), 2) if rollouts else "-",
        _range(per_bin),
        _range(multipliers),
        _fmt(mu[-1], 4) if mu else "-",
        f"{100 * sum(reduction) / len(reduction):.1f}%" if reduction else "-",
        f"{int(sum(tokens)):,}" if tokens else "-",
    ]


def gdro_table(runs: Sequence[Run]) -> list[str]:
    head = [
        "run",
        "steps",
        "validations",
        "rollouts / prompt",
        "per-bin rollouts",
        "Prompt-GDRO multipliers",
        "final μ",
        "SE-proxy reduction",
        "generated tokens",
    ]
    note = "GDRO (training lines: means over steps, ranges over steps and bins)"
    return [note, "", *markdown_table(head, map(gdro_row, runs))]


def markdown(runs: Sequence[Run]) -> str:
    files = [f"- `{run.label}`: {run.path}" for run in runs]
    return "\n".join(["# Runs compared", "", *files, "", *validation_table(runs), "", *gdro_table(runs)]) + "\n"


def plot_curves(runs: Sequence[Run], path: str) -> str:
    """The validation curves of every run on shared axes, one panel per data source, and the per-prompt
    training score (module docstring); returns ``path``."""
    from recipe.gdro.lab.results.plot import finish_figure, pyplot

    plt = pyplot()
    sources = sorted({s for run in runs for s in run.sources()})
    if len(sources) > MAX_SOURCE_PANELS or not sources:
        sources = [POOLED] if any(run.curve(POOLED)[0] for run in runs) else sources[:MAX_SOURCE_PANELS]
    panels = len(sources) + 1
    ncol = min(4, panels)
    nrow = math.ceil(panels / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.6 * ncol, 2.9 * nrow), squeeze=False)
    flat = [ax for row in axes for ax in row]
    val_axes = flat[: len(sources)]
    for ax in val_axes[1:]:
        ax.sharex(val_axes[0])
        ax.sharey(val_axes[0])
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        for ax, source in zip(val_axes, sources, strict=True):
            steps, values = run.curve(source)
            if steps:
                ax.plot(steps, values, marker="o", ms=3, color=color, label=run.label)
        steps, score = run.training_points(SCORE_KEY)
        if score:
            flat[len(sources)].plot(steps, score, color=color, lw=1.2, label=run.label)
    for ax, source in zip(val_axes, sources, strict=True):
        ax.set_title(f"validation: {source}", fontsize=9)
        ax.set_ylabel("accuracy", fontsize=8)
    train_ax = flat[len(sources)]
    train_ax.set_title("training: per-prompt score", fontsize=9)
    train_ax.set_ylabel("mean score", fontsize=8)
    for ax in flat[:panels]:
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in flat[panels:]:
        ax.axis("off")
    (val_axes[0] if val_axes else train_ax).legend(fontsize=7)
    return finish_figure(fig, "runs compared: " + ", ".join(run.label for run in runs), path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN", help=f"a run's {METRICS_FILE}, its folder, or a folder of runs")
    ap.add_argument("--out", metavar="FILE", help="also write the tables as Markdown to FILE")
    ap.add_argument("--plot", metavar="PNG", help="the curves' figure (default: compare.png beside --out, else here)")
    args = ap.parse_args(argv)
    plot = args.plot or os.path.join(os.path.dirname(os.path.abspath(args.out)) if args.out else ".", "compare.png")
    for flag, target in (("--out", args.out), ("--plot", plot)):
        if target is not None and os.path.isdir(target):
            print(f"compare: error: {flag} {target} is a folder; give a file name", file=sys.stderr)
            return 2
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MetricsFileWarning)
            runs = read_runs(args.runs)
    except (ValueError, OSError) as e:  # CompareError and the readers' ValueError name the file and line
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    for message in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, MetricsFileWarning)):
        print(f"compare: warning: {message}", file=sys.stderr)
    text = markdown(runs)
    try:
        if args.out:
            with atomic_replace(args.out, "wb") as f:
                f.write(text.encode("utf-8"))
        plot_curves(runs, plot)
    except OSError as e:
        print(f"compare: error: cannot write {e.filename or args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(text, end="")
    for written in (args.out, plot):
        if written:
            print(f"[compare] wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
