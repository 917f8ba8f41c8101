"""Driver-side cost of GDRO: the controller alone, and the recipe's real trainer overrides.

    python -m recipe.gdro.lab.experiments.bench_overhead --json

Two measurements, side by side in one run (default shape: 512 prompts, mean 8 rollouts = 4096
responses, response lengths uniform in 1..4096 tokens, so verl's padded width is 4096):

**Controller** (``gdro_over_grpo``, ``scale_1m_over_14k``): one GDRO controller step (Rollout-GDRO's
``schedule``, ``observe`` with the Prompt-GDRO weights, scaling a responses x tokens advantage tensor,
``metrics``) over ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`` on the same batch.
``scale_1m_over_14k`` is the controller step with a 1,000,000-prompt dataset over a 14,116-prompt one
(DAPO-14.1k): the state is dense arrays indexed by prompt id and a step touches only the batch's rows.

**Recipe** (``recipe_over_grpo``): the three driver methods the recipe overrides, run for real --
``_next_train_batch``, ``_compute_advantage`` (verl's GRPO advantage stage, with Prompt-GDRO's weights
applied inside it) and ``_compute_metrics`` (verl's data metrics + the GDRO JSONL line) -- of
``recipe.gdro.trainer.GDROTrainerSync`` against plain verl ``PPOTrainerSync`` doing the same steps.
Only two things are replaced, identically for every variant: TransferQueue's ``kv_batch_get`` /
``kv_batch_put`` by :class:`InProcessStore` (a dict of per-row tensors that assembles jagged nested
tensors on a get, as TransferQueue returns them), and verl's dataloader fetch by a synthetic batch of
prompt ids. Generation is simulated between the methods, untimed: each prompt gets its scheduled
number of responses (``__rollout_n__`` with Rollout-GDRO, n̄ otherwise), with a deterministic outcome
and length per (prompt, session, step), and the reward's ``acc`` in ``extra_fields``.

``recipe_over_grpo[variant]`` is the median over steps of ``T_variant / T_plain - 1``, T the summed
process CPU time (``time.process_time``) of the three methods in that step, paired with plain verl's
same step (same prompts, same outcomes; Rollout-GDRO changes only how the same total of responses is
spread). ``recipe_over_grpo_wall`` is the same with wall time, which a shared machine makes noisy;
``recipe_driver_over_grpo`` is the recipe's own timer (``gdro/recipe/driver_ms``: uid map, group-size
check, the ``extra_fields`` get, the controller, the scaling) over plain verl's wall time. Variants run
interleaved step by step (plain, observe, prompt, rollout, joint, plain, ...) after untimed warm-up
steps, with Python's GC collected before and paused during each timed method, and torch limited to
one intra-op thread (``--threads``). With an
in-process store verl's own transport cost (a real TransferQueue get+put of the advantages took
~2.3 s at this shape) is NOT in T_plain, so the ratio here is an upper bound of the real one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import uuid
from contextlib import contextmanager

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from verl_ext import GDROController, gdro_config_from_dict

N_14K = 14_116
VARIANTS = {
    "plain": None,  # verl's PPOTrainerSync
    "observe": [],  # GDROTrainerSync, both adversaries off (binner observes)
    "prompt": ["gdro.prompt.enable=true"],
    "rollout": ["gdro.rollout.enable=true"],
    "joint": ["gdro.prompt.enable=true", "gdro.rollout.enable=true"],
}


# ------------------------------------------------------------------------------------ controller alone
def make_controller(num_prompts: int, n_mean: int, allocator: str, warm_steps: int, batch: int, seed: int):
    cfg = gdro_config_from_dict(
        {
            "prompt": {"enable": True},
            "rollout": {"enable": True, "allocator": allocator, "n_mean": n_mean},  # n_max: 3·n̄ by default
        }
    )
    ctl = GDROController(cfg, num_prompts)
    rng = np.random.default_rng(seed)
    p_true = rng.beta(0.6, 0.6, size=num_prompts)
    for _ in range(warm_steps):  # populate the bins so every code path is exercised
        ids = rng.choice(num_prompts, batch, replace=False)
        n = ctl.schedule(ids)
        rp = np.repeat(ids, n)
        ctl.observe(rp, rng.random(len(rp)) < p_true[rp], np.abs(rng.standard_normal(len(rp))))
    return ctl


def gdro_step(ctl, ids, acc_draw, p_true, advantages: torch.Tensor):
    n = ctl.schedule(ids)
    rp = np.repeat(ids, n)
    acc = acc_draw[: len(rp)] < p_true[rp]
    mult = ctl.observe(rp, acc, np.ones(len(rp)))
    adv = advantages[: len(rp)]
    adv.mul_(torch.from_numpy(mult).to(adv.dtype).unsqueeze(-1))
    ctl.metrics()


def time_gdro(ctl, num_prompts, batch, responses, tokens, seed, adv):
    rng = np.random.default_rng(seed + 1)
    p_true = rng.beta(0.6, 0.6, size=num_prompts)
    ids = rng.choice(num_prompts, batch, replace=False)
    draw = rng.random(adv.shape[0])
    t0 = time.perf_counter()
    gdro_step(ctl, ids, draw, p_true, adv)
    return time.perf_counter() - t0


def bench_controller(B: int, n_mean: int, T: int, repeats: int, allocator: str, seed: int) -> dict:
    R = B * n_mean
    torch.manual_seed(seed)
    gen = np.random.default_rng(seed)
    scores = (torch.rand(R) < 0.4).float()
    lengths = torch.randint(1, T + 1, (R,))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(R, T)
    rewards[torch.arange(R), lengths - 1] = scores
    uid = np.repeat(np.array([f"u{i}" for i in range(B)], dtype=object), n_mean)
    adv = torch.zeros(B * 3 * n_mean, T)  # room for any realised total
    ctl_14k = make_controller(N_14K, n_mean, allocator, 20, B, seed)
    ctl_1m = make_controller(1_000_000, n_mean, allocator, 20, B, seed)
    grpo_t, t14k, t1m = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compute_grpo_outcome_advantage(rewards, mask, uid)
        grpo_t.append(time.perf_counter() - t0)
        t14k.append(time_gdro(ctl_14k, N_14K, B, R, T, int(gen.integers(1 << 30)), adv))
        t1m.append(time_gdro(ctl_1m, 1_000_000, B, R, T, int(gen.integers(1 << 30)), adv))
    med = statistics.median
    return {
        "grpo_advantage_s": med(grpo_t),
        "gdro_step_s": med(t14k),
        "gdro_over_grpo": med(t14k) / med(grpo_t),
        "gdro_step_14k_s": med(t14k),
        "gdro_step_1m_s": med(t1m),
        "scale_1m_over_14k": med(t1m) / med(t14k),
    }


# ------------------------------------------------------------------------------------ recipe methods
class InProcessStore:
    """TransferQueue's ``kv_batch_get`` / ``kv_batch_put`` over a dict (bench only).

    Rows are stored per key and field: variable-length tensors come back as jagged nested tensors,
    equal-shape tensors stacked, anything else as a ``NonTensorStack`` -- the types verl and the recipe
    read from a real TransferQueue. A field absent for the requested keys is left out of the result.
    """

    def __init__(self):
        self.rows: dict[tuple[str, str], dict] = {}
        self.tags: dict[tuple[str, str], dict] = {}
        self.puts: list[tuple[str, ...]] = []

    def put_rows(self, partition_id: str, keys, columns: dict[str, list], tags: list[dict]):
        for i, key in enumerate(keys):
            self.rows[(partition_id, key)] = {name: values[i] for name, values in columns.items()}
            self.tags[(partition_id, key)] = dict(tags[i])

    def kv_batch_put(self, keys, partition_id=None, fields=None, tags=None):
        from tensordict import NonTensorStack
        from transfer_queue import KVBatchMeta

        keys = list(keys)
        if fields is not None:
            self.puts.append(tuple(fields.keys()))
            for name in fields.keys():
                col = fields.get(name)
                if isinstance(col, NonTensorStack):
                    values = col.tolist()
                else:
                    values = col.unbind(0)
                for key, value in zip(keys, values, strict=True):
                    self.rows.setdefault((partition_id, key), {})[name] = value
        if tags is not None:
            for key, tag in zip(keys, tags, strict=True):
                self.tags[(partition_id, key)] = dict(tag)
        return KVBatchMeta(
            keys=keys, tags=[self.tags.get((partition_id, k), {}) for k in keys], partition_id=partition_id
        )

    def kv_batch_get(self, keys, partition_id=None, select_fields=None):
        from tensordict import NonTensorData, NonTensorStack, TensorDict

        keys = list(keys)
        rows = [self.rows[(partition_id, k)] for k in keys]
        names = select_fields if select_fields is not None else list(rows[0]) if rows else []
        out = {}
        for name in names:
            values = [r.get(name) for r in rows]
            if any(v is None for v in values):
                continue
            if all(isinstance(v, torch.Tensor) for v in values):
                shapes = {tuple(v.shape) for v in values}
                if len(shapes) == 1 and values[0].dim() == 0:
                    out[name] = torch.stack(values)
                else:
                    out[name] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
            else:
                out[name] = NonTensorStack.from_list([NonTensorData(v) for v in values])
        return TensorDict(out, batch_size=len(keys))

    def clear(self):
        self.rows.clear()
        self.tags.clear()


@contextmanager
def patched_transport(store: InProcessStore):
    import transfer_queue as tq

    saved = tq.kv_batch_get, tq.kv_batch_put
    tq.kv_batch_get, tq.kv_batch_put = store.kv_batch_get, store.kv_batch_put
    try:
        yield
    finally:
        tq.kv_batch_get, tq.kv_batch_put = saved


def bench_config(variant_overrides: list[str], B: int, n_mean: int, T: int, out_dir: str):
    from omegaconf import OmegaConf

    from recipe.gdro.startup.cli import compose_config

    config = compose_config(
        [
            "data.train_files=[/nonexistent/train.parquet]",
            "data.val_files=[/nonexistent/val.parquet]",
            f"data.train_batch_size={B}",
            f"data.max_response_length={T}",
            "actor_rollout_ref.model.path=/nonexistent/model",
            f"actor_rollout_ref.rollout.n={n_mean}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={B}",
            f"trainer.default_local_dir={out_dir}",
            "trainer.device=cpu",
            *variant_overrides,
        ]
    )
    OmegaConf.resolve(config)
    return config


def make_trainer(variant: str, B: int, n_mean: int, T: int, out_dir: str, seed: int):
    """A real verl / recipe trainer object; only the dataloader fetch is synthetic (same for all)."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1 import PPOTrainerSync
    from verl.utils import tensordict_utils as tu

    from recipe.gdro.trainer import GDROTrainerSync

    overrides = VARIANTS[variant]
    base = PPOTrainerSync if overrides is None else GDROTrainerSync

    class Bench(base):
        def _fetch_one_gen_batch(self):
            rng = np.random.default_rng([seed, int(self.global_steps)])
            ids = rng.choice(N_14K, self.config.data.train_batch_size, replace=False)
            batch = {
                "index": ids.astype(np.int64),
                "raw_prompt": np.array([[{"role": "user", "content": f"p{i}"}] for i in ids], dtype=object),
                "uid": np.array([str(uuid.uuid4()) for _ in ids], dtype=object),
            }
            return tu.get_tensordict(batch)

    folder = os.path.join(out_dir, variant)
    trainer = Bench(bench_config(overrides or [], B, n_mean, T, folder))
    trainer.resource_pool_manager = SimpleNamespace(get_n_gpus=lambda: 8)
    trainer.global_steps = 1
    if overrides is not None and trainer.gdro_runs:
        trainer.gdro = GDROController(trainer.gdro_config, N_14K)  # what _init_dataloader builds
    return trainer


