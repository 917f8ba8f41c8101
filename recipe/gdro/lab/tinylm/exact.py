"""The exact metric: the probability that a sampled response is exactly the canonical answer.

For a prompt x with canonical response y = ``Answer: 46<|end|>`` (tokens y_1..y_L, eos included),
sampling at temperature T draws y with probability

    P_T(y | x) = prod_{t=1..L} softmax(logits_t / T)[y_t],

where logits_t are the model's logits after x ‖ y_<t. This module computes it by one teacher-forced
forward per batch (no sampling, so no Monte-Carlo noise): the noise-free primary metric of issue 26
item 2. It is a lower bound on the sampled pass@1, since the scorer (verl's ``math_dapo``) may
accept other strings too (``Answer: 046`` is never produced in practice; a response that never
ends is cut at the response budget and scored on its text).

Prompts are rendered by :func:`recipe.gdro.lab.tinylm.tasks.prompt_ids` (the chat template, as the
sampler and verl's ``RLHFDataset`` see them) and laid out by :func:`policy.rollout_batch`; the
per-token log-probs are :func:`policy.response_log_probs`, the actor's own computation, so the
number here is the product of the log-probs a rollout of that response would carry.
``temperature == 0`` is greedy decoding: the probability is 1 if every canonical token is the
argmax, else 0.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from data_prep import arith
from recipe.gdro.lab.tinylm import policy
from recipe.gdro.lab.tinylm.tasks import prompt_ids

__all__ = ["answer_probability", "canonical_response_ids", "exact_by_skill", "mean_exact", "per_prompt", "skill_table"]


def canonical_response_ids(tokenizer, answer: str) -> list[int]:
    """Token ids of the canonical response to a prompt whose ground truth is ``answer`` (eos included)."""
    ids = tokenizer.encode(arith.response_text(answer), add_special_tokens=False)
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
        raise ValueError(f"answer {answer!r}: its response has characters outside the tokenizer's vocabulary")
    return list(ids) + [tokenizer.eos_token_id]


@torch.no_grad()
def answer_probability(
    model,
    tokenizer,
    prompts: list[str],
    answers: list[str],
    *,
    temperature: float = 1.0,
    batch_size: int = 256,
    device=None,
) -> np.ndarray:
    """Per prompt, P_T(canonical response | prompt) (float64 array, same order as ``prompts``).

    ``prompts`` are the user-turn contents (``"12+34="``), ``answers`` the ground truths (``"46"``,
    ``reward_model.ground_truth`` of a data_prep/arith.py row). ``device`` defaults to the model's;
    the model is used in eval mode and its mode is restored.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if device is not None:
        model = model.to(device)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = np.empty(len(prompts), dtype=np.float64)
    try:
        for start in range(0, len(prompts), batch_size):
            chunk_p = [prompt_ids(tokenizer, p) for p in prompts[start : start + batch_size]]
            chunk_r = [canonical_response_ids(tokenizer, str(a)) for a in answers[start : start + batch_size]]
            batch = policy.rollout_batch(chunk_p, [(r, [0.0] * len(r)) for r in chunk_r], tokenizer.pad_token_id)
            ids, mask, resp = (batch[k].to(device) for k in ("input_ids", "attention_mask", "responses"))
            rmask = batch["response_mask"].to(device).bool()
            if temperature == 0:
                logits = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=policy.position_ids_from_mask(mask),
                    use_cache=False,
                ).logits[:, -resp.shape[1] - 1 : -1, :]
                hit = (logits.argmax(-1) == resp) | ~rmask
                prob = hit.all(dim=1).double()
            else:
                logp = policy.response_log_probs(model, ids, mask, resp, temperature)
                prob = torch.exp((logp.double() * rmask).sum(dim=1))
            out[start : start + len(chunk_p)] = prob.cpu().numpy()
    finally:
        model.train(was_training)
    return out


def _rows(records: list[dict]) -> tuple[list[str], list[str], list[str]]:
    prompts = [r["prompt"][-1]["content"] for r in records]
    answers = [str(r["reward_model"]["ground_truth"]) for r in records]
    return prompts, answers, per_prompt_skills(records)


def per_prompt_skills(records: list[dict]) -> list[str]:
    """Each row's skill (``extra_info.skill``, else its ``data_source``)."""
    return [r.get("extra_info", {}).get("skill") or r["data_source"] for r in records]


def mean_exact(model, tokenizer, records: list[dict], *, temperature: float = 1.0, batch_size: int = 256) -> float:
    """Mean exact probability over data_prep/arith.py rows (``prompt``, ``reward_model.ground_truth``)."""
    prompts, answers, _ = _rows(records)
    return float(
        answer_probability(model, tokenizer, prompts, answers, temperature=temperature, batch_size=batch_size).mean()
    )


