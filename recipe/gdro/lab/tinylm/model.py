"""The tiny LM: a character-level tokenizer and a small ``Qwen3ForCausalLM``, both built offline.

The model is an ordinary Hugging Face causal LM (``transformers.Qwen3ForCausalLM`` from a
``Qwen3Config``), so everything verl does with a model path works on it: ``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained(BASE_MODEL_DIR)`` load it with no hub access, and verl's
``RLHFDataset`` renders prompts with the tokenizer's chat template.

Tokenizer: one token per character of :data:`CHARS` (digits, the operators, and the letters of
``Answer:``), plus the special tokens :data:`SPECIAL_TOKENS` (pad, unk, the end-of-turn token that
is also eos, and one role marker per chat role). The chat template renders a conversation as
``<|user|>12+34<|end|><|assistant|>`` (with ``add_generation_prompt``); the assistant's turn is
``Answer: 46<|end|>``.

The shipped base (:data:`BASE_MODEL_DIR`) is made by ``python -m recipe.gdro.lab.tinylm.sft --out
recipe/gdro/lab/tinylm/base`` (see ``docs/tiny_lm.md``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from recipe.gdro.lab.tinylm import BASE_MODEL_DIR  # the shipped SFT base (defined there: no torch import)

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
EOS_TOKEN = "<|end|>"  # ends every chat turn; generation stops on it
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values()]

# Every character a prompt or a response of the arithmetic task family uses (data_prep/arith.py).
CHARS = "0123456789+-*=() :\nAnswer"

# Unknown roles render as the user marker; content characters outside CHARS become <unk>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>"
    "{% else %}<|user|>{% endif %}"
    "{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _vocab() -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, *CHARS]:
        if token not in vocab:
            vocab[token] = len(vocab)
    return vocab


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer, built from code (no files, no hub).

    Special tokens are matched first (so ``<|end|>`` in a string is one token); every other
    character is its own token (``<unk>`` if not in :data:`CHARS`). Decoding concatenates the
    characters (``skip_special_tokens=True`` drops pad/eos/roles).
    """
    vocab = _vocab()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        padding_side="left",
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 3,
    *,
    intermediate_size: int = 256,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    max_positions: int = 128,
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """A freshly initialised ``Qwen3ForCausalLM`` sized for the tokenizer (tied embeddings).

    Initialisation is deterministic for ``seed`` (the global torch RNG is saved and restored).
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def widen_heads(model: Qwen3ForCausalLM, head_dim: int, *, noise: float = 0.0, seed: int = 0) -> Qwen3ForCausalLM:
    """A copy of ``model`` with attention heads of ``head_dim`` (>= the old), computing the same function.

    vLLM's CPU attention supports head sizes 32, 64, 80, ... only (issue 25), so a head-dim-16 model
    is widened: each head's old dimension pair (j, j + d/2) of RoPE frequency theta^(-2j/d) moves to
    the pair (rj, rj + D/2) of the same frequency in the new head size D = r d; the other dimensions
    get zero q/k/v rows and zero o_proj columns. Qwen3's per-head RMSNorm on q and k then divides by
    an RMS sqrt(r) smaller, and the attention scale is 1/sqrt(D) instead of 1/sqrt(d): the q-norm
    weights are kept (q grows by sqrt(r)) and the k-norm weights divided by sqrt(r), which restores
    every attention score exactly (up to the norms' eps). ``noise`` > 0 puts N(0, noise^2 x the rows'
    variance) in the new rows instead of zeros, so training can use them (zero q and k rows get no
    gradient from each other); the function then changes by O(noise^2).
    """
    cfg = model.config
    old = cfg.head_dim
    if head_dim % old or head_dim < old:
        raise ValueError(f"head_dim {head_dim} must be a multiple of the model's head_dim {old}")
    r = head_dim // old
    new_cfg = cfg.__class__.from_dict({**cfg.to_dict(), "head_dim": head_dim})
    new = Qwen3ForCausalLM(new_cfg)
    half_old, half_new = old // 2, head_dim // 2
    # old index o in one head -> new index (RoPE pairs keep their frequency)
    index = torch.tensor([r * o if o < half_old else r * (o - half_old) + half_new for o in range(old)])
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    out = {}
    with torch.no_grad():
        for name, tensor in new.state_dict().items():
            src = state[name]
            if src.shape == tensor.shape:
                out[name] = src.clone()
                continue
            leaf = name.rsplit(".", 2)[-2]
            if leaf in ("q_proj", "k_proj", "v_proj"):  # [heads * head_dim, hidden]
                heads = src.shape[0] // old
                dst = torch.randn(heads, head_dim, src.shape[1], generator=gen) * (noise * float(src.std()))
                dst[:, index] = src.reshape(heads, old, -1)
                out[name] = dst.reshape(heads * head_dim, -1)
            elif leaf == "o_proj":  # [hidden, heads * head_dim]
                heads = src.shape[1] // old
                dst = torch.randn(src.shape[0], heads, head_dim, generator=gen) * (noise * float(src.std()))
                dst[:, :, index] = src.reshape(src.shape[0], heads, old)
                out[name] = dst.reshape(src.shape[0], -1)
            elif leaf in ("q_norm", "k_norm"):  # [head_dim]
                dst = torch.ones(head_dim)
                dst[index] = src if leaf == "q_norm" else src / r**0.5
                out[name] = dst
            else:
                raise ValueError(f"widen_heads: unexpected shape change in {name}")
    new.load_state_dict(out)
    new.generation_config = model.generation_config
    return new.to(next(model.parameters()).device).eval()


def load_model(path: str | Path = BASE_MODEL_DIR, device: str | torch.device = "cpu") -> Qwen3ForCausalLM:
    """Load a saved tiny LM (or any local causal LM folder) in float32 on ``device``, in eval mode."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model at {path} (no config.json); make one with python -m recipe.gdro.lab.tinylm.sft"
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(path: str | Path = BASE_MODEL_DIR) -> PreTrainedTokenizerFast:
    """The tokenizer saved beside a model (``AutoTokenizer``, offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
