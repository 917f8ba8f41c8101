"""Packaging: ``recipe`` is a namespace package, the wheel's contents, editable and regular installs.

verl's recipes use a namespace ``recipe`` (TransferQueue also installs a ``recipe/`` portion into
site-packages). A regular ``recipe`` package (with ``__init__.py``) would shadow every other
``recipe.*`` portion on ``sys.path``. The install tests build the package with pip exactly as a
user does (build isolation: setuptools comes from the index) into a throw-away venv that sees this
interpreter's site-packages for the dependencies, and import it from outside the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from recipe_helpers.paths import REPO


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


IMPORT_PROBE = """
import importlib, importlib.resources, json, sys
import recipe, recipe.gdro, recipe.gdro.main_gdro, verl_ext, data_prep.common
out = {
    "recipe_file": getattr(recipe, "__file__", None),
    "recipe_path": list(recipe.__path__),
    "gdro": recipe.gdro.__file__,
    "config": (importlib.resources.files("recipe.gdro") / "config" / "gdro_trainer.yaml").is_file(),
    "scenario": (importlib.resources.files("recipe.gdro") / "lab" / "sim" / "scenarios" / "dapo_like.yaml").is_file(),
}
from recipe.gdro.startup.cli import compose_config  # the config groups resolve from the installed package
out["groups"] = compose_config(["size=8b", "method=rollout_gdro", "paper_exact=on"]).gdro.rollout.allocator
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    out[name] = getattr(module, "__file__", None) or list(module.__path__)[0]
print(json.dumps(out))
"""


def _probe(python: str, cwd: Path, *modules: str, **env: str) -> dict:
    proc = _run([python, "-c", IMPORT_PROBE, *modules], cwd=cwd, env=_clean_env(**env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _other_recipe(root: Path) -> Path:
    """Another project's namespace portion: <root>/recipe/other/ (a regular package)."""
    pkg = root / "recipe" / "other"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("NAME = 'other'\n")
    return root


def test_recipe_is_a_namespace_package_and_gdro_a_regular_one():
    assert not (REPO / "recipe" / "__init__.py").exists()
    assert (REPO / "recipe" / "gdro" / "__init__.py").is_file()


def test_another_namespace_recipe_imports_beside_gdro(tmp_path):
    other = _other_recipe(tmp_path / "other_project")
    out = _probe(sys.executable, tmp_path, "recipe.other", PYTHONPATH=f"{other}{os.pathsep}{REPO}")
    assert out["recipe_file"] is None  # a namespace package has no __init__ file
    assert str(other / "recipe") in out["recipe_path"] and str(REPO / "recipe") in out["recipe_path"]
    assert out["recipe.other"] == str(other / "recipe" / "other" / "__init__.py")
    assert out["gdro"] == str(REPO / "recipe" / "gdro" / "__init__.py")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("verl_gdro-*.whl")
    return path


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "recipe/__init__.py" not in names
    for name in (
        "recipe/gdro/__init__.py",
        "recipe/gdro/main_gdro.py",
        "recipe/gdro/config/__init__.py",
        "recipe/gdro/config/gdro_trainer.yaml",
        "recipe/gdro/config/size/8b.yaml",  # the config groups
        "recipe/gdro/config/paper_exact_settings/on_rollout_gdro.yaml",
        "recipe/gdro/lab/sim/scenarios/dapo_like.yaml",
        "recipe/gdro/lab/tinylm/policy.py",
        "recipe/gdro/lab/tinylm/base/config.json",
        "recipe/gdro/lab/tinylm/base/model.safetensors",
        "recipe/gdro/lab/tinylm/base/tokenizer.json",
        "verl_ext/__init__.py",
        "data_prep/dapo.py",
    ):
        assert name in names, name
    assert not any(n.startswith(("tests/", "run_scripts/")) or "__pycache__" in n for n in names)
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    metadata = zipfile.ZipFile(wheel).read(meta).decode()
    required = (REPO / "REQUIRED_VERL.txt").read_text().strip()
    assert f"Requires-Dist: {required}" in metadata
    assert "Requires-Dist: torch" not in metadata  # never a bare torch (CUDA build on PyPI)


def _venv_seeing_site_packages(path: Path) -> str:
    """A fresh venv whose dependencies come from this interpreter's site-packages (via a .pth file,
    which adds the folder but does not run its .pth files, so this project's own editable install
    there is not active)."""
    venv.EnvBuilder(with_pip=True).create(path)
    python = str(path / "bin" / "python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(site, "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.parametrize("editable", [True, False], ids=["editable", "regular"])
def test_installed_package_imports_outside_the_repo(tmp_path, editable):
    python = _venv_seeing_site_packages(tmp_path / "venv")
    target = ["-e", str(REPO)] if editable else [str(REPO)]
    proc = _run([python, "-m", "pip", "install", "-q", "--no-deps", *target])
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = _other_recipe(tmp_path / "other_project")
    work = tmp_path / "elsewhere"
    work.mkdir()
    modules = ["recipe.other"]
    try:
        import recipe.simple_use_case  # noqa: F401 - TransferQueue's namespace portion

        modules.append("recipe.simple_use_case")
    except ImportError:
        pass
    out = _probe(python, work, *modules, PYTHONPATH=str(other))
    assert out["recipe_file"] is None
    expected = REPO if editable else tmp_path / "venv"
    assert Path(out["gdro"]).is_relative_to(expected), out["gdro"]
    assert out["config"] and out["scenario"]
    assert out["groups"] == "bandit"
    assert out["recipe.other"] == str(other / "recipe" / "other" / "__init__.py")
    if "recipe.simple_use_case" in modules:
        assert "site-packages" in out["recipe.simple_use_case"]


def test_ruff_pins_agree():
    """The `lint` extra and the pre-commit hook run the same ruff."""
    import re

    hook = re.search(r"ruff-pre-commit\s+rev: v([\d.]+)", (REPO / ".pre-commit-config.yaml").read_text())
    extra = re.search(r'"ruff==([\d.]+)"', (REPO / "setup.py").read_text())
    assert hook and extra and hook.group(1) == extra.group(1)
