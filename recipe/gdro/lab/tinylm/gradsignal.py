"""How much signal one GRPO step carries: the half-batch gradient cosine.

Usage (from the repository root)::

    python -m recipe.gdro.lab.tinylm.gradsignal --prompts 64 --n 4 --repeats 8      # the shipped base

One GRPO batch as ``recipe.gdro.lab.experiments.direct`` draws it (``--prompts`` training prompts x
``--n`` rollouts at ``--temperature``, scored by verl's ``math_dapo``, verl's
``compute_grpo_outcome_advantage``) is split into two random halves of whole prompt groups; each
half's policy gradient is the one :func:`policy.ppo_update` computes (verl's vanilla clipped loss,
token-mean over the half, on-policy so ratio 1), read off before the optimizer step. The cosine
between the two half-gradients estimates how much of a step is signal: two independent
estimates g + e1 and g + e2 of the true gradient g have cosine about |g|^2 / (|g|^2 + E|e|^2), so 0
means each step is noise and 1 that one half already points where the whole batch does. Doubling
the batch halves E|e|^2, so the cosine rises with batch size until the signal dominates.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from data_prep import arith
from recipe.gdro.lab.tinylm import policy, tasks
from recipe.gdro.lab.tinylm.model import BASE_MODEL_DIR, load_model, load_tokenizer

# size/tiny.yaml's actor (policy.tiny_actor_config), with no gradient clipping (the raw gradient) and no
# KL term (no reference model here)
ACTOR = policy.tiny_actor_config(use_kl_loss=False, optim={"clip_grad": 1e30})


class _Capture(torch.optim.Optimizer):
    """An "optimizer" whose step copies the gradient (flattened) instead of changing the weights."""

    def __init__(self, params):
        super().__init__(list(params), {"lr": 0.0})
        self.grad: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        ps = [p for g in self.param_groups for p in g["params"]]
        self.grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])


def policy_gradient(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """The flattened gradient of verl's PPO loss on ``batch`` (one mini-batch, weights unchanged)."""
    capture = _Capture(model.parameters())
    policy.ppo_update(
        model, capture, batch, actor_config=ACTOR, mini_batch_size=batch["input_ids"].shape[0], temperature=temperature
    )
    return capture.grad.clone()


def grpo_batch(model, tok, records: list[dict], prompt_rows: np.ndarray, n: int, temperature: float, generator):
    """A GRPO batch in verl's layout (``advantages`` set) and the per-response accuracy, as direct.py draws it."""
    pid = np.repeat(prompt_rows, n)
    prompts = [tasks.prompt_ids(tok, records[i]["prompt"][0]["content"]) for i in pid]
    out = policy.sample(
        model,
        prompts,
        max_new_tokens=tasks.MAX_RESPONSE_TOKENS,
        temperature=temperature,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        generator=generator,
    )
    acc = np.array(tasks.score_samples(tok, [records[i] for i in pid], out))
    batch = policy.rollout_batch(prompts, out, tok.pad_token_id)
    lengths = batch["response_mask"].sum(1)
    rewards = torch.zeros_like(batch["old_log_probs"])
    rewards[torch.arange(len(pid)), lengths - 1] = torch.as_tensor(np.where(acc, 1.0, -1.0), dtype=torch.float32)
    batch["advantages"], _ = compute_grpo_outcome_advantage(rewards, batch["response_mask"], index=pid)
    return batch, pid, acc


def half_batch_cosine(
    model,
    tok,
    records: list[dict],
    *,
    prompts: int = 64,
    n: int = 4,
    temperature: float = 1.0,
    repeats: int = 8,
    seed: int = 0,
) -> dict[str, float]:
    """Mean (and SD over ``repeats`` batches) of the cosine between the two halves' policy gradients.

    Also the share of responses with a non-zero advantage (the responses that carry any gradient).
    """
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    cosines, active, accs = [], [], []
    for _ in range(repeats):
        rows = rng.choice(len(records), size=prompts, replace=False)
        batch, pid, acc = grpo_batch(model, tok, records, rows, n, temperature, generator)
        halves = np.array_split(rng.permutation(rows), 2)
        grads = []
        for half in halves:
            keep = torch.as_tensor(np.isin(pid, half))
            grads.append(policy_gradient(model, {k: v[keep] for k, v in batch.items()}, temperature))
        g1, g2 = grads
        denom = float(g1.norm() * g2.norm())
        cosines.append(float(g1 @ g2) / denom if denom > 0 else float("nan"))
        active.append(float((batch["advantages"].abs().amax(1) > 0).float().mean()))
        accs.append(float(acc.mean()))
    c = np.asarray(cosines)
    return {
        "cosine_mean": float(np.nanmean(c)),
        "cosine_sd": float(np.nanstd(c, ddof=1)) if len(c) > 1 else float("nan"),
        "active_share": float(np.mean(active)),
        "train_acc": float(np.mean(accs)),
        "prompts": prompts,
        "n": n,
        "repeats": repeats,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_path", default=str(BASE_MODEL_DIR))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--num_train", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.prompts < 2 or args.n < 2 or args.repeats < 1 or not args.temperature > 0:
        print("error: --prompts and --n must be >= 2, --repeats >= 1, --temperature > 0", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model, tok = load_model(args.model_path), load_tokenizer(args.model_path)
    records = arith.build_split(args.num_train, 0, val=False)
    result = half_batch_cosine(
        model,
        tok,
        records,
        prompts=args.prompts,
        n=args.n,
        temperature=args.temperature,
        repeats=args.repeats,
        seed=args.seed,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
