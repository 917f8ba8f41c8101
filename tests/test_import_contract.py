"""The line between the recipe and the lab (pyproject.toml's [tool.importlinter], checked by import-linter's
``lint-imports``): no recipe module imports ``recipe.gdro.lab``, verl_ext imports nothing of the recipe, no
import cycle. Cost: about 1 s (lint-imports reads the import graph of ~85 files)."""

import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
from recipe_helpers.paths import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS)], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    run = lint_imports(REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 3 kept, 0 broken." in run.stdout


def test_a_recipe_module_that_imports_the_lab_breaks_the_contract(tmp_path):
    for part in ("recipe", "verl_ext", "data_prep"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__", "base"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "recipe/gdro/startup/uses_the_lab.py").write_text("from recipe.gdro.lab.results import table\n")
    run = lint_imports(tmp_path)
    assert run.returncode == 1
    assert "The recipe never imports the lab BROKEN" in run.stdout
    assert "recipe.gdro.startup.uses_the_lab -> recipe.gdro.lab.results.table" in run.stdout


def test_the_contract_lists_every_recipe_module():
    """A new module of recipe.gdro is either the lab or a source of the forbidden contract."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (forbidden,) = [c for c in contracts if c["id"] == "recipe-never-imports-lab"]
    children = {f"recipe.gdro.{m.name}" for m in pkgutil.iter_modules([str(REPO / "recipe" / "gdro")])}
    assert children - {"recipe.gdro.lab"} <= set(forbidden["source_modules"])
