"""In-process backends by name: ``gdro.backend=NAME`` other than ``verl`` is looked up among the
``gdro.backends`` entry points (setup.py registers the lab's ``cpu = recipe.gdro.lab.backends.cpu``), so
the recipe never imports the lab (pyproject.toml's ``[tool.importlinter]``).

A backend is a module with ``prepare_config(config)`` (the settings it needs, before the start-up
checks) and ``Backend`` (the hooks of ``GDROTaskRunner.run``, built with the task runner's arguments).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from types import ModuleType

from omegaconf import DictConfig, OmegaConf

from recipe.gdro.startup.errors import GDRORecipeError
from recipe.gdro.startup.recipe_config import Backend

GROUP = "gdro.backends"
VERL = "verl"  # verl's own workers and servers: no plugin


def backend_name(config: DictConfig) -> str:
    return str(OmegaConf.select(config, "gdro.backend", default=VERL))


def in_process_backend(config: DictConfig) -> ModuleType | None:
    """The plugin module of ``gdro.backend``, or None for ``verl`` (and for a value that is no choice of
    :class:`Backend`: the start-up checks refuse it, naming the choices); a choice no installed package
    registers is a :class:`GDRORecipeError` (one line)."""
    name = backend_name(config)
    if name == VERL or name not in {choice.value for choice in Backend}:
        return None
    found = entry_points(group=GROUP, name=name)
    if not found:
        installed = sorted(ep.name for ep in entry_points(group=GROUP))
        raise GDRORecipeError(
            f"gdro.backend={name}: no installed package registers that backend (entry points {GROUP}: "
            f"{installed or 'none'}); reinstall this package (pip install -e .) or use gdro.backend=verl"
        )
    return next(iter(found)).load()
