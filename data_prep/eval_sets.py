"""Evaluation sets -> one verl RL parquet per set (``DIR/<set>.parquet``).

Usage (from the repository root)::

    python data_prep/eval_sets.py --local_dir ~/data/gdro_eval    # all sets, from the hub
    python -m data_prep.eval_sets --local_dir DIR --sets math500,aime2024
    python -m data_prep.eval_sets --local_dir DIR --input_dir RAW   # offline: RAW/<set>.parquet|.jsonl|.json

Each set gets its own ``data_source`` (= the set name), so verl reports it separately
(``val-core/<set>/acc/mean@8``); ``data_prep/reward_fn.py`` scores every math set with verl's
``math_dapo`` and GPQA-Diamond with a multiple-choice scorer. Rows keep the source order and
``extra_info.index`` is the dense position 0..N-1 (exact duplicate problems are merged, as for
the train set). GPQA's four options are shuffled with a seed taken from the question's hash, so
the letter layout is the same on every run and machine; the correct letter is the ground truth.

All files share one schema, so they can be passed together as ``data.val_files=[...]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python data_prep/eval_sets.py`: data_prep/_repo_path.py
    import _repo_path  # noqa: F401
if __name__ == "__main__":  # Ctrl-C from here on, the imports included: one line (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("eval_sets.py")

from data_prep.common import (  # noqa: E402
    INSTRUCTION,
    BadRowLog,
    DataPrepError,
    Deduper,
    Entry,
    RowProblem,
    Source,
    Summary,
    build_records,
    check_row_object,
    coerce_answer,
    get_column,
    hub_source,
    prompt_hash,
    read_local,
    require_columns,
    require_text,
    strip_instructions,
    to_table,
    write_parquet_atomic,
)

# The GPQA instruction: same \boxed{} convention as the math prompts, asking for the letter.
GPQA_INSTRUCTION = "Let's think step by step and output the final answer (the letter A, B, C or D) within \\boxed{}."
GPQA_INCORRECT = ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


@dataclass(frozen=True)
class EvalSet:
    """Where a set lives on the hub and which of its columns hold the problem and the answer."""

    name: str  # also the output file stem and the data_source
    hub_id: str
    hub_config: str | None
    split: str
    question_column: str
    answer_column: str
    id_column: str | None = None  # optional; the row number is used when absent
    kind: str = "math"  # "math" or "mc" (multiple choice)
    answer_is_list: bool = False
    context_column: str | None = None  # optional preamble printed before the question

    @property
    def data_source(self) -> str:
        return self.name

    @property
    def ability(self) -> str:
        return "science" if self.kind == "mc" else "math"

    def required_columns(self) -> list[str]:
        if self.kind == "mc":
            return [self.question_column, self.answer_column, *GPQA_INCORRECT]
        return [self.question_column, self.answer_column]


# Column names as published on the hub (checked against the dataset cards / files).
EVAL_SETS: dict[str, EvalSet] = {
    s.name: s
    for s in [
        # problem, solution, answer, subject, level, unique_id (500 rows)
        EvalSet("math500", "HuggingFaceH4/MATH-500", None, "test", "problem", "answer", "unique_id"),
        # id, problem, solution, answer (str), url, year (30 rows)
        EvalSet("aime2024", "HuggingFaceH4/aime_2024", None, "train", "problem", "answer", "id"),
        # problem_idx, problem, answer (int64), problem_type (30 rows)
        EvalSet("aime2025", "MathArena/aime_2025", None, "train", "problem", "answer", "problem_idx"),
        # id, question, answer (float64, e.g. 27.0), url (40 rows)
        EvalSet("amc23", "math-ai/amc23", None, "test", "question", "answer", "id"),
        # question, answer (272 rows)
        EvalSet("minerva", "math-ai/minervamath", None, "test", "question", "answer"),
        # id, question, solution (list), final_answer (list of "$...$"), context, ... (675 rows)
        EvalSet(
            "olympiadbench",
            "math-ai/olympiadbench",
            None,
            "test",
            "question",
            "final_answer",
            "id",
            answer_is_list=True,
            context_column="context",
        ),
        # Question, Correct Answer, Incorrect Answer 1..3, Record ID, ... (198 rows; gated on the hub)
        EvalSet(
            "gpqa_diamond",
            "Idavidrein/gpqa",
            "gpqa_diamond",
            "train",
            "Question",
            "Correct Answer",
            "Record ID",
            kind="mc",
        ),
    ]
}


def gpqa_layout(question: str, correct: str, incorrect: list[str]) -> tuple[list[str], str]:
    """Deterministically shuffled options and the correct letter.

    The RNG is seeded by the question's SHA-256, so the layout depends only on the content.
    """
    options = [correct, *incorrect]
    rng = random.Random(int(prompt_hash(question)[:16], 16))
    order = list(range(4))
    rng.shuffle(order)
    shuffled = [options[i] for i in order]
    return shuffled, "ABCD"[order.index(0)]


def gpqa_prompt(question: str, options: list[str]) -> str:
    """The GPQA user message: question, lettered options, instruction."""
    lettered = [f"{letter}) {text}" for letter, text in zip("ABCD", options, strict=True)]  # always 4 options
    lines = [question, "", *lettered, "", GPQA_INSTRUCTION]
    return "\n".join(lines)


def _source_id(spec: EvalSet, row: dict, row_number: int) -> str:
    if spec.id_column and row.get(spec.id_column) is not None:
        return str(row[spec.id_column])
    return str(row_number)


def _convert_row(spec: EvalSet, row: dict, rec_row: int, where: str) -> Entry:
    """One validated source row -> :class:`Entry` (raises :class:`RowProblem`)."""
    question = strip_instructions(require_text(get_column(row, spec.question_column), spec.question_column))
    if not question:
        raise RowProblem(spec.question_column, "empty prompt (only an instruction)")
    if spec.kind == "mc":
        correct = require_text(get_column(row, spec.answer_column), spec.answer_column, "answer")
        incorrect = [require_text(get_column(row, c), c, "answer") for c in GPQA_INCORRECT]
        if correct in incorrect:
            raise RowProblem(spec.answer_column, "ambiguous options: the correct answer equals an incorrect one")
        options, letter = gpqa_layout(question, correct, incorrect)
        return Entry(
            question,
            letter,
            _source_id(spec, row, rec_row),
            rec_row,
            where,
            prompt_content=gpqa_prompt(question, options),
            answer_text=correct,
        )
    answer = coerce_answer(get_column(row, spec.answer_column), spec.answer_column, allow_list=spec.answer_is_list)
    if spec.context_column:
        context = row.get(spec.context_column)
        if isinstance(context, str) and context.strip():
            question = f"{context.strip()}\n\n{question}"
    return Entry(question, answer, _source_id(spec, row, rec_row), rec_row, where)


def convert(spec: EvalSet, source: Source, *, strict: bool = False, stream=None) -> tuple[list[dict], Summary]:
    """Convert one evaluation set to verl records (source order) and a :class:`Summary`."""
    summary = Summary(spec.name)
    log = BadRowLog(summary, strict, stream)
    require_columns(source, spec.required_columns(), spec.hub_id)
    dedup = Deduper(log, spec.answer_column)
    ids: dict[str, list[int]] = {}  # source id -> input rows (for the repeated-id warning)
    for rec in source.records:
        summary.read += 1
        if spec.id_column and isinstance(rec.data, dict) and rec.data.get(spec.id_column) is not None:
            ids.setdefault(str(rec.data[spec.id_column]), []).append(rec.row)
        try:
            entry = _convert_row(spec, check_row_object(rec), rec.row, rec.where)
        except RowProblem as problem:
            log.report(rec, problem)
            continue
        dedup.add(rec, entry)
    if not dedup.entries:
        raise DataPrepError(f"{source.name}: no valid rows to write ({summary.line()})")
    warn_repeated_source_ids(spec, ids, stream)
    ordered = list(dedup.entries.items())  # dicts keep insertion order: first appearance
    out = build_records(ordered, data_source=spec.data_source, ability=spec.ability, split="test", dataset=spec.hub_id)
    summary.written = len(out)
    summary.check()
    return out, summary


def warn_repeated_source_ids(spec: EvalSet, rows: dict[str, list[int]], stream=None) -> list[str]:
    """Warn, naming them, about source ids (``spec.id_column`` -> the input rows carrying it) found on
    more than one row: rows are kept or merged by their text, but an id that names two rows is the
    source's defect, and a user matching results back to the source should know. Returns the lines."""
    repeated = {k: v for k, v in rows.items() if len(v) > 1}
    if not repeated:
        return []
    shown = ", ".join(f"{k!r} (rows {', '.join(map(str, v))})" for k, v in list(repeated.items())[:5])
    more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
    line = f"warning: {spec.name}: {len(repeated)} source id(s) in column {spec.id_column!r} on several rows: "
    print(line + shown + more, file=stream if stream is not None else sys.stderr)
    return [line + shown + more]


