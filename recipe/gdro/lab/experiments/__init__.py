"""Experiments that run methods and report on them: the direct tiny-LM loop (``direct``), the tiny-LM
study (``study``), the simulator sweeps (``sweep``) and the CPU quick start (``quickstart``).

The top of the import graph: may import every other subpackage; nothing imports it."""
