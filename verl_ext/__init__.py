"""GDRO controllers for verl, framework-light (numpy only; no Ray, no GPU, no verl trainer imports).

* :class:`OnlineDifficultyBinner` — per-prompt sliding-window pass rate → difficulty bins.
* :class:`PromptGDRO` — the data adversary: EMA-debiased EXP3P weights on GRPO advantages.
* :class:`RolloutGDRO` — the compute adversary: per-prompt rollout counts under Σ n = B · n̄;
  :func:`allocation_quality` scores an allocation against uniform and the per-prompt oracle.
* :class:`GDROController` — the three behind one ``schedule`` / ``observe`` / ``metrics`` API.
"""

import importlib

# Each public name -> its module, imported on first use (PEP 562): ``verl_ext.interrupt`` is imported by the
# commands before their slow imports to take Ctrl-C at once, and must not pull numpy and pydantic in first.
_HOME = {
    "OnlineDifficultyBinner": "binner",
    "PromptIdError": "binner",
    "aggregate_responses": "binner",
    "check_prompt_ids": "binner",
    "BinnerConfig": "config",
    "GDROConfig": "config",
    "GDROConfigError": "config",
    "PromptGDROConfig": "config",
    "RolloutGDROConfig": "config",
    "gdro_config_from_dict": "config",
    "gdro_config_to_dict": "config",
    "GDROController": "controller",
    "PromptGDRO": "prompt_gdro",
    "prompt_loss": "prompt_gdro",
    "RolloutGDRO": "rollout_gdro",
    "allocation_quality": "rollout_gdro",
    "oracle_allocation": "rollout_gdro",
    "repair_to_budget": "rollout_gdro",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'verl_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"verl_ext.{_HOME[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])


__all__ = sorted(_HOME)
