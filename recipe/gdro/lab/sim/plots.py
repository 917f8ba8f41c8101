"""The simulator's plots: accuracy curves per method, compute share per skill, and, per method, the
training-run plots of :mod:`recipe.gdro.lab.results.plot` drawn from the simulator's metrics files
(every title says "synthetic learner").

    python -m recipe.gdro.lab.sim.plots SIM_OUT_DIR [--out DIR]
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from recipe.gdro.lab.results import plot as run_plots
from recipe.gdro.lab.sim.methods import file_label


def _curve(entry: Mapping[str, Any], key: str) -> tuple[np.ndarray, np.ndarray]:
    c = entry["curves"][key]
    return (
        np.array([np.nan if v is None else v for v in c["mean"]]),
        np.array([np.nan if v is None else v for v in c["std"]]),
    )


def plot_accuracy_curves(res: Mapping[str, Any], out_dir: str) -> str:
    plt = run_plots.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, (name, e) in enumerate(res["methods"].items()):
        steps = np.asarray(e["curves"]["step"])
        for ax, key in zip(axes, ("mean_accuracy", "worst_skill_accuracy"), strict=True):
            m, sd = _curve(e, key)
            ax.plot(steps, 100 * m, color=f"C{i}", label=f"{name} (lr {e.get('lr', float('nan')):.3g})", lw=1.4)
            ax.fill_between(steps, 100 * (m - sd), 100 * (m + sd), color=f"C{i}", alpha=0.18, lw=0)
    axes[0].set_title("held-out mean accuracy", fontsize=9)
    axes[1].set_title("worst-skill held-out accuracy", fontsize=9)
    axes[0].set_ylabel("mean accuracy (%)")
    axes[1].set_ylabel("worst-skill accuracy (%)")
    for ax in axes:
        ax.set_xlabel("step")
    axes[1].legend(fontsize=8)
    n_seeds = len(res["seeds"])
    return run_plots.finish_figure(
        fig,
        f"{run_plots.SYNTH_TAG} scenario {res['scenario']['name']}: accuracy per method at equal total rollouts "
        f"(mean ± std over {n_seeds} seed{'s' if n_seeds > 1 else ''}) — synthetic, not LLM evidence",
        os.path.join(out_dir, "accuracy_curves.png"),
    )


def plot_skill_compute_share(res: Mapping[str, Any], out_dir: str) -> str:
    plt = run_plots.pyplot()
    skills = [s["name"] for s in res["scenario"]["skills"]]
    first = next(iter(res["methods"].values()))
    data = np.array([first["skill_data_share"][k] for k in skills])
    # methods with a uniform allocation have compute share == data share: leave them out
    methods = [
        m
        for m, e in res["methods"].items()
        if max(abs(e["skill_compute_share"][k] - e["skill_data_share"][k]) for k in skills) > 1e-6
    ]
    width = 0.8 / (len(methods) + 1)
    xs = np.arange(len(skills))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(skills)), 4.5))
    ax.bar(xs - 0.4 + width / 2, 100 * data, width, color="0.6", label="data share")
    for i, m in enumerate(methods):
        comp = np.array([res["methods"][m]["skill_compute_share"][k] for k in skills])
        ax.bar(
            xs - 0.4 + width * (i + 1.5),
            100 * comp,
            width,
            color=f"C{list(res['methods']).index(m)}",
            label=f"{m} compute share",
        )
    ax.set_xticks(xs)
    ax.set_xticklabels(skills, rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("skill (scenario order)")
    ax.set_ylabel("% of prompts / % of rollouts (log)")
    run_plots.log_axis(ax, "y")
    ax.legend(fontsize=7)
    ax.set_title(
        f"{run_plots.SYNTH_TAG} scenario {res['scenario']['name']}: "
        "share of rollouts per skill vs its share of prompts (log scale)\n"
        "(methods with uniform rollouts omitted: their compute share equals the data share)",
        fontsize=10,
    )
    return run_plots.save_figure(fig, os.path.join(out_dir, "skill_compute_share.png"))


def plot_token_curves(res: Mapping[str, Any], out_dir: str) -> str:
    """Tokens per step (from the scenario's length model) and their ratio to the uniform allocation's."""
    plt = run_plots.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, (name, e) in enumerate(res["methods"].items()):
        steps = np.asarray(e["curves"]["step"])
        for ax, key, scale in zip(axes, ("tokens_generated", "tokens_ratio_to_uniform"), (1e-3, 1.0), strict=True):
            m, sd = _curve(e, key)
            ax.plot(steps, scale * m, color=f"C{i}", label=name, lw=1.2)
            ax.fill_between(steps, scale * (m - sd), scale * (m + sd), color=f"C{i}", alpha=0.15, lw=0)
    axes[0].set_title("generated tokens per step (thousands)", fontsize=9)
    axes[1].set_title("generated / uniform allocation's tokens on the same prompts", fontsize=9)
    axes[1].axhline(1.0, color="0.3", lw=0.8, ls="--")
    for ax in axes:
        ax.set_xlabel("step")
    axes[1].legend(fontsize=8)
    n_seeds = len(res["seeds"])
    return run_plots.finish_figure(
        fig,
        f"{run_plots.SYNTH_TAG} scenario {res['scenario']['name']}: tokens per step (mean ± std over {n_seeds} "
        f"seed{'s' if n_seeds > 1 else ''}; failures run longer) — synthetic, not LLM evidence",
        os.path.join(out_dir, "token_curves.png"),
    )


def plot_simulation(sim_dir: str, out_dir: Optional[str] = None) -> list[str]:
    """All plots of a simulator output folder (reads results.json and metrics/<method>/seed*.jsonl)."""
    out_dir = out_dir or sim_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(sim_dir, "results.json"), encoding="utf-8") as f:
        res = json.load(f)
    files = [plot_accuracy_curves(res, out_dir), plot_skill_compute_share(res, out_dir)]
    if all("tokens_generated" in e["curves"] for e in res["methods"].values()):
        files.append(plot_token_curves(res, out_dir))
    for name, e in res["methods"].items():
        paths = [os.path.join(sim_dir, p) for p in e.get("metrics_files", [])]
        paths = [p for p in paths if os.path.exists(p)]
        if not paths:
            continue
        series = run_plots.Series.mean_of(
            [run_plots.Series.from_records(run_plots.read_metrics_jsonl(p)) for p in paths]
        )
        k = len(paths)
        seeds_txt = f"mean of {k} seed{'s' if k > 1 else ''}"
        title = f"{run_plots.SYNTH_TAG} {res['scenario']['name']} / {name} ({seeds_txt}; synthetic, not LLM evidence)"
        files += run_plots.plot_gdro_run(series, out_dir, title=title, prefix=file_label(name))
    return files


def main(argv: Optional[Sequence[str]] = None) -> int:
    def refuse(path: str) -> Optional[str]:
        if os.path.exists(os.path.join(path, "results.json")):
            return None
        return f"{path}: not a simulator output folder (no results.json)"

    return run_plots.plot_cli(
        argv,
        prog="python -m recipe.gdro.lab.sim.plots",
        description="Plot a simulator output folder (results.json and metrics/<method>/seed*.jsonl).",
        path_help="a simulator output folder (python -m recipe.gdro.lab.sim.simulate --out)",
        out_help="folder for the PNGs (default: the simulator folder)",
        refuse=refuse,
        plot=plot_simulation,
    )


if __name__ == "__main__":
    sys.exit(main())
