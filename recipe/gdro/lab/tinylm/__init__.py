"""The tiny language model: its config and tokenizer (``model``), sampling / log-probs / PPO update
(``policy``), the arithmetic skills (``tasks``), the exact metric (``exact``), the half-batch gradient
cosine (``gradsignal``), supervised pretraining (``sft``) and the shipped base (``base/``).

Imports only torch, transformers, verl and ``verl_ext``; the backends and the experiments import it,
never the reverse."""

from pathlib import Path

# The shipped SFT base model folder (config.json, model.safetensors, tokenizer files). Defined here, not in
# ``model`` (which re-exports it), so that a launcher can name it without importing torch (~5 s).
BASE_MODEL_DIR = Path(__file__).resolve().parent / "base"
