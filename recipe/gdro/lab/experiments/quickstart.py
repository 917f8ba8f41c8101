"""The quick start: real RL of the shipped tiny LM on CPU, GRPO against GDRO at equal rollouts.

    python -m recipe.gdro.lab.experiments.quickstart [--steps 30] [--runs grpo,joint_gdro] [--out quickstart_out]

Each run is ``run_scripts/cpu_backend_tiny.sh`` (``gdro.backend=cpu``: verl 0.9.1's v1 loop, the recipe's
trainer, the tiny LM sampled and trained on CPU) with the same data, seed, steps and rollout budget
(64 prompts x 4 rollouts a step); only the adversaries differ. Its output is in ``<out>/<run>/``
(``gdro_metrics.jsonl`` with training and validation lines, ``cpu_backend_stats.json``,
``train.log``); a progress bar follows each run's metrics file, and says what the run is doing before its
first step (checks, Ray and TransferQueue start-up, the validation before training: about a minute). Then
``<out>/report.md``: per-skill validation accuracy before and after, mean and worst-skill accuracy,
generated tokens and wall time per run, plots of the runs' own metrics (``recipe.gdro.lab.results.plot``:
per-bin rollout share and adversary weight over steps) and the validation learning curves.

A result is replaced only by a complete one: the runs and the report are written to ``<out>.partial/``
beside ``<out>``, which takes its place (the previous result removed) once every run and the report are
written. An interrupted or failed rerun leaves ``<out>`` as it was, its report matching its metrics, and
its partial runs in ``<out>.partial/`` (removed by the next rerun). An ``--out`` folder holding anything a
quick start does not write is refused (exit 2), as it would be replaced.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below: one line, no traceback (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("quickstart")

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
RUN_LABELS = {
    "grpo": "GRPO",
    "prompt_gdro": "Prompt-GDRO",
    "rollout_gdro": "Rollout-GDRO",
    "joint_gdro": "GDRO (Prompt + Rollout, joint)",
}
# GRPO's tuned lr on the shipped base: the tiny-LM study's tuning stage chose 1e-4 of 5e-5..4e-4 for
# every method (results/tiny_lm_study/REPORT.md). Every quick-start run uses it: runs differ only in the adversaries.
LR = 1e-4
# Validation prompts (data_prep/arith.py --num_val): 1,000 so that the rise is well above the noise
# of one sampled answer per prompt (SE about 0.016 at accuracy 0.5).
NUM_VAL = 1000
PASS_RE = re.compile(r"^gdro/val/(?P<source>[^/]+)/acc/pass@1$")


# What a quick start writes in --out: the runs' folders, their data, the report and its figure.
RESULT_ENTRIES = {"data", "report.md", "learning_curves.png", *RUN_LABELS}
PLAN_DONE = "start-up checks passed"  # recipe.gdro.startup.plan: the launch's checks are over


def _count_lines(path: Path, start: str) -> int:
    if not path.exists():
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.startswith(start))


def startup_phase(folder: Path) -> str:
    """What a run in ``folder`` is doing before its first step, from its ``train.log`` and metrics file."""
    log, metrics = folder / "train.log", folder / "gdro_metrics.jsonl"
    if _count_lines(metrics, '{"val_step"'):
        return "step 1"
    text = log.read_text(errors="replace") if log.exists() else ""
    if PLAN_DONE not in text:
        return "checking the config and data"
    return "starting Ray and TransferQueue, loading the model, validating before training"


def replaceable(out: Path) -> str | None:
    """None when ``out`` is absent, empty or a quick start's result; else an entry it holds that is not."""
    if not out.is_dir():
        return None
    foreign = sorted(p.name for p in out.iterdir() if p.name not in RESULT_ENTRIES)
    return foreign[0] if foreign else None


def publish(staging: Path, out: Path) -> None:
    """``staging`` (complete) becomes ``out``; a previous result there is removed once it is out of the way."""
    if out.exists():
        previous = out.with_name(out.name + ".replaced")
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(out, previous)
        os.rename(staging, out)
        shutil.rmtree(previous)
    else:
        os.rename(staging, out)


