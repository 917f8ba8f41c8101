"""The synthetic simulator: scenarios (``scenario``, ``scenarios/``), learners (``learner``), method
presets (``methods``), the engine and its CLI (``simulate``) and its plots (``plots``).

May import ``results`` and ``verl_ext``; the experiments import it."""
