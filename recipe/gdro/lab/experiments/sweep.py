"""Sweeps on the SYNTHETIC learner: learning-rate tuning, the tuned headline, and the defaults study.

The plan (lr grid, tuning seeds, the defaults study's variants) is data: ``protocols/sim_sweep.yaml``,
read when a sweep runs (:func:`load_plan`).

    python -m recipe.gdro.lab.experiments.sweep tune  [--scenarios ...] [--learner L] [--tune-seeds 3] [--workers W]
    python -m recipe.gdro.lab.experiments.sweep study [--scenarios ...] [--learner L] [--seeds 5] [--workers W]
                                                  [--full]
    python -m recipe.gdro.lab.experiments.sweep all   (tune, then study)

``tune`` runs every method (and the released-normalisation Prompt-GDRO) at lr × the plan's grid of the
scenario's lr (GRPO also × 8, for the lr curve) on TUNING seeds 100, 101, ... and picks, per
method, the multiplier with the best tuning metric (final held-out mean accuracy, mean over the
tuning seeds). It writes ``recipe/gdro/lab/sim/scenarios/tuned_lr.csv`` (read by ``simulate --tuned-lr``
and the quick start) and ``<out>/lr_curve.md``.

``study`` evaluates on DIFFERENT seeds 0, 1, ... (so tuning does not leak):

* headline: every method at its own tuned lr (verl_ext defaults otherwise);
* equal advantage mass: every method at TUNED GRPO's lr with ``prompt.normalize=advantage_mass``
  (Σ|A·m| = Σ|A|), so no method takes a larger step than GRPO;
* defaults study: one option changed at a time against the current verl_ext default, at the
  tuned lr of the method it modifies (the released normalisation at its own tuned lr).

Every comparison is paired (same seed = same dataset, batches, reward and noise draws) and
reported as the mean difference with a 95% t interval. Tables go to ``<out>/headline.md``,
``equal_mass.md``, ``defaults.md`` and ``STUDY.md`` (all of them, with the command). The learner
is synthetic: this is evidence about a stand-in, not about an LLM (docs/simulator.md).
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below: one line, no traceback (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("sim.sweep")

import argparse
import csv
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, Sequence

import numpy as np
from annotated_types import MaxLen, MinLen
from pydantic import ConfigDict, StrictInt, StrictStr, with_config

from recipe.gdro.lab.experiments.protocol import YamlNumber, typed_parse
from recipe.gdro.lab.results.runner import choose_lr
from recipe.gdro.lab.results.stats import paired_ci
from recipe.gdro.lab.results.table import markdown_row, markdown_table
from recipe.gdro.lab.sim.learner import DEFAULT_LEARNER, LEARNERS
from recipe.gdro.lab.sim.methods import TUNED_LR_COLUMNS, TUNED_LR_FILE, check_method, default_methods, lookup_tuned_lr
from recipe.gdro.lab.sim.scenario import Scenario, ScenarioError, load_scenario, shipped_scenarios
from recipe.gdro.lab.sim.simulate import SYNTHETIC_NOTE, _pct, run_experiment
from verl_ext import GDROConfigError
from verl_ext.config import Range

SWEEP_PLAN = Path(__file__).resolve().parent / "protocols" / "sim_sweep.yaml"


@dataclass(frozen=True)
class SweepPlan:
    """The sweep's plan, read from ``protocols/sim_sweep.yaml`` (its comments say what each key is)."""

    lr_grid: tuple[float, ...]
    grpo_extra: tuple[float, ...]
    tune_seed0: int
    extra_tuned: tuple[str, ...]
    defaults: tuple[tuple[str, str, str, str], ...]  # (question, variant, lr_of, label)
    defaults_full: tuple[tuple[str, str, str, str], ...]
    question_default: dict[str, tuple[str, str]]
    allocator_rows: tuple[tuple[str, str], ...]

    def tune_methods(self) -> list[str]:
        """Tuned methods: the simulator's default comparison and the plan's extras."""
        return [*default_methods(), *self.extra_tuned]

    def lr_curve_columns(self) -> tuple[str, ...]:
        return ("scenario", "method", *(f"lr ×{g:g}" for g in self.lr_grid + self.grpo_extra), "best")


