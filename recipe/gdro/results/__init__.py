"""Results and statistics: the metrics file (``metrics_io``), Table-1 rows (``table``), plots
(``plot``), the studies' statistics and run cache (``stats``: Holm, paired tests, power, equal budgets),
per-prompt outcomes and the endpoints computed from them (``outcomes``: exact pass@k, a hard tail, the
worst skill) and their one runner (``runner``: cache plus process pool, the lr choice, code provenance).

Imports only ``verl_ext`` and plotting/statistics libraries; every other part may import it."""
