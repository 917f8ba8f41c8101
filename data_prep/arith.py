"""Arithmetic task family for the tiny LM -> verl RL parquet (``DIR/train.parquet``, ``DIR/val.parquet``).

Usage (from the repository root)::

    python data_prep/arith.py --local_dir ~/data/arith                     # seed 0, 8000 train, 1000 val
    python -m data_prep.arith --local_dir DIR --seed 1 --num_train 4000 --num_val 500

A family of skills (:data:`SKILLS`) with graded difficulty that build on each other: a solved
core (2-digit addition), a frontier the shipped base half solves (2-digit subtraction, 3- and
4-digit addition with its longer carry chains, 1x2-digit multiplication) and a hard tail it rarely
solves (1x3-digit multiplication: the 1x2 steps plus one more carried digit), learnable as the
frontier moves. Skills of share 0 (``add5``, ``add6``, ``mul2x2``) have no rows: only the base's
SFT stages draw them. A prompt is the bare problem (``"12+34="``, one user turn); the expected
response is ``"Answer: 46"``, which verl's ``math_dapo`` scorer reads (its Minerva ``Answer:``
line); ``data_prep/reward_fn.py`` routes every ``arith_<skill>`` data source there.

Rows have the schema every data_prep file has (:data:`data_prep.common.OUTPUT_SCHEMA`) plus
``extra_info.skill``; ``data_source`` is ``arith_<skill>``, so verl's validation metrics are
reported per skill (``val-core/arith_add3/acc/mean@1``). Within each file ``extra_info.index`` is
the dense position 0..N-1 in order of the prompt's SHA-256, as in ``dapo.py``.

Train/validation disjointness does not depend on the seed: a problem is *validation-eligible*
iff its SHA-256 falls in a fixed 10% slice (:func:`is_val_problem`). ``val.parquet`` draws only
eligible problems, ``train.parquet`` and the tiny LM's supervised pretraining
(``recipe.gdro.lab.tinylm.sft``) only the others, so no validation prompt is ever trained on, for any
seed or size. Problems within a file are distinct; each skill gets its share of the rows
(largest remainder), drawn without replacement with ``numpy`` from the seed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

if __package__ in (None, ""):  # run as `python data_prep/arith.py`: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_prep.common import (  # noqa: E402
    OUTPUT_SCHEMA,
    DataPrepError,
    Entry,
    build_records,
    prompt_hash,
    to_table,
    write_parquet_atomic,
)

ABILITY = "arith"
DATASET = "gdro-arith"
DATA_SOURCE_PREFIX = "arith_"
VAL_SLICE = 10  # one problem in VAL_SLICE (by hash) is reserved for validation
ANSWER_PREFIX = "Answer: "

# Arrow schema: the common one with extra_info.skill appended (no second copy of the fields).
_EXTRA = OUTPUT_SCHEMA.field("extra_info")
SCHEMA = OUTPUT_SCHEMA.set(
    OUTPUT_SCHEMA.get_field_index("extra_info"),
    _EXTRA.with_type(pa.struct([*_EXTRA.type, pa.field("skill", pa.string())])),
)


@dataclass(frozen=True)
class Skill:
    """One skill: operand digit counts, operator, RL share, and the role it plays."""

    name: str
    op: str  # "+", "-" or "*"
    digits: tuple[int, int]  # operand digit counts (no leading zeros)
    share: float  # fraction of train/val rows
    role: str  # core / frontier / hard tail (what the shipped base makes of it)

    @property
    def data_source(self) -> str:
        return DATA_SOURCE_PREFIX + self.name

    def operand_range(self, k: int) -> tuple[int, int]:
        d = self.digits[k]
        if d == 1:  # one-digit operands: 2..9 for multiplication (no x0 / x1), 0..9 otherwise
            return (2 if self.op == "*" else 0), 10
        return 10 ** (d - 1), 10**d  # [low, high)

    def pool_size(self) -> int:
        """Distinct problems of this skill (for subtraction: pairs with a >= b)."""
        (lo0, hi0), (lo1, hi1) = self.operand_range(0), self.operand_range(1)
        if self.op != "-":
            return (hi0 - lo0) * (hi1 - lo1)
        assert self.digits[0] == self.digits[1]
        n = hi0 - lo0
        return n * (n + 1) // 2

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` operand pairs [size, 2] (a >= b for subtraction), with repeats."""
        (lo0, hi0), (lo1, hi1) = self.operand_range(0), self.operand_range(1)
        a = rng.integers(lo0, hi0, size=size)
        b = rng.integers(lo1, hi1, size=size)
        if self.op == "-":
            a, b = np.maximum(a, b), np.minimum(a, b)
        return np.stack([a, b], axis=1)


