"""Defaults sweep on the SYNTHETIC learner: the evidence behind the verl_ext defaults.

    python -m recipe.gdro.sim_sweep --out outputs/sim_sweep [--scenarios dapo_like rare_hard_skill unsolvable_share]
                                    [--seeds 3] [--steps N] [--workers 2]

Runs, at equal total rollouts and with the same seeds (same datasets, batches and reward draws)
for every variant:

* ``loss_signal``: Prompt-GDRO with ``learnability`` / ``failure_rate`` / ``mean_abs_advantage``;
* ``allocator``:   Rollout-GDRO with ``sqrt`` / ``bandit`` / ``knapsack`` (and uniform = GRPO);
* ``num_bins``:    Prompt-GDRO and Rollout-GDRO (sqrt) with K = 4, 6, 10, 20 bins;
* ``coupling``:    joint mode with ``rollout_coupling`` = ``none`` / ``divide_by_allocation``.

Writes ``<out>/<scenario>/{results.json,report.md}`` per scenario and ``<out>/SWEEP.md`` with
one table per question (mean ± std over seeds). Everything else is the verl_ext default.
The learner is synthetic: this chooses defaults for a stand-in, not for an LLM (docs/simulator.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from typing import Any, Mapping, Optional, Sequence

from recipe.gdro.sim_scenario import load_scenario
from recipe.gdro.simulate import SYNTHETIC_NOTE, run_experiment

P_ON = {"enable": True}
P_OFF = {"enable": False}
R_OFF = {"enable": False}


def _prompt(**kw: Any) -> dict[str, Any]:
    binner = {"num_bins": kw.pop("num_bins")} if "num_bins" in kw else {}
    d: dict[str, Any] = {"prompt": {**P_ON, **kw}, "rollout": dict(R_OFF)}
    if binner:
        d["binner"] = binner
    return d


def _rollout(allocator: str = "sqrt", num_bins: Optional[int] = None) -> dict[str, Any]:
    d: dict[str, Any] = {"prompt": dict(P_OFF), "rollout": {"enable": True, "allocator": allocator}}
    if num_bins is not None:
        d["binner"] = {"num_bins": num_bins}
    return d


VARIANTS: dict[str, dict[str, Any]] = {
    "grpo": {"prompt": dict(P_OFF), "rollout": dict(R_OFF)},
    "prompt-learnability": _prompt(loss_signal="learnability"),
    "prompt-failure_rate": _prompt(loss_signal="failure_rate"),
    "prompt-mean_abs_advantage": _prompt(loss_signal="mean_abs_advantage"),
    "rollout-sqrt": _rollout("sqrt"),
    "rollout-bandit": _rollout("bandit"),
    "rollout-knapsack": _rollout("knapsack"),
    "prompt-bins4": _prompt(num_bins=4),
    "prompt-bins6": _prompt(num_bins=6),
    "prompt-bins20": _prompt(num_bins=20),
    "rollout_sqrt-bins4": _rollout("sqrt", 4),
    "rollout_sqrt-bins6": _rollout("sqrt", 6),
    "rollout_sqrt-bins20": _rollout("sqrt", 20),
    "joint-coupling_none": {"prompt": {**P_ON, "rollout_coupling": "none"}, "rollout": {"enable": True, "allocator": "sqrt"}},
    "joint-coupling_divide": {"prompt": {**P_ON, "rollout_coupling": "divide_by_allocation"}, "rollout": {"enable": True, "allocator": "sqrt"}},
}

# Each question: (title, rows as (label, variant name)); the verl_ext default is marked.
QUESTIONS: list[tuple[str, list[tuple[str, str]]]] = [
    ("Prompt-GDRO loss signal", [
        ("GRPO (baseline)", "grpo"),
        ("learnability p(1-p) [current default]", "prompt-learnability"),
        ("failure_rate 1-p", "prompt-failure_rate"),
        ("mean_abs_advantage", "prompt-mean_abs_advantage"),
    ]),
    ("Rollout-GDRO allocator", [
        ("uniform (= GRPO)", "grpo"),
        ("sqrt [current default]", "rollout-sqrt"),
        ("bandit", "rollout-bandit"),
        ("knapsack", "rollout-knapsack"),
    ]),
    ("Number of bins K (Prompt-GDRO)", [
        ("K = 4", "prompt-bins4"),
        ("K = 6", "prompt-bins6"),
        ("K = 10 [current default]", "prompt-learnability"),
        ("K = 20", "prompt-bins20"),
    ]),
    ("Number of bins K (Rollout-GDRO, sqrt)", [
        ("K = 4", "rollout_sqrt-bins4"),
        ("K = 6", "rollout_sqrt-bins6"),
        ("K = 10 [current default]", "rollout-sqrt"),
        ("K = 20", "rollout_sqrt-bins20"),
    ]),
    ("Joint-mode coupling (both adversaries, sqrt allocator)", [
        ("none [current default]", "joint-coupling_none"),
        ("divide_by_allocation", "joint-coupling_divide"),
    ]),
]

COLUMNS = (
    ("mean_accuracy", "mean acc."),
    ("worst_skill_accuracy", "worst skill"),
    ("mean_accuracy_auc", "mean acc. AUC"),
    ("worst_skill_accuracy_auc", "worst AUC"),
)


def _cell(e: Mapping[str, Any], key: str) -> str:
    return f"{100 * e[key]:.1f} ± {100 * e[key + '_std']:.1f}"


def question_table(rows: Sequence[tuple[str, str]], results: Mapping[str, Mapping[str, Any]]) -> str:
    """One markdown table: rows = variants, column groups = scenarios."""
    scen = list(results)
    head = "| variant | " + " | ".join(f"{s}: {label} (%)" for s in scen for _, label in COLUMNS) + " |"
    lines = [head, "|---|" + "---|" * (len(scen) * len(COLUMNS))]
    for label, var in rows:
        cells = [_cell(results[s]["methods"][var], key) for s in scen for key, _ in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _paired(results_s: Mapping[str, Any], var: str, ref: str, key: str) -> str:
    """Mean ± std over seeds of the per-seed difference var - ref (same seeds = same data and draws)."""
    a = np.asarray(results_s["methods"][var]["per_seed"][key], dtype=np.float64)
    b = np.asarray(results_s["methods"][ref]["per_seed"][key], dtype=np.float64)
    d = 100 * (a - b)
    sd = float(np.std(d, ddof=1)) if len(d) > 1 else 0.0
    return f"{d.mean():+.1f} ± {sd:.1f}"


def compact_table(rows: Sequence[tuple[str, str]], results: Mapping[str, Mapping[str, Any]], ref: Optional[str] = None) -> str:
    """One row per (variant, scenario); with ``ref``, paired differences against that variant."""
    head = "| variant | scenario | " + " | ".join(f"{label} (%)" for _, label in COLUMNS) + " | SE-proxy red. (%) |"
    sep = "|---|---|" + "---|" * (len(COLUMNS) + 1)
    if ref:
        head += " Δ mean acc. vs default (pts) | Δ worst AUC vs default (pts) |"
        sep += "---|---|"
    lines = [head, sep]
    for label, var in rows:
        for s in results:
            e = results[s]["methods"][var]
            se = f"{100 * e['se_proxy_reduction_vs_uniform']:.1f}"
            line = f"| {label} | {s} | " + " | ".join(_cell(e, k) for k, _ in COLUMNS) + f" | {se} |"
            if ref:
                if var == ref:
                    line += " – | – |"
                else:
                    line += f" {_paired(results[s], var, ref, 'mean_accuracy')} | {_paired(results[s], var, ref, 'worst_skill_accuracy_auc')} |"
            lines.append(line)
    return "\n".join(lines)


def run_sweep(out: str, scenarios: Sequence[str], seeds: int, steps: Optional[int], workers: Optional[int], progress: bool = True) -> str:
    results: dict[str, Any] = {}
    for name in scenarios:
        sc = load_scenario(name)
        results[sc.name] = run_experiment(
            sc, os.path.join(out, sc.name), methods=list(VARIANTS), presets=VARIANTS, seeds=list(range(seeds)),
            steps=steps, workers=workers, progress=progress, plots=False,
            title=f"GDRO defaults sweep — synthetic learner — scenario `{sc.name}`",
        )
    cmd = "python -m recipe.gdro.sim_sweep --out " + out + " --scenarios " + " ".join(scenarios) + f" --seeds {seeds}" + (f" --steps {steps}" if steps else "")
    runtime = sum(r["runtime_seconds"] for r in results.values())
    parts = [
        "# GDRO defaults sweep — synthetic learner",
        "",
        f"> **{SYNTHETIC_NOTE}**",
        "",
        f"Reproduce: `{cmd}` ({runtime:.0f} s of simulation).",
        f"Seeds 0..{seeds - 1}, mean ± sample std over seeds; every variant at the same total rollouts;",
        "final accuracies on held-out prompts after the last step; AUC = mean over steps (learning speed).",
        "All other settings are the verl_ext defaults. Δ columns: per-seed paired differences against the",
        "current default (same seed = same dataset, batches and reward draws), mean ± std over seeds.",
        "",
    ]
    for title, rows in QUESTIONS:
        ref = next((var for label, var in rows if "[current default]" in label), None)
        parts += [f"## {title}", "", compact_table(rows, results, ref), ""]
    text = "\n".join(parts)
    with open(os.path.join(out, "SWEEP.md"), "w", encoding="utf-8") as f:
        f.write(text)
    summary = {s: {v: {k: r["methods"][v][k] for k in ("mean_accuracy", "mean_accuracy_std", "worst_skill_accuracy", "worst_skill_accuracy_std",
                                                         "mean_accuracy_auc", "mean_accuracy_auc_std", "worst_skill_accuracy_auc",
                                                         "worst_skill_accuracy_auc_std", "se_proxy_reduction_vs_uniform", "total_rollouts")}
                   for v in VARIANTS} for s, r in results.items()}
    with open(os.path.join(out, "sweep_summary.json"), "w", encoding="utf-8") as f:
        json.dump({"synthetic_learner": True, "note": SYNTHETIC_NOTE, "command": cmd, "variants": VARIANTS, "results": summary}, f, indent=1)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipe.gdro.sim_sweep", description="GDRO defaults sweep on the SYNTHETIC learner.")
    p.add_argument("--out", default=os.path.join("outputs", "sim_sweep"))
    p.add_argument("--scenarios", nargs="+", default=["dapo_like", "rare_hard_skill", "unsolvable_share"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(run_sweep(args.out, args.scenarios, args.seeds, args.steps, args.workers, progress=not args.quiet))
    return 0


if __name__ == "__main__":
    sys.exit(main())