def load_hub(spec: EvalSet) -> Source:
    """Load one set's split from the Hugging Face hub through the ``datasets`` library."""
    import datasets  # imported here: only the hub path needs it

    try:
        if spec.hub_config:
            ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.split)
        else:
            ds = datasets.load_dataset(spec.hub_id, split=spec.split)
    except Exception as e:  # network, auth (GPQA is gated: accept its terms, then `hf auth login`), ...
        raise DataPrepError(
            f"could not load {spec.hub_id} (config {spec.hub_config}, split {spec.split}) for set {spec.name!r} "
            f"from the hub: {e}; without hub access, pass local files with --input_dir"
        ) from e
    return hub_source(f"{spec.hub_id}[{spec.split}]", ds)


def find_local(input_dir: Path, name: str) -> Path:
    """``input_dir/<name>.parquet`` (or .jsonl / .json)."""
    candidates = [input_dir / f"{name}{ext}" for ext in (".parquet", ".jsonl", ".json")]
    found = [path for path in candidates if path.is_file()]
    if len(found) > 1:
        raise DataPrepError(
            f"set {name!r}: {' and '.join(str(p) for p in found)} all exist in --input_dir; keep one (move the "
            "others away), so the set's source is not a silent choice"
        )
    if found:
        return found[0]
    raise DataPrepError(f"no local file for set {name!r}: expected one of {', '.join(str(c) for c in candidates)}")


