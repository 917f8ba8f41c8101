"""The tiny-LM study: GDRO against a tuned GRPO on a real learner, under a declared protocol.

Usage (from the repository root; outputs go under ``--out``, never into the source tree)::

    python -m recipe.gdro.experiments.study --out ~/gdro_study tune      # lr grid per method, tuning seeds
    python -m recipe.gdro.experiments.study --out ~/gdro_study primary   # tuned lrs, evaluation seeds, Holm
    python -m recipe.gdro.experiments.study --out ~/gdro_study explore   # exploratory arms, tuning seeds only
    python -m recipe.gdro.experiments.study --out ~/gdro_study long      # regimes: 1,000 steps, a 256-prompt pool
    python -m recipe.gdro.experiments.study --out ~/gdro_study confirm   # the best explore arm vs GRPO, fresh seeds
    python -m recipe.gdro.experiments.study --out ~/gdro_study report    # the primary tables again, from the cache

Every run is :func:`recipe.gdro.experiments.direct.run_direct` (the CPU backend's sampling, log-prob and
update code, the recipe's ``verl_ext`` controllers, verl's GRPO advantage and policy loss; no Ray).
Finished runs are stored in ``OUT/cache`` under the SHA-256 of their full configuration
(:class:`recipe.gdro.results.stats.RunCache`), so an interrupted stage resumes where it stopped and
a changed setting never reuses a stale run.

The protocol, fixed here before any evaluation-seed run:

* **Tuning.** Each method's learning rate is the best of :data:`LR_GRID` by mean final validation
  accuracy over :data:`TUNING_SEEDS`. Nothing is chosen on :data:`EVAL_SEEDS`.
* **Pairing.** A seed fixes the data order, the initial sampling stream and the validation draws;
  every method sees the same training prompts in the same order and the same validation prompts.
* **Primary family** (:func:`primary_comparisons`), each GDRO method against tuned GRPO, paired
  over the evaluation seeds, Holm-corrected together: final mean accuracy, final worst-skill
  accuracy (over the skills the base solves at pass@1 >= :data:`SOLVABLE`), and the generated
  tokens needed to reach GRPO's final mean accuracy (log ratio; lower is better).
* **Budgets.** All methods generate the same number of rollouts (refused otherwise); tokens differ
  and are reported, with accuracy also read at GRPO's token total (exploratory), and the step size
  in the loss's units (sum of |A| x tokens) against GRPO's.
* **Exploration, then confirmation.** Exploratory arms (:data:`EXPLORE_ARMS`) run on tuning seeds
  only, unadjusted. The confirmatory run takes the GDRO arm with the largest mean gain there
  (:func:`chosen_arm`) and runs it against tuned GRPO on fresh seeds (:data:`CONFIRM_SEEDS`), its
  own Holm family of two (final mean and worst-skill accuracy).
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below: one line, no traceback (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("study")

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from recipe.gdro.experiments.direct import METHODS, DirectConfig
from recipe.gdro.results.stats import (
    PRIMARY,
    Comparison,
    RunCache,
    budget_to_reach,
    check_equal_budgets,
    holm,
    paired_t_pvalue,
    value_at_budget,
)
from recipe.gdro.results.table import markdown_table
from recipe.gdro.sim.simulate import paired_ci
from verl_ext.atomic import atomic_replace

TUNING_SEEDS = (100, 101)
EVAL_SEEDS = (0, 1, 2)
LR_GRID = (6.25e-6, 1.25e-5, 2.5e-5, 5e-5, 1e-4, 2e-4)
SOLVABLE = 0.1  # a skill counts for worst-skill accuracy if the base's pass@1 is at least this
# The run shape shared by every run of the study (DirectConfig fields; method, lr, seed vary).
STUDY_SHAPE: dict[str, Any] = {"steps": 150, "prompts": 64, "n": 4, "num_train": 2048, "eval_every": 30}


def paper_exact_settings(method: str) -> dict[str, Any]:
    """The ``gdro`` section PAPER_EXACT=1 sets for ``method`` (read from the shipped Hydra file)."""
    from omegaconf import OmegaConf

    path = Path(__file__).resolve().parents[1] / "config" / "paper_exact_settings" / f"on_{method}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path))["gdro"]


# Rollout-GDRO's step in the loss's units (Σ|A|·tokens) against GRPO's at one lr (2.5e-5), measured
# on the tuning seeds by the first exploratory run: the equal-step arms divide their tuned lr by it.
STEP_MASS = {"rollout_gdro": 1.34, "joint": 1.38}

# Exploratory arms (issue 16, item 5; issue 17): name -> (method, gdro overrides, lr multiplier),
# each at its method's tuned lr times the multiplier, on EXPLORE_SEEDS (tuning seeds, never the
# evaluation seeds), against tuned GRPO on the same seeds. Unadjusted.
EXPLORE_SEEDS = (100, 101)
EXPLORE_ARMS: dict[str, tuple[str, dict[str, Any], float]] = {
    "rollout_gdro (defaults: budget=rollouts)": ("rollout_gdro", {}, 1.0),
    "joint (defaults: budget=rollouts)": ("joint", {}, 1.0),
    "rollout_gdro, budget=tokens": ("rollout_gdro", {"rollout": {"budget": "tokens"}}, 1.0),
    "joint, budget=tokens": ("joint", {"rollout": {"budget": "tokens"}}, 1.0),
    "rollout_gdro, n_max=16 (4 n̄)": ("rollout_gdro", {"rollout": {"n_max": 16}}, 1.0),
    "rollout_gdro, half_life=2": ("rollout_gdro", {"binner": {"half_life": 2.0}}, 1.0),
    "rollout_gdro, equal step (lr / 1.34)": ("rollout_gdro", {}, 1.0 / STEP_MASS["rollout_gdro"]),
    "joint, equal step (lr / 1.38)": ("joint", {}, 1.0 / STEP_MASS["joint"]),
    "rollout_gdro, allocator=discovery": ("rollout_gdro", {"rollout": {"allocator": "discovery"}}, 1.0),
    "rollout_gdro, allocator=discovery, n_max=16": (
        "rollout_gdro",
        {"rollout": {"allocator": "discovery", "n_max": 16}},
        1.0,
    ),
    "prompt_gdro, PAPER_EXACT=1": ("prompt_gdro", paper_exact_settings("prompt_gdro"), 1.0),
    "prompt_gdro, normalize=all_responses": ("prompt_gdro", {"prompt": {"normalize": "all_responses"}}, 1.0),
    "rollout_gdro, PAPER_EXACT=1": ("rollout_gdro", paper_exact_settings("rollout_gdro"), 1.0),
    # a control, never a candidate for the confirmatory run: what a run that does not learn scores
    "grpo at lr 0 (control: no learning)": ("grpo", {}, 0.0),
}


# Regimes (exploratory, run after the confirmatory run, never candidates for it): the paper's
# travelling wave needs the core to saturate and the frontier to move, so prompts must be revisited
# often: 1,000 steps (each training prompt seen ~31 times), or a 256-prompt pool (~37 times in 150).
LONG_SHAPE: dict[str, Any] = {**STUDY_SHAPE, "steps": 1000, "eval_every": 100}
SMALL_POOL_SHAPE: dict[str, Any] = {**STUDY_SHAPE, "num_train": 256}
REGIMES: dict[str, dict[str, Any]] = {"long horizon": LONG_SHAPE, "small pool": SMALL_POOL_SHAPE}
LONG_METHODS = ("grpo", "rollout_gdro")
LONG_SEEDS = (100, 101)


def run_config(
    method: str, lr: float, seed: int, shape: dict[str, Any] | None = None, gdro: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The full, JSON-able configuration of one run (the run cache's key)."""
    config = asdict(
        DirectConfig(method=method, lr=float(lr), seed=int(seed), gdro=gdro or {}, **(shape or STUDY_SHAPE))
    )
    if config["device"] == "cpu":  # keyed only off CPU: the cached runs predate the key and are CPU runs
        del config["device"]
    return config


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    """What the study keeps of a run: curves, budgets, before/after, step-size totals."""
    history = result["history"]
    return {
        "before": result["before"],
        "after": result["after"],
        "curve": result["curve"],
        # run_direct's last curve point holds the run's totals
        "rollouts": int(result["curve"][-1]["rollouts"]),
        "tokens": int(result["curve"][-1]["tokens"]),
        "adv_token_mass": float(sum(h["train/adv_token_mass"] for h in history)),
        "weighted_adv_token_mass": float(sum(h["train/weighted_adv_token_mass"] for h in history)),
        "train_acc": [h["train/acc"] for h in history],
        "seconds": result["train_seconds"],
    }