# Roles as the shipped base (recipe/gdro/lab/tinylm/base, docs/tiny_lm.md) measures them, exact metric at T=1:
# add2 0.89, sub2 0.70, add3 0.42, add4 0.37, mul1x2 0.29, mul1x3 0.02.
SKILLS: tuple[Skill, ...] = (
    Skill("add2", "+", (2, 2), 0.10, "core"),
    Skill("sub2", "-", (2, 2), 0.15, "frontier"),
    Skill("add3", "+", (3, 3), 0.20, "frontier"),
    Skill("add4", "+", (4, 4), 0.25, "frontier"),
    Skill("mul1x2", "*", (1, 2), 0.05, "frontier"),
    Skill("mul1x3", "*", (1, 3), 0.25, "hard tail"),
    # Not in the RL mix (share 0: no rows): only the base's SFT stages drew them.
    Skill("add5", "+", (5, 5), 0.0, "SFT only"),
    Skill("add6", "+", (6, 6), 0.0, "SFT only"),
    Skill("mul2x2", "*", (2, 2), 0.0, "SFT only"),
)
SKILL_BY_NAME = {s.name: s for s in SKILLS}
DATA_SOURCES = tuple(s.data_source for s in SKILLS)

_OPS: dict[str, Callable[[int, int], int]] = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}


def problem_text(a: int, op: str, b: int) -> str:
    """The prompt content: ``"12+34="``."""
    return f"{a}{op}{b}="


def answer(a: int, op: str, b: int) -> int:
    return _OPS[op](int(a), int(b))


def response_text(value: int) -> str:
    """The expected assistant turn: ``"Answer: 46"``."""
    return f"{ANSWER_PREFIX}{value}"


def is_val_problem(problem: str) -> bool:
    """True for the fixed ~10% hash slice of problems reserved for validation (seed-independent)."""
    return int(prompt_hash(problem)[:8], 16) % VAL_SLICE == 0


