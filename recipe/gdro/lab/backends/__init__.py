"""Stand-ins for verl's GPU parts: the in-process CPU backend (``gdro.backend=cpu``: ``cpu`` mixin,
``cpu_workers`` actor/reference, ``cpu_rollout`` LLM server and agent-loop manager).

May import ``tinylm``, ``startup``, ``results`` and ``verl_ext``; only the wiring at ``recipe.gdro`` imports it."""