def _run(config: dict[str, Any]) -> dict[str, Any]:
    import torch

    from recipe.gdro.experiments.direct import run_direct

    torch.set_num_threads(1)
    return _summary(run_direct(config, log=lambda *_: None))


class MissingRuns(RuntimeError):
    """``report`` asked for runs the cache does not hold."""


def run_all(configs: list[dict[str, Any]], cache: RunCache, jobs: int, log=print) -> list[dict[str, Any]]:
    """Results of ``configs`` in order: cached ones read back, the rest run (``jobs`` at a time;
    ``jobs=0`` runs nothing and raises :class:`MissingRuns` if any is absent)."""
    todo = [c for c in configs if cache.get(c) is None]
    if todo and jobs == 0:
        first = todo[0]
        raise MissingRuns(
            f"{len(todo)} of {len(configs)} runs are not in the cache (first: {first['method']} lr={first['lr']:g} "
            f"seed={first['seed']}); run the stage that makes them"
        )
    log(f"{len(configs)} runs, {len(configs) - len(todo)} cached, {len(todo)} to run ({jobs} at a time)")
    if todo:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for k, (config, result) in enumerate(zip(todo, pool.map(_run, todo), strict=True), 1):
                cache.put(config, result)
                log(
                    f"[{k}/{len(todo)}] {config['method']} lr={config['lr']:g} seed={config['seed']}: "
                    f"mean {result['after']['all']['pass1']:.3f} ({result['seconds']:.0f} s)"
                )
    return [cache.get(c) for c in configs]


