"""``verl_ext`` imports its modules on first use, so the commands' early Ctrl-C handler comes in at once."""

import subprocess
import sys

import verl_ext


def test_the_interrupt_handler_imports_without_numpy_or_pydantic():
    """``install`` runs at the top of each command, before its slow imports: importing it must not load the
    controllers (numpy, pydantic: ~0.25 s here, seconds on a loaded machine, during which a Ctrl-C was a
    traceback, the CI failure of test_simulator_interrupted_during_its_imports)."""
    code = "import sys, verl_ext.interrupt; print(sorted(m for m in ('numpy', 'pydantic') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_public_name_resolves_to_its_module():
    assert sorted(verl_ext.__all__) == sorted(verl_ext._HOME)
    for name in verl_ext.__all__:
        assert getattr(verl_ext, name).__module__ == f"verl_ext.{verl_ext._HOME[name]}", name
    assert set(verl_ext.__all__) <= set(dir(verl_ext))
