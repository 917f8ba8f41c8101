"""GDRO simulator: compare GRPO, Prompt-GDRO, Rollout-GDRO and joint mode on a SYNTHETIC learner.

    python -m recipe.gdro.lab.sim.simulate [--scenario dapo_like|FILE.yaml] [--out DIR] [--steps N]
                                   [--seed S] [--seeds K] [--methods grpo prompt_gdro ...]
                                   [--set prompt.loss_signal=failure_rate ...] [--workers W]

The learner (recipe/gdro/lab/sim/learner.py) is a stand-in with the structure the paper argues about
(long-tailed skills, shared parameters within a skill, Bernoulli rewards, verl's own GRPO
advantages, a policy-gradient step, a fixed rollout budget). The GDRO controllers are the SAME
``verl_ext`` classes the training recipe runs. Results are NOT evidence about LLMs.

Outputs in DIR: ``results.json``, ``report.md``, PNG plots, and ``metrics/<method>/seed<S>.jsonl``
(per-step metrics in the recipe's own JSON-lines format, so ``python -m recipe.gdro.lab.sim.plots`` reads
simulator and training runs alike). See docs/simulator.md.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from here on, the slow imports included: one line (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("sim.simulate")

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from recipe.gdro.lab.results.runner import run_all
from recipe.gdro.lab.results.stats import paired_ci
from recipe.gdro.lab.results.table import markdown_row, markdown_table
from recipe.gdro.lab.sim.learner import DEFAULT_LEARNER, LEARNERS, make_learner
from recipe.gdro.lab.sim.methods import (
    TUNED_LR_FILE,
    build_gdro_dict,
    check_method,
    default_methods,
    file_label,
    lookup_tuned_lr,
    parse_set_overrides,
)
from recipe.gdro.lab.sim.scenario import Scenario, ScenarioError, load_scenario, shipped_scenarios
from recipe.gdro.results.metrics_io import append_metrics_jsonl

SYNTHETIC_NOTE = (
    "SYNTHETIC LEARNER: a skills-and-prompts logit model trained by GRPO on simulated Bernoulli "
    "rewards, driven by the real verl_ext controllers. It shows what the adversaries do; it is not "
    "evidence about LLM training."
)
SUMMARY_KEYS = (
    "mean_accuracy",
    "worst_skill_accuracy",
    "pass_at_8",
    "train_mean_accuracy",
    "mean_accuracy_auc",
    "worst_skill_accuracy_auc",
    "se_reduction",
    "variance_reduction",
    "oracle_se_reduction",
    "efficiency",
    "advantage_mass_ratio",
    "tokens_per_step",
    "tokens_ratio_to_uniform",
    "truncation_rate",
    "accuracy_gain_per_mtoken",
)
EXTRA_CURVES = (
    "mu",
    "se_proxy_reduction",
    "true_se_reduction",
    "true_variance_reduction",
    "oracle_se_reduction",
    "advantage_mass_ratio",
    "tokens_generated",
    "tokens_ratio_to_uniform",
)
CURVE_KEYS = ("mean_accuracy", "worst_skill_accuracy", "pass_at_8", "train_mean_accuracy")


def _replace_folder(staging: str, out_dir: str) -> None:
    """Move a finished output folder into place: the old one (if any) is renamed away first, then deleted."""
    old = None
    if os.path.isdir(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(staging))
        os.rename(out_dir, os.path.join(old, "previous"))
    os.rename(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------ one run
def run_one(
    scenario: Scenario,
    method: str,
    seed: int,
    *,
    steps: Optional[int] = None,
    spec: Optional[str] = None,
    overrides: Optional[Mapping[str, Any]] = None,
    metrics_path: Optional[str] = None,
    learner: str = DEFAULT_LEARNER,
    lr_scale: float = 1.0,
) -> dict[str, Any]:
    """Train the synthetic learner for ``steps`` steps with one method and one seed.

    ``method`` is a registry method or variant (:mod:`recipe.gdro.lab.sim.methods`); ``spec``, when
    given, is the one to run and ``method`` only its label (the sweeps use it). Returns per-step
    curves and summary numbers; ``metrics_path`` receives one JSON line per step.
    """
    from verl_ext import GDROController, gdro_config_from_dict, gdro_config_to_dict

    steps = int(steps or scenario.steps)
    gdro_dict = build_gdro_dict(scenario, spec or method, overrides or {}, seed)
    cfg = gdro_config_from_dict(gdro_dict)
    ctl = GDROController(cfg, scenario.num_prompts, max_response_length=scenario.max_response_length)
    learner_name = learner
    learner = make_learner(learner_name, scenario, seed, lr=scenario.lr * float(lr_scale))
    S = learner.num_skills
    names = [s.name for s in scenario.skills]

    from verl_ext.rollout_gdro import allocation_quality

    curves = {k: np.empty(steps + 1) for k in CURVE_KEYS}
    skill_acc = np.empty((steps + 1, S))
    extra = {k: np.full(steps + 1, np.nan) for k in EXTRA_CURVES}
    ev = learner.evaluate()
    for k in CURVE_KEYS:
        curves[k][0] = ev[k]
    skill_acc[0] = ev["skill_accuracy"]
    skill_rollouts = np.zeros(S)
    skill_prompts = np.zeros(S)
    total_rollouts = 0
    token_totals = (0.0, 0.0, 0.0)  # generated, uniform expectation, truncated responses
    if metrics_path and os.path.exists(metrics_path):
        os.remove(metrics_path)
    r_cfg = cfg.rollout

    for t in range(1, steps + 1):
        ids = learner.next_batch()
        counts = ctl.schedule(ids)
        # How good this allocation is for the TRUE per-prompt variances p(1-p) (before the update).
        q = allocation_quality(counts, learner.true_variance(ids), r_cfg.n_mean, r_cfg.n_min, r_cfg.n_max)
        roll = learner.rollout(ids, counts, t)
        adv = learner.grpo_advantages(roll["rewards"], roll["prompt_ids"])
        mult = ctl.observe(
            roll["prompt_ids"],
            roll["rewards"] > 0.5,
            response_abs_advantage=np.abs(adv),
            response_length=roll["lengths"],
        )
        learner.update(ids, roll, adv, mult)

        ev = learner.evaluate()
        for k in CURVE_KEYS:
            curves[k][t] = ev[k]
        skill_acc[t] = ev["skill_accuracy"]
        total_rollouts += int(counts.sum())
        sk = learner.skill_of[ids]
        step_skill_rollouts = np.bincount(sk, weights=counts, minlength=S)
        step_skill_prompts = np.bincount(sk, minlength=S).astype(np.float64)
        skill_rollouts += step_skill_rollouts
        skill_prompts += step_skill_prompts
        m = ctl.metrics()
        extra["mu"][t] = m.get("gdro/mu", np.nan)
        extra["se_proxy_reduction"][t] = m.get("gdro/se_proxy_reduction", np.nan)
        extra["true_se_reduction"][t] = q["se_reduction"]
        extra["true_variance_reduction"][t] = q["variance_reduction"]
        extra["oracle_se_reduction"][t] = q["oracle_se_reduction"]
        abs_mass = float(np.abs(adv).sum())
        extra["advantage_mass_ratio"][t] = float(np.abs(adv * mult).sum() / abs_mass) if abs_mass > 0 else 1.0
        token_totals = _record_tokens(extra, t, m, token_totals)

        if metrics_path:
            rec = dict(m)
            rec["sim/synthetic_learner"] = 1.0
            rec["sim/mean_accuracy"] = ev["mean_accuracy"]
            rec["sim/worst_skill_accuracy"] = ev["worst_skill_accuracy"]
            rec["sim/pass_at_8"] = ev["pass_at_8"]
            rec["sim/train_mean_accuracy"] = ev["train_mean_accuracy"]
            rec["sim/rollouts_total"] = float(counts.sum())
            for key, val in q.items():
                rec[f"sim/true_se/{key}"] = val
            for j, name in enumerate(names):
                rec[f"sim/skill/{name}/accuracy"] = float(ev["skill_accuracy"][j])
                rec[f"sim/skill/{name}/data_share"] = float(step_skill_prompts[j] / len(ids))
                rec[f"sim/skill/{name}/compute_share"] = float(step_skill_rollouts[j] / counts.sum())
            append_metrics_jsonl(metrics_path, t, rec)

    summary = {k: float(curves[k][-1]) for k in CURVE_KEYS}
    summary["mean_accuracy_auc"] = float(curves["mean_accuracy"][1:].mean())
    summary["worst_skill_accuracy_auc"] = float(curves["worst_skill_accuracy"][1:].mean())
    lo = steady_state_start(scenario, steps)
    win = slice(lo, steps + 1)
    se, vr, orc = (
        float(np.mean(extra[k][win])) for k in ("true_se_reduction", "true_variance_reduction", "oracle_se_reduction")
    )
    summary["se_reduction"] = se
    summary["variance_reduction"] = vr
    summary["oracle_se_reduction"] = orc
    # Share of the oracle's achievable SE reduction obtained, over the window (ratio of means).
    summary["efficiency"] = se / orc if orc > 1e-12 else float("nan")
    summary["advantage_mass_ratio"] = float(np.mean(extra["advantage_mass_ratio"][1:]))
    summary.update(_token_summary(token_totals, steps, curves["mean_accuracy"], total_rollouts))
    return {
        "method": method,
        "seed": int(seed),
        "steps": steps,
        "learner": learner_name,
        "lr": learner.lr,
        "lr_scale": float(lr_scale),
        "gdro_config": gdro_config_to_dict(cfg),
        "summary": summary,
        "total_rollouts": int(total_rollouts),
        "curves": {**{k: v.tolist() for k, v in curves.items()}, **{k: v.tolist() for k, v in extra.items()}},
        "skill_accuracy_final": skill_acc[-1].tolist(),
        "skill_compute_share": (skill_rollouts / max(skill_rollouts.sum(), 1.0)).tolist(),
        "skill_data_share": (skill_prompts / max(skill_prompts.sum(), 1.0)).tolist(),
        "skill_rollouts_per_prompt": (skill_rollouts / np.maximum(skill_prompts, 1.0)).tolist(),
    }


def _record_tokens(extra: dict, t: int, m: Mapping[str, float], totals: tuple) -> tuple:
    """Per-step token curves from the controller's ``gdro/tokens/*`` metrics; running totals."""
    generated = m["gdro/tokens/generated"]
    extra["tokens_generated"][t] = generated
    extra["tokens_ratio_to_uniform"][t] = m["gdro/tokens/ratio_to_uniform"]
    rollouts = generated / max(m["gdro/tokens/mean_response_length"], 1e-300)
    truncated = m.get("gdro/tokens/truncation_rate", 0.0) * rollouts
    return totals[0] + generated, totals[1] + m["gdro/tokens/uniform_expected"], totals[2] + truncated