# ------------------------------------------------------------------------------------- tuning
def tune(cache: RunCache, jobs: int, log=print) -> dict[str, float]:
    """Each method's lr: best mean final accuracy over the tuning seeds (ties: the smaller lr)."""
    configs = [run_config(m, lr, s) for m in METHODS for lr in LR_GRID for s in TUNING_SEEDS]
    results = run_all(configs, cache, jobs, log)
    score: dict[tuple[str, float], list[float]] = {}
    for config, result in zip(configs, results, strict=True):
        score.setdefault((config["method"], config["lr"]), []).append(result["after"]["all"]["pass1"])
    rows, tuned = [], {}
    for m in METHODS:
        means = {lr: float(np.mean(score[(m, lr)])) for lr in LR_GRID}
        tuned[m] = max(sorted(means), key=lambda lr: means[lr])
        rows.append([m, *(f"{means[lr]:.3f}" for lr in LR_GRID), f"{tuned[m]:g}"])
    base = results[0]["before"]["all"]["pass1"]
    log(f"tuning seeds {list(TUNING_SEEDS)}: final mean validation accuracy (base {base:.3f})")
    log("\n".join(markdown_table(["method", *(f"lr {lr:g}" for lr in LR_GRID), "chosen"], rows)))
    return tuned


# ------------------------------------------------------------------------------------ primary
PRIMARY_COLUMNS = ("comparison", "mean diff vs GRPO", "seeds", "p", "p (Holm)", "verdict")


def primary_comparisons() -> list[Comparison]:
    """The declared primary family: 3 GDRO methods x 3 metrics against tuned GRPO."""
    out = []
    for m in METHODS[1:]:
        out.append(Comparison(f"{m} final mean", m, "grpo", "final_mean"))
        out.append(Comparison(f"{m} final worst-skill", m, "grpo", "final_worst"))
        out.append(
            Comparison(f"{m} tokens to GRPO's final mean", m, "grpo", "log_tokens_to_target", lower_is_better=True)
        )
    return out


def solvable_skills(before: dict[str, dict[str, Any]]) -> list[str]:
    """Skills the base solves at pass@1 >= SOLVABLE (fixed by the base, not by any method's run)."""
    return [k for k, v in before.items() if k != "all" and v["pass1"] >= SOLVABLE]