def simulate_rollout(store: InProcessStore, batch, n_mean: int, T: int, step: int, p_true: np.ndarray):
    """Untimed: the responses of a step into the store, as verl's agent loop writes them."""
    from transfer_queue import KVBatchMeta

    uids = [str(u) for u in list(batch["uid"])]
    ids = [int(i) for i in list(batch["index"])]
    counts = [int(n) for n in list(batch["__rollout_n__"])] if "__rollout_n__" in batch.keys() else [n_mean] * len(ids)
    keys, cols, tags = (
        [],
        {k: [] for k in ("prompts", "responses", "response_mask", "rm_scores", "num_turns", "uid", "extra_fields")},
        [],
    )
    for uid, pid, n in zip(uids, ids, counts, strict=True):
        for s in range(n):
            rng = np.random.default_rng([pid, s, step])
            length = int(rng.integers(1, T + 1)) if s else T  # every group has a full-length response
            correct = bool(rng.random() < p_true[pid])
            keys.append(f"{uid}_{s}_0")
            cols["prompts"].append(torch.ones(64, dtype=torch.int64))
            cols["responses"].append(torch.ones(length, dtype=torch.int64))
            cols["response_mask"].append(torch.ones(length, dtype=torch.int64))
            score = torch.zeros(length, dtype=torch.float32)
            score[-1] = 1.0 if correct else -1.0
            cols["rm_scores"].append(score)
            cols["num_turns"].append(2)
            cols["uid"].append(uid)
            cols["extra_fields"].append({"reward_extra_info": {"acc": correct, "score": float(score[-1])}})
            tags.append(
                {"status": "success", "global_steps": step, "min_global_steps": step - 1, "max_global_steps": step - 1}
            )
    store.put_rows("train", keys, cols, tags)
    return KVBatchMeta(keys=keys, tags=tags, partition_id="train")