def exact_by_skill(
    model, tokenizer, records: list[dict], *, temperature: float = 1.0, batch_size: int = 256
) -> dict[str, dict[str, float]]:
    """``{skill: {"n", "exact", "frac_below_0.05"}}`` plus ``"all"`` (frequency-weighted over the rows).

    ``frac_below_0.05`` is the share of prompts the model (almost) never answers exactly: a dead
    skill has most of its prompts there.
    """
    prompts, answers, skills = _rows(records)
    p = answer_probability(model, tokenizer, prompts, answers, temperature=temperature, batch_size=batch_size)
    return skill_table(p, skills)


def per_prompt(
    model, tokenizer, records: list[dict], *, temperature: float = 1.0, batch_size: int = 256
) -> tuple[list[str], list[str], np.ndarray]:
    """``(prompt ids, skills, p)`` of data_prep/arith.py rows: each prompt's exact probability p_i
    (:func:`answer_probability`), keyed by its prompt text (``"12+34="``, unique within a split and
    the same in every split) and its skill. :func:`skill_table` of ``(p, skills)`` is
    :func:`exact_by_skill`."""
    prompts, answers, skills = _rows(records)
    p = answer_probability(model, tokenizer, prompts, answers, temperature=temperature, batch_size=batch_size)
    return prompts, skills, p


def skill_table(p, skills: list[str]) -> dict[str, dict[str, float]]:
    """:func:`exact_by_skill`'s table from per-prompt probabilities ``p`` and their ``skills``."""
    groups: dict[str, list[float]] = defaultdict(list)
    for skill, value in zip(skills, p, strict=True):
        groups[skill].append(value)
    order = [s.name for s in arith.SKILLS if s.name in groups] + sorted(set(groups) - set(arith.SKILL_BY_NAME))
    result = {}
    for key, values in [*((k, groups[k]) for k in order), ("all", list(p))]:
        v = np.asarray(values)
        result[key] = {"n": int(v.size), "exact": float(v.mean()), "frac_below_0.05": float((v < 0.05).mean())}
    return result


def temperature_sweep(
    model, tokenizer, records: list[dict], temperatures=(0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5)
) -> dict[str, object]:
    """The exact metric per skill at each temperature, and the temperature that maximises the mean.

    The base at its best decoding temperature is the baseline an RL gain must beat: sharpening the
    distribution by decoding colder already moves the exact metric, with no training at all.
    """
    tables = {float(t): exact_by_skill(model, tokenizer, records, temperature=float(t)) for t in temperatures}
    best = max(tables, key=lambda t: tables[t]["all"]["exact"])
    return {"tables": tables, "best_temperature": best, "best_exact": tables[best]["all"]["exact"]}


def main(argv=None) -> int:
    """``python -m recipe.gdro.lab.tinylm.exact [--model_path P] [--temperatures 0.3,...,1.5] [--num_val 1000]``."""
    import argparse
    import json
    import sys

    from recipe.gdro.lab.tinylm.model import BASE_MODEL_DIR, load_model, load_tokenizer
    from recipe.gdro.lab.tinylm.tasks import val_records

    p = argparse.ArgumentParser(description="The exact metric of a tiny LM per skill, over a temperature grid.")
    p.add_argument("--model_path", default=str(BASE_MODEL_DIR))
    p.add_argument("--temperatures", default="0.3,0.5,0.7,0.8,0.9,1.0,1.2,1.5")
    p.add_argument("--num_val", type=int, default=1000)
    p.add_argument("--out", default=None, help="also write the tables as JSON here")
    args = p.parse_args(argv)
    try:
        temps = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        print(f"error: --temperatures {args.temperatures!r} is not a comma-separated list of numbers", file=sys.stderr)
        return 2
    if not temps or any(t < 0 for t in temps):
        print(f"error: --temperatures {args.temperatures!r}: need numbers >= 0", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model, tok = load_model(args.model_path), load_tokenizer(args.model_path)
    sweep = temperature_sweep(model, tok, val_records(args.num_val, 0), temps)
    skills = list(next(iter(sweep["tables"].values())))
    print("T     " + " ".join(f"{s:>7}" for s in skills))
    for t, table in sweep["tables"].items():
        print(f"{t:<5} " + " ".join(f"{table[s]['exact']:>7.3f}" for s in skills))
    print(f"best temperature {sweep['best_temperature']}: exact {sweep['best_exact']:.4f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(sweep, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
