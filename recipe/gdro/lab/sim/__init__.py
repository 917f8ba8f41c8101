"""The synthetic simulator: scenarios (``scenario``, ``scenarios/``), learners (``learner``), the recipe's
methods (``methods``, read from ``config/method/``), the engine and its CLI (``simulate``) and its plots (``plots``).

May import ``config`` (the method registry), ``results`` and ``verl_ext``; the experiments import it."""