def allocate(total: int, shares: list[float]) -> list[int]:
    """Split ``total`` rows by ``shares`` with the largest-remainder rule (sums exactly to total)."""
    raw = [total * s / sum(shares) for s in shares]
    counts = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def sample_problems(
    skill: Skill, count: int, rng: np.random.Generator, *, val: bool, exclude: frozenset[str] = frozenset()
) -> list[tuple[str, int, int, int]]:
    """``count`` distinct problems ``(text, a, b, answer)`` of one skill from its train or val side,
    none of whose text is in ``exclude`` (the test split leaves out the validation split's problems).

    Raises :class:`DataPrepError` when the side of the pool cannot hold ``count`` distinct problems.
    """
    side = "validation" if val else "train"
    wanted = "test" if exclude else side  # the test split draws from the validation side, less exclude
    flag = "--num_test" if exclude else f"--num_{'val' if val else 'train'}"
    pool = skill.pool_size()
    # Expected side size (the hash slice is uniform); exact for small pools, checked below.
    if pool <= 200_000:
        (lo0, hi0), (lo1, hi1) = skill.operand_range(0), skill.operand_range(1)
        eligible = [
            (a, b)
            for a in range(lo0, hi0)
            for b in range(lo1, hi1)
            if (skill.op != "-" or a >= b)
            and is_val_problem(problem_text(a, skill.op, b)) == val
            and problem_text(a, skill.op, b) not in exclude
        ]
        if count > len(eligible):
            raise DataPrepError(
                f"skill {skill.name}: {count} distinct {wanted} problems requested but its {side} pool holds only "
                f"{len(eligible)}{' beside the validation split' if exclude else ''} (of {pool}); lower {flag}"
            )
        picks = rng.choice(len(eligible), size=count, replace=False)
        pairs = [eligible[i] for i in sorted(picks)]
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    else:
        expected = pool / VAL_SLICE if val else pool * (VAL_SLICE - 1) / VAL_SLICE
        if count > expected / 2:
            raise DataPrepError(
                f"skill {skill.name}: {count} distinct {wanted} problems requested, more than half its {side} "
                f"pool (~{int(expected)}); lower {flag}"
            )
        seen: set[tuple[int, int]] = set()
        pairs = []
        while len(pairs) < count:
            for a, b in skill.draw(rng, 2 * (count - len(pairs)) + 16).tolist():
                text = problem_text(a, skill.op, b)
                if (a, b) in seen or is_val_problem(text) != val or text in exclude:
                    continue
                seen.add((a, b))
                pairs.append((a, b))
                if len(pairs) == count:
                    break
    return [(problem_text(a, skill.op, b), a, b, answer(a, skill.op, b)) for a, b in pairs]


def mix_shares(mix: Mapping[str, float] | None) -> list[float]:
    """Each skill's share of the rows, in :data:`SKILLS` order: ``mix`` (skill name -> share; skills it
    leaves out get 0; shares need not sum to 1) or, for None, each skill's own ``share``. DataPrepError
    naming an unknown skill, a negative or non-finite share, or a mix of no rows."""
    if mix is None:
        return [s.share for s in SKILLS]
    for name, share in mix.items():
        if name not in SKILL_BY_NAME:
            raise DataPrepError(f"task mix: unknown skill {name!r}; use some of {', '.join(SKILL_BY_NAME)}")
        if not (isinstance(share, (int, float)) and math.isfinite(share) and share >= 0):
            raise DataPrepError(f"task mix: {name}={share!r}: a share is a finite number >= 0")
    if not sum(mix.values()) > 0:
        raise DataPrepError("task mix: every share is 0; give at least one skill a share > 0")
    return [float(mix.get(s.name, 0.0)) for s in SKILLS]


def build_split(
    total: int, seed: int, *, val: bool, beside_val: int | None = None, mix: Mapping[str, float] | None = None
) -> list[dict]:
    """All rows of one split, index-ordered by prompt hash (as dapo.py orders its rows).

    ``beside_val`` (the test split, :func:`build_test_split`): draw from the validation side, leaving out the
    problems of the validation split of that size and ``seed`` (and ``mix``), on a stream of its own.
    ``mix``: the skills' shares (:func:`mix_shares`; default each skill's ``share``). A skill's problems
    come from its own stream, so a skill of the same count draws the same problems under any mix."""
    counts = allocate(total, mix_shares(mix))
    exclude: frozenset[str] = frozenset()
    stream = int(val)
    if beside_val is not None:
        exclude = frozenset(r["prompt"][-1]["content"] for r in build_split(beside_val, seed, val=True, mix=mix))
        stream = TEST_STREAM
    # One independent stream per (seed, split, skill): adding a skill does not reshuffle the others.
    entries: list[tuple[str, Entry, Skill]] = []
    for k, (skill, count) in enumerate(zip(SKILLS, counts, strict=True)):
        rng = np.random.default_rng([seed, stream, k])
        for row, (text, _a, _b, value) in enumerate(sample_problems(skill, count, rng, val=val, exclude=exclude)):
            entry = Entry(
                problem=text,
                ground_truth=str(value),
                source_index=f"{skill.name}:{text}",
                source_row=row,
                where=f"{skill.name} row {row}",
                prompt_content=text,
            )
            entries.append((prompt_hash(text), entry, skill))
    entries.sort(key=lambda item: item[0])
    records = build_records(
        [(key, entry) for key, entry, _ in entries],
        data_source=DATA_SOURCE_PREFIX,
        ability=ABILITY,
        split="test" if val else "train",
        dataset=DATASET,
    )
    for record, (_, _, skill) in zip(records, entries, strict=True):
        record["data_source"] = skill.data_source
        record["extra_info"]["skill"] = skill.name
    return records


