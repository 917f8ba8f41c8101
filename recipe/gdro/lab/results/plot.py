"""Plots of GDRO per-step metrics of a training run (the simulator's own plots, built on these,
are in :mod:`recipe.gdro.lab.sim.plots`).

    python -m recipe.gdro.lab.results.plot RUN_DIR/gdro_metrics.jsonl --out DIR    # a training run

Input is the recipe's JSON-lines format (``recipe/gdro/results/metrics_io.py``): one object per line,
``{"step": N, "gdro/bin_03/adversary_weight": ..., ...}``, NaN written as null. The simulator
writes the same format per method and seed (plus ``sim/*`` keys), so both go through
:func:`plot_gdro_run`. Anything coming from the simulator is labelled "synthetic learner".

Plots (each written only when the run has the data for it):

* ``traveling_wave``: the adversary's distribution q(b) over the bins present in the batch
  (``adversary_prob``, renormalised over those bins, so it is comparable with the data share),
  against the bin's data share, over steps (heatmaps + centre of mass): the paper's "traveling wave";
* ``weight_vs_share_per_bin``: the same, one small panel per bin;
* ``rollouts_per_bin``: mean rollouts per prompt of each bin over steps (n̄ dashed);
* ``compute_share``: data share and compute share (share of rollouts) per bin over steps, and
  their step averages against each other;
* ``mu``: the shadow price μ (log scale) and the standard-error proxy reduction vs uniform;
* ``bins``: when no adversary is active (a GRPO baseline in observe-only mode), the data share
  and batch accuracy per bin over steps;
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

_GROUP_RE = re.compile(r"^gdro/(bin_\d+|unseen)/(.+)$")
SYNTH_TAG = "[synthetic learner]"
# Why the hardest bin can get fewer rollouts than the mean (the caption of rollouts_per_bin.png; docs/controllers.md)
SQRT_LAW_NOTE = (
    "sqrt allocator: n_b ∝ √(p_b(1−p_b)) minimises the batch-mean reward's variance, so a bin that nearly "
    "always fails (p ≈ 0) gets fewer\nrollouts than the mean n̄, not more: its groups are all-fail and carry no "
    "GRPO signal whatever n; the most go to bins near p = 0.5"
)


# ------------------------------------------------------------------------------------ reading
def read_metrics_jsonl(path: str) -> list[dict[str, Any]]:
    """Records of a metrics JSONL file, via the recipe's own reader (null → NaN, last line per step wins)."""
    from recipe.gdro.results.metrics_io import read_metrics_jsonl as _read

    records = _read(path)
    if not records:
        from recipe.gdro.results.metrics_io import read_validation_jsonl

        validations = read_validation_jsonl(path)
        if validations:  # the run validated (step 0, before training) and has not finished a step yet
            steps = ", ".join(str(int(r["val_step"])) for r in validations[:3])
            raise ValueError(
                f"{path}: validation records only (at step {steps}), no training step yet: plot it once the run "
                "has logged a step"
            )
        raise ValueError(f"{path}: no metrics records")
    return records


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Series:
    """Per-step metrics: ``frame``, a pandas DataFrame indexed by step with one float column per numeric
    key, seen as ``steps`` and ``values[key]`` arrays (NaN where missing)."""

    def __init__(self, frame: pd.DataFrame):
        self.frame = frame
        self.steps = frame.index.to_numpy(dtype=np.int64)
        self.values = {k: frame[k].to_numpy(dtype=float) for k in frame.columns}

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]]) -> Series:
        by_step = {int(r["step"]): r for r in records}  # a resumed run may repeat steps: the last record wins
        # the keys with a number in some record (a bool is not one), NaN in the records without it
        numeric = sorted({k for r in by_step.values() for k, v in r.items() if k != "step" and _is_number(v)})
        steps = pd.Index(list(by_step), dtype=np.int64, name="step")
        frame = pd.DataFrame.from_records(list(by_step.values()), index=steps, columns=numeric)
        return cls(frame.sort_index().astype(float))

    @classmethod
    def mean_of(cls, runs: Sequence[Series]) -> Series:
        """Step-aligned nan-mean of several runs (e.g. seeds)."""
        steps = pd.Index(sorted(set().union(*[r.frame.index for r in runs])), dtype=np.int64, name="step")
        keys = sorted(set().union(*[r.frame.columns for r in runs]))
        stack = np.stack([r.frame.reindex(index=steps, columns=keys).to_numpy(dtype=float) for r in runs])
        with warnings.catch_warnings():  # np.nanmean, not groupby().mean(): the same sums as before, bit for bit
            warnings.simplefilter("ignore", RuntimeWarning)
            return cls(pd.DataFrame(np.nanmean(stack, axis=0), index=steps, columns=keys))

    def get(self, key: str) -> Optional[np.ndarray]:
        v = self.values.get(key)
        if v is None or not np.any(np.isfinite(v)):
            return None
        return v

    def groups(self) -> list[str]:
        """Bin names present (``bin_00``.. ascending, ``unseen`` last)."""
        found = {m.group(1) for k in self.values for m in [_GROUP_RE.match(k)] if m}
        bins = sorted(g for g in found if g.startswith("bin_"))
        return bins + (["unseen"] if "unseen" in found else [])

    def matrix(self, metric: str, groups: Sequence[str]) -> np.ndarray:
        """(len(groups), steps) array of ``gdro/<group>/<metric>``."""
        return np.vstack([self.values.get(f"gdro/{g}/{metric}", np.full(len(self.steps), np.nan)) for g in groups])

    def is_synthetic(self) -> bool:
        return any(k.startswith("sim/") for k in self.values)


