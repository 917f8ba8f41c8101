"""Benchmark (not a test): the study's referee, the direct loop, split into its parts per step.

    python -m recipe.gdro.lab.experiments.bench_direct_step [--steps 30] [--rounds 2] [--method grpo]

Runs :func:`recipe.gdro.lab.experiments.direct.run_direct` at the study's shape (64 prompts x 4 rollouts,
2,048 training prompts, data seed 1, lr 1e-4, validation and test scored before and after only) on
one torch thread, twice a round, alternating: with the sampler's plain loop (``policy.sample(...,
plain=True)``: every row through every decode step, each prompt prefilled once per row) and with its
default (one prefill per distinct prompt, finished rows leave the decode batch). It prints each
variant's seconds per training step split into sampling, scoring, the rollout batch, the GRPO
advantage, the PPO update and the rest (controller, bookkeeping), the evaluations' seconds, the ratio
plain / default of each part (both variants run on the same machine in the same minutes: compare the
ratios, not the absolute figures of two runs) and whether the two variants ended with the same
numbers (every validation and test prompt's exact probability at every evaluation, and the last step's
metrics): the speed-up must not change a run.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import time
from collections import defaultdict

PARTS = (
    ("sample", "policy", "sample"),
    ("score", "tasks", "score_samples"),
    ("rollout batch", "policy", "rollout_batch"),
    ("advantage", None, "compute_grpo_outcome_advantage"),
    ("update", "policy", "ppo_update"),
    ("evaluation (sampled)", "tasks", "evaluate"),
    ("evaluation (exact)", "exact", "per_prompt"),
)
EVALUATION = ("evaluation (sampled)", "evaluation (exact)")


def timed_run(config, plain: bool) -> tuple[dict[str, float], str]:
    """One run of the direct loop with each part of ``PARTS`` timed: (seconds per part, the run's digest)."""
    from recipe.gdro.lab.experiments import direct

    seconds: dict[str, float] = defaultdict(float)
    depth = [0]
    saved = []
    for name, module, attr in PARTS:
        owner = getattr(direct, module) if module else direct
        original = getattr(owner, attr)
        target = functools.partial(original, plain=True) if plain and attr == "sample" else original

        def wrapper(*args, _target=target, _name=name, **kwargs):
            # only the outermost timed call counts (exact.per_prompt builds its batch with rollout_batch)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return _target(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    seconds[_name] += time.perf_counter() - t0

        saved.append((owner, attr, original))
        setattr(owner, attr, wrapper)
    if plain:  # the evaluations' sampling (tasks.evaluate holds its own reference to policy.sample)
        saved.append((direct.tasks, "sample", direct.tasks.sample))
        direct.tasks.sample = functools.partial(direct.tasks.sample, plain=True)
    try:
        t0 = time.perf_counter()
        result = direct.run_direct(config, log=lambda *_: None)
        seconds["total"] = time.perf_counter() - t0
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)
    seconds["train"] = result["train_seconds"]
    last = {k: v for k, v in result["history"][-1].items() if k != "time/step_s"}
    digest = hashlib.sha256(json.dumps([result["per_prompt"], last], sort_keys=True, default=float).encode())
    return dict(seconds), digest.hexdigest()[:16]


def per_step(seconds: dict[str, float], steps: int) -> dict[str, float]:
    """Seconds per training step of each part, the rest of the step, the step, and the evaluations (a run)."""
    rows = {name: seconds.get(name, 0.0) / steps for name, _, _ in PARTS if name not in EVALUATION}
    step = seconds["train"] / steps
    rows["rest (controller, bookkeeping)"] = step - sum(rows.values())
    rows["train step"] = step
    rows["evaluations (s per run)"] = sum(seconds.get(name, 0.0) for name in EVALUATION)
    rows["run total (s)"] = seconds["total"]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two variants")
    p.add_argument("--method", default="grpo")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.threads < 1:
        print("error: --steps, --rounds and --threads must be positive", file=sys.stderr)
        return 2
    import torch

    from recipe.gdro.lab.experiments.direct import DirectConfig

    torch.set_num_threads(args.threads)
    config = DirectConfig(
        steps=args.steps,
        prompts=64,
        n=4,
        lr=1e-4,
        num_train=2048,
        num_val=1000,
        num_test=500,
        data_seed=1,
        method=args.method,
    )
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "default": []}
    digests: dict[str, set[str]] = {"plain": set(), "default": set()}
    for _ in range(args.rounds):
        for name in runs:
            seconds, digest = timed_run(config, plain=name == "plain")
            runs[name].append(per_step(seconds, args.steps))
            digests[name].add(digest)
    mean = {name: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for name, rs in runs.items()}
    print(
        f"direct loop, {args.method}, 64 prompts x 4, {args.steps} steps, {args.threads} thread(s), "
        f"{args.rounds} round(s); load average {os.getloadavg()[0]:.2f}"
    )
    print(f"  {'part (s / step)':<34s} {'plain':>8s} {'default':>8s}  plain/default")
    for key in mean["plain"]:
        a, b = mean["plain"][key], mean["default"][key]
        ratio = f"{a / b:6.2f}x" if b > 1e-4 else "     -"
        print(f"  {key:<34s} {a:8.3f} {b:8.3f}  {ratio}")
    seen = sorted(digests["plain"] | digests["default"])
    same = len(seen) == 1
    print(f"  same numbers (every p_i, last step's metrics): {'yes' if same else 'NO'} ({', '.join(seen)})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
