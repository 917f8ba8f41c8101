"""Shared helpers of the recipe tests (stand-ins for verl's GPU workers and LLM servers).

Imported as ``recipe_helpers``: the ``pythonpath`` setting of pytest in pyproject.toml puts
``tests/`` on ``sys.path`` (pytest runs with ``--import-mode=importlib`` and verl's wheel installs
its own top-level ``tests`` package, so the name ``tests.recipe_helpers`` is not usable).
"""