def seed_metrics(run: dict[str, Any], grpo: dict[str, Any]) -> dict[str, float]:
    """One run's per-seed metrics, with GRPO's run of the same seed as the reference."""
    skills = solvable_skills(grpo["before"])
    tokens = [p["tokens"] for p in run["curve"]]
    means = [p["mean"] for p in run["curve"]]
    target = grpo["after"]["all"]["pass1"]
    reach = budget_to_reach(tokens, means, target)
    grpo_reach = budget_to_reach([p["tokens"] for p in grpo["curve"]], [p["mean"] for p in grpo["curve"]], target)
    grpo_mass = grpo["weighted_adv_token_mass"]
    both_reach = math.isfinite(reach) and reach > 0 and math.isfinite(grpo_reach) and grpo_reach > 0
    return {
        "final_mean": run["after"]["all"]["pass1"],
        "final_worst": min(run["after"][k]["pass1"] for k in skills),
        # NaN when either run never leaves (or starts at) the target: untestable, never counted as 0
        "log_tokens_to_target": math.log(reach / grpo_reach) if both_reach else float("nan"),
        "mean_at_grpo_tokens": value_at_budget(tokens, means, grpo["tokens"]),
        "tokens": run["tokens"],
        "step_mass_ratio": run["weighted_adv_token_mass"] / grpo_mass if grpo_mass > 0 else float("nan"),
    }


def primary(cache: RunCache, jobs: int, tuned: dict[str, float], log=print) -> str:
    """Run the evaluation seeds at the tuned lrs and return the report (Markdown)."""
    configs = {(m, s): run_config(m, tuned[m], s) for m in METHODS for s in EVAL_SEEDS}
    results = dict(zip(configs, run_all(list(configs.values()), cache, jobs, log), strict=True))
    for s in EVAL_SEEDS:
        check_equal_budgets({m: results[(m, s)]["rollouts"] for m in METHODS}, "rollouts")
    per = {(m, s): seed_metrics(results[(m, s)], results[("grpo", s)]) for m in METHODS for s in EVAL_SEEDS}
    comparisons = primary_comparisons()
    diffs = {
        c.name: [per[(c.method, s)][c.metric] - per[("grpo", s)][c.metric] for s in EVAL_SEEDS] for c in comparisons
    }
    adjusted = holm({c.name: paired_t_pvalue(diffs[c.name]) for c in comparisons if c.family == PRIMARY})
    rows = []
    for c in comparisons:
        d = np.asarray(diffs[c.name], dtype=float)
        ok = d[~np.isnan(d)]
        mean = float(ok.mean()) if ok.size else float("nan")
        better = mean < 0 if c.lower_is_better else mean > 0
        h = adjusted[c.name]
        verdict = ("GDRO better" if better else "GRPO better") if h.rejected else "not resolved"
        rows.append(
            [
                c.name,
                f"{mean:+.3f}" if ok.size else "n/a",
                f"{ok.size}/{d.size}",
                f"{h.p:.3f}",
                f"{h.p_adjusted:.3f}",
                verdict,
            ]
        )
    lines = [
        f"Primary family (declared; {len(comparisons)} comparisons, Holm at 0.05; "
        f"paired over seeds {list(EVAL_SEEDS)}):",
        *markdown_table(PRIMARY_COLUMNS, rows),
        "",
        "Per method, mean over evaluation seeds (exploratory rows: mean at GRPO's tokens, step mass):",
    ]
    skills = [k for k in results[("grpo", EVAL_SEEDS[0])]["after"] if k != "all"]
    rows = []
    for m in METHODS:
        runs = [results[(m, s)] for s in EVAL_SEEDS]
        pm = [per[(m, s)] for s in EVAL_SEEDS]
        rows.append(
            [
                f"{m} (lr {tuned[m]:g})",
                f"{np.mean([r['before']['all']['pass1'] for r in runs]):.3f}",
                f"{np.mean([p['final_mean'] for p in pm]):.3f}",
                f"{np.mean([p['final_worst'] for p in pm]):.3f}",
                *(f"{np.mean([r['after'][k]['pass1'] for r in runs]):.3f}" for k in skills),
                f"{np.nanmean([p['mean_at_grpo_tokens'] for p in pm]):.3f}",
                f"{np.mean([p['tokens'] for p in pm]):,.0f}",
                f"{np.mean([p['step_mass_ratio'] for p in pm]):.2f}",
            ]
        )
    head = ["method", "base mean", "final mean", "worst-skill", *skills, "mean at GRPO tokens", "tokens", "step mass"]
    lines.extend(markdown_table(head, rows))
    lines.append(
        f"worst-skill over {solvable_skills(results[('grpo', EVAL_SEEDS[0])]['before'])} (base pass@1 >= {SOLVABLE})"
    )
    return "\n".join(lines)


