"""The tiny language model: its config and tokenizer (``model``), sampling / log-probs / PPO update
(``policy``), the arithmetic skills (``tasks``), the exact metric (``exact``), the half-batch gradient
cosine (``gradsignal``), supervised pretraining (``sft``) and the shipped base (``base/``).

Imports only torch, transformers, verl and ``verl_ext``; the backends and the experiments import it,
never the reverse."""