def rolling(x: np.ndarray, w: int) -> np.ndarray:
    """Trailing nan-mean over ``w`` steps along the last axis (pandas rolling; NaN where a window has no value)."""
    if w <= 1:
        return x
    import pandas as pd

    x = np.asarray(x, dtype=np.float64)
    flat = x.reshape(-1, x.shape[-1])
    out = pd.DataFrame(flat.T).rolling(w, min_periods=1).mean().to_numpy().T
    return out.reshape(x.shape)


def _label(group: str) -> str:
    if group == "unseen":
        return "unseen"
    return f"bin {int(group.split('_')[1])}"


def _smooth_window(n_steps: int) -> int:
    return max(1, n_steps // 60)


# ------------------------------------------------------------------------------------ plotting
def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> str:
    """Write ``fig`` as a PNG at ``path``, close it, return ``path``."""
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def finish_figure(fig: Any, title: str, path: str) -> str:
    """How every figure of the plotting tools ends: its title, a tight layout, the PNG (:func:`save_figure`)."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def pass_at_k_svg(
    ks: Sequence[int],
    panels: Mapping[str, Mapping[str, np.ndarray]],
    reference: str,
    title: str,
) -> str:
    """The pass@k figure of a study as SVG text, the same bytes for the same input (no date, no
    version, a fixed id salt, text as text): per panel (a set of prompts, e.g. the whole test split
    and its hard tail) the mean pass@k over seeds of each method with its 95% t interval (top), and
    each method minus ``reference`` with the paired 95% t interval (bottom). ``panels[name][method]``
    is an array (seeds x len(ks)), seeds in the same order for every method (paired)."""
    import io

    from recipe.gdro.lab.results.stats import paired_ci

    plt = pyplot()
    ks = list(ks)
    style = {"svg.hashsalt": "pass_at_k", "svg.fonttype": "none", "font.size": 8}
    with plt.rc_context(style):
        fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 6.4), squeeze=False, sharex=True)
        for col, (name, by_method) in enumerate(panels.items()):
            top, bottom = axes[0][col], axes[1][col]
            for i, (method, values) in enumerate(by_method.items()):
                values = np.asarray(values, dtype=np.float64)
                color = f"C{i}"
                zero = np.zeros(len(values))
                cis = [paired_ci(values[:, j], zero) for j in range(len(ks))]
                top.plot(ks, [c[0] for c in cis], marker="o", ms=2.5, color=color, label=method)
                top.fill_between(ks, [c[1] for c in cis], [c[2] for c in cis], color=color, alpha=0.2, lw=0)
                if method == reference:
                    continue
                ref = np.asarray(by_method[reference], dtype=np.float64)
                diffs = [paired_ci(values[:, j], ref[:, j]) for j in range(len(ks))]
                bottom.plot(ks, [d[0] for d in diffs], marker="o", ms=2.5, color=color, label=f"{method} - {reference}")
                bottom.fill_between(ks, [d[1] for d in diffs], [d[2] for d in diffs], color=color, alpha=0.2, lw=0)
            bottom.axhline(0.0, color="black", lw=0.7)
            top.set_title(f"{name}: pass@k", fontsize=8)
            bottom.set_title(f"{name}: minus {reference}", fontsize=8)
            bottom.set_xlabel("k")
            ticks = [k for k in ks if k & (k - 1) == 0]  # the powers of two
            for ax in (top, bottom):
                ax.set_xscale("log", base=2)
                ax.set_xticks(ticks, [str(k) for k in ticks])
                ax.minorticks_off()
                ax.grid(alpha=0.3)
            top.legend(fontsize=7)
            bottom.legend(fontsize=7)
        fig.suptitle(f"{title}\nmeans over seeds with 95% t intervals; differences paired by seed", fontsize=9)
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return buf.getvalue()


def log_ticks(lo: float, hi: float, at_least: int = 3) -> list[float] | None:
    """Tick values for a log axis over the data range [lo, hi]: 1-2-5 steps, else 1..9 steps of each decade,
    else evenly spaced plain numbers (a range narrower than a factor of 2, e.g. a shadow price between 0.010
    and 0.016, has one 1-2-5 tick); None when 1-2-5 steps already give ``at_least`` ticks."""
    if not (0 < lo < hi and math.isfinite(hi)):
        return None
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for step, subs in enumerate(((1, 2, 5), range(1, 10))):
        ticks = [float(f"{m * 10.0**e:.6g}") for e in decades for m in subs if lo <= m * 10.0**e <= hi]
        if len(ticks) >= at_least:
            return None if step == 0 else ticks
    top = math.floor(math.log10(hi - lo))
    for step in (m * 10.0**e for e in range(top - 2, top + 1) for m in (1, 2, 5)):  # the finest with <= 6 ticks
        ticks = [float(f"{k * step:.6g}") for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
        if len(ticks) <= 6:
            return ticks
    return [lo, hi]


def log_axis(ax: Any, which: str) -> None:
    """Log scale with plain-number ticks at 1-2-5 steps (no 10^x labels, no bare minor ticks); over a narrow
    range of the data plotted so far, the finer ticks of :func:`log_ticks`, so that at least three read."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = ax.yaxis if which == "y" else ax.xaxis
    lo, hi = (ax.dataLim.y0, ax.dataLim.y1) if which == "y" else (ax.dataLim.x0, ax.dataLim.x1)
    ticks = log_ticks(lo, hi)
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)) if ticks is None else FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _bin_colors(groups: Sequence[str]) -> list:
    plt = pyplot()
    bins = [g for g in groups if g != "unseen"]
    # Qualitative palette: neighbouring bins must be told apart (adjacent viridis shades cannot).
    cmap = plt.get_cmap("tab10" if len(bins) <= 10 else "tab20")
    cols = [cmap(i % cmap.N) for i in range(len(bins))]
    return cols + (["0.82"] if "unseen" in groups else [])  # light grey: tab10 already has a mid grey


