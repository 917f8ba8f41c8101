"""The lab around the recipe: the tiny-LM study and its experiments (``experiments``), the simulator
(``sim``), the tiny model (``tinylm``), the in-process CPU backend (``backends``, registered as the
``gdro.backends`` entry point ``cpu``), the benches, and the report side of the results (``results``:
tables, plots, comparisons, statistics).

The lab imports the recipe; no recipe module imports the lab (``lint-imports``, pyproject.toml's
``[tool.importlinter]``, run by tests/test_import_contract.py)."""
