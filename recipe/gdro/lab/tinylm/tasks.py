"""The arithmetic task family as the tiny LM sees it: token ids, scoring, per-skill evaluation.

Prompts are rendered with the tokenizer's chat template (what verl's ``RLHFDataset`` does) and
responses are scored by ``data_prep.reward_fn.compute_score`` (verl's ``math_dapo``), so numbers
measured here are the ones a verl run reports as ``val-core/arith_<skill>/acc``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from data_prep import arith
from data_prep.reward_fn import compute_score
from recipe.gdro.lab.tinylm.policy import sample

# Response budget (tokens, eos included): "Answer: " + up to 5 digits + eos is 14.
MAX_RESPONSE_TOKENS = 16


def prompt_ids(tokenizer, content: str) -> list[int]:
    """Token ids of a one-turn chat prompt, exactly as verl renders it (generation prompt added)."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def score(data_source: str, text: str, ground_truth: str) -> bool:
    """Whether a decoded response is correct, by the reward function verl would call."""
    result = compute_score(data_source, text, ground_truth)
    return bool(result["acc"]) if isinstance(result, dict) else result > 0


def score_samples(tok, records: list[dict], samples) -> list[bool]:
    """Whether each sampled ``(response_ids, log_probs)`` is correct for its record (``score``)."""
    return [
        score(rec["data_source"], tok.decode(r, skip_special_tokens=True), rec["reward_model"]["ground_truth"])
        for rec, (r, _) in zip(records, samples, strict=True)
    ]


def val_records(num_val: int = 1000, seed: int = 0) -> list[dict]:
    """The validation rows ``data_prep/arith.py --seed S --num_val M`` writes (same order)."""
    return arith.build_split(num_val, seed, val=True)


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    records: list[dict],
    *,
    samples: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = MAX_RESPONSE_TOKENS,
    seed: int = 0,
    batch_size: int = 512,
) -> dict[str, dict[str, Any]]:
    """Per-skill pass@1 (mean accuracy over ``samples`` draws per prompt) and response lengths.

    Returns ``{skill: {"n", "pass1", "mean_len", "mean_len_correct", "mean_len_wrong"}}`` plus an
    ``"all"`` entry (frequency-weighted over the given rows). Lengths are in tokens, eos included.
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    prompts = [prompt_ids(tokenizer, r["prompt"][0]["content"]) for r in records]
    jobs = [(i, p) for i, p in enumerate(prompts) for _ in range(samples)]
    stats: dict[str, dict[str, list]] = defaultdict(lambda: {"acc": [], "len": []})
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        out = sample(
            model,
            [p for _, p in chunk],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=generator,
        )
        for (i, _), (ids, _) in zip(chunk, out, strict=True):
            rec = records[i]
            ok = score(
                rec["data_source"], tokenizer.decode(ids, skip_special_tokens=True), rec["reward_model"]["ground_truth"]
            )
            for key in (rec["extra_info"]["skill"], "all"):
                stats[key]["acc"].append(ok)
                stats[key]["len"].append(len(ids))
    result = {}
    order = [s.name for s in arith.SKILLS if s.name in stats] + ["all"]
    for key in order:
        acc, lens = stats[key]["acc"], stats[key]["len"]
        right = [n for n, a in zip(lens, acc, strict=True) if a]
        wrong = [n for n, a in zip(lens, acc, strict=True) if not a]
        result[key] = {
            "n": len(acc) // samples,
            "pass1": sum(acc) / len(acc),
            "mean_len": sum(lens) / len(lens),
            "mean_len_correct": sum(right) / len(right) if right else float("nan"),
            "mean_len_wrong": sum(wrong) / len(wrong) if wrong else float("nan"),
        }
    return result


def format_table(result: dict[str, dict[str, Any]]) -> str:
    """The per-skill table the CLIs print."""
    lines = [f"{'skill':<8} {'n':>5} {'pass@1':>7} {'len':>5} {'len ok':>7} {'len wrong':>9}"]
    for key, r in result.items():
        lines.append(
            f"{key:<8} {r['n']:>5} {r['pass1']:>7.3f} {r['mean_len']:>5.1f} "
            f"{r['mean_len_correct']:>7.1f} {r['mean_len_wrong']:>9.1f}"
        )
    return "\n".join(lines)