def adversary_distribution(s: Series, groups: Sequence[str]) -> np.ndarray:
    """(groups, steps) Prompt-GDRO distribution q(b) renormalised over the groups in each batch.

    Uses ``adversary_prob`` (q(b) over all groups) when logged; older files only have
    ``adversary_weight`` (then q(b)·G, logged for every group), which gives the same result.
    Groups absent from a batch get NaN.
    """
    q = s.matrix("adversary_prob", groups)
    if not np.any(np.isfinite(q)):
        q = s.matrix("adversary_weight", groups)
    present = np.nan_to_num(s.matrix("data_share", groups)) > 0
    q = np.where(present & np.isfinite(q), q, 0.0)
    tot = q.sum(axis=0, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(present & (tot > 0), q / np.where(tot > 0, tot, 1.0), np.nan)


def prompt_adversary_active(s: Series) -> bool:
    groups = s.groups()
    w = s.matrix("adversary_weight", groups)
    if np.any(np.isfinite(w)) and np.nanmax(np.abs(w - 1.0)) > 1e-9:
        return True
    q = s.matrix("adversary_prob", groups)
    return bool(np.any(np.isfinite(q)) and np.nanmax(q) - np.nanmin(q) > 1e-9)


def rollout_adversary_active(s: Series) -> bool:
    if s.get("gdro/mu") is not None or s.get("gdro/se_proxy_reduction") is not None:
        return True
    r = s.matrix("rollouts_per_prompt", s.groups())
    return bool(np.any(np.isfinite(r)) and np.nanmax(r) - np.nanmin(r) > 1e-9)


def plot_gdro_run(
    s: Series, out_dir: str, *, title: str, prefix: str = "", what: Iterable[str] = ("prompt", "rollout")
) -> list[str]:
    """Render the GDRO plots of one run (or a seed average) into ``out_dir``; return the files written."""
    plt = pyplot()
    groups = s.groups()
    files: list[str] = []
    if not groups:
        return files  # nothing to plot: no (empty) output folder either
    os.makedirs(out_dir, exist_ok=True)
    x = s.steps
    w = _smooth_window(len(x))
    smooth_note = f" (trailing mean over {w} steps)" if w > 1 else ""
    colors = _bin_colors(groups)
    G = len(groups)
    data = rolling(s.matrix("data_share", groups), w)
    pre = f"{prefix}_" if prefix else ""

    # ---- traveling wave (Prompt-GDRO)
    if "prompt" in what and prompt_adversary_active(s):
        q = rolling(adversary_distribution(s, groups), w)
        fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True, gridspec_kw={"height_ratios": [2, 2, 1.4]})
        vmax = float(np.nanmax(np.concatenate([q.ravel(), data.ravel()])))
        for ax, mat, name in (
            (axes[0], q, "adversary q(b)\n(bins in batch)"),
            (axes[1], data, "data share\nof the batch"),
        ):
            im = ax.imshow(
                np.nan_to_num(mat),
                aspect="auto",
                origin="lower",
                cmap="magma",
                vmin=0,
                vmax=vmax,
                extent=[x[0] - 0.5, x[-1] + 0.5, -0.5, G - 0.5],
                interpolation="nearest",
            )
            ax.set_yticks(range(G))
            ax.set_yticklabels([_label(g) for g in groups], fontsize=7)
            ax.set_ylabel(name)
            ax.set_xlabel("step")
            ax.tick_params(labelbottom=True)
            fig.colorbar(im, ax=ax, pad=0.01, label="share")
        bins_only = [i for i, g in enumerate(groups) if g != "unseen"]
        idx = np.arange(len(bins_only))[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            qb, db = np.nan_to_num(q[bins_only]), np.nan_to_num(data[bins_only])
            com_q = (idx * qb).sum(0) / qb.sum(0)
            com_d = (idx * db).sum(0) / db.sum(0)
        axes[2].plot(x, com_q, label="adversary q(b)", color="C3")
        axes[2].plot(x, com_d, label="data share", color="C0", ls="--")
        axes[2].set_ylabel("centre of mass\n(bin index)")
        axes[2].set_xlabel("step")
        axes[2].legend(fontsize=8)
        files.append(
            finish_figure(
                fig,
                f"{title}\nPrompt-GDRO traveling wave: adversary weight vs data share per bin "
                f"(bin 0 = hardest){smooth_note}",
                os.path.join(out_dir, f"{pre}traveling_wave.png"),
            )
        )

        ncol = 4
        nrow = math.ceil(G / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(12, 2.3 * nrow), sharex=True, squeeze=False)
        for i, g in enumerate(groups):
            ax = axes[i // ncol][i % ncol]
            ax.plot(x, q[i], color="C3", label="adversary q(b)")
            ax.plot(x, data[i], color="C0", ls="--", label="data share")
            ax.set_title(_label(g), fontsize=8)
            ax.set_xlabel("step", fontsize=7)
            ax.set_ylabel("share", fontsize=7)
            ax.tick_params(labelsize=7, labelbottom=True)
        for j in range(G, nrow * ncol):
            axes[j // ncol][j % ncol].axis("off")
        axes[0][0].legend(fontsize=7)
        files.append(
            finish_figure(
                fig,
                f"{title}\nadversary weight q(b) against data share, per bin{smooth_note}",
                os.path.join(out_dir, f"{pre}weight_vs_share_per_bin.png"),
            )
        )

    # ---- no adversary (a GRPO baseline logged in observe-only mode): how the bins evolve
    if not prompt_adversary_active(s) and not rollout_adversary_active(s):
        acc = rolling(s.matrix("accuracy", groups), w)
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.5))
        ax0.stackplot(x, np.nan_to_num(data), colors=colors, labels=[_label(g) for g in groups])
        ax0.set_ylim(0, 1)
        ax0.set_title("data share per bin", fontsize=9)
        for i, g in enumerate(groups):
            ax1.plot(x, acc[i], color=colors[i], label=_label(g), lw=1.2)
        ax1.set_ylim(0, 1)
        ax1.set_title("batch accuracy per bin", fontsize=9)
        ax0.set_ylabel("share of the batch's prompts")
        ax1.set_ylabel("batch accuracy")
        ax1.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        for ax in (ax0, ax1):
            ax.set_xlabel("step")
        files.append(
            finish_figure(
                fig,
                f"{title}\nno adversary active: difficulty bins over steps (bin 0 = hardest){smooth_note}",
                os.path.join(out_dir, f"{pre}bins.png"),
            )
        )

    # ---- Rollout-GDRO
    if "rollout" in what and rollout_adversary_active(s):
        rpp = rolling(s.matrix("rollouts_per_prompt", groups), w)
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for i, g in enumerate(groups):
            ax.plot(x, rpp[i], color=colors[i], label=_label(g), lw=1.3)
        mean_n = s.get("gdro/rollouts_per_prompt")
        if mean_n is not None:
            ax.axhline(float(np.nanmean(mean_n)), color="k", ls="--", lw=1, label="n̄ (budget)")
        ax.set_xlabel("step")
        ax.set_ylabel("rollouts per prompt")
        ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(
            f"{title}\nRollout-GDRO: rollouts per prompt per bin (bin 0 = hardest){smooth_note}\n{SQRT_LAW_NOTE}",
            fontsize=10,
        )
        files.append(save_figure(fig, os.path.join(out_dir, f"{pre}rollouts_per_bin.png")))

        comp = rolling(s.matrix("compute_share", groups), w)
        fig = plt.figure(figsize=(13, 4.5))
        gs = fig.add_gridspec(1, 3, width_ratios=[2, 2, 1.3])
        ax0, ax1, ax2 = fig.add_subplot(gs[0]), fig.add_subplot(gs[1]), fig.add_subplot(gs[2])
        for ax, mat, name in ((ax0, data, "data share (prompts)"), (ax1, comp, "compute share (rollouts)")):
            ax.stackplot(x, np.nan_to_num(mat), colors=colors, labels=[_label(g) for g in groups])
            ax.set_ylim(0, 1)
            ax.set_xlabel("step")
            ax.set_ylabel("share")
            ax.set_title(name, fontsize=9)
        ax1.legend(fontsize=6, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            d_avg = np.nanmean(s.matrix("data_share", groups), axis=1)
            c_avg = np.nanmean(s.matrix("compute_share", groups), axis=1)
        # Colours match the stack plots' legend; no text labels (they overlap where bins cluster).
        for i, g in enumerate(groups):
            ax2.scatter([d_avg[i]], [c_avg[i]], color=colors[i], s=40, zorder=3, edgecolors="k", linewidths=0.4)
        lim = float(np.nanmax(np.concatenate([d_avg, c_avg, [0.05]]))) * 1.1
        ax2.plot([0, lim], [0, lim], "k--", lw=1)
        ax2.set_xlim(0, lim)
        ax2.set_ylim(0, lim)
        ax2.set_xlabel("mean data share")
        ax2.set_ylabel("mean compute share")
        ax2.set_title("above the diagonal = more rollouts\nthan its share of prompts", fontsize=8)
        files.append(
            finish_figure(
                fig,
                f"{title}\nRollout-GDRO: compute share vs data share per bin{smooth_note}",
                os.path.join(out_dir, f"{pre}compute_share.png"),
            )
        )

        mu = s.get("gdro/mu")
        red = s.get("gdro/se_proxy_reduction")
        if mu is not None or red is not None:
            panels = (["mu"] if mu is not None else []) + (["red"] if red is not None else [])
            fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3 * len(panels) + 0.6), sharex=True, squeeze=False)
            axes = axes[:, 0]
            for ax, what_p in zip(axes, panels, strict=True):
                if what_p == "mu":
                    ax.plot(x, mu, color="C2")
                    if np.nanmin(mu) > 0:
                        log_axis(ax, "y")
                    ax.set_ylabel("shadow price μ")
                else:
                    ax.plot(x, 100 * red, color="C4", alpha=0.35, lw=0.8)
                    ax.plot(x, 100 * rolling(red, max(w, 1)), color="C4")
                    ax.axhline(0, color="k", lw=0.8)
                    ax.set_ylabel("SE-proxy reduction\nvs uniform (%)")
                ax.set_xlabel("step")
                ax.tick_params(labelbottom=True)
            what_t = (
                "shadow price μ and standard-error proxy"
                if mu is not None
                else "standard-error proxy (this allocator has no shadow price μ)"
            )
            files.append(
                finish_figure(
                    fig,
                    f"{title}\nRollout-GDRO: {what_t} (controller's own estimates)",
                    os.path.join(out_dir, f"{pre}mu.png"),
                )
            )
    return files


