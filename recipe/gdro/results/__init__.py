"""What a training run writes and prints about its results: the metrics file (``metrics_io``, also the
validation figures by data source) and the closing summary (``summary``).

Imports only ``verl_ext`` and ``checkpoints``; the report side (tables, plots, statistics) is the lab's
``recipe.gdro.lab.results``."""
