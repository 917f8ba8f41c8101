"""The report side of the results: Table-1 rows (``table``), plots (``plot``), runs side by side
(``compare``), the studies' statistics and run cache (``stats``: Holm, paired tests, power, equal budgets),
per-prompt outcomes and the endpoints computed from them (``outcomes``: exact pass@k, a hard tail, the
worst skill) and their one runner (``runner``: cache plus process pool, the lr choice, code provenance).

Imports ``recipe.gdro.results.metrics_io``, ``verl_ext`` and plotting/statistics libraries."""
