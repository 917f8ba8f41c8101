"""Benchmark (not a test): does the shipped tiny base learn through the CPU backend, and as much as
through the direct loop the study uses?

    python -m recipe.gdro.lab.experiments.bench_learning [--steps 30] [--prompts 32] [--lr 1e-4]

Picks ``--prompts`` frontier training prompts (ones the base solves in 2..6 of 8 samples), then trains
GRPO on them for ``--steps`` steps of 16 prompts x 4 rollouts three ways: the CPU backend (verl's v1
loop) at ``--lr``, the CPU backend at lr 0 (a control that cannot learn), and the direct loop
(``experiments.direct``, no Ray) at ``--lr``. It prints each run's training-accuracy gain (mean of the
last 6 steps minus the first 6) and exits 1 when the backend or the direct loop fails to beat the
control by ``--margin``, or when the two differ by more than ``--agreement``.

The runs are deterministic for their seeds; each gain has a sampling SE of about 0.036, so the default
margin (0.08) is about 2.5 SE of a gain's noise. tests/gdro/lab/experiments/test_bench_learning.py runs
this code path for 2 steps (the learning itself needs tens of steps, too long for the suite).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

FRONTIER_TRIES = 8
FRONTIER_CHUNK = 128  # rows sampled at once while looking for frontier prompts
BATCH = 16


def frontier_prompts(base: Path, count: int, tries: int = FRONTIER_TRIES) -> list[dict]:
    """Training rows the model at ``base`` solves sometimes but not always (2..tries-2 of ``tries``
    samples at temperature 1), numbered 0..count-1; raises ValueError when 2,000 rows hold fewer."""
    import torch

    from data_prep import arith
    from recipe.gdro.lab.tinylm import model as tinylm
    from recipe.gdro.lab.tinylm import policy, tasks

    tok = tinylm.load_tokenizer(base)
    model = tinylm.load_model(base)
    rows = arith.build_split(2000, 0, val=False)
    generator = torch.Generator().manual_seed(0)
    picked: list[dict] = []
    for start in range(0, len(rows), FRONTIER_CHUNK):  # sampled a chunk at a time, until enough are found
        chunk = rows[start : start + FRONTIER_CHUNK]
        prompts = [tasks.prompt_ids(tok, r["prompt"][0]["content"]) for r in chunk]
        out = policy.sample(
            model,
            [p for p in prompts for _ in range(tries)],
            max_new_tokens=tasks.MAX_RESPONSE_TOKENS,
            temperature=1.0,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            generator=generator,
        )
        for i, row in enumerate(chunk):
            truth = row["reward_model"]["ground_truth"]
            texts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in out[i * tries : (i + 1) * tries]]
            if 2 <= sum(tasks.score(row["data_source"], text, truth) for text in texts) <= tries - 2:
                picked.append(row)
        if len(picked) >= count:
            picked = picked[:count]
            break
    if len(picked) < count:
        raise ValueError(f"only {len(picked)} frontier prompts among 2000 (asked for {count})")
    for k, row in enumerate(picked):
        row["extra_info"]["index"] = k
    return picked


class RewardLog:
    """Trainer mixin: verl's per-step mean training score (critic/score/mean)."""

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        self.scores = getattr(self, "scores", []) + [float(metrics["critic/score/mean"])]


def gain(accuracy) -> float:
    """Mean of the last 6 steps' training accuracy minus the first 6 (fewer when the run is shorter)."""
    acc = np.asarray(accuracy, dtype=float)
    k = min(6, len(acc) // 2) or 1
    return float(acc[-k:].mean() - acc[:k].mean())


def backend_run(train: Path, out: Path, *, steps: int, lr: float):
    """GRPO on ``train`` through ``gdro.backend=cpu``; returns the trainer (``scores``: per-step score)."""
    from recipe.gdro.lab.backends.cpu import prepare_cpu_config
    from recipe.gdro.lab.experiments.bench_cpu_step import tiny_overrides
    from recipe.gdro.startup.checks import prepare
    from recipe.gdro.startup.cli import compose_config
    from recipe.gdro.task_runner import run_cpu

    config = compose_config(
        [
            *tiny_overrides(train, train, out, batch=BATCH, n=4, steps=steps),
            f"actor_rollout_ref.actor.optim.lr={lr}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",  # one optimizer step per training step
        ]
    )
    prepare(prepare_cpu_config(config))
    return run_cpu(config, trainer_mixins=(RewardLog,))


def learning_gains(work: Path, *, steps: int, prompts: int, lr: float) -> dict:
    """The three runs of the module docstring: their gains, and the two backend runs' trainers."""
    import pyarrow as pa

    from data_prep.common import write_parquet_atomic
    from recipe.gdro.lab.experiments.direct import run_direct
    from recipe.gdro.lab.tinylm.model import BASE_MODEL_DIR

    train = work / "frontier.parquet"
    write_parquet_atomic(pa.Table.from_pylist(frontier_prompts(BASE_MODEL_DIR, prompts)), train)
    result = {"gains": {}, "trainers": {}}
    for name, rate in (("backend", lr), ("backend_lr0", 0.0)):
        trainer = backend_run(train, work / name, steps=steps, lr=rate)
        result["trainers"][name] = trainer
        result["gains"][name] = gain((np.asarray(trainer.scores) + 1) / 2)  # math_dapo: +1 correct, -1 wrong
    direct = run_direct(
        {"train_file": str(train), "prompts": BATCH, "n": 4, "steps": steps, "lr": lr, "num_val": 12},
        log=lambda *_: None,
    )
    result["gains"]["direct"] = gain([h["train/acc"] for h in direct["history"]])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--margin", type=float, default=0.08, help="gain over the lr-0 control each run must beat")
    p.add_argument("--agreement", type=float, default=0.12, help="largest backend-direct gain difference")
    args = p.parse_args(argv)
    gains = learning_gains(
        Path(tempfile.mkdtemp(prefix="bench_learning_")), steps=args.steps, prompts=args.prompts, lr=args.lr
    )["gains"]
    print(f"training accuracy gain (last 6 - first 6 of {args.steps} steps):")
    for name, value in gains.items():
        print(f"  {name:<12s} {value:+.3f}")
    ok = (
        gains["backend"] - gains["backend_lr0"] > args.margin
        and gains["direct"] - gains["backend_lr0"] > args.margin
        and abs(gains["backend"] - gains["direct"]) < args.agreement
    )
    print("learns: yes" if ok else "learns: NO (see the margins in the module docstring)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