class Timer:
    """Wall and process-CPU time of a block, with Python's GC paused (its pauses land on random methods)."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self):
        gc.disable()
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self._w, time.process_time() - self._c
        gc.enable()


def recipe_step(trainer, store, n_mean, T, step, p_true) -> dict[str, dict[str, float]]:
    """One step of the three overridden methods; {"wall"|"cpu": {method: seconds, "total": ...}}."""
    trainer.global_steps = step
    gc.collect()
    with Timer() as t_next:
        batch = trainer._next_train_batch()
    meta = simulate_rollout(store, batch, n_mean, T, step, p_true)
    metrics: dict = {}
    gc.collect()
    with Timer() as t_adv:
        meta = trainer._compute_advantage(meta, metrics)
    timing_raw = {"step": 1.0, "gen": 0.5, "adv": t_adv.wall}
    with Timer() as t_metrics:
        trainer._compute_metrics(meta, metrics, timing_raw, global_steps=step, epoch=0)
    store.clear()
    out = {}
    for kind in ("wall", "cpu"):
        parts = {
            "next_train_batch": getattr(t_next, kind),
            "compute_advantage": getattr(t_adv, kind),
            "compute_metrics": getattr(t_metrics, kind),
        }
        parts["total"] = sum(parts.values())
        out[kind] = parts
    out["driver_ms"] = metrics.get("gdro/recipe/driver_ms", 0.0)
    return out


def bench_recipe(B: int, n_mean: int, T: int, steps: int, warm: int, seed: int) -> dict:
    store = InProcessStore()
    p_true = np.random.default_rng(seed).beta(0.6, 0.6, size=N_14K)
    times: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    puts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="gdro_bench_") as out_dir, patched_transport(store):
        trainers = {v: make_trainer(v, B, n_mean, T, out_dir, seed) for v in VARIANTS}
        for step in range(1, warm + steps + 1):
            for variant, trainer in trainers.items():
                before = len(store.puts)
                t = recipe_step(trainer, store, n_mean, T, step, p_true)
                puts[variant] = len(store.puts) - before  # TransferQueue writes of the step's methods
                if step > warm:
                    times[variant].append(t)
    med = statistics.median
    result: dict = {"recipe_steps": steps, "recipe_warmup_steps": warm}
    plain = times["plain"]
    for variant, ts in times.items():
        for kind in ("cpu", "wall"):
            result[f"recipe_{variant}_{kind}_s"] = {k: med(t[kind][k] for t in ts) for k in ts[0][kind]}
        result[f"recipe_{variant}_tq_puts"] = puts[variant]
        if variant == "plain":
            continue
        for kind, name in (("cpu", "recipe_over_grpo"), ("wall", "recipe_over_grpo_wall")):
            # per step, paired with plain verl's same step; the median over steps
            ratios = [t[kind]["total"] / p[kind]["total"] - 1.0 for t, p in zip(ts, plain, strict=True)]
            result.setdefault(name, {})[variant] = med(ratios)
        # the recipe's own timer (gdro/recipe/driver_ms) over plain verl's wall time: the least noisy figure
        result.setdefault("recipe_driver_over_grpo", {})[variant] = (
            med(t["driver_ms"] for t in ts) / 1000.0 / med(p["wall"]["total"] for p in plain)
        )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n-mean", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15, help="controller bench repetitions")
    ap.add_argument("--steps", type=int, default=8, help="timed recipe steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed recipe steps per variant first")
    ap.add_argument("--allocator", default="sqrt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-recipe", action="store_true", help="controller bench only (no verl trainer)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared machine idle-spinning worker threads "
        "inflate the CPU time of whichever method runs)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    B, n_mean, T = args.prompts, args.n_mean, args.tokens
    result = {
        "batch_prompts": B,
        "mean_rollouts": n_mean,
        "response_tokens": T,
        "allocator": args.allocator,
        "repeats": args.repeats,
        "torch_threads": args.threads,
    }
    result.update(bench_controller(B, n_mean, T, args.repeats, args.allocator, args.seed))
    if not args.skip_recipe:
        result.update(bench_recipe(B, n_mean, T, args.steps, args.warmup, args.seed))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            if isinstance(v, dict):
                v = ", ".join(f"{a}={b:.3g}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items())
            print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