@with_config(ConfigDict(extra="forbid"))
@dataclass
class VariantRow:
    """A row of the defaults study: one option changed (``variant``), at the tuned lr of ``lr_of``."""

    question: StrictStr
    variant: StrictStr
    lr_of: StrictStr
    label: StrictStr


Pair = Annotated[list[StrictStr], MinLen(2), MaxLen(2)]  # (method or variant, label)


@with_config(ConfigDict(extra="forbid"))
@dataclass
class SweepPlanSpec:
    """``protocols/sim_sweep.yaml`` as written, typed as the study's protocol is (protocol.typed_parse)."""

    lr_grid: Annotated[list[YamlNumber], MinLen(1)] = field(metadata={"range": Range(lo=0, lo_open=True)})
    tune_seed0: StrictInt = field(metadata={"range": Range(lo=0, integer=True)})
    question_default: dict[str, Pair]
    allocator_rows: list[Pair]
    grpo_extra: list[YamlNumber] = field(default_factory=list, metadata={"range": Range(lo=0, lo_open=True)})
    extra_tuned: list[StrictStr] = field(default_factory=list)
    defaults: list[VariantRow] = field(default_factory=list)
    defaults_full: list[VariantRow] = field(default_factory=list)


def load_plan(path: str | os.PathLike = SWEEP_PLAN) -> SweepPlan:
    """Read and check the sweep's plan: the typed parse (:class:`SweepPlanSpec`), then every method and
    variant must be a registry method. ValueError in one line naming the file and the key."""
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            d = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not YAML: {e}") from None
    spec: SweepPlanSpec = typed_parse(Path(path), SweepPlanSpec, d)
    rows = lambda rs: tuple((r.question, r.variant, r.lr_of, r.label) for r in rs)  # noqa: E731
    plan = SweepPlan(
        lr_grid=tuple(spec.lr_grid),
        grpo_extra=tuple(spec.grpo_extra),
        tune_seed0=spec.tune_seed0,
        extra_tuned=tuple(spec.extra_tuned),
        defaults=rows(spec.defaults),
        defaults_full=rows(spec.defaults_full),
        question_default={q: (m, label) for q, (m, label) in spec.question_default.items()},
        allocator_rows=tuple((m, label) for m, label in spec.allocator_rows),
    )
    for spec_name in [*plan.extra_tuned, *(v for r in plan.defaults + plan.defaults_full for v in r[1:3])]:
        try:
            check_method(spec_name)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return plan


def tune_methods() -> list[str]:
    return load_plan().tune_methods()


COMPARE_COLUMNS = (
    "scenario", "method", "lr (× base)", "mean acc. (%)", "worst-skill acc. (%)", "Δ mean (pts, 95% CI)",
    "Δ worst-skill (pts, 95% CI)", "SE red. (%)", "var. red. (%)", "efficiency (%)", "adv. mass ratio",
)  # fmt: skip
DEFAULTS_COLUMNS = (
    "question", "variant", "scenario", "lr (× base)", "mean acc. (%)", "worst-skill acc. (%)",
    "Δ mean vs default (pts, 95% CI)", "Δ worst-skill vs default (pts, 95% CI)", "SE red. (%)", "efficiency (%)",
)  # fmt: skip
COMPARE_HEADER, DEFAULTS_HEADER = map(markdown_row, (COMPARE_COLUMNS, DEFAULTS_COLUMNS))


def lr_curve_header() -> str:
    return markdown_row(load_plan().lr_curve_columns())