def parse_sets(text: str) -> list[str]:
    """``"all"`` or a comma-separated list of set names (validated)."""
    names = list(EVAL_SETS) if text.strip() == "all" else [n.strip() for n in text.split(",")]
    if not all(names):  # "math500," as "" : an empty item is a slip, not "the others"
        raise DataPrepError(f"--sets {text!r} has an empty item; choose from: {', '.join(EVAL_SETS)} or all")
    unknown = [n for n in names if n not in EVAL_SETS]
    if unknown:
        raise DataPrepError(f"unknown set(s) {unknown or text!r}; choose from: {', '.join(EVAL_SETS)} or all")
    return list(dict.fromkeys(names))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--local_dir", required=True, help="output folder; <set>.parquet is written per set")
    p.add_argument("--sets", default="all", help=f"comma-separated subset of: {', '.join(EVAL_SETS)} (default all)")
    p.add_argument("--input_dir", help="read <input_dir>/<set>.parquet|.jsonl|.json (hub schema) instead of the hub")
    p.add_argument("--strict", action="store_true", help="any bad row is fatal (non-zero exit, nothing written)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """CLI entry point; returns the process exit code.

    All selected sets are converted before anything is written, so an error in one set leaves
    the output folder untouched; each file is then written atomically.
    """
    args = parse_args(argv)
    try:
        names = parse_sets(args.sets)
        results = []
        for name in names:
            spec = EVAL_SETS[name]
            source = read_local(find_local(Path(args.input_dir), name)) if args.input_dir else load_hub(spec)
            records, summary = convert(spec, source, strict=args.strict)
            results.append((spec, records, summary))
        out_dir = Path(os.path.expanduser(args.local_dir))
        for spec, records, summary in results:
            instruction = GPQA_INSTRUCTION if spec.kind == "mc" else INSTRUCTION
            metadata = {
                "set": spec.name,
                "dataset": spec.hub_id,
                "instruction": instruction,
                "index_order": "source order",
                "rows": summary.written,
            }
            write_parquet_atomic(to_table(records, metadata), out_dir / f"{spec.name}.parquet")
    except DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unreadable input, disk full, ...: any earlier output file is left intact
        print(f"error: {e} (no partial output left behind)", file=sys.stderr)
        return 2
    for spec, _, summary in results:
        print(summary.line())
    print(f"wrote {len(results)} set(s) to {out_dir}: {', '.join(s.name + '.parquet' for s, _, _ in results)}")
    return 0


if __name__ == "__main__":
    from verl_ext.interrupt import run_main

    run_main(
        "eval_sets.py", main, detail="nothing written for the set being converted (each file is written atomically)"
    )
