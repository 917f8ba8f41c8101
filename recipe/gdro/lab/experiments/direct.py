"""A direct GRPO / GDRO training loop for the tiny LM: no Ray, no TransferQueue, one process.

Usage (from the repository root)::

    python -m recipe.gdro.lab.experiments.direct --steps 200 --method grpo --out /tmp/direct_grpo.json
    python -m recipe.gdro.lab.experiments.direct --steps 150 --method rollout_gdro --lr 2.5e-5 --num_train 2048 \
        --eval_every 30 --gdro rollout.budget=tokens --device auto

One step, in the order the recipe's trainer (``recipe/gdro/trainer.py``) runs it:

1. draw ``--prompts`` training prompts (epoch-shuffled, ``data_prep/arith.py``'s train split, its skills
   in the shares of ``--task_mix`` / ``DirectConfig.mix``, as are the validation and test splits);
2. ``GDROController.schedule`` -> the rollout count n(x) of each prompt (n̄ = ``--n`` for GRPO);
3. :func:`recipe.gdro.lab.tinylm.policy.sample` the rollouts at temperature 1, score them with
   ``data_prep.reward_fn.compute_score`` (verl's ``math_dapo``: +1 / -1);
4. verl's ``compute_grpo_outcome_advantage`` per prompt group;
5. ``GDROController.observe`` (accuracy, |A| and length per response) -> per-response multipliers,
   applied to the advantages (Prompt-GDRO's reweighting; all ones otherwise);
6. :func:`recipe.gdro.lab.tinylm.policy.ppo_update` with verl's vanilla clipped loss, one mini-batch
   of the whole step (on-policy: the rollout log-probs are the old log-probs, ratio 1).

``run_direct(config)`` returns per-skill validation accuracy before and after, the exact metric
(``base_exact`` / ``final_exact``: the mean teacher-forced probability of the canonical answer at
``config.temperature``, ``recipe.gdro.lab.tinylm.exact``; per skill in ``before_exact`` / ``after_exact``
and in every curve point as ``exact`` / ``exact_<skill>``), the learning curve
(validation every ``eval_every`` steps against cumulative tokens and rollouts), per-step metrics
(with the step's Σ|A|·tokens) and timings. ``allocation`` holds, per evaluation interval, what the
schedule gave each skill and each bin (the bin a prompt was in when its count was scheduled): prompts,
rollouts, groups that all failed and groups that all passed (no GRPO gradient either way), and the
tokens generated (:class:`AllocationRecord`). ``per_prompt`` holds every evaluated prompt's exact
probability p_i with its id and skill (``recipe.gdro.lab.results.outcomes``: any pass@k is recomputed from
it): the validation split at every evaluation, the held-out test split (``num_test`` prompts,
disjoint from validation and training, checked) before and after training. The CLI prints them and
writes them as JSON with ``--out``. The study harness (``recipe.gdro.lab.experiments.study``) runs it
under its protocol.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from data_prep import arith
from data_prep.common import DataPrepError
from recipe.gdro.config.registry import method_config, method_names, parse_overrides
from recipe.gdro.lab.results.outcomes import add_evaluation, check_disjoint, per_prompt_record
from recipe.gdro.lab.tinylm import exact, policy, tasks
from recipe.gdro.lab.tinylm.model import BASE_MODEL_DIR, load_model, load_tokenizer
from verl_ext import GDROController
from verl_ext.binner import aggregate_responses
from verl_ext.config import gdro_config_from_dict


@dataclass
class DirectConfig:
    """Everything ``run_direct`` reads (defaults: the study harness's quick setting)."""

    model_path: str = str(BASE_MODEL_DIR)
    steps: int = 200
    prompts: int = 64  # prompts per step
    n: int = 4  # mean rollouts per prompt
    lr: float = 3e-4
    temperature: float = 1.0  # rollouts, the loss and validation (one temperature, as verl's val_kwargs here)
    max_new_tokens: int = tasks.MAX_RESPONSE_TOKENS
    method: str = "grpo"  # a config/method/<name>.yaml (grpo, prompt_gdro, rollout_gdro, joint_gdro, ...)
    gdro: dict = field(default_factory=dict)  # extra gdro.* overrides (merged over the method's)
    # Binner warm start (issue 26 item 7): before step 1, sample warm_start responses per training
    # prompt with the model being trained and record them in the binner only (no update, no
    # adversary step). Its rollouts and tokens count in the budget: the run trains
    # steps - warm_start * num_train / (prompts * n) steps, which must be a whole number.
    warm_start: int = 0
    num_train: int = 8000
    train_file: str | None = None  # train on these rows (data_prep/arith.py's parquet schema) instead
    num_val: int = 1000
    # Held-out test prompts (data_prep.arith.build_test_split: validation-side problems not in the
    # validation split), scored before and after training only: the study's endpoints. 0: none.
    num_test: int = 0
    # The task mix: skill name -> share of the training, validation and test rows (data_prep.arith.mix_shares;
    # skills left out get none). None: each skill's own share (data_prep.arith.SKILLS).
    mix: dict | None = None
    data_seed: int = 0
    seed: int = 0
    eval_samples: int = 1
    device: str = "cpu"  # "cuda", "cuda:1", or "auto" (CUDA when present); the run cache keys on it
    eval_every: int = 0  # also evaluate every k steps (0: before and after only): the learning curve
    # size/tiny.yaml's actor settings (policy.tiny_actor_config); no KL loss: this loop has no reference model
    actor: dict = field(default_factory=lambda: policy.tiny_actor_config(use_kl_loss=False))


def method_gdro(method: str, n: int, overrides: dict | None = None) -> dict[str, Any]:
    """The ``gdro:`` section of a run: ``config/method/<method>.yaml`` (the registry), the binner
    observing (GRPO logs its bins too), n̄ = ``n``, then ``overrides``; the method's switches win."""
    return method_config(method, {"observe": True, "rollout": {"n_mean": n}}, overrides or {})


def warm_steps(config: DirectConfig) -> int:
    """Training steps the warm start's rollouts replace (ValueError unless a whole number of steps)."""
    if config.warm_start <= 0:
        return 0
    spent = config.warm_start * config.num_train
    per_step = config.prompts * config.n
    if spent % per_step or spent // per_step >= config.steps:
        raise ValueError(
            f"warm_start={config.warm_start}: {spent} warm-up rollouts must be a whole number of steps of "
            f"{per_step} rollouts, fewer than steps={config.steps}"
        )
    return spent // per_step


def held_out_split(num_test: int, data_seed: int, num_val: int, mix: dict | None = None) -> list[dict]:
    """The held-out test rows (``data_prep.arith.build_test_split`` under the task ``mix``; none for
    ``num_test`` 0). DataPrepError naming the skill when the validation side cannot hold them beside
    validation, or the mix's fault (``data_prep.arith.mix_shares``)."""
    return arith.build_test_split(num_test, data_seed, num_val, mix) if num_test else []


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine")
    return device


def _curve_point(result: dict[str, dict[str, Any]], exact_table: dict[str, dict[str, float]]) -> dict[str, float]:
    """One learning-curve point: mean (frequency-weighted) and per-skill pass@1, and the exact metric
    (``exact``, ``exact_<skill>``: mean teacher-forced probability of the canonical answer)."""
    return {
        "mean": result["all"]["pass1"],
        **{k: v["pass1"] for k, v in result.items() if k != "all"},
        "exact": exact_table["all"]["exact"],
        **{f"exact_{k}": v["exact"] for k, v in exact_table.items() if k != "all"},
    }


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each prompt's group starts in the step's responses (``np.repeat(ids, counts)`` order)."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


class AllocationRecord:
    """One evaluation interval's allocation, per skill and per bin (the bin each prompt was in when its
    count was scheduled): ``[prompts, rollouts, all-fail groups, all-pass groups]``, and the tokens
    generated. A group with every outcome equal carries no GRPO gradient."""

    def __init__(self, group_names: list[str]):
        self.group_names = group_names
        self.reset()

    def reset(self) -> None:
        self.by_skill: dict[str, np.ndarray] = {}
        self.by_bin = np.zeros((len(self.group_names), 4), dtype=np.int64)
        self.steps = self.tokens = 0

    def add(self, skills: np.ndarray, groups: np.ndarray, counts: np.ndarray, correct: np.ndarray) -> None:
        rows = np.stack([np.ones_like(counts), counts, correct == 0, correct == counts], axis=1).astype(np.int64)
        np.add.at(self.by_bin, groups, rows)
        for skill in np.unique(skills):
            self.by_skill.setdefault(str(skill), np.zeros(4, dtype=np.int64))
            self.by_skill[str(skill)] += rows[skills == skill].sum(axis=0)
        self.steps += 1

    def close(self, step: int) -> dict[str, Any]:
        """The interval ending at ``step`` as JSON-able lists; the record starts afresh."""
        out = {
            "step": step,
            "steps": self.steps,
            "tokens": self.tokens,
            "by_skill": {k: v.tolist() for k, v in sorted(self.by_skill.items())},
            "by_bin": {name: row.tolist() for name, row in zip(self.group_names, self.by_bin, strict=True) if row[0]},
        }
        self.reset()
        return out


def run_direct(config: DirectConfig | dict, log=print) -> dict[str, Any]:
    """Train the model at ``config.model_path`` and return before/after validation and step metrics."""
    if isinstance(config, dict):
        config = DirectConfig(**config)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    device = resolve_device(config.device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    model = load_model(config.model_path).to(device)
    tok = load_tokenizer(config.model_path)
    train = (
        pq.read_table(config.train_file).to_pylist()
        if config.train_file
        else arith.build_split(config.num_train, config.data_seed, val=False, mix=config.mix)
    )
    val = arith.build_split(config.num_val, config.data_seed, val=True, mix=config.mix)
    test = held_out_split(config.num_test, config.data_seed, config.num_val, config.mix)
    splits = {"validation": val, "test": test, "training": train}
    check_disjoint({name: [r["prompt"][-1]["content"] for r in rows] for name, rows in splits.items() if rows})
    # Each evaluated prompt's exact probability at each evaluation (recipe.gdro.lab.results.outcomes):
    # validation at every evaluation, test before and after training.
    per_prompt = {
        name: per_prompt_record([r["prompt"][-1]["content"] for r in rows], exact.per_prompt_skills(rows))
        for name, rows in (("val", val), ("test", test))
        if rows
    }

    def score_exact(step: int, split: str = "val") -> dict[str, dict[str, float]]:
        """The exact metric on ``split`` per skill; each prompt's p_i recorded at ``step``."""
        rows = val if split == "val" else test
        _, skills, p = exact.per_prompt(model, tok, rows, temperature=config.temperature)
        add_evaluation(per_prompt[split], step, p)
        return exact.skill_table(p, skills)

    prompt_tokens = [tasks.prompt_ids(tok, r["prompt"][0]["content"]) for r in train]
    train_skills = np.array(exact.per_prompt_skills(train))
    # As the recipe's trainer builds it: the actor's loss_agg_mode sets Prompt-GDRO's mass units.
    ctl = GDROController(
        gdro_config_from_dict(method_gdro(config.method, config.n, config.gdro)),
        len(train),
        loss_agg_mode=config.actor["loss_agg_mode"],
        max_response_length=config.max_new_tokens,
    )
    actor = dict(config.actor, ppo_mini_batch_size=config.prompts, rollout_n=config.n)
    optimizer = policy.make_optimizer(model, config.lr)

    t0 = time.perf_counter()
    before = tasks.evaluate(
        model, tok, val, samples=config.eval_samples, temperature=config.temperature, seed=config.seed
    )
    before_exact = score_exact(0)
    before_test = score_exact(0, "test") if test else None
    eval_seconds = time.perf_counter() - t0
    log(f"before ({eval_seconds:.0f} s, exact {before_exact['all']['exact']:.4f}):\n{tasks.format_table(before)}")

    order = rng.permutation(len(train))
    cursor = 0
    history = []
    # The learning curve: validation accuracy against cumulative generated tokens and rollouts.
    curve = [{"step": 0, "tokens": 0, "rollouts": 0, **_curve_point(before, before_exact)}]
    tokens_total = rollouts_total = 0
    # The allocation, per evaluation interval (issue 45): what each skill and bin was given
    allocation: list[dict[str, Any]] = []
    interval = AllocationRecord(ctl.group_names())

    def rollouts(pid: np.ndarray) -> tuple[list, np.ndarray]:
        """Sample one response per entry of ``pid`` (prompt ids) and score each: (responses, correct)."""
        out = policy.sample(
            model,
            [prompt_tokens[i] for i in pid],
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            generator=generator,
        )
        return out, np.array(tasks.score_samples(tok, [train[i] for i in pid], out))

    first_step = warm_steps(config)
    if first_step:  # the binner warm start: every training prompt visited once, k samples, binner only
        warm = np.repeat(np.arange(len(train)), config.warm_start)
        chunk = config.prompts * config.n
        for lo in range(0, len(warm), chunk):
            pid = warm[lo : lo + chunk]
            out, acc = rollouts(pid)
            ids, correct, counts, nonfinite = aggregate_responses(pid, acc)
            ctl.binner.update(ids, correct, counts, num_nonfinite=nonfinite)
            mask = policy.rollout_batch([prompt_tokens[i] for i in pid], out, tok.pad_token_id)["response_mask"]
            tokens_total += int(mask.sum())  # counted as the training steps count them
            rollouts_total += len(pid)
        log(f"warm start: {len(warm)} rollouts, {tokens_total} tokens (= {first_step} steps' rollouts)")
        curve[0].update(tokens=tokens_total, rollouts=rollouts_total)
    t_train = time.perf_counter()
    for step in range(first_step, config.steps):
        t_step = time.perf_counter()
        if cursor + config.prompts > len(order):
            order, cursor = rng.permutation(len(train)), 0
        ids = order[cursor : cursor + config.prompts]
        cursor += config.prompts
        # the cold start (issue 26 item 7): the share of the batch the binner has never seen
        unseen = float(np.mean(ctl.binner.visits_of(ids) == 0))
        groups = ctl.binner.groups_of(ids)  # the bins the allocation saw (observe moves prompts after)
        counts = ctl.schedule(ids)
        pid = np.repeat(ids, counts)
        out, acc = rollouts(pid)
        batch = policy.rollout_batch([prompt_tokens[i] for i in pid], out, tok.pad_token_id)
        lengths = batch["response_mask"].sum(1)
        rewards = torch.zeros_like(batch["old_log_probs"])
        rewards[torch.arange(len(pid)), lengths - 1] = torch.as_tensor(np.where(acc, 1.0, -1.0), dtype=torch.float32)
        advantages, _ = compute_grpo_outcome_advantage(rewards, batch["response_mask"], index=pid)
        abs_adv = advantages.abs().amax(dim=1).double().numpy()
        mult = ctl.observe(pid, acc, response_abs_advantage=abs_adv, response_length=lengths.numpy())
        batch["advantages"] = advantages * torch.as_tensor(mult, dtype=torch.float32)[:, None]
        # The step's size in the loss's units: sum over responses of |A| x tokens (token-mean's
        # numerator), before and after the multipliers.
        mask = batch["response_mask"].float()
        adv_token_mass = float((advantages.abs() * mask).sum())
        weighted_mass = float((batch["advantages"].abs() * mask).sum())
        metrics = policy.ppo_update(
            model,
            optimizer,
            batch,
            actor_config=actor,
            mini_batch_size=len(pid),
            temperature=config.temperature,
        )
        metrics.update(
            {
                "step": step + 1,
                "train/acc": float(acc.mean()),
                "train/response_length": float(lengths.float().mean()),
                "train/rollouts": int(len(pid)),
                "train/tokens": int(lengths.sum()),
                "train/unseen_share": unseen,
                "train/adv_token_mass": adv_token_mass,
                "train/weighted_adv_token_mass": weighted_mass,
                "time/step_s": time.perf_counter() - t_step,
            }
        )
        metrics.update(ctl.metrics())
        history.append(metrics)
        tokens_total += int(lengths.sum())
        rollouts_total += len(pid)
        interval.add(train_skills[ids], groups, counts, np.add.reduceat(acc.astype(np.int64), _starts(counts)))
        interval.tokens += int(lengths.sum())
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            allocation.append(interval.close(step + 1))
            point = tasks.evaluate(
                model, tok, val, samples=config.eval_samples, temperature=config.temperature, seed=config.seed
            )
            point_exact = score_exact(step + 1)
            curve.append(
                {
                    "step": step + 1,
                    "tokens": tokens_total,
                    "rollouts": rollouts_total,
                    **_curve_point(point, point_exact),
                }
            )
        if (step + 1) % max(1, config.steps // 10) == 0:
            log(
                f"step {step + 1}/{config.steps} train acc {metrics['train/acc']:.3f} "
                f"len {metrics['train/response_length']:.1f} ({time.perf_counter() - t_train:.0f} s)"
            )
    train_seconds = time.perf_counter() - t_train
    after = tasks.evaluate(
        model, tok, val, samples=config.eval_samples, temperature=config.temperature, seed=config.seed
    )
    after_exact = score_exact(config.steps)
    after_test = score_exact(config.steps, "test") if test else None
    log(f"after {config.steps} steps ({train_seconds:.0f} s, {train_seconds / max(1, config.steps):.2f} s/step):")
    log(tasks.format_table(after))
    log(f"exact metric {before_exact['all']['exact']:.4f} -> {after_exact['all']['exact']:.4f}")
    curve.append(
        {"step": config.steps, "tokens": tokens_total, "rollouts": rollouts_total, **_curve_point(after, after_exact)}
    )
    if interval.steps:
        allocation.append(interval.close(config.steps))
    return {
        "config": config.__dict__,
        "before": before,
        "after": after,
        # the exact metric (recipe.gdro.lab.tinylm.exact) at config.temperature, per skill and its mean
        "before_exact": before_exact,
        "after_exact": after_exact,
        "base_exact": before_exact["all"]["exact"],
        "final_exact": after_exact["all"]["exact"],
        # the same on the test split (None without one), and every prompt's p_i at each evaluation
        "before_test_exact": before_test,
        "after_test_exact": after_test,
        "per_prompt": per_prompt,
        "train_seconds": train_seconds,
        "seconds_per_step": train_seconds / max(1, config.steps),
        "eval_seconds": eval_seconds,
        "history": history,
        "curve": curve,
        "allocation": allocation,
        "model": model,
    }


@dataclass
class _CliOnly:
    """Flags of the command line that are not run settings."""

    threads: int = field(default=1, metadata={"help": "torch threads"})
    gdro: list[str] = field(
        default_factory=list,
        metadata={
            "action": "extend",
            "metavar": "KEY=VALUE",
            "help": "a gdro.* override over the method's, e.g. rollout.budget=tokens (repeatable)",
        },
    )
    out: str | None = field(default=None, metadata={"help": "write the result (without the model) as JSON here"})
    task_mix: str | None = field(
        default=None,
        metadata={"metavar": "SKILL=SHARE,...", "help": "the task mix, e.g. add3=1,add4=2 (default: arith's shares)"},
    )


_HELP = {
    "method": "a method of recipe/gdro/config/method/ (the registry)",
    "num_train": "training prompts (revisits need few)",
    "eval_every": "validate every k steps too (0: off)",
    "device": "cpu, cuda[:N] or auto (CUDA when present)",
    "temperature": "rollouts, loss and validation",
    "warm_start": "binner warm start: k samples per training prompt before step 1, counted in the budget",
    "num_test": "held-out test prompts (disjoint from validation), scored exactly before and after (0: none)",
}


def build_parser():
    """``transformers.HfArgumentParser`` over :class:`DirectConfig`'s scalar fields plus the CLI's own flags:
    each flag is its field (name, type, default), written once."""
    from transformers import HfArgumentParser

    hints = typing.get_type_hints(DirectConfig)
    fields = []
    for f in dataclasses.fields(DirectConfig):
        if f.name == "gdro" or dict in (hints[f.name], *typing.get_args(hints[f.name])):  # mappings: not flags
            continue
        meta = {"help": _HELP.get(f.name, "")}
        if f.name == "method":
            meta["choices"] = list(method_names())
        fields.append((f.name, hints[f.name], field(default=f.default, metadata=meta)))
    cli = dataclasses.make_dataclass("DirectArgs", fields, bases=(_CliOnly,))
    return HfArgumentParser(cli, description=__doc__.split("\n\n")[0])


def parse_args(argv=None):
    (args,) = build_parser().parse_args_into_dataclasses(list(sys.argv[1:] if argv is None else argv))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("steps", "prompts", "n", "eval_samples", "threads", "num_train"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be a positive integer, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.num_test < 0:
        print(f"error: --num_test must be >= 0, got {args.num_test}", file=sys.stderr)
        return 2
    try:
        mix = (
            None
            if args.task_mix is None
            else {k: float(v) for k, v in parse_overrides(args.task_mix.split(","), what="--task_mix").items()}
        )
    except (TypeError, ValueError) as e:
        print(f"error: --task_mix {args.task_mix!r}: {e}; write skill=share pairs, e.g. add3=1,add4=2", file=sys.stderr)
        return 2
    try:
        arith.mix_shares(mix)
    except DataPrepError as e:
        print(f"error: --task_mix: {e}", file=sys.stderr)
        return 2
    try:
        held_out_split(args.num_test, args.data_seed, args.num_val, mix)
    except DataPrepError as e:
        print(f"error: --num_test: {e}", file=sys.stderr)
        return 2
    if not args.temperature > 0:
        print(f"error: --temperature must be > 0, got {args.temperature}", file=sys.stderr)
        return 2
    if args.n < 2:
        print("error: --n must be >= 2 (a GRPO group needs two rollouts)", file=sys.stderr)
        return 2
    try:
        resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        print(f"error: --device: {e}", file=sys.stderr)
        return 2
    try:
        gdro = parse_overrides(args.gdro, what="--gdro")
        gdro_config_from_dict(method_gdro(args.method, args.n, gdro))
    except ValueError as e:
        print(f"error: --gdro: {e}", file=sys.stderr)
        return 2
    config = DirectConfig(
        gdro=gdro,
        mix=mix,
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(DirectConfig)
            if f.name != "gdro" and hasattr(args, f.name)
        },
    )
    try:
        warm_steps(config)
    except ValueError as e:
        print(f"error: --warm_start: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    result = run_direct(config)
    result.pop("model")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=float) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
