"""The methods the simulator compares, as verl_ext ``gdro:`` config presets.

Every method runs at the same budget: Σ_i n(x_i) = B · n̄ rollouts every step. A method is a
preset of the controller config; the scenario's ``gdro:`` overrides and the command line's
``--set`` overrides are merged underneath it (the preset wins only on what defines the method:
which adversaries are on and, for the ``rollout_gdro_*`` methods, the allocator).

=========================  ======================================================================
``grpo``                   plain GRPO: uniform n̄ rollouts, all advantage multipliers 1
``prompt_gdro``            Prompt-GDRO (advantage reweighting), uniform rollouts
``rollout_gdro_sqrt``      Rollout-GDRO with the shadow-price square-root law
``rollout_gdro_bandit``    Rollout-GDRO with the per-bin Hedge allocator (``hedge``, once ``bandit``) + DP
``rollout_gdro_knapsack``  Rollout-GDRO with Knapsack-RL's value rule
``joint``                  both adversaries (allocator and coupling from the config: verl_ext
                           defaults unless overridden)
``rollout_gdro_sqrt_tok``  ``rollout_gdro_sqrt`` with ``rollout.budget=tokens`` (expected tokens
                           <= uniform's); not in the default set
``joint_tok``              ``joint`` with ``rollout.budget=tokens``; not in the default set
=========================  ======================================================================

The ``*_tok`` presets pin ``budget=tokens``; the others take ``rollout.budget`` from the config
(``--set rollout.budget=...``), so ``rollout_gdro_sqrt`` next to ``rollout_gdro_sqrt_tok`` compares
the two budgets at the default (``rollouts``).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

METHOD_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"prompt": {"enable": False}, "rollout": {"enable": False}},
    "prompt_gdro": {"prompt": {"enable": True}, "rollout": {"enable": False}},
    "rollout_gdro_sqrt": {"prompt": {"enable": False}, "rollout": {"enable": True, "allocator": "sqrt"}},
    "rollout_gdro_bandit": {"prompt": {"enable": False}, "rollout": {"enable": True, "allocator": "bandit"}},
    "rollout_gdro_knapsack": {"prompt": {"enable": False}, "rollout": {"enable": True, "allocator": "knapsack"}},
    "joint": {"prompt": {"enable": True}, "rollout": {"enable": True}},
}
DEFAULT_METHODS = list(METHOD_PRESETS)
# Token-budget variants (budget=tokens), for the budget comparison; not part of the default set.
METHOD_PRESETS["rollout_gdro_sqrt_tok"] = {
    "prompt": {"enable": False},
    "rollout": {"enable": True, "allocator": "sqrt", "budget": "tokens"},
}
METHOD_PRESETS["joint_tok"] = {"prompt": {"enable": True}, "rollout": {"enable": True, "budget": "tokens"}}


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``top`` wins."""
    out = copy.deepcopy(dict(base))
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_set_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["prompt.loss_signal=failure_rate", "binner.bin_edges=[0,0.5,1]"]`` → nested dict.

    Parsed by ``OmegaConf.from_dotlist`` (values as YAML: numbers, booleans, lists) and merged in
    order, so a later ``--set`` of the same key wins. A leading ``gdro.`` is accepted.
    """
    from omegaconf import OmegaConf

    merged = OmegaConf.create({})
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. prompt.loss_signal=failure_rate")
        key = item.split("=", 1)[0].strip()
        parts = [p for p in key.split(".") if p]
        if parts and parts[0] == "gdro":
            parts = parts[1:]
            item = item.split("=", 1)[0].strip()[len("gdro.") :] + "=" + item.split("=", 1)[1]
        if len(parts) < 2 or parts[0] not in ("binner", "prompt", "rollout"):
            raise ValueError(f"--set {item!r}: KEY must be binner.*, prompt.* or rollout.* (a verl_ext gdro key)")
        if tuple(parts) in (("prompt", "enable"), ("rollout", "enable")):
            raise ValueError(f"--set {item!r}: the enable flags are set by the method")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except Exception as exc:  # omegaconf grammar errors
            raise ValueError(f"--set {item!r}: cannot parse the value: {exc}") from None
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


# The lr table written by ``python -m recipe.gdro.experiments.sweep tune`` and read by ``simulate --tuned-lr``.
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
        raise ValueError(f"{path}: no tuned-lr table; write it with python -m recipe.gdro.experiments.sweep tune")
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    table = {(r["scenario"], r["learner"], r["method"]): float(r["best_lr_scale"]) for r in rows}
    missing = [m for m in methods if (scenario, learner, m) not in table]
    if missing:
        raise ValueError(
            f"{path}: no tuned lr for scenario {scenario!r}, learner {learner!r}, method(s) {', '.join(missing)}; "
            "run python -m recipe.gdro.experiments.sweep tune for it"
        )
    return {m: table[(scenario, learner, m)] for m in methods}


def build_gdro_dict(
    scenario: Any, method: str | Mapping[str, Any], overrides: Mapping[str, Any], seed: int
) -> dict[str, Any]:
    """The verl_ext ``gdro:`` mapping for one method of one run.

    ``method`` is a preset name or an explicit preset mapping (used by the defaults sweep).
    """
    preset = METHOD_PRESETS[method] if isinstance(method, str) else dict(method)
    d = deep_merge(scenario.gdro or {}, overrides or {})
    d = deep_merge(d, {"rollout": {"n_mean": scenario.n_mean, "seed": int(seed)}})
    # n_mean must stay within [n_min, n_max] even if the scenario's budget differs from the defaults.
    r = d["rollout"]
    r.setdefault("n_min", min(2, scenario.n_mean))
    r.setdefault("n_max", max(12, 3 * scenario.n_mean))
    return deep_merge(d, preset)
