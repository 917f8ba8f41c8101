"""The CPU backend: a tiny real language model (``tinylm``), its sampling / log-prob / PPO-update
code (``policy``), supervised pretraining (``sft``) and the shipped base model (``base/``)."""
