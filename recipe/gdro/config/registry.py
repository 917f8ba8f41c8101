"""The method registry: ``config/method/<name>.yaml`` is the one definition of a method.

The recipe's Hydra entry point selects a file with ``method=<name>``; the simulator
(:mod:`recipe.gdro.lab.sim.methods`), the direct tiny-LM loop and the study read the same files
through this module, so a method means the same ``gdro:`` settings everywhere (for example
``binner.hysteresis: 0.03`` for Prompt-GDRO and joint GDRO). A *variant* of a method is that method
plus ``gdro.*`` overrides, written ``NAME:KEY=VALUE[:KEY=VALUE...]`` (for example
``rollout_gdro:rollout.allocator=bandit``), never a separate preset.

Nothing is read at import. Imports only omegaconf.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METHOD_DIR = Path(__file__).resolve().parent / "method"


class UnknownMethod(ValueError):
    """A method name with no ``config/method/<name>.yaml``."""


def merge(*parts: Mapping[str, Any] | None) -> dict[str, Any]:
    """Recursive merge of plain mappings, later ones winning (OmegaConf's merge; the project's only one)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(*(OmegaConf.create(dict(p or {})) for p in parts)) if parts else OmegaConf.create({})
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


@functools.cache
def _load(name: str) -> tuple[str, dict[str, Any]]:
    from omegaconf import OmegaConf

    path = METHOD_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UnknownMethod(f"unknown method {name!r} (choose from {', '.join(method_names())})")
    gdro = OmegaConf.to_container(OmegaConf.load(path)).get("gdro")
    if not isinstance(gdro, dict):
        raise UnknownMethod(f"{path}: no gdro: section")
    return str(path), gdro


def method_names() -> tuple[str, ...]:
    """Every registered method, ordered by what it switches on: GRPO, Prompt-, Rollout-, joint GDRO."""
    from omegaconf import OmegaConf

    def rank(path: Path) -> tuple[int, str]:
        g = OmegaConf.to_container(OmegaConf.load(path)).get("gdro") or {}
        on = lambda k: bool((g.get(k) or {}).get("enable", False))  # noqa: E731
        return (int(on("prompt")) + 2 * int(on("rollout")), path.stem)

    return tuple(p.stem for p in sorted(METHOD_DIR.glob("*.yaml"), key=rank))


def method_gdro(name: str) -> dict[str, Any]:
    """The ``gdro:`` section of ``config/method/<name>.yaml`` (a fresh copy)."""
    import copy

    return copy.deepcopy(_load(name)[1])


def enable_flags(name: str) -> dict[str, Any]:
    """Which adversaries the method switches on: the part of a method no override may change."""
    g = method_gdro(name)
    return {k: {"enable": bool((g.get(k) or {}).get("enable", False))} for k in ("prompt", "rollout")}


def parse_overrides(items: list[str] | tuple[str, ...] | None, what: str = "override") -> dict[str, Any]:
    """``["rollout.budget=tokens", "binner.bin_edges=[0,0.5,1]"]`` -> a nested dict.

    Values are parsed as YAML by ``OmegaConf.from_dotlist``; a later item wins; a leading ``gdro.``
    is accepted. Errors name the item.
    """
    from omegaconf import OmegaConf

    merged = OmegaConf.create({})
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("gdro.")
        if not sep or not key:
            raise ValueError(f"{what} {item!r}: expected KEY=VALUE, e.g. rollout.budget=tokens")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key}={value}"]))
        except Exception as exc:  # omegaconf grammar errors
            raise ValueError(f"{what} {item!r}: cannot parse the value: {exc}") from None
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """``"rollout_gdro:rollout.allocator=bandit"`` -> ``("rollout_gdro", {"rollout": {"allocator": "bandit"}})``.

    The name must be registered; the overrides may not switch an adversary on or off (that is a
    different method).
    """
    name, *items = spec.split(":")
    _load(name)  # raises UnknownMethod
    overrides = parse_overrides(items, what=f"method {spec!r}:")
    for k in ("prompt", "rollout"):
        if "enable" in (overrides.get(k) or {}):
            raise ValueError(f"method {spec!r}: {k}.enable is what defines a method; use another method name")
    return name, overrides


def method_config(spec: str, *layers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``gdro:`` mapping of method ``spec``: the registry's file, then ``layers`` (e.g. a scenario's
    settings, command-line overrides), then the variant's own overrides; the method's enable flags last."""
    name, own = parse_method(spec)
    return merge(method_gdro(name), *layers, own, enable_flags(name))
