"""The tree stays clean under the ruff settings in pyproject.toml (verl's rules), as pre-commit enforces."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from recipe_helpers.paths import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff not installed (the test extra)")


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_is_clean(args):
    proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
