"""The methods the simulator compares: the recipe's methods, read from ``config/method/*.yaml``.

Every method runs at the same budget: Σ_i n(x_i) = B · n̄ rollouts every step. A method is a name
of the registry (:mod:`recipe.gdro.config.registry`: ``grpo``, ``prompt_gdro``, ``rollout_gdro``,
``joint_gdro``, the same files ``method=<name>`` selects for a GPU run), or a variant of one,
``NAME:KEY=VALUE[:KEY=VALUE...]`` (e.g. ``rollout_gdro:rollout.allocator=bandit``,
``joint_gdro:rollout.budget=tokens``): the method's file, then the scenario's ``gdro:`` settings,
then the command line's ``--set``, then the variant's own overrides; the method's enable flags
always win (they are what defines it).

=============================================  ==========================================================
``grpo``                                       plain GRPO: uniform n̄ rollouts, all advantage multipliers 1
``prompt_gdro``                                Prompt-GDRO (advantage reweighting), uniform rollouts,
                                               binner hysteresis 0.03
``rollout_gdro``                               Rollout-GDRO (verl_ext's default allocator, ``sqrt``)
``rollout_gdro:rollout.allocator=bandit``      the per-bin Hedge allocator + DP (also ``knapsack``,
                                               ``discovery``)
``joint_gdro``                                 both adversaries, hysteresis 0.03
``rollout_gdro_failure_weighted``              Rollout-GDRO with ``failure_weighted`` (joint form:
                                               ``joint_gdro_failure_weighted``); by name only, not in
                                               :func:`default_methods`
``…:rollout.budget=tokens``                    the token budget (expected tokens <= uniform's)
=============================================  ==========================================================
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from recipe.gdro.config.registry import method_config, parse_method, parse_overrides

# The simulator's default comparison: the paper's four methods and Rollout-GDRO's other allocators (the
# tuned-lr table holds a row for each; a method registered since, e.g. rollout_gdro_failure_weighted, is
# compared by naming it).
PAPER_METHODS = ("grpo", "prompt_gdro", "rollout_gdro", "joint_gdro")
ALLOCATOR_VARIANTS = ("rollout_gdro:rollout.allocator=bandit", "rollout_gdro:rollout.allocator=knapsack")


def default_methods() -> list[str]:
    """The paper's methods (each checked against the registry on call), Rollout-GDRO's variants before joint."""
    names = [check_method(m) for m in PAPER_METHODS]
    return names[:3] + list(ALLOCATOR_VARIANTS) + names[3:]


def check_method(spec: str) -> str:
    """``spec`` if it names a registered method or a valid variant of one, else ValueError naming it."""
    parse_method(spec)
    return spec


def file_label(spec: str) -> str:
    """A method spec as a file-name part: ``rollout_gdro:rollout.allocator=bandit`` ->
    ``rollout_gdro__rollout.allocator-bandit`` (no ``:``, which a Markdown link reads as a URL scheme)."""
    return spec.replace(":", "__").replace("=", "-").replace("/", "-")


def parse_set_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["prompt.loss_signal=failure_rate", "binner.bin_edges=[0,0.5,1]"]`` → nested dict.

    Parsed by ``OmegaConf.from_dotlist`` (values as YAML: numbers, booleans, lists) and merged in
    order, so a later ``--set`` of the same key wins. A leading ``gdro.`` is accepted.
    """
    for item in items or []:
        key = item.split("=", 1)[0].strip().removeprefix("gdro.")
        parts = [p for p in key.split(".") if p]
        if "=" in item and (len(parts) < 2 or parts[0] not in ("binner", "prompt", "rollout")):
            raise ValueError(f"--set {item!r}: KEY must be binner.*, prompt.* or rollout.* (a verl_ext gdro key)")
        if tuple(parts) in (("prompt", "enable"), ("rollout", "enable")):
            raise ValueError(f"--set {item!r}: the enable flags are set by the method")
    return parse_overrides(items, what="--set")


# The lr table written by ``python -m recipe.gdro.lab.experiments.sweep tune`` and read by ``simulate --tuned-lr``.
TUNED_LR_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios", "tuned_lr.csv")
TUNED_LR_COLUMNS = (
    "scenario",
    "learner",
    "method",
    "best_lr_scale",
    "best_lr",
    "grid",
    "tuning_seeds",
    "steps",
    "tuning_metric",
    "metric_by_scale",
)


def lookup_tuned_lr(scenario: str, learner: str, methods: list[str], path: str = TUNED_LR_FILE) -> dict[str, float]:
    """Per-method lr multipliers from the shipped tuning table; errors name what is missing."""
    import csv

    if not os.path.exists(path):
        from verl_ext.atomic import blocking_file

        blocker = blocking_file(path)
        if blocker is not None:  # not a table still to tune: a path that cannot hold one
            raise ValueError(f"{path}: {blocker} is a file, not a folder")
        raise ValueError(f"{path}: no tuned-lr table; write it with python -m recipe.gdro.lab.experiments.sweep tune")
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    table = {(r["scenario"], r["learner"], r["method"]): float(r["best_lr_scale"]) for r in rows}
    missing = [m for m in methods if (scenario, learner, m) not in table]
    if missing:
        raise ValueError(
            f"{path}: no tuned lr for scenario {scenario!r}, learner {learner!r}, method(s) {', '.join(missing)}; "
            "run python -m recipe.gdro.lab.experiments.sweep tune for it"
        )
    return {m: table[(scenario, learner, m)] for m in methods}


def build_gdro_dict(scenario: Any, method: str, overrides: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The verl_ext ``gdro:`` mapping for one method (a registry name or variant) of one run."""
    budget = {"rollout": {"n_mean": scenario.n_mean, "seed": int(seed)}}
    # n_min and n_max are RolloutGDROConfig's (2 and 3·n̄, the appendix's rule), as in the recipe.
    return method_config(method, scenario.gdro or {}, overrides or {}, budget)
