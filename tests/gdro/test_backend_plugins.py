"""gdro.backend=cpu reaches the lab's in-process backend through the gdro.backends entry point (setup.py),
so the recipe never imports the lab."""

import pytest

from recipe.gdro import backend_plugins
from recipe.gdro.startup.cli import compose_config
from recipe.gdro.startup.errors import GDRORecipeError


def test_the_cpu_backend_is_found_by_its_entry_point():
    from recipe.gdro.lab.backends.cpu import CPUBackend, prepare_cpu_config

    plugin = backend_plugins.in_process_backend(compose_config(["gdro.backend=cpu"]))
    assert plugin.Backend is CPUBackend and plugin.prepare_config is prepare_cpu_config
    assert backend_plugins.in_process_backend(compose_config([])) is None  # verl's own workers


def test_a_backend_no_package_registers_is_one_line(monkeypatch):
    """An install without the entry point (an old `pip install -e .`): one line naming the key and the remedy."""
    monkeypatch.setattr(backend_plugins, "entry_points", lambda group, name=None: [])
    with pytest.raises(GDRORecipeError) as e:
        backend_plugins.in_process_backend(compose_config(["gdro.backend=cpu"]))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("gdro.backend=cpu: no installed package registers that backend")
    assert "pip install -e ." in str(e.value)