def run_one(method: str, out: Path, data: Path, steps: int, extra: list[str]) -> float:
    """Run cpu_backend_tiny.sh for ``method``; a progress bar follows its metrics file. Returns the wall time (s)."""
    from tqdm import tqdm

    folder = out / method
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "gdro_metrics.jsonl"
    env = dict(os.environ, METHOD=method, DATA_DIR=str(data), OUT_DIR=str(folder), NUM_VAL=str(NUM_VAL))
    cmd = [
        "bash",
        str(REPO / "run_scripts" / "cpu_backend_tiny.sh"),
        f"trainer.total_training_steps={steps}",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "trainer.logger=[]",
        f"hydra.run.dir={folder / 'hydra'}",
        *extra,
    ]
    start = time.perf_counter()
    print(
        f"[quickstart] {method}: start-up (checks, Ray and TransferQueue, the validation before training) "
        f"takes about a minute; its log: {folder / 'train.log'}",
        flush=True,
    )
    with open(folder / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        with tqdm(total=steps, desc=f"{RUN_LABELS.get(method, method):>32s}", unit="step") as bar:
            shown = None
            while proc.poll() is None:
                done = _count_lines(metrics, '{"step"')
                phase = "" if done else startup_phase(folder)
                if phase != shown:  # drawn at once: the bar is not redrawn while it stays at 0
                    bar.set_postfix_str(phase)
                    shown = phase
                bar.update(max(0, done - bar.n))
                time.sleep(0.5)
            bar.set_postfix_str("", refresh=False)
            bar.update(max(0, _count_lines(metrics, '{"step"') - bar.n))
    seconds = time.perf_counter() - start
    if proc.returncode:
        tail = (folder / "train.log").read_text(errors="replace").splitlines()[-30:]
        head = f"quickstart: {method} failed (exit {proc.returncode}); end of {folder / 'train.log'}:"
        raise SystemExit("\n".join([head, *tail]))
    return seconds


def skill_accuracy(record: dict) -> dict[str, tuple[float, int]]:
    """``{source: (pass@1, prompts)}`` of one validation line."""
    out = {}
    for key, value in record.items():
        m = PASS_RE.match(key)
        if m and value is not None:
            prompts = record.get(f"gdro/val/{m['source']}/prompts") or 0
            out[m["source"]] = (float(value), int(prompts))
    return out


def summary(acc: dict[str, tuple[float, int]]) -> dict[str, float]:
    if not acc:
        return {"macro": float("nan"), "pooled": float("nan"), "worst": float("nan")}
    values = [a for a, _ in acc.values()]
    total = sum(n for _, n in acc.values())
    pooled = sum(a * n for a, n in acc.values()) / total if total else float("nan")
    return {"macro": sum(values) / len(values), "pooled": pooled, "worst": min(values)}


def plot_learning_curves(runs: dict[str, list[dict]], path: Path) -> None:
    from recipe.gdro.lab.results.plot import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for method, vals in runs.items():
        steps = [v["val_step"] for v in vals]
        s = [summary(skill_accuracy(v)) for v in vals]
        label = RUN_LABELS.get(method, method)
        axes[0].plot(steps, [x["pooled"] for x in s], marker="o", label=label)
        axes[1].plot(steps, [x["worst"] for x in s], marker="o", label=label)
    axes[0].set_title("validation accuracy (all prompts)")
    axes[1].set_title("worst-skill validation accuracy")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.set_ylabel("pass@1 (temperature 1)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny LM on CPU (gdro.backend=cpu), one seed")
    save_figure(fig, str(path))


def write_report(out: Path, methods: list[str], walls: dict[str, float], steps: int, install_s: float | None) -> str:
    from recipe.gdro.lab.results.plot import plot_path
    from recipe.gdro.lab.results.table import markdown_table
    from recipe.gdro.results.metrics_io import read_validation_jsonl

    vals = {m: read_validation_jsonl(out / m / "gdro_metrics.jsonl") for m in methods}
    stats = {m: json.loads((out / m / "cpu_backend_stats.json").read_text()) for m in methods}
    first = {m: skill_accuracy(v[0]) if v else {} for m, v in vals.items()}
    last = {m: skill_accuracy(v[-1]) if v else {} for m, v in vals.items()}
    skills = sorted({s for m in methods for s in last[m]} | {s for m in methods for s in first[m]})
    lines = [
        "# Quick start: the tiny LM trained on CPU (GRPO vs GDRO)",
        "",
        f"Every run: the shipped base (recipe/gdro/lab/tinylm/base), {steps} steps of 64 prompts x 4 rollouts "
        "(the same total rollouts), the same data and seed, through verl 0.9.1's v1 loop with the CPU "
        f"backend (`gdro.backend=cpu`, docs/cpu_backend.md), lr {LR:g} (GRPO's tuned lr). Validation: one response per "
        "validation prompt at temperature 1 (the study's metric), before training and every 10 steps. "
        "640 training prompts, so each is revisited "
        "every 10 steps (the difficulty binner keys prompts by id; in the first 10 steps every prompt is "
        "unseen and GDRO's allocation and weights are uniform).",
        "",
        "## Per-skill validation accuracy (pass@1 at temperature 1), before -> after",
        "",
    ]
    rows = []
    for s in skills:
        n = next((last[m][s][1] for m in methods if s in last[m]), 0)
        before_after = [(first[m].get(s, (float("nan"), 0))[0], last[m].get(s, (float("nan"), 0))[0]) for m in methods]
        rows.append([s, n, *(f"{b:.3f} -> {a:.3f}" for b, a in before_after)])
    lines += markdown_table(["skill", "val prompts", *(RUN_LABELS.get(m, m) for m in methods)], rows)
    lines += ["", "## Summary", ""]
    rows = []
    for m in methods:
        b, a = summary(first[m]), summary(last[m])
        rows.append(
            [
                RUN_LABELS.get(m, m),
                f"{b['macro']:.3f} -> {a['macro']:.3f}",
                f"{b['pooled']:.3f} -> {a['pooled']:.3f}",
                f"{b['worst']:.3f} -> {a['worst']:.3f}",
                f"{stats[m]['generated_tokens']:,}",
                f"{walls[m]:.0f} s",
            ]
        )
    head = ["run", "mean over skills", "all prompts", "worst skill", "generated tokens", "wall time"]
    lines += markdown_table(head, rows)
    lines += [
        "",
        "Wall time per run includes Ray and TransferQueue start-up and the validations"
        + (f"; the install took {install_s:.0f} s." if install_s is not None else "."),
        "",
        "## What this can and cannot tell",
        "",
        f"lr {LR:g} is GRPO's tuned lr on the shipped base (docs/tiny_lm.md), whose frontier skills (sub2, add3, "
        "add4, mul1x2) it only half solves: GRPO's held-out accuracy rises within these steps.",
        "",
        "One seed per method, a few dozen steps, a few hundred validation prompts. Differences between the runs "
        "of a few points are within what a different seed moves (sampling at temperature 1, the adversaries' "
        "own randomness, one sampled answer per validation prompt: about ±0.016 on 1,000 prompts); "
        "this quick start shows that the whole loop runs "
        "for real and how the adversaries act (the plots: where the rollouts went, which bins were "
        "up-weighted), not that one method beats another. A claim of that kind needs several seeds per "
        "method, confidence intervals, and more steps.",
        "",
        "## Plots",
        "",
        "- `learning_curves.png`: validation accuracy (all prompts, worst skill) over steps, per run.",
    ]
    plot_learning_curves(vals, out / "learning_curves.png")
    for m in methods:
        written = plot_path(str(out / m / "gdro_metrics.jsonl"), str(out / m / "plots"))
        for p in written:
            lines.append(f"- `{os.path.relpath(p, out)}`")
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--runs", default="grpo,joint_gdro", help="comma-separated: " + ", ".join(RUN_LABELS))
    p.add_argument("--out", default="quickstart_out")
    p.add_argument("--install-seconds", type=float, default=None, help="shown in the report (quickstart.sh)")
    args, extra = p.parse_known_args(argv)
    methods = [m.strip() for m in args.runs.split(",")]
    if not all(methods):  # '' would train nothing and then find no curves to plot
        print(
            f"quickstart: --runs {args.runs!r} has an empty item; name runs from {', '.join(RUN_LABELS)}",
            file=sys.stderr,
        )
        return 2
    unknown = [m for m in methods if m not in RUN_LABELS]
    if unknown:
        print(f"quickstart: unknown run {unknown[0]!r}; use {', '.join(RUN_LABELS)}", file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"quickstart: --steps {args.steps}: must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    staging = out.with_name(out.name + ".partial")
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        print(f"quickstart: --out {args.out}: {blocker} is a file, not a folder", file=sys.stderr)
        return 2
    # the runs go to <out>.partial beside --out, which then takes its place: its parent must be writable
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        print(f"quickstart: --out {args.out}: {parent} is not writable", file=sys.stderr)
        return 2
    foreign = replaceable(out)
    if foreign is not None:
        print(
            f"quickstart: --out {args.out} holds {foreign!r}, which a quick start does not write; a complete run "
            "replaces the whole folder: give a new or a quick start's folder",
            file=sys.stderr,
        )
        return 2
    shutil.rmtree(staging, ignore_errors=True)  # an interrupted rerun's partial runs
    from verl_ext.interrupt import set_detail

    set_detail(f"stopped its runs; {out} is as it was, the partial runs are in {staging}")
    data = staging / "data"  # made by the first cpu_backend_tiny.sh run (its NUM_TRAIN / NUM_VAL defaults)
    walls = {m: run_one(m, staging, data, args.steps, extra) for m in methods}
    report = write_report(staging, methods, walls, args.steps, args.install_seconds)
    publish(staging, out)
    print(report)
    print(f"[quickstart] report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    from verl_ext.interrupt import run_main

    run_main("quickstart", main, detail="stopped")
