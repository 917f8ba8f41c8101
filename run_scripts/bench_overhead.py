"""Driver-side cost of GDRO next to verl's own GRPO advantage computation.

    python run_scripts/bench_overhead.py --json

One GDRO step is everything the recipe adds on the driver per training step: Rollout-GDRO's
allocation (``schedule``), the binner update and Prompt-GDRO weights (``observe``), scaling the
(responses × tokens) advantage tensor by the weights, and the metrics dict. It is timed side by
side with ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`` on the same batch
(default: 512 prompts, mean 8 rollouts = 4096 responses, 4096 response tokens), alternating the
two in one loop and reporting medians, so machine noise hits both alike.

``scale_1m_over_14k`` is the GDRO step time with a 1,000,000-prompt dataset over a
14,116-prompt one (DAPO-14.1k): the controllers' state is dense arrays indexed by prompt id, and
a step touches only the batch's rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl_ext import GDROController, gdro_config_from_dict


def make_controller(num_prompts: int, n_mean: int, allocator: str, warm_steps: int, batch: int, seed: int) -> GDROController:
    cfg = gdro_config_from_dict(
        {
            "prompt": {"enable": True},
            "rollout": {"enable": True, "allocator": allocator, "n_mean": n_mean, "n_min": 2, "n_max": 3 * n_mean},
        }
    )
    ctl = GDROController(cfg, num_prompts)
    rng = np.random.default_rng(seed)
    p_true = rng.beta(0.6, 0.6, size=num_prompts)
    for _ in range(warm_steps):  # populate the bins so every code path is exercised
        ids = rng.choice(num_prompts, batch, replace=False)
        n = ctl.schedule(ids)
        rp = np.repeat(ids, n)
        ctl.observe(rp, rng.random(len(rp)) < p_true[rp])
    return ctl


def gdro_step(ctl: GDROController, ids: np.ndarray, acc_draw: np.ndarray, p_true: np.ndarray, advantages: torch.Tensor):
    n = ctl.schedule(ids)
    rp = np.repeat(ids, n)
    acc = acc_draw[: len(rp)] < p_true[rp]
    mult = ctl.observe(rp, acc)
    adv = advantages[: len(rp)]
    adv.mul_(torch.from_numpy(mult).to(adv.dtype).unsqueeze(-1))
    ctl.metrics()


def time_gdro(ctl, num_prompts, batch, responses, tokens, repeats, seed):
    rng = np.random.default_rng(seed + 1)
    p_true = rng.beta(0.6, 0.6, size=num_prompts)
    adv = torch.zeros(responses + 3 * batch * 8, tokens)  # room for any realised total
    times = []
    for _ in range(repeats):
        ids = rng.choice(num_prompts, batch, replace=False)
        draw = rng.random(adv.shape[0])
        t0 = time.perf_counter()
        gdro_step(ctl, ids, draw, p_true, adv)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n-mean", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--allocator", default="sqrt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    B, n_mean, T = args.prompts, args.n_mean, args.tokens
    R = B * n_mean
    torch.manual_seed(args.seed)
    gen = np.random.default_rng(args.seed)

    # verl's GRPO on a batch with R responses in groups of n_mean and right-padded masks.
    scores = (torch.rand(R) < 0.4).float()
    lengths = torch.randint(1, T + 1, (R,))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(R, T)
    rewards[torch.arange(R), lengths - 1] = scores
    uid = np.repeat(np.array([f"u{i}" for i in range(B)], dtype=object), n_mean)

    ctl_14k = make_controller(14_116, n_mean, args.allocator, 20, B, args.seed)
    ctl_1m = make_controller(1_000_000, n_mean, args.allocator, 20, B, args.seed)

    grpo_t, gdro_t, t14k, t1m = [], [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        compute_grpo_outcome_advantage(rewards, mask, uid)
        grpo_t.append(time.perf_counter() - t0)
        gdro_t += time_gdro(ctl_14k, 14_116, B, R, T, 1, int(gen.integers(1 << 30)))
        t14k += time_gdro(ctl_14k, 14_116, B, R, T, 1, int(gen.integers(1 << 30)))
        t1m += time_gdro(ctl_1m, 1_000_000, B, R, T, 1, int(gen.integers(1 << 30)))

    med = statistics.median
    result = {
        "batch_prompts": B,
        "mean_rollouts": n_mean,
        "response_tokens": T,
        "allocator": args.allocator,
        "repeats": args.repeats,
        "grpo_advantage_s": med(grpo_t),
        "gdro_step_s": med(gdro_t),
        "gdro_over_grpo": med(gdro_t) / med(grpo_t),
        "gdro_step_14k_s": med(t14k),
        "gdro_step_1m_s": med(t1m),
        "scale_1m_over_14k": med(t1m) / med(t14k),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>20}: {v:.4g}" if isinstance(v, float) else f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
