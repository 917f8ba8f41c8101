"""GDRO controllers for verl, framework-light (numpy only; no Ray, no GPU, no verl trainer imports).

* :class:`OnlineDifficultyBinner` — per-prompt sliding-window pass rate → difficulty bins.
* :class:`PromptGDRO` — the data adversary: EMA-debiased EXP3P weights on GRPO advantages.
* :class:`RolloutGDRO` — the compute adversary: per-prompt rollout counts under Σ n = B · n̄;
  :func:`allocation_quality` scores an allocation against uniform and the per-prompt oracle.
* :class:`GDROController` — the three behind one ``schedule`` / ``observe`` / ``metrics`` API.
"""

from verl_ext.binner import OnlineDifficultyBinner, PromptIdError, aggregate_responses, check_prompt_ids
from verl_ext.config import (
    BinnerConfig,
    GDROConfig,
    GDROConfigError,
    PromptGDROConfig,
    RolloutGDROConfig,
    gdro_config_from_dict,
    gdro_config_to_dict,
)
from verl_ext.controller import GDROController
from verl_ext.prompt_gdro import PromptGDRO, prompt_loss
from verl_ext.rollout_gdro import RolloutGDRO, allocation_quality, oracle_allocation, repair_to_budget

__all__ = [
    "BinnerConfig",
    "GDROConfig",
    "GDROConfigError",
    "GDROController",
    "OnlineDifficultyBinner",
    "PromptGDRO",
    "PromptGDROConfig",
    "PromptIdError",
    "RolloutGDRO",
    "RolloutGDROConfig",
    "aggregate_responses",
    "allocation_quality",
    "check_prompt_ids",
    "gdro_config_from_dict",
    "gdro_config_to_dict",
    "oracle_allocation",
    "prompt_loss",
    "repair_to_budget",
]
