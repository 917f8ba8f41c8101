"""A vLLM-CPU-servable copy of the tiny LM's base (docs/real_path.md).

vLLM's CPU attention takes head sizes 32, 64, 80, 96, ... only (vllm/v1/attention/backends/cpu_attn.py);
a base whose ``head_dim`` it takes is used as it is. A smaller head (the base shipped before the
retrained one has 16) is widened to 32 by an exact zero-padded copy: same function, same tokenizer.

The copy: for each attention head, the original query/key dimension ``i`` of ``d`` goes to
dimension ``2i`` (``i < d/2``) or ``2(i - d/2) + D/2`` (``i >= d/2``) of ``D``, where RoPE rotates it
with exactly the original frequency ``theta^(-2i/d)`` (RoPE pairs dimension ``j`` with ``j + D/2`` at
frequency ``theta^(-2j/D)``); the other query/key dimensions, their ``q_norm``/``k_norm`` weights and
the padded value dimensions (and ``o_proj``'s matching input columns) are zero. Qwen3's RMSNorm over
``D`` dimensions of which only ``d`` are non-zero scales each of q and k by ``sqrt(D/d)`` and the
attention scale ``D^-1/2`` replaces ``d^-1/2``; both are undone by multiplying the ``q_norm`` and
``k_norm`` weights by ``(d/D)^(1/4)``: q.k grows by ``D/d``, the scale by ``sqrt(d/D)``, and the two
weights by ``sqrt(d/D)``, a product of 1. Logits agree
with the original up to the norms' epsilon (tests/gdro/backends/test_cpu_platform.py measures it).

    python -m recipe.gdro.lab.backends.cpu_platform_model OUT_DIR     # prints the servable base's path
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def shipped_base() -> Path:
    from recipe.gdro.lab.tinylm import BASE_MODEL_DIR

    return Path(BASE_MODEL_DIR)


def head_dim(model_dir: Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _target_head(d: int) -> int:
    for size in VLLM_CPU_HEAD_SIZES:
        if size >= d:
            return size
    raise ValueError(f"head_dim {d} is larger than vLLM-CPU's largest head size {VLLM_CPU_HEAD_SIZES[-1]}")


def pad_heads(src: Path, dst: Path, new_head: int | None = None) -> Path:
    """Write to ``dst`` a copy of the Qwen3 model at ``src`` with ``head_dim`` ``new_head`` (the module docstring)."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "qwen3":
        raise ValueError(f"{src}: model_type {cfg.get('model_type')!r}; only qwen3 heads are padded")
    d = head_dim(src)
    big = _target_head(d) if new_head is None else int(new_head)
    if big < d or big % 2 or d % 2:
        raise ValueError(f"cannot pad head_dim {d} to {big}")
    n_q, n_kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    half = d // 2
    index = torch.tensor([2 * i if i < half else 2 * (i - half) + big // 2 for i in range(d)])
    norm_scale = (d / big) ** 0.25
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in state.items():
        leaf = name.rsplit(".", 2)
        kind = ".".join(leaf[-2:])
        if kind in ("q_proj.weight", "k_proj.weight"):
            heads = n_q if kind.startswith("q") else n_kv
            w3 = w.reshape(heads, d, -1)
            new = torch.zeros(heads, big, w3.shape[-1], dtype=w.dtype)
            new[:, index, :] = w3
            out[name] = new.reshape(heads * big, -1)
        elif kind in ("q_norm.weight", "k_norm.weight"):
            new = torch.zeros(big, dtype=w.dtype)
            new[index] = w * norm_scale
            out[name] = new
        elif kind == "v_proj.weight":
            w3 = w.reshape(n_kv, d, -1)
            new = torch.zeros(n_kv, big, w3.shape[-1], dtype=w.dtype)
            new[:, :d, :] = w3
            out[name] = new.reshape(n_kv * big, -1)
        elif kind == "o_proj.weight":
            w3 = w.reshape(w.shape[0], n_q, d)
            new = torch.zeros(w.shape[0], n_q, big, dtype=w.dtype)
            new[:, :, :d] = w3
            out[name] = new.reshape(w.shape[0], n_q * big)
        elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            raise ValueError(f"{src}: attention biases are not padded ({name})")
        else:
            out[name] = w
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, dst / f.name)
    cfg["head_dim"] = big
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "PADDED_FROM").write_text(f"{src} head_dim {d} -> {big} (recipe/gdro/lab/backends/cpu_platform_model.py)\n")
    return dst


def servable_base(out_dir: Path) -> Path:
    """The shipped base when vLLM-CPU takes its head size, else its padded copy in ``out_dir`` (reused
    when it was padded from the same base file)."""
    base = shipped_base()
    if head_dim(base) in VLLM_CPU_HEAD_SIZES:
        return base
    out_dir = Path(out_dir)
    stamp = out_dir / "PADDED_FROM"
    src_size = (base / "model.safetensors").stat().st_size
    key = f"{base} {src_size} {(base / 'model.safetensors').stat().st_mtime_ns}"
    if stamp.exists() and (out_dir / "KEY").exists() and (out_dir / "KEY").read_text() == key:
        return out_dir
    pad_heads(base, out_dir)
    (out_dir / "KEY").write_text(key)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m recipe.gdro.lab.backends.cpu_platform_model OUT_DIR")
    print(servable_base(Path(sys.argv[1])))