# ------------------------------------------------------------------------------------ CLI
def run_name(path: str) -> str:
    """The run a metrics file belongs to: its folder's name for ``gdro_metrics.jsonl`` (a run's
    ``trainer.default_local_dir``: ``tiny_joint_gdro``), else the file's name without ``.jsonl``."""
    path = os.path.abspath(path)
    if os.path.basename(path) == "gdro_metrics.jsonl":
        return os.path.basename(os.path.dirname(path)) or path
    return os.path.splitext(os.path.basename(path))[0]


def plot_path(path: str, out_dir: Optional[str] = None) -> list[str]:
    """Plot a metrics JSONL file, a simulator output folder, or a folder of JSONL files."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "results.json")):
            raise ValueError(
                f"{path} is a simulator output folder: plot it with python -m recipe.gdro.lab.sim.plots {path}"
            )
        files = sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
        if not files:
            raise ValueError(f"{path}: no results.json and no *.jsonl metrics files")
        out: list[str] = []
        for f in files:
            out += plot_path(
                f, os.path.join(out_dir or path, os.path.splitext(os.path.relpath(f, path))[0].replace(os.sep, "_"))
            )
        return out
    if os.path.basename(path) == "results.json" or path.endswith(".json"):
        raise ValueError(
            f"{path}: this is a results file; plot wants a metrics JSONL file (e.g. gdro_metrics.jsonl) "
            f"or the simulator output folder ({os.path.dirname(path) or '.'})"
        )
    series = Series.from_records(read_metrics_jsonl(path))
    out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(path)), "gdro_plots")
    name = run_name(path)
    if series.is_synthetic():
        title = f"{SYNTH_TAG} {name} (synthetic, not LLM evidence)"
    else:
        title = f"GDRO training run: {name}"
    files = plot_gdro_run(series, out_dir, title=title)
    if not files:
        raise ValueError(f"{path} has no per-bin GDRO metrics with an active adversary; nothing plotted")
    return files


def plot_cli(
    argv: Optional[Sequence[str]],
    *,
    prog: str,
    description: str,
    path_help: str,
    out_help: str,
    refuse: Callable[[str], Optional[str]],
    plot: Callable[[str, Optional[str]], list[str]],
) -> int:
    """The command line both plotting tools share (``PATH [--out DIR]``): ``refuse(path)`` names an input it
    will not read, ``plot(path, out)`` returns the PNGs it wrote. Bad input is one line and exit 2; the
    metrics readers' warnings (a cut line, a literal NaN) are one ``warning:`` line each."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("path", help=path_help)
    p.add_argument("--out", default=None, help=out_help)
    args = p.parse_args(argv)
    problem = refuse(args.path)
    if problem is None and args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        problem = f"--out {args.out} is an existing file, not a folder"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from recipe.gdro.results.metrics_io import MetricsFileWarning

    files, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MetricsFileWarning)
        try:
            files = plot(args.path, args.out)
        except (ValueError, OSError) as exc:
            error = exc
    for w in caught:
        if issubclass(w.category, MetricsFileWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0 if files else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    return plot_cli(
        argv,
        prog="python -m recipe.gdro.lab.results.plot",
        description="Plot GDRO per-step metrics of a training run (JSONL).",
        path_help="metrics JSONL file (e.g. gdro_metrics.jsonl) or a folder of them",
        out_help="folder for the PNGs (default: beside the input)",
        refuse=lambda path: None if os.path.exists(path) else f"{path}: no such file or folder",
        plot=plot_path,
    )


if __name__ == "__main__":
    sys.exit(main())
