"""The names the lab had before it moved under ``recipe/gdro/lab/`` (issue 43): ``python -m`` on an old
name ends in one line naming the new one (exit 2) instead of "No module named ...".

``recipe/gdro/__init__.py`` calls :func:`refuse_old_name` (``python -m`` imports the parent packages
first), so no module is left at an old path: the moved files keep their history (``git log --follow``)
and a merge carries edits made to them under their old names over to the new ones.
"""

from __future__ import annotations

import sys

MOVED = {
    "recipe.gdro.experiments": "recipe.gdro.lab.experiments",
    "recipe.gdro.sim": "recipe.gdro.lab.sim",
    "recipe.gdro.tinylm": "recipe.gdro.lab.tinylm",
    "recipe.gdro.backends.cpu_platform_bench": "recipe.gdro.lab.backends.cpu_platform_bench",
    "recipe.gdro.backends.cpu_platform_model": "recipe.gdro.lab.backends.cpu_platform_model",
    **{f"recipe.gdro.results.{m}": f"recipe.gdro.lab.results.{m}" for m in ("compare", "plot", "stats", "table")},
}


def new_name(module: str) -> str | None:
    """The lab's name for ``module`` when it is one of the :data:`MOVED` old names, else None."""
    for old, new in MOVED.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    return None


def refuse_old_name(argv: list[str] | None = None) -> None:
    """Exit 2 with one line when this process runs ``python -m <old name>``."""
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":
            module = argv[i + 1]
            break
    else:
        return
    moved = new_name(module)
    if moved is not None:
        print(f"{module} moved to {moved} (the lab is under recipe/gdro/lab/): python -m {moved}", file=sys.stderr)
        sys.exit(2)
