"""The lab's old module names (before it moved under recipe/gdro/lab/) end in one line naming the new one."""

import subprocess
import sys

from recipe_helpers.paths import REPO

from recipe.gdro.moved import new_name


def test_an_old_name_run_with_python_m_is_refused_in_one_line_naming_the_new_one():
    run = subprocess.run(
        [sys.executable, "-m", "recipe.gdro.results.table", "x"], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "recipe.gdro.results.table moved to recipe.gdro.lab.results.table (the lab is under recipe/gdro/lab/): "
        "python -m recipe.gdro.lab.results.table"
    ]


def test_new_names():
    assert new_name("recipe.gdro.experiments.study") == "recipe.gdro.lab.experiments.study"
    assert new_name("recipe.gdro.sim.simulate") == "recipe.gdro.lab.sim.simulate"
    assert new_name("recipe.gdro.results.metrics_io") is None  # the recipe's own
    assert new_name("recipe.gdro.main_gdro") is None
