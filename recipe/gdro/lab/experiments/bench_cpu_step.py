"""Benchmark (not a test): one CPU-backend training step, split into its parts.

    python -m recipe.gdro.lab.experiments.bench_cpu_step [--steps 8] [--warmup 2] [--method rollout_gdro] [overrides]
    python -m recipe.gdro.lab.experiments.bench_cpu_step --compare [--rounds 2] ...  # verl's per-session path vs ours

Trains the shipped tiny base (recipe/gdro/lab/tinylm/base) on arithmetic data made on the fly
(``python -m data_prep.arith``) through ``gdro.backend=cpu`` -- verl's real v1 loop -- at 64 prompts x 4
rollouts, and prints the mean per-step wall time after ``--warmup`` steps, split into:

* generation: the rollout server sampling the tiny LM (``policy.sample``, batched);
* agent loop (verl): verl's ``AgentLoopWorkerTQ`` / ``SingleTurnAgentLoop`` per-session work around
  generation and reward (task start-up, chat template, TransferQueue puts of trajectories and tags);
* reward: verl's reward loop (``RewardLoopWorker.compute_score`` -> ``math_dapo``), summed over sessions;
* log-prob: old (and reference) log-probs; update: ``policy.ppo_update``; weight sync;
* GDRO: the recipe's driver work (``gdro/recipe/driver_ms``);
* verl driver: the rest of the step -- replay buffer, ``_balance_batch``, TransferQueue gets/puts,
  advantage, metrics.

``--compare`` runs, in one process and alternating ``--rounds`` times, the same training twice: as
before the speed-ups (verl's per-session agent-loop path unchanged -- ``CPUAgentLoopManager(
reuse_agent_loops=False, inline_executor=False)``: a new ``SingleTurnAgentLoop`` a session, thread-pool
hops -- and no ``gc.freeze``) and with the backend's defaults. It prints the two splits side by side,
their ratios, the load average after each run (the machine is shared: compare ratios) and whether
every run ended with the same weights (the speed-ups must not change a rollout).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

METHODS = {
    "grpo": [],
    "prompt_gdro": ["gdro.prompt.enable=true"],
    "rollout_gdro": ["gdro.rollout.enable=true"],
    "joint_gdro": ["gdro.prompt.enable=true", "gdro.rollout.enable=true"],
}


def make_data(folder: Path, num_train: int, num_val: int, seed: int = 0) -> tuple[Path, Path]:
    train, val = folder / "train.parquet", folder / "val.parquet"
    if not (train.exists() and val.exists()):
        from data_prep import arith

        argv = [f"--local_dir={folder}", f"--num_train={num_train}", f"--num_val={num_val}", f"--seed={seed}"]
        if arith.main(argv) != 0:
            raise SystemExit(2)
    return train, val


def tiny_overrides(train: Path, val: Path, out: Path, *, batch: int = 64, n: int = 4, steps: int = 10) -> list[str]:
    """The tiny CPU run's settings (the same as run_scripts/cpu_backend_tiny.sh's, without validation)."""
    from recipe.gdro.lab.tinylm.model import BASE_MODEL_DIR

    return [
        "gdro.backend=cpu",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=32",
        "data.max_response_length=16",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={BASE_MODEL_DIR}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // 2}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch // 2 * n}",
        "actor_rollout_ref.actor.optim.lr=3e-4",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "algorithm.use_kl_in_reward=false",
        "reward.custom_reward_function.path=pkg://data_prep.reward_fn",
        "reward.custom_reward_function.name=compute_score",
        "actor_rollout_ref.rollout.seed=0",
        "data.seed=0",
        "trainer.logger=[]",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={out}",
        "trainer.n_gpus_per_node=1",
        "gdro.binner.num_bins=6",
    ]


class StepTimer:
    """Trainer mixin: per-step wall time and the CPU stand-ins' counters, read at each step's metrics."""

    def on_step_begin(self):
        self._bench_t0 = time.perf_counter()
        return super().on_step_begin()

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        gdro_ms = metrics.get("gdro/recipe/driver_ms", 0.0)
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        wg, server, manager = self.actor_rollout_wg, self.cpu_server, self.agent_loop_manager
        now = {
            "generation": server.stats["generate_s"],
            "agent_loop_total": manager.generate_s,
            "reward": manager.reward.seconds,
            "log_prob": wg.timing["log_prob_s"] + wg.timing["ref_s"],
            "update": wg.timing["update_s"],
            "weight_sync": self.checkpoint_manager.sync_s,
            "tokens": float(server.stats["tokens"]),
        }
        prev = getattr(self, "_bench_prev", {k: 0.0 for k in now})
        row = {k: now[k] - prev[k] for k in now}
        self._bench_prev = now
        row["gdro"] = gdro_ms / 1000.0
        row["step"] = time.perf_counter() - self._bench_t0
        self.bench_rows = getattr(self, "bench_rows", []) + [row]


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def split(rows: list[dict], warmup: int) -> tuple[dict[str, float], dict[str, float]]:
    """(named parts in s/step, the means) over the steps after ``warmup``."""
    rows = rows[warmup:] or rows
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    mean["measured_steps"] = len(rows)
    agent = mean["agent_loop_total"] - mean["generation"] - mean["reward"]
    parts = {
        "generation": mean["generation"],
        "agent loop (verl, per session)": agent,
        "reward (verl reward loop)": mean["reward"],
        "log-prob (old/ref)": mean["log_prob"],
        "update (ppo_update)": mean["update"],
        "weight sync": mean["weight_sync"],
        "GDRO (recipe driver)": mean["gdro"],
    }
    parts["verl driver (TQ, replay buffer, balance, advantage, metrics)"] = mean["step"] - sum(parts.values())
    parts["step total"] = mean["step"]
    return parts, mean


def report(rows: list[dict], warmup: int) -> str:
    parts, mean = split(rows, warmup)
    step = parts["step total"]
    lines = [
        f"steps measured: {mean['measured_steps']} (after {warmup} warm-up); "
        f"generated tokens/step: {mean['tokens']:.0f}"
    ]
    for name, value in parts.items():
        share = "" if name == "step total" else f"  {100 * value / step:5.1f}%"
        lines.append(f"  {name:<62s} {value:7.3f} s{share}")
    model = parts["generation"] + parts["log-prob (old/ref)"] + parts["update (ppo_update)"]
    lines.append(f"  model work (generation + log-prob + update): {model:.3f} s; the rest {step - model:.3f} s")
    return "\n".join(lines)


def compare_report(results: dict[str, list[tuple[dict, tuple]]]) -> str:
    """Side by side: mean over rounds of each variant's parts, and the ratio before / after."""
    names = list(results)
    means = {}
    for name, runs in results.items():
        keys = runs[0][0].keys()
        means[name] = {k: sum(r[0][k] for r in runs) / len(runs) for k in keys}
    a, b = names
    lines = [f"  {'part (s / step)':<62s} {a:>8s} {b:>8s}  ratio"]
    for k in means[a]:
        va, vb = means[a][k], means[b][k]
        ratio = f"{va / vb:6.1f}x" if vb > 1e-3 else "     -"
        lines.append(f"  {k:<62s} {va:8.3f} {vb:8.3f} {ratio}")
    for name, runs in results.items():
        loads = ", ".join(f"{load[0]:.1f}" for _, load in runs)
        steps = ", ".join(f"{r['step total']:.2f}" for r, _ in runs)
        lines.append(f"  {name}: step s per round {steps}; 1-min load average at the end of each run {loads}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--method", choices=sorted(METHODS), default="rollout_gdro")
    p.add_argument("--data-dir", default=None, help="folder for the arithmetic parquet files (default: a temp dir)")
    p.add_argument("--compare", action="store_true", help="before vs after the speed-ups (module docstring)")
    p.add_argument("--rounds", type=int, default=1, help="with --compare: alternations of the two runs")
    args, overrides = p.parse_known_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_cpu_"))
    data_dir = Path(args.data_dir) if args.data_dir else work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    train, val = make_data(data_dir, 2000, 200)

    from recipe.gdro.lab.backends.cpu import prepare_cpu_config
    from recipe.gdro.startup.checks import prepare
    from recipe.gdro.startup.cli import compose_config
    from recipe.gdro.task_runner import run_cpu

    def run(options: dict, tag: str):  # options: run_cpu's keyword arguments
        config = compose_config(
            [*tiny_overrides(train, val, work / tag, steps=args.steps), *METHODS[args.method], *overrides]
        )
        prepare(prepare_cpu_config(config))
        trainer = run_cpu(config, trainer_mixins=(StepTimer,), **options)
        return trainer.bench_rows, os.getloadavg(), weights_digest(trainer.actor_rollout_wg.model)

    header = f"CPU backend step ({args.method}, 64 prompts x 4 rollouts)"
    if not args.compare:
        rows, load, _ = run({}, "run")
        print(f"\n{header}, load average {load[0]:.1f} / {load[1]:.1f}:")
        print(report(rows, args.warmup))
        return 0
    before = {"agent_loop_options": {"reuse_agent_loops": False, "inline_executor": False}, "freeze_gc": False}
    variants = {"before": before, "after": {}}
    results: dict[str, list] = {name: [] for name in variants}
    digests = set()
    for r in range(args.rounds):
        for name, options in variants.items():
            rows, load, digest = run(options, f"{name}{r}")
            results[name].append((split(rows, args.warmup)[0], load))
            digests.add(digest)
            print(f"\n{header}, {name} (round {r + 1}), load average {load[0]:.1f} / {load[1]:.1f}:")
            print(report(rows, args.warmup))
    print(f"\n{header}: before vs after the speed-ups, mean of {args.rounds} round(s):")
    print(compare_report(results))
    same = "identical" if len(digests) == 1 else "DIFFERENT"
    print(f"  final weights of all {2 * args.rounds} runs: {same} (sha256 {', '.join(sorted(digests))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