def _token_summary(totals: tuple, steps: int, mean_accuracy: np.ndarray, total_rollouts: int) -> dict[str, float]:
    """Tokens per step, Σ generated / Σ uniform expectation, truncation, and accuracy gained per 10⁶ tokens."""
    generated, uniform, truncated = totals
    return {
        "tokens_per_step": generated / steps,
        "tokens_ratio_to_uniform": generated / uniform if uniform > 0 else float("nan"),
        "truncation_rate": truncated / max(total_rollouts, 1),
        "accuracy_gain_per_mtoken": (float(mean_accuracy[-1]) - float(mean_accuracy[0])) / generated * 1e6
        if generated > 0
        else float("nan"),
    }


def steady_state_start(scenario: Scenario, steps: int) -> int:
    """First step of the steady-state window for the SE figures: the second epoch.

    During the first epoch (ceil(num_prompts / batch_size) steps) most prompts are unseen and
    every allocator is still near uniform; from the second epoch every prompt has been seen once.
    Runs shorter than two epochs use all steps.
    """
    warmup = -(-scenario.num_prompts // scenario.batch_size)
    return warmup + 1 if steps > warmup else 1


def _run_job(job: tuple) -> dict[str, Any]:
    scenario, method, seed, steps, spec, overrides, metrics_path, learner, lr_scale = job
    return run_one(
        scenario,
        method,
        seed,
        steps=steps,
        spec=spec,
        overrides=overrides,
        metrics_path=metrics_path,
        learner=learner,
        lr_scale=lr_scale,
    )


# ------------------------------------------------------------------------------------ statistics
def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0 or np.all(np.isnan(arr)):
        return float("nan"), float("nan")
    std = float(np.nanstd(arr, ddof=1)) if np.count_nonzero(~np.isnan(arr)) > 1 else 0.0
    return float(np.nanmean(arr)), std


def _json_safe(obj: Any) -> Any:
    """NaN / inf → None (strict JSON), recursively."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def _round_list(values: Sequence[float], nd: int = 5) -> list[Optional[float]]:
    return [None if (v is None or not np.isfinite(v)) else round(float(v), nd) for v in values]


# ------------------------------------------------------------------------------------ experiment
def run_experiment(
    scenario: Scenario,
    out_dir: str,
    *,
    methods: Optional[Sequence[str]] = None,
    seeds: Optional[Sequence[int]] = None,
    steps: Optional[int] = None,
    overrides: Optional[Mapping[str, Any]] = None,
    variants: Optional[Mapping[str, str]] = None,
    lr_scales: Optional[Mapping[str, float]] = None,
    learner: str = DEFAULT_LEARNER,
    workers: Optional[int] = None,
    progress: bool = True,
    plots: bool = True,
    write_files: bool = True,
    metrics_files: bool = True,
    title: Optional[str] = None,
    lr_note: str = "",
) -> dict[str, Any]:
    """Run every (method, seed), write results.json / report.md / plots / metrics JSONL to ``out_dir``.

    ``variants`` maps labels to method specs (for sweeps: ``{"prompt_gdro@0.5": "prompt_gdro"}``);
    every other name in ``methods`` is itself a method spec. ``lr_scales`` multiplies the scenario's
    lr per method (default 1).
    """
    variants = dict(variants or {})
    lr_scales = dict(lr_scales or {})
    methods = list(methods or default_methods())
    for m in methods:
        check_method(variants.get(m, m))
    if learner not in LEARNERS:
        raise ValueError(f"unknown learner {learner!r}; choose from {', '.join(LEARNERS)}")
    seeds = list(seeds if seeds is not None else range(scenario.seeds))
    steps = int(steps or scenario.steps)
    overrides = dict(overrides or {})
    workers = int(workers or min(2, os.cpu_count() or 1))
    if write_files:
        os.makedirs(out_dir, exist_ok=True)

    jobs = []
    for m in methods:
        for s in seeds:
            path = None
            if write_files and metrics_files:
                path = os.path.join(out_dir, "metrics", file_label(m), f"seed{s}.jsonl")
            scale = float(lr_scales.get(m, 1.0))
            jobs.append((scenario, m, s, steps, variants.get(m), overrides, path, learner, scale))

    # Import verl once here so forked workers share it instead of importing it each.
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: F401

    t0 = time.perf_counter()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    from tqdm import tqdm

    # One tick per finished (method, seed) run, in the main process (results/runner.py's pool).
    with tqdm(
        total=len(jobs),
        unit="run",
        desc=f"simulating {scenario.name} [synthetic learner] {steps} steps/run",
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 5.0,
    ) as bar:
        for r in run_all(jobs, _run_job, workers=workers, on_done=lambda _job, _r: bar.update()):
            results[(r["method"], r["seed"])] = r
    runtime = time.perf_counter() - t0

    out = assemble_results(
        scenario, methods, seeds, steps, overrides, results, runtime, out_dir, learner=learner, lr_note=lr_note
    )
    if not write_files:
        return out
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(_json_safe(out), f, indent=1, allow_nan=False)
    plot_files: list[str] = []
    if plots:
        from recipe.gdro.lab.sim.plots import plot_simulation

        plot_files = plot_simulation(out_dir)
    write_report(out, out_dir, plot_files, title=title)
    return out


def assemble_results(
    scenario: Scenario,
    methods: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    overrides: Mapping[str, Any],
    results: Mapping[tuple[str, int], dict[str, Any]],
    runtime: float,
    out_dir: str,
    *,
    learner: str = DEFAULT_LEARNER,
    lr_note: str = "",
) -> dict[str, Any]:
    names = [s.name for s in scenario.skills]
    per_method: dict[str, Any] = {}
    for m in methods:
        runs = [results[(m, s)] for s in seeds]
        entry: dict[str, Any] = {"synthetic_learner": True, "lr": runs[0]["lr"], "lr_scale": runs[0]["lr_scale"]}
        per_seed: dict[str, list] = {}
        for k in SUMMARY_KEYS:
            vals = [r["summary"][k] for r in runs]
            entry[k], entry[f"{k}_std"] = _mean_std(vals)
            per_seed[k] = vals
        totals = [r["total_rollouts"] for r in runs]
        entry["total_rollouts"] = int(totals[0]) if len(set(totals)) == 1 else float(np.mean(totals))
        per_seed["total_rollouts"] = totals
        entry["per_seed"] = per_seed
        entry["seeds"] = list(seeds)
        entry["gdro_config"] = runs[0]["gdro_config"]
        for key in ("skill_accuracy_final", "skill_compute_share", "skill_data_share", "skill_rollouts_per_prompt"):
            arr = np.asarray([r[key] for r in runs])
            entry[key.replace("_final", "")] = {
                n: round(float(v), 5) for n, v in zip(names, arr.mean(axis=0), strict=True)
            }
        curves: dict[str, Any] = {"step": list(range(steps + 1))}
        for k in list(CURVE_KEYS) + list(EXTRA_CURVES):
            arr = np.asarray([r["curves"][k] for r in runs], dtype=np.float64)
            if np.all(np.isnan(arr)):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN steps (e.g. μ before the first step)
                mean = np.nanmean(arr, axis=0)
                std = np.nanstd(arr, axis=0, ddof=1) if len(runs) > 1 else np.zeros(arr.shape[1])
            curves[k] = {"mean": _round_list(mean), "std": _round_list(std)}
        entry["curves"] = curves
        entry["metrics_files"] = [
            os.path.relpath(os.path.join(out_dir, "metrics", file_label(m), f"seed{s}.jsonl"), out_dir) for s in seeds
        ]
        per_method[m] = entry
    totals = {m: per_method[m]["per_seed"]["total_rollouts"] for m in methods}
    equal = len({t for v in totals.values() for t in v}) == 1
    return {
        "synthetic_learner": True,
        "note": SYNTHETIC_NOTE,
        "learner": learner,
        "scenario": scenario.to_dict(),
        "scenario_file": scenario.source,
        "methods_compared": list(methods),
        "seeds": list(seeds),
        "steps": steps,
        "steady_state_from_step": steady_state_start(scenario, steps),
        "rollouts_per_step": scenario.batch_size * scenario.n_mean,
        "equal_total_rollouts": bool(equal),
        "gdro_overrides": dict(overrides),
        "lr_note": lr_note,
        "runtime_seconds": round(runtime, 2),
        "methods": per_method,
    }


# ------------------------------------------------------------------------------------ report
def _fmt(mean: float, std: float, pct: bool = True) -> str:
    if mean is None or not np.isfinite(mean):
        return "–"
    if pct:
        return f"{100 * mean:.1f} ± {100 * std:.1f}"
    return f"{mean:.3f} ± {std:.3f}"


def _pct(x: Optional[float]) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{100 * x:.1f}"


RESULTS_COLUMNS = (
    "method", "lr", "mean acc. (%)", "worst-skill acc. (%)", "pass@8 (%)", "mean acc. AUC (%)", "SE red. (%)",
    "var. red. (%)", "oracle SE red. (%)", "efficiency (%)", "adv. mass ratio", "total rollouts",
)  # fmt: skip
RESULTS_HEADER = markdown_row(RESULTS_COLUMNS)


def results_table(res: Mapping[str, Any]) -> str:
    """Markdown table of the per-method summary (percentages; mean ± std over seeds).

    SE figures use the TRUE per-prompt variances p(1-p), averaged over the steady-state window.
    """
    rows = [
        [
            name,
            f"{e['lr']:.4g}",
            *(
                _fmt(e[k], e[f"{k}_std"])
                for k in ("mean_accuracy", "worst_skill_accuracy", "pass_at_8", "mean_accuracy_auc")
            ),
            *(_pct(e[k]) for k in ("se_reduction", "variance_reduction", "oracle_se_reduction", "efficiency")),
            f"{e['advantage_mass_ratio']:.2f}",
            e["total_rollouts"],
        ]
        for name, e in res["methods"].items()
    ]
    return "\n".join(markdown_table(RESULTS_COLUMNS, rows))


def _ci_text(a: Sequence[float], b: Sequence[float]) -> tuple[str, float, float]:
    mean, lo, hi, _ = paired_ci(a, b)
    if not np.isfinite(lo):
        return f"{100 * mean:+.1f}", lo, hi
    return f"{100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]", lo, hi


def outcome_lines(res: Mapping[str, Any], baseline: str = "grpo", baseline_label: str = "GRPO") -> list[str]:
    """One sentence per method: paired differences against the baseline with 95% CIs, and a plain verdict."""
    methods = res["methods"]
    if baseline not in methods:
        return []
    base = methods[baseline]["per_seed"]
    n = len(res["seeds"])
    out = []
    winners_mean, winners_worst = [], []
    for name, e in methods.items():
        if name == baseline:
            continue
        mt, mlo, mhi = _ci_text(e["per_seed"]["mean_accuracy"], base["mean_accuracy"])
        wt, wlo, whi = _ci_text(e["per_seed"]["worst_skill_accuracy"], base["worst_skill_accuracy"])
        verdict = []
        for metric, lo, hi, winners in (("mean", mlo, mhi, winners_mean), ("worst-skill", wlo, whi, winners_worst)):
            if np.isfinite(lo) and lo > 0:
                verdict.append(f"better on {metric}")
                winners.append(name)
            elif np.isfinite(hi) and hi < 0:
                verdict.append(f"worse on {metric}")
            else:
                verdict.append(f"no clear difference on {metric}")
        out.append(
            f"- **{name}** vs {baseline_label}: {mt} mean / {wt} worst-skill points "
            f"(paired, {n} seeds, 95% CI): {', '.join(verdict)}."
        )
    if n >= 2:
        if not winners_mean and not winners_worst:
            out.append(f"- **No method beats {baseline_label}** on mean or worst-skill accuracy here (95% CI above 0).")
        else:
            if not winners_mean:
                out.append(f"- No method beats {baseline_label} on mean accuracy here.")
            if not winners_worst:
                out.append(f"- No method beats {baseline_label} on worst-skill accuracy here.")
    return out


TOKENS_COLUMNS = (
    "method", "tokens / step", "vs GRPO (%)", "ratio to uniform", "truncated (%)", "mean acc. (%)",
    "acc. gain per 10⁶ tokens (points)",
)  # fmt: skip


def tokens_table(res: Mapping[str, Any], baseline: str = "grpo") -> str:
    """Tokens per step (against GRPO), Σ generated / Σ uniform expectation, and accuracy per token."""
    base = res["methods"].get(baseline, {}).get("tokens_per_step")
    rows = [
        [
            name,
            f"{e['tokens_per_step']:.0f} ± {e['tokens_per_step_std']:.0f}",
            f"{100 * (e['tokens_per_step'] / base - 1):+.1f}" if base else "–",
            f"{e['tokens_ratio_to_uniform']:.3f} ± {e['tokens_ratio_to_uniform_std']:.3f}",
            _pct(e["truncation_rate"]),
            _fmt(e["mean_accuracy"], e["mean_accuracy_std"]),
            f"{100 * e['accuracy_gain_per_mtoken']:.3f} ± {100 * e['accuracy_gain_per_mtoken_std']:.3f}",
        ]
        for name, e in res["methods"].items()
    ]
    return "\n".join(markdown_table(TOKENS_COLUMNS, rows))


def skills_table(res: Mapping[str, Any]) -> str:
    """Per-skill final accuracy and compute share vs data share per method."""
    skills = res["scenario"]["skills"]
    methods = res["methods"]
    columns = ["skill", "frequency", *(f"{m} acc. / compute share (%)" for m in methods)]
    total_f = sum(s["frequency"] for s in skills)
    rows = [
        [
            s["name"],
            f"{100 * s['frequency'] / total_f:.1f}%",
            *(
                f"{100 * e['skill_accuracy'][s['name']]:.1f} / {100 * e['skill_compute_share'][s['name']]:.1f}"
                for e in methods.values()
            ),
        ]
        for s in skills
    ]
    return "\n".join(markdown_table(columns, rows))


def write_report(res: Mapping[str, Any], out_dir: str, plot_files: Sequence[str], title: Optional[str] = None) -> str:
    sc = res["scenario"]
    title = title or f"GDRO simulator — synthetic learner — scenario `{sc['name']}`"
    overrides = json.dumps(res["gdro_overrides"]) if res["gdro_overrides"] else "none (verl_ext defaults)"
    lines = [
        f"# {title}",
        "",
        f"> **{SYNTHETIC_NOTE}**",
        "",
        f"Scenario: `{sc['name']}` ({res['scenario_file']}). {sc.get('description', '').strip()}",
        "",
        f"- Learner: `{res['learner']}` (recipe/gdro/lab/sim/learner.py). {sc['num_prompts']} training prompts in "
        f"{len(sc['skills'])} skills, {sc['num_eval_prompts']} held-out prompts; batch {sc['batch_size']} prompts × "
        f"n̄ = {sc['n_mean']} → {res['rollouts_per_step']} rollouts per step for every method; {res['steps']} steps; "
        f"base lr {sc['lr']}, transfer {sc['transfer']}, grad_noise {sc['grad_noise']}.",
        f"- Learning rates: {res.get('lr_note') or 'the scenario lr for every method (not tuned)'}.",
        f"- Seeds: {res['seeds']} (mean ± sample std over seeds). Equal total rollouts across methods: "
        f"**{'yes' if res['equal_total_rollouts'] else 'NO'}**.",
        f"- gdro overrides: `{overrides}`; simulation time {res['runtime_seconds']:.1f} s.",
        "- Accuracies are exact expectations on held-out prompts of the same skills after the last step (synthetic).",
        "  AUC = mean over steps (learning speed).",
        "- SE figures use the learner's TRUE per-prompt variances p(1-p) and are averaged over the steady-state "
        f"window (steps {res['steady_state_from_step']}..{res['steps']}: from the second epoch, when every prompt "
        "has been seen): "
        "SE red. = 1 − se(n)/se(uniform), var. red. = 1 − V(n)/V(uniform), oracle SE red. = the best allocation "
        "for the true variances, efficiency = SE red. / oracle SE red. (ratio of window means). "
        "Adv. mass ratio = Σ|A·m| / Σ|A| (mean over steps; > 1 means a larger effective step than GRPO).",
        "",
        "## Results (synthetic learner)",
        "",
        results_table(res),
        "",
        "## Outcome per method (synthetic learner)",
        "",
        *(outcome_lines(res) or ["- (GRPO not run: no paired comparison)"]),
        "",
        "## Tokens (synthetic learner)",
        "",
        "Tokens from the scenario's length model (failures run longer). Ratio to uniform = Σ generated / "
        "Σ n̄·(each prompt's mean length that step), the tokens uniform allocation would have generated on "
        "the same prompts (1 for GRPO). Accuracy gain per 10⁶ tokens = (final − initial mean accuracy) / "
        "tokens generated.",
        "",
        tokens_table(res),
        "",
        "## Per skill: final accuracy / share of all rollouts (synthetic learner)",
        "",
        skills_table(res),
        "",
    ]
    if plot_files:
        lines += ["## Plots (synthetic learner)", ""]
        for p in plot_files:
            rel = os.path.relpath(p, out_dir)
            lines.append(f"![{rel}]({rel})")
        lines.append("")
    text = "\n".join(lines)
    path = os.path.join(out_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


# ------------------------------------------------------------------------------------ CLI
@dataclass
class SimulateArgs:
    """The simulator's command line: one field per flag (``--lr_scale`` and ``--lr-scale`` both work)."""

    scenario: Optional[str] = field(
        default=None, metadata={"help": "scenario YAML file or shipped scenario name (default: dapo_like)"}
    )
    learner: str = field(
        default=DEFAULT_LEARNER,
        metadata={
            "choices": list(LEARNERS),
            "help": "synthetic learner: shared (shared representation, noise, interference, capacity, curvature; "
            "default) or logistic (the earlier monotone per-skill learner)",
        },
    )
    out: Optional[str] = field(default=None, metadata={"help": "output folder (default: outputs/sim_<scenario>)"})
    steps: Optional[int] = field(default=None, metadata={"help": "training steps (default: the scenario's)"})
    seed: int = field(default=0, metadata={"help": "first seed (default 0)"})
    seeds: Optional[int] = field(
        default=None, metadata={"help": "number of seeds: SEED .. SEED+K-1 (default: the scenario's)"}
    )
    methods: list[str] = field(
        default_factory=list,
        metadata={
            "help": "methods to compare (default: the registry's four and Rollout-GDRO's bandit and knapsack "
            "allocators): config/method names, or variants NAME:KEY=VALUE, e.g. rollout_gdro:rollout.allocator=bandit"
        },
    )
    lr_scale: Optional[float] = field(
        default=None, metadata={"help": "multiply the scenario's lr by this for every method"}
    )
    tuned_lr: bool = field(
        default=False,
        metadata={
            "help": f"each method at its own tuned lr, read from {os.path.relpath(TUNED_LR_FILE)} "
            "(written by python -m recipe.gdro.lab.experiments.sweep tune); not with --lr-scale"
        },
    )
    overrides: list[str] = field(
        default_factory=list,
        metadata={
            "aliases": ["--set"],
            "action": "extend",
            "metavar": "KEY=VALUE",
            "help": "verl_ext gdro override for every method, e.g. prompt.loss_signal=failure_rate or "
            "binner.bin_edges=[0,0.1,0.2,0.4,0.6,0.8,0.9,1] (repeatable)",
        },
    )
    workers: Optional[int] = field(default=None, metadata={"help": "parallel processes (default: min(2, cores))"})
    no_plots: bool = field(default=False, metadata={"help": "skip the PNG plots"})
    quiet: bool = field(default=False, metadata={"help": "no progress bar"})


def build_parser():
    """``transformers.HfArgumentParser`` over :class:`SimulateArgs`."""
    from transformers import HfArgumentParser

    shipped = ", ".join(shipped_scenarios())
    return HfArgumentParser(
        SimulateArgs,
        prog="python -m recipe.gdro.lab.sim.simulate",
        description="Compare GRPO / Prompt-GDRO / Rollout-GDRO / joint at equal rollouts on a SYNTHETIC learner.",
        epilog=f"Shipped scenarios: {shipped}. Learners: {', '.join(LEARNERS)} (default {DEFAULT_LEARNER}). "
        "Sweeps (lr tuning, defaults study): python -m recipe.gdro.lab.experiments.sweep --help. "
        "See docs/simulator.md.",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    (args,) = build_parser().parse_args_into_dataclasses(list(sys.argv[1:] if argv is None else argv))
    from verl_ext import GDROConfigError, gdro_config_from_dict  # light: no verl import

    # Everything that can be wrong in the arguments fails here: before verl's slow import and
    # before the output folder exists.
    try:
        scenario = load_scenario(args.scenario)
        overrides = parse_set_overrides(args.overrides)
        if args.tuned_lr and args.lr_scale is not None:
            raise ValueError("--tuned-lr and --lr-scale exclude each other: each sets the learning rates")
        methods = list(args.methods or default_methods())
        for m in methods:
            gdro_config_from_dict(build_gdro_dict(scenario, m, overrides, seed=0))
        if args.steps is not None and args.steps < 1:
            raise ValueError("--steps must be >= 1")
        n_seeds = args.seeds if args.seeds is not None else scenario.seeds
        if n_seeds < 1:
            raise ValueError("--seeds must be >= 1")
        if args.workers is not None and args.workers < 1:
            raise ValueError(f"--workers {args.workers} must be >= 1 (omit it for the default, min(2, cores))")
        if args.lr_scale is not None and not args.lr_scale > 0:
            raise ValueError(f"--lr-scale {args.lr_scale} must be > 0")
        lr_scales: dict[str, float] = {}
        lr_note = ""
        if args.tuned_lr:
            lr_scales = lookup_tuned_lr(scenario.name, args.learner, methods)
            lr_note = f"each method at its own tuned lr (× base) from {os.path.relpath(TUNED_LR_FILE)}: " + ", ".join(
                f"{m} ×{lr_scales[m]:g}" for m in methods
            )
        elif args.lr_scale is not None:
            lr_scales = {m: args.lr_scale for m in methods}
            lr_note = f"the scenario lr × {args.lr_scale:g} for every method (not tuned)"
    except (ScenarioError, GDROConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seeds = list(range(args.seed, args.seed + n_seeds))
    out_dir = args.out or os.path.join("outputs", f"sim_{scenario.name}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        print(f"error: --out {out_dir} is an existing file, not a folder", file=sys.stderr)
        return 2
    blocker = next((p for p in _ancestors(out_dir) if os.path.lexists(p)), None)
    if blocker is not None and not os.path.isdir(blocker):
        print(f"error: --out {out_dir}: {blocker} is a file, not a folder", file=sys.stderr)
        return 2
    # Write into a temporary sibling folder and move it into place at the end, so an interrupted or
    # failed run leaves the previous outputs as they were (or none), never a mix of old and new.
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.partial-", dir=parent)
    except OSError as exc:
        print(f"error: cannot create the output folder {out_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    try:
        res = _run_into(staging, out_dir, scenario, methods, seeds, args, overrides, lr_scales, lr_note)
    except KeyboardInterrupt as exc:
        shutil.rmtree(staging, ignore_errors=True)
        from verl_ext.interrupt import interrupted_exit

        print(file=sys.stderr)  # past the progress bar
        interrupted_exit(
            "sim.simulate", getattr(exc, "signum", signal.SIGINT), f"{out_dir} is as it was before this run"
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(
        f"\n[synthetic learner: {args.learner}] scenario {scenario.name}: "
        f"{len(res['methods'])} methods × {len(seeds)} seeds "
        f"× {res['steps']} steps in {res['runtime_seconds']:.1f} s"
    )
    print(results_table(res))
    print("\n".join(outcome_lines(res)))
    print(f"\nwrote {os.path.join(out_dir, 'results.json')}, {os.path.join(out_dir, 'report.md')} and plots")
    return 0


def _ancestors(path: str) -> list[str]:
    """``path``'s parent folders, nearest first."""
    out, current = [], os.path.dirname(os.path.abspath(path))
    while True:
        out.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            return out
        current = parent


def _run_into(staging, out_dir, scenario, methods, seeds, args, overrides, lr_scales, lr_note) -> dict[str, Any]:
    """run_experiment into ``staging``, then move it to ``out_dir``."""
    res = run_experiment(
        scenario,
        staging,
        methods=methods,
        seeds=seeds,
        steps=args.steps,
        overrides=overrides,
        lr_scales=lr_scales,
        learner=args.learner,
        workers=args.workers,
        progress=not args.quiet,
        plots=not args.no_plots,
        lr_note=lr_note,
    )
    _replace_folder(staging, out_dir)
    return res


if __name__ == "__main__":
    from verl_ext.interrupt import run_main

    run_main("sim.simulate", main, detail="nothing written")
