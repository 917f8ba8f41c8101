"""Results and statistics: the metrics file (``metrics_io``), Table-1 rows (``table``), plots
(``plot``), and the studies' statistics and run cache (``stats``: Holm, paired tests, equal budgets).

Imports only ``verl_ext`` and plotting/statistics libraries; every other part may import it."""