def arm_config(name: str, seed: int, tuned: dict[str, float]) -> dict[str, Any]:
    """The run of exploratory arm ``name`` on ``seed``: its method at the tuned lr times its multiplier."""
    method, gdro, scale = EXPLORE_ARMS[name]
    return run_config(method, tuned[method] * scale, seed, gdro=gdro)


def explore_runs(
    cache: RunCache, jobs: int, tuned: dict[str, float], log=print
) -> tuple[dict[int, dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]:
    """GRPO's run per exploration seed and every arm's run per seed (run if not cached)."""
    grpo = {s: run_config("grpo", tuned["grpo"], s) for s in EXPLORE_SEEDS}
    arms = {(name, s): arm_config(name, s, tuned) for name in EXPLORE_ARMS for s in EXPLORE_SEEDS}
    done = run_all([*grpo.values(), *arms.values()], cache, jobs, log)
    ref = dict(zip(EXPLORE_SEEDS, done[: len(grpo)], strict=True))
    return ref, dict(zip(arms, done[len(grpo) :], strict=True))


def explore_gains(ref: dict[int, dict[str, Any]], got: dict[tuple[str, int], dict[str, Any]]) -> dict[str, list[float]]:
    """Each arm's final mean accuracy minus GRPO's, per exploration seed."""
    return {
        name: [got[(name, s)]["after"]["all"]["pass1"] - ref[s]["after"]["all"]["pass1"] for s in EXPLORE_SEEDS]
        for name in EXPLORE_ARMS
    }


def explore(cache: RunCache, jobs: int, tuned: dict[str, float], log=print) -> str:
    """Run the exploratory arms and return their table (Markdown; every row exploratory)."""
    ref, got = explore_runs(cache, jobs, tuned, log)
    gains = explore_gains(ref, got)
    rows = []
    for name in ["grpo", *EXPLORE_ARMS]:
        runs = [ref[s] if name == "grpo" else got[(name, s)] for s in EXPLORE_SEEDS]
        per = [seed_metrics(r, ref[s]) for r, s in zip(runs, EXPLORE_SEEDS, strict=True)]
        diff = gains.get(name, [0.0] * len(EXPLORE_SEEDS))
        _, lo, hi, _ = paired_ci(diff, [0.0] * len(diff))
        lr = tuned["grpo"] if name == "grpo" else arm_config(name, EXPLORE_SEEDS[0], tuned)["lr"]
        rows.append(
            [
                name,
                f"{lr:.3g}",
                f"{np.mean([p['final_mean'] for p in per]):.3f}",
                f"{np.mean(diff):+.3f}",
                "–" if name == "grpo" else f"[{lo:+.3f}, {hi:+.3f}]",
                f"{np.mean([p['final_worst'] for p in per]):.3f}",
                f"{np.mean([r['tokens'] for r in runs]) / np.mean([ref[s]['tokens'] for s in EXPLORE_SEEDS]):.3f}",
                f"{np.mean([p['step_mass_ratio'] for p in per]):.2f}",
            ]
        )
    head = [
        "arm (exploratory)",
        "lr",
        "final mean",
        "vs GRPO",
        "95% CI",
        "worst-skill",
        "tokens / GRPO's",
        "step mass",
    ]
    lines = [f"Exploratory arms, tuning seeds {list(EXPLORE_SEEDS)}, unadjusted:", *markdown_table(head, rows)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------- confirmatory
# The confirmatory run (issue 16, item 5): the exploratory arm with the largest mean gain in final
# mean accuracy over GRPO on the tuning seeds (chosen by this rule, in code, before the run) against
# tuned GRPO on fresh seeds no stage uses otherwise; its own family of two, Holm-corrected.
CONFIRM_SEEDS = (3, 4, 5, 6, 7)
CONFIRM_COLUMNS = ("comparison", "mean diff vs GRPO", "95% CI", "seeds", "p", "p (Holm)", "verdict")


def confirm_comparisons(method: str) -> list[Comparison]:
    return [
        Comparison("final mean", method, "grpo", "final_mean"),
        Comparison("final worst-skill", method, "grpo", "final_worst"),
    ]


def chosen_arm(gains: dict[str, list[float]]) -> str:
    """The arm to confirm: the GDRO arm (controls excluded) of largest mean gain (ties: the first declared)."""
    candidates = [name for name, (method, _, _) in EXPLORE_ARMS.items() if method != "grpo"]
    return max(candidates, key=lambda name: (float(np.mean(gains[name])), -candidates.index(name)))


def confirm(cache: RunCache, jobs: int, tuned: dict[str, float], log=print) -> str:
    """Pick the arm on the tuning seeds, run it and GRPO on CONFIRM_SEEDS; return the report (Markdown)."""
    ref, got = explore_runs(cache, jobs, tuned, log)
    gains = explore_gains(ref, got)
    name = chosen_arm(gains)
    method = EXPLORE_ARMS[name][0]
    configs = {s: (run_config("grpo", tuned["grpo"], s), arm_config(name, s, tuned)) for s in CONFIRM_SEEDS}
    flat = run_all([c for pair in configs.values() for c in pair], cache, jobs, log)
    runs = {s: (flat[2 * k], flat[2 * k + 1]) for k, s in enumerate(CONFIRM_SEEDS)}
    for s, (g, a) in runs.items():
        check_equal_budgets({"grpo": g["rollouts"], name: a["rollouts"]}, "rollouts")
    per = {s: (seed_metrics(g, g), seed_metrics(a, g)) for s, (g, a) in runs.items()}
    comparisons = confirm_comparisons(method)
    diffs = {c.name: [per[s][1][c.metric] - per[s][0][c.metric] for s in CONFIRM_SEEDS] for c in comparisons}
    adjusted = holm({c.name: paired_t_pvalue(diffs[c.name]) for c in comparisons})
    rows = []
    for c in comparisons:
        mean, lo, hi, n = paired_ci(diffs[c.name], [0.0] * len(CONFIRM_SEEDS))
        h = adjusted[c.name]
        verdict = ("arm better" if mean > 0 else "GRPO better") if h.rejected else "not resolved"
        rows.append(
            [c.name, f"{mean:+.3f}", f"[{lo:+.3f}, {hi:+.3f}]", f"{n}", f"{h.p:.3f}", f"{h.p_adjusted:.3f}", verdict]
        )
    grpo_final = np.mean([per[s][0]["final_mean"] for s in CONFIRM_SEEDS])
    arm_final = np.mean([per[s][1]["final_mean"] for s in CONFIRM_SEEDS])
    lines = [
        f"Confirmatory run: {name!r} (chosen on tuning seeds {list(EXPLORE_SEEDS)}: "
        f"{np.mean(gains[name]):+.3f}) against GRPO on fresh seeds {list(CONFIRM_SEEDS)}; 2 comparisons, Holm at 0.05:",
        *markdown_table(CONFIRM_COLUMNS, rows),
        "",
        f"final mean: GRPO {grpo_final:.3f}, arm {arm_final:.3f}; tokens / GRPO's "
        f"{np.mean([a['tokens'] / g['tokens'] for g, a in runs.values()]):.3f}; step mass "
        f"{np.mean([per[s][1]['step_mass_ratio'] for s in CONFIRM_SEEDS]):.2f}",
    ]
    if arm_config(name, EVAL_SEEDS[0], tuned) == run_config(method, tuned[method], EVAL_SEEDS[0]):
        # the arm is the primary's configuration: pool its seeds (exploratory)
        prim = run_all([run_config(m, tuned[m], s) for s in EVAL_SEEDS for m in ("grpo", method)], cache, jobs, log)
        pairs = [(prim[2 * k], prim[2 * k + 1]) for k in range(len(EVAL_SEEDS))] + list(runs.values())
        d, lo, hi, n = paired_ci(
            [a["after"]["all"]["pass1"] for _, a in pairs], [g["after"]["all"]["pass1"] for g, _ in pairs]
        )
        lines.append(
            f"pooled with the primary's seeds {list(EVAL_SEEDS)} (same configurations; exploratory): "
            f"final mean {d:+.3f} [{lo:+.3f}, {hi:+.3f}] over {n} paired seeds"
        )
    return "\n".join(lines)


def regime_table(name: str, shape: dict[str, Any], results: dict, tuned: dict[str, float]) -> list[str]:
    """One regime's learning curves (mean over LONG_SEEDS) and final gap to GRPO (Markdown lines)."""
    steps = [p["step"] for p in results[(LONG_METHODS[0], LONG_SEEDS[0])]["curve"]]
    if len(steps) > 7:  # every other evaluation, and always the last
        steps = sorted({*steps[::2], steps[-1]})
    rows = []
    for m in LONG_METHODS:
        runs = [results[(m, s)] for s in LONG_SEEDS]
        means = [np.mean([next(p["mean"] for p in r["curve"] if p["step"] == k) for r in runs]) for k in steps]
        per = [seed_metrics(r, results[("grpo", s)]) for r, s in zip(runs, LONG_SEEDS, strict=True)]
        gap, lo, hi, _ = paired_ci(
            [p["final_mean"] for p in per], [results[("grpo", s)]["after"]["all"]["pass1"] for s in LONG_SEEDS]
        )
        ci = "–" if m == "grpo" else f"{gap:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        worst = np.mean([p["final_worst"] for p in per])
        rows.append([f"{m} (lr {tuned[m]:g})", *(f"{v:.3f}" for v in means), ci, f"{worst:.3f}"])
    head = ["method", *(f"step {k}" for k in steps), "final vs GRPO (95% CI)", "final worst-skill"]
    title = (
        f"{name} ({shape['steps']} steps, {shape['num_train']} training prompts), seeds {list(LONG_SEEDS)}, "
        "mean validation accuracy:"
    )
    return [title, *markdown_table(head, rows)]


def long_horizon(cache: RunCache, jobs: int, tuned: dict[str, float], log=print) -> str:
    """Run the regimes (long horizon, small pool); return their learning curves (Markdown; exploratory)."""
    configs = {
        (name, m, s): run_config(m, tuned[m], s, shape=shape)
        for name, shape in REGIMES.items()
        for m in LONG_METHODS
        for s in LONG_SEEDS
    }
    done = dict(zip(configs, run_all(list(configs.values()), cache, jobs, log), strict=True))
    lines: list[str] = []
    for name, shape in REGIMES.items():
        results = {(m, s): done[(name, m, s)] for m in LONG_METHODS for s in LONG_SEEDS}
        lines.extend([*regime_table(name, shape, results, tuned), ""])
    return "\n".join(lines).rstrip()


# stage -> (what it runs after tuning, the file its report goes to); ``tune`` runs only the tuning
STAGES = {
    "primary": (primary, "report.md"),
    "report": (primary, "report.md"),  # with jobs=0: from the cache only
    "explore": (explore, "explore.md"),
    "confirm": (confirm, "confirm.md"),
    "long": (long_horizon, "long.md"),
}


def _write(path: Path, text: str) -> None:
    """Replace ``path`` atomically: an interrupted stage leaves the old file or the new one."""
    with atomic_replace(path, "w") as f:
        f.write(text + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("stage", choices=("tune", *STAGES))
    p.add_argument("--out", required=True, help="study folder (run cache, tuned_lr.json, report.md)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    args = p.parse_args(argv)
    out = Path(args.out).expanduser()
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    if args.stage == "report" and not (out / "cache").is_dir():  # report reads the cache; it makes nothing
        print(f"error: no run cache at {out / 'cache'}; run the primary stage first", file=sys.stderr)
        return 2
    try:
        cache = RunCache(out / "cache")
    except OSError as e:
        print(f"error: cannot write to --out {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    jobs = 0 if args.stage == "report" else args.jobs
    try:
        tuned = tune(cache, jobs)
        _write(out / "tuned_lr.json", json.dumps(tuned, indent=1))
        if args.stage in STAGES:
            stage, filename = STAGES[args.stage]
            report = stage(cache, jobs, tuned)
            print(report)
            _write(out / filename, report)
    except MissingRuns as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from verl_ext.interrupt import run_main

    # stop the pool's workers at the signal: leaving its `with` otherwise waits for every queued run
    run_main("study", main, detail="finished runs are in the cache", stop_children_at_signal=True)
