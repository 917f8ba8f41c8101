"""The recipe's own keys of the ``gdro:`` section: how a launch runs, not how the controllers behave.

``gdro.dry_run``, ``gdro.metrics_file``, ``gdro.backend``, ``gdro.overwrite_checkpoints`` and
``gdro.restart_controller`` keep their names (users' overrides are unchanged); the controllers' keys
(``gdro.binner.*``, ``gdro.prompt.*``, ``gdro.rollout.*``, ``gdro.observe``) are :class:`verl_ext.GDROConfig`'s.
:func:`split_gdro_section` hands each its part. The choices are typed (:class:`DryRun`, :class:`Backend`),
checked by OmegaConf when the section is merged onto :class:`RecipeConfig`, with a did-you-mean and exit 2
for anything else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_ext.config import Choice, GDROConfigError, _choice

RECIPE_KEYS = ("dry_run", "metrics_file", "backend", "overwrite_checkpoints", "restart_controller")


class DryRun(Choice):
    """``gdro.dry_run``: ``false`` trains; ``true`` checks config and data, prints the plan, exits;
    ``config`` the same without requiring the data files."""

    false = "false"
    true = "true"
    config = "config"


class Backend(Choice):
    """``gdro.backend``: ``verl`` (verl's GPU workers and rollout servers) or ``cpu`` (the tiny LM's
    in-process CPU stand-ins, recipe/gdro/lab/backends, docs/cpu_backend.md)."""

    verl = "verl"
    cpu = "cpu"


@dataclass
class RecipeConfig:
    """The recipe-only keys of the ``gdro:`` section."""

    dry_run: DryRun = field(
        default=DryRun.false,
        metadata={
            "brief": "``true``: validate, print the plan, exit; ``config``: configuration only",
            "help": (
                "``true``: validate the config and the data, print the plan and exit (no Ray, no GPU); ``config``: "
                "the same without requiring the data files; ``false``: train."
            ),
        },
    )
    metrics_file: str = field(
        default="gdro_metrics.jsonl",
        metadata={
            "brief": "per-step JSON lines file in the experiment folder; empty disables",
            "help": (
                "per-step JSON lines file name inside the experiment folder (trainer.default_local_dir); empty "
                "disables it."
            ),
        },
    )
    backend: Backend = field(
        default=Backend.verl,
        metadata={
            "brief": "``cpu``: tiny-LM CPU workers and server ([docs](docs/cpu_backend.md))",
            "help": (
                "``verl`` trains with verl's GPU workers and vLLM/SGLang servers; ``cpu`` runs the same v1 loop "
                "with the tiny-LM CPU stand-ins of recipe/gdro/backends."
            ),
        },
    )

    overwrite_checkpoints: bool = field(
        default=False,
        metadata={
            "brief": "``true``: ``resume_mode=disable`` may overwrite checkpoints",
            "help": (
                "``true``: let ``trainer.resume_mode=disable`` start over in a folder that holds checkpoints (its "
                "saves overwrite the folders of the steps it saves); ``false`` refuses such a launch."
            ),
        },
    )

    restart_controller: bool = field(
        default=False,
        metadata={
            "brief": "``true``: resume the model but start the GDRO controller afresh",
            "help": (
                "``true``: a resume loads verl's checkpoint (model, optimizer, dataloader, step) but not the saved "
                "GDRO controller state (gdro_state.pkl): the binner and the adversaries start afresh. The way on "
                "when the saved state does not fit the launch (other bins, rollout arms or training data); "
                "``false`` restores the state and refuses one that does not fit."
            ),
        },
    )

    def __post_init__(self) -> None:
        self.dry_run = _choice("dry_run", DryRun, _bool_name(self.dry_run))
        self.backend = _choice("backend", Backend, self.backend)
        if not isinstance(self.metrics_file, str):
            raise GDROConfigError(
                f"gdro config: gdro.metrics_file={self.metrics_file!r} must be a file name (a string)"
            )
        if self.metrics_file and (os.path.isabs(self.metrics_file) or self.metrics_file.endswith(("/", os.sep))):
            raise GDROConfigError(
                f"gdro config: gdro.metrics_file={self.metrics_file!r} must be a file name inside "
                "trainer.default_local_dir (relative, not a directory)"
            )

    @property
    def is_dry_run(self) -> bool:
        return self.dry_run is not DryRun.false


def _bool_name(value: Any) -> Any:
    """YAML's and Hydra's booleans (``gdro.dry_run=true`` arrives as ``True``) as the choice names."""
    return {True: "true", False: "false"}.get(value, value) if isinstance(value, bool) else value


def split_gdro_section(section: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(controller keys, recipe keys)`` of a plain ``gdro`` mapping."""
    section = dict(section or {})
    recipe = {k: section.pop(k) for k in RECIPE_KEYS if k in section}
    return section, recipe


def recipe_config_from_dict(data: Mapping[str, Any]) -> RecipeConfig:
    """A validated :class:`RecipeConfig`; :class:`GDROConfigError` names the key at fault."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    data = {k: _bool_name(v) for k, v in dict(data).items()}
    for name, cls in (("dry_run", DryRun), ("backend", Backend)):
        if name in data:
            _choice(name, cls, data[name])  # the did-you-mean message before OmegaConf's
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), data))
    except GDROConfigError:
        raise
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "?")
        raise GDROConfigError(f"gdro config: gdro.{key}: {str(e).splitlines()[0]}") from None


def recipe_config(config: Any) -> RecipeConfig:
    """The :class:`RecipeConfig` of a composed recipe config (its ``gdro`` section)."""
    from omegaconf import DictConfig, OmegaConf

    node = config.get("gdro", None) if isinstance(config, (DictConfig, Mapping)) else None
    section = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    return recipe_config_from_dict(split_gdro_section(section)[1])


__all__ = [
    "RECIPE_KEYS",
    "Backend",
    "DryRun",
    "RecipeConfig",
    "recipe_config",
    "recipe_config_from_dict",
    "split_gdro_section",
]