TEST_STREAM = 2  # the test split's random streams are [seed, 2, skill] (train: 0, validation: 1)


def build_test_split(total: int, seed: int, num_val: int, mix: Mapping[str, float] | None = None) -> list[dict]:
    """A held-out test split of ``total`` rows: validation-eligible problems (never trained on, as
    :func:`is_val_problem` reserves them) that are not in ``build_split(num_val, seed, val=True)``,
    so the test prompts are disjoint from the validation prompts that choose checkpoints and lrs.
    Each skill keeps its share; a skill whose validation side is too small after the validation
    split's problems are removed (``mul1x2`` holds 77: at most 27 beside 1000 validation rows) is a
    :class:`DataPrepError` naming it. Rows as :func:`build_split` writes them."""
    return build_split(total, seed, val=True, beside_val=num_val, mix=mix)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--local_dir", required=True, help="output folder; train.parquet and val.parquet are written there")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_train", type=int, default=8000, help="distinct training prompts (default 8000)")
    p.add_argument("--num_val", type=int, default=1000, help="distinct validation prompts (default 1000)")
    # run_scripts/tiny_real_path_env.sh and cpu_backend_tiny.sh: the user set NUM_TRAIN / NUM_VAL / DATA_DIR, not
    # these flags, so the messages name those (SCRIPT_VARIABLES)
    p.add_argument("--name_script_variables", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# The launch scripts' variables behind each flag (--name_script_variables).
SCRIPT_VARIABLES = {"--num_train": "NUM_TRAIN", "--num_val": "NUM_VAL", "--local_dir": "DATA_DIR"}


def name_script_variables(message: str) -> str:
    """``message`` with each flag the launch scripts set from a variable named as that variable."""
    for flag, variable in SCRIPT_VARIABLES.items():
        message = re.sub(rf"{re.escape(flag)}\b", variable, message)
    return message


def main(argv=None) -> int:
    """CLI entry point; returns the process exit code (2 on a bad argument or an unwritable folder)."""
    args = parse_args(argv)
    try:
        for name in ("num_train", "num_val"):
            if getattr(args, name) < 1:
                raise DataPrepError(f"--{name} must be a positive integer, got {getattr(args, name)}")
        if args.seed < 0:
            raise DataPrepError(f"--seed must be >= 0, got {args.seed}")
        out_dir = Path(os.path.expanduser(args.local_dir))
        if out_dir.exists() and not out_dir.is_dir():
            raise DataPrepError(f"--local_dir {out_dir} exists and is not a folder")
        tables = {}
        for split, total, val in (("train", args.num_train, False), ("val", args.num_val, True)):
            records = build_split(total, args.seed, val=val)
            metadata = {
                "set": f"arith-{split}",
                "dataset": DATASET,
                "seed": args.seed,
                "rows": len(records),
                "skills": {s.name: s.share for s in SKILLS},
                "index_order": "sha256(problem text)",
            }
            tables[split] = to_table(records, metadata, schema=SCHEMA)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            for split, table in tables.items():
                write_parquet_atomic(table, out_dir / f"{split}.parquet")
        except OSError as e:
            raise DataPrepError(f"cannot write to --local_dir {out_dir}: {e.strerror or e}") from e
    except DataPrepError as e:
        print(f"error: {name_script_variables(str(e)) if args.name_script_variables else e}", file=sys.stderr)
        return 2
    for split, table in tables.items():
        print(f"wrote {out_dir / (split + '.parquet')}: {table.num_rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