@dataclass(frozen=True)
class RunSpec:
    """What every run of a sweep shares (learner, seeds, length, workers, progress bar); :meth:`run`
    is :func:`run_experiment` with it, without files unless asked."""

    learner: str
    seeds: Sequence[int]
    steps: Optional[int]
    workers: Optional[int]
    progress: bool

    def run(self, scenario: Scenario, out: str, methods: Sequence[str], **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("write_files", False)
        return run_experiment(
            scenario,
            out,
            methods=list(methods),
            seeds=self.seeds,
            steps=self.steps,
            learner=self.learner,
            workers=self.workers,
            progress=self.progress,
            **kwargs,
        )


def _pm(e: Mapping[str, Any], key: str) -> str:
    return f"{100 * e[key]:.1f} ± {100 * e[key + '_std']:.1f}"


def _delta(e: Mapping[str, Any], ref: Mapping[str, Any], key: str) -> str:
    mean, lo, hi, _ = paired_ci(e["per_seed"][key], ref["per_seed"][key])
    if not np.isfinite(lo):
        return f"{100 * mean:+.1f}"
    mark = " ↑" if lo > 0 else (" ↓" if hi < 0 else "")
    return f"{100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]{mark}"


# ------------------------------------------------------------------------------------ tuning
def tune(
    scenarios: Sequence[str],
    spec: RunSpec,
    out: str,
    table_path: str = TUNED_LR_FILE,
    plan: Optional[SweepPlan] = None,
) -> str:
    """Run the lr grid on the tuning seeds ``spec.seeds``; (re)write the rows of these scenarios and
    ``spec.learner`` in the tuned-lr table."""
    plan = plan or load_plan()
    LR_GRID, GRPO_EXTRA = plan.lr_grid, plan.grpo_extra  # noqa: N806
    os.makedirs(out, exist_ok=True)
    learner, seeds, steps = spec.learner, list(spec.seeds), spec.steps
    rows: list[dict[str, Any]] = []
    curve_rows: list[list[Any]] = []
    for name in scenarios:
        sc = load_scenario(name)
        tuned_methods = plan.tune_methods()
        grid_runs: dict[str, dict[float, float]] = {m: {} for m in tuned_methods}
        scales = sorted(set(LR_GRID + GRPO_EXTRA))
        for g in scales:
            methods = [m for m in tuned_methods if g in LR_GRID or m == "grpo"]
            names = [f"{m}@{g:g}" for m in methods]
            variants = {f"{m}@{g:g}": m for m in methods}
            res = spec.run(sc, out, names, variants=variants, lr_scales={n: g for n in names})
            for m, n in zip(methods, names, strict=True):
                grid_runs[m][g] = float(res["methods"][n]["mean_accuracy"])
        for m, by in grid_runs.items():
            in_grid = {g: v for g, v in by.items() if g in LR_GRID}
            best = choose_lr({g: [v] for g, v in in_grid.items()}, prefer="nearest_one")
            rows.append(
                {
                    "scenario": sc.name,
                    "learner": learner,
                    "method": m,
                    "best_lr_scale": best,
                    "best_lr": sc.lr * best,
                    "grid": " ".join(f"{g:g}" for g in LR_GRID),
                    "tuning_seeds": " ".join(map(str, seeds)),
                    "steps": int(steps or sc.steps),
                    "tuning_metric": "final held-out mean accuracy (mean over tuning seeds)",
                    "metric_by_scale": " ".join(f"{g:g}:{v:.4f}" for g, v in sorted(by.items())),
                }
            )
            cells = [f"{100 * by[g]:.1f}" if g in by else "–" for g in LR_GRID + GRPO_EXTRA]
            curve_rows.append([sc.name, m, *cells, f"×{best:g}"])
    # Keep rows of other scenarios / learners already in the table.
    keep: list[dict[str, Any]] = []
    if os.path.exists(table_path):
        with open(table_path, encoding="utf-8", newline="") as f:
            done = {(r["scenario"], r["learner"]) for r in rows}
            keep = [r for r in csv.DictReader(f) if (r["scenario"], r["learner"]) not in done]
    with open(table_path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(TUNED_LR_COLUMNS), lineterminator="\n")
        w.writeheader()
        for r in keep + rows:
            w.writerow(r)
    text = "\n".join(markdown_table(plan.lr_curve_columns(), curve_rows))
    with open(os.path.join(out, "lr_curve.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    plot_lr_curves(rows, os.path.join(out, "lr_curve.png"), plan)
    return text


def plot_lr_curves(rows: Sequence[Mapping[str, Any]], path: str, plan: Optional[SweepPlan] = None) -> str:
    """One panel per scenario: the tuning metric against the lr multiplier, one line per method."""
    from recipe.gdro.lab.results.plot import SYNTH_TAG, log_axis, pyplot, save_figure

    plan = plan or load_plan()

    plt = pyplot()
    scen = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(1, len(scen), figsize=(5.2 * len(scen), 4.2), squeeze=False)
    for ax, sname in zip(axes[0], scen, strict=True):
        for i, r in enumerate([r for r in rows if r["scenario"] == sname]):
            pts = sorted((float(a), float(b)) for a, b in (kv.split(":") for kv in r["metric_by_scale"].split()))
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, [100 * y for y in ys], marker="o", ms=3, color=f"C{i}", label=r["method"], lw=1.3)
        log_axis(ax, "x")
        ax.set_xticks(sorted(set(plan.lr_grid + plan.grpo_extra)))  # label exactly the grid points
        ax.set_xlabel("lr multiplier (× scenario lr)")
        ax.set_ylabel("final held-out mean accuracy (%)")
        ax.set_title(sname, fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(
        f"{SYNTH_TAG} learning-rate curves on the tuning seeds (a too-large step hurts every method)", fontsize=10
    )
    fig.tight_layout()
    return save_figure(fig, path)


# ------------------------------------------------------------------------------------ study
def _versus(e: Mapping[str, Any], ref: Mapping[str, Any], same: bool) -> list[str]:
    """lr, mean and worst-skill accuracy, and their paired Δ against ``ref`` ("–" for ``ref`` itself)."""
    deltas = ["–", "–"] if same else [_delta(e, ref, k) for k in ("mean_accuracy", "worst_skill_accuracy")]
    return [f"×{e['lr_scale']:g}", _pm(e, "mean_accuracy"), _pm(e, "worst_skill_accuracy"), *deltas]


def _compare_rows(scen: str, res: Mapping[str, Any], ref: Mapping[str, Any], methods: Sequence[str]) -> list[list]:
    rows = []
    for m in methods:
        e = res["methods"][m]
        rows.append(
            [
                scen,
                m.split("@")[0].replace("eqmass-", ""),
                *_versus(e, ref, e is ref),
                _pct(e["se_reduction"]),
                _pct(e["variance_reduction"]),
                _pct(e["efficiency"]),
                f"{e['advantage_mass_ratio']:.2f}",
            ]
        )
    return rows


def _outcomes(
    scen: str, res: Mapping[str, Any], ref: Mapping[str, Any], methods: Sequence[str], ref_label: str
) -> list[str]:
    out, any_mean, any_worst = [], False, False
    n = len(res["seeds"])
    for m in methods:
        e = res["methods"][m]
        if e is ref:
            continue
        dm = paired_ci(e["per_seed"]["mean_accuracy"], ref["per_seed"]["mean_accuracy"])
        dw = paired_ci(e["per_seed"]["worst_skill_accuracy"], ref["per_seed"]["worst_skill_accuracy"])
        any_mean |= dm[1] > 0
        any_worst |= dw[1] > 0
        out.append(
            f"- {scen}: **{m.replace('eqmass-', '')}** vs {ref_label}: "
            f"{100 * dm[0]:+.1f} mean / {100 * dw[0]:+.1f} worst-skill points (paired, {n} seeds, 95% CI "
            f"[{100 * dm[1]:+.1f}, {100 * dm[2]:+.1f}] / [{100 * dw[1]:+.1f}, {100 * dw[2]:+.1f}])."
        )
    if not any_mean and not any_worst:
        out.append(f"- {scen}: **no method beats {ref_label}** on mean or worst-skill accuracy (no 95% CI above 0).")
    elif not any_mean:
        out.append(f"- {scen}: no method beats {ref_label} on mean accuracy.")
    elif not any_worst:
        out.append(f"- {scen}: no method beats {ref_label} on worst-skill accuracy.")
    return out


def study(
    scenarios: Sequence[str],
    spec: RunSpec,
    out: str,
    table_path: str = TUNED_LR_FILE,
    command: str = "",
    full: bool = False,
    plan: Optional[SweepPlan] = None,
) -> str:
    """Headline, equal-mass and defaults tables over the evaluation seeds ``spec.seeds``, each
    method at its tuned lr from ``table_path``."""
    os.makedirs(out, exist_ok=True)
    plan = plan or load_plan()
    variants = plan.defaults + (plan.defaults_full if full else ())
    learner, seeds = spec.learner, list(spec.seeds)
    head: list[list] = []  # rows of the headline, equal-mass and defaults tables
    eq: list[list] = []
    dft: list[list] = []
    outcome_head: list[str] = []
    outcome_eq: list[str] = []
    t0 = time.perf_counter()
    summary: dict[str, Any] = {}
    for name in scenarios:
        sc = load_scenario(name)
        methods = default_methods()
        tuned = lookup_tuned_lr(sc.name, learner, plan.tune_methods(), table_path)
        lr_note = "each method at its own tuned lr (× base): " + ", ".join(f"{m} ×{tuned[m]:g}" for m in methods)
        headline = spec.run(
            sc,
            os.path.join(out, sc.name),
            methods,
            lr_scales=tuned,
            write_files=True,
            lr_note=lr_note,
            title=f"GDRO simulator, tuned learning rates — synthetic learner — scenario `{sc.name}`",
        )
        ref = headline["methods"]["grpo"]
        head += _compare_rows(sc.name, headline, ref, methods)
        outcome_head += _outcomes(sc.name, headline, ref, methods, "tuned GRPO")

        # Equal advantage mass and the defaults study: one batch of runs (no files, no plots).
        specs: dict[str, str] = {}
        scales: dict[str, float] = {}
        eq_names = [f"eqmass-{m}" for m in methods if m != "grpo"]
        for m in methods:
            if m == "grpo":
                continue
            specs[f"eqmass-{m}"] = f"{m}:prompt.normalize=advantage_mass"
            scales[f"eqmass-{m}"] = tuned["grpo"]
        for _, vspec, lr_of, _ in variants:
            specs[vspec] = vspec
            scales[vspec] = tuned[lr_of]
        extra = spec.run(sc, os.path.join(out, sc.name), list(specs), variants=specs, lr_scales=scales)
        both = {"seeds": seeds, "methods": {**headline["methods"], **extra["methods"]}}
        eq += _compare_rows(sc.name, both, ref, ["grpo"] + eq_names)
        outcome_eq += _outcomes(sc.name, both, ref, eq_names, "tuned GRPO")
        for q, (ref_m, ref_label) in plan.question_default.items():
            r = both["methods"][ref_m]
            rows = [(ref_label, ref_m)]
            if q == "Rollout-GDRO allocator":
                rows += [(label, m) for m, label in plan.allocator_rows]
            rows += [(label, v) for qq, v, _, label in variants if qq == q]
            for label, v in rows:
                e = both["methods"][v]
                dft.append(
                    [q, label, sc.name, *_versus(e, r, v == ref_m), _pct(e["se_reduction"]), _pct(e["efficiency"])]
                )
        summary[sc.name] = {
            m: {
                k: e[k]
                for k in (
                    "lr_scale",
                    "mean_accuracy",
                    "worst_skill_accuracy",
                    "se_reduction",
                    "variance_reduction",
                    "efficiency",
                    "advantage_mass_ratio",
                )
            }
            | {"per_seed": e["per_seed"]}
            for m, e in both["methods"].items()
        }
    runtime = time.perf_counter() - t0
    tables = {
        name: "\n".join(markdown_table(columns, rows))
        for name, columns, rows in (
            ("headline", COMPARE_COLUMNS, head),
            ("equal_mass", COMPARE_COLUMNS, eq),
            ("defaults", DEFAULTS_COLUMNS, dft),
        )
    }
    files = {f"{name}.md": text for name, text in tables.items()}
    for fn, text in files.items():
        with open(os.path.join(out, fn), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    with open(table_path, encoding="utf-8", newline="") as f:
        tuned_rows = [r for r in csv.DictReader(f) if r["learner"] == learner and r["scenario"] in summary]
    plot_lr_curves(tuned_rows, os.path.join(out, "lr_curve.png"), plan)
    lr_curve = ""
    if os.path.exists(os.path.join(out, "lr_curve.md")):
        with open(os.path.join(out, "lr_curve.md"), encoding="utf-8") as f:
            lr_curve = f.read().strip()
    parts = [
        f"# GDRO simulator study — synthetic learner `{learner}`",
        "",
        f"> **{SYNTHETIC_NOTE}**",
        "",
        f"Reproduce: `{command}` ({runtime:.0f} s of simulation for the study; tuning separately).",
        f"Evaluation seeds {seeds[0]}..{seeds[-1]} (n = {len(seeds)}); lr tuned on seeds {plan.tune_seed0}..",
        "(different datasets,"
        f"batches and draws) over lr × {{{', '.join(f'{g:g}' for g in plan.lr_grid)}}} "
        "by final held-out mean accuracy.",
        "Δ = paired per-seed difference (same seed = same dataset, batches, reward and noise draws),",
        "mean and 95% t interval; ↑ / ↓ = the interval lies above / below 0.",
        "SE figures: true per-prompt variances, steady-state window (second epoch on).",
        "",
        "## Headline: every method at its own tuned lr (Δ vs tuned GRPO)",
        "",
        tables["headline"],
        "",
        *outcome_head,
        "",
        "## Equal step size: every method at tuned GRPO's lr, Prompt-GDRO mass-normalised (Δ vs tuned GRPO)",
        "",
        "prompt.normalize=advantage_mass keeps Σ|A·m| = Σ|A| for the methods with Prompt-GDRO; the Rollout-GDRO-only",
        "methods have no multipliers, so their rows compare them at GRPO's lr (their own tuned lr is in the headline).",
        "",
        tables["equal_mass"],
        "",
        *outcome_eq,
        "",
        "## Defaults study (one option at a time; Δ vs the current default at its tuned lr)",
        "",
        tables["defaults"],
        "",
    ]
    if lr_curve:
        parts += [
            "## Learning-rate curves (tuning seeds; final held-out mean accuracy, %)",
            "",
            lr_curve,
            "",
            "![lr curves](lr_curve.png)",
            "",
        ]
    text = "\n".join(parts)
    with open(os.path.join(out, "STUDY.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(out, "study_summary.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"synthetic_learner": True, "learner": learner, "command": command, "seeds": seeds, "results": summary},
            f,
            indent=1,
            default=float,
        )
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m recipe.gdro.lab.experiments.sweep",
        description="lr tuning, tuned headline and defaults study on the SYNTHETIC learner.",
    )
    p.add_argument("what", choices=["tune", "study", "all"])
    p.add_argument("--out", default=os.path.join("outputs", "sim_study"))
    p.add_argument(
        "--scenarios", nargs="+", default=shipped_scenarios(), help=f"default: {' '.join(shipped_scenarios())}"
    )
    p.add_argument("--learner", default=DEFAULT_LEARNER, choices=list(LEARNERS))
    p.add_argument("--seeds", type=int, default=5, help="evaluation seeds 0..N-1 (study)")
    p.add_argument("--tune-seeds", type=int, default=3, help="tuning seeds from the plan's tune_seed0 (100): N of them")
    p.add_argument("--steps", type=int, default=None, help="steps (default: each scenario's)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--table", default=TUNED_LR_FILE, help="tuned-lr table to write (tune) / read (study)")
    p.add_argument(
        "--full", action="store_true", help="study: also the extra variants (K = 6 bins, mean_abs_advantage)"
    )
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    for flag, value in (
        ("--steps", args.steps),
        ("--seeds", args.seeds),
        ("--tune-seeds", args.tune_seeds),
        ("--workers", args.workers),
    ):
        if value is not None and value < 1:
            print(f"error: {flag} {value}: must be >= 1", file=sys.stderr)
            return 2
    try:  # bad input in one line, as simulate does (a scenario file, a tuned-lr table, a value)
        for s in args.scenarios:
            load_scenario(s)
        cmd = "python -m recipe.gdro.lab.experiments.sweep " + " ".join(argv if argv is not None else sys.argv[1:])
        shared = {"learner": args.learner, "steps": args.steps, "workers": args.workers, "progress": not args.quiet}
        if args.what in ("tune", "all"):
            seed0 = load_plan().tune_seed0
            tune_seeds = range(seed0, seed0 + args.tune_seeds)
            print(tune(args.scenarios, RunSpec(seeds=list(tune_seeds), **shared), args.out, args.table))
        if args.what in ("study", "all"):
            spec = RunSpec(seeds=list(range(args.seeds)), **shared)
            print(study(args.scenarios, spec, args.out, args.table, cmd, args.full))
    except (ScenarioError, GDROConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from verl_ext.interrupt import run_main

    run_main("sim.sweep", main)
