"""DAPO-Math training set -> verl RL parquet (``DIR/train.parquet``).

Usage (from the repository root)::

    python data_prep/dapo.py --local_dir ~/data/dapo              # hub: open-r1/DAPO-Math-17k-Processed, en
    python -m data_prep.dapo --local_dir ~/data/dapo --input dapo.parquet   # offline, local file

Accepted inputs (``--schema auto`` tells them apart):

* ``processed``: open-r1/DAPO-Math-17k-Processed -- ``prompt`` (str, the problem), ``solution``
  (the answer), plus ``source_prompt``, ``reward_model``, ``extra_info``, ... (ignored).
* ``raw``: BytedTsinghua-SIA/DAPO-Math-17k -- ``prompt`` is a chat-message list whose user turn
  wraps the problem in DAPO's "Answer:" template, answer in ``reward_model.ground_truth``, each
  problem repeated ~100 times. Repeats are merged into one row.

Every output row: ``data_source="math_dapo"`` (verl's default reward routes it to
``math_dapo.compute_score``), a single user message "<problem> Let's think step by step and output
the final answer within \\boxed{}." (any instruction already in the source is stripped first), and
``extra_info.index``: a dense id 0..N-1 per distinct problem, assigned in order of the SHA-256 of
the normalised problem text. That order does not depend on the input's row order or format, so
the same problem set always gets the same ids (the GDRO binner keys on them).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python data_prep/dapo.py`: data_prep/_repo_path.py
    import _repo_path  # noqa: F401
if __name__ == "__main__":  # Ctrl-C from here on, the imports included: one line (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("dapo.py")

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
    contains_cjk,
    get_column,
    hub_source,
    read_local,
    require_columns,
    require_text,
    strip_instructions,
    to_table,
    write_parquet_atomic,
)

HUB_DATASET = "open-r1/DAPO-Math-17k-Processed"
HUB_CONFIG = "en"
RAW_HUB_DATASET = "BytedTsinghua-SIA/DAPO-Math-17k"
DATA_SOURCE = "math_dapo"  # routed to verl's math_dapo scorer by default_compute_score
ABILITY = "math"
OUTPUT_NAME = "train.parquet"


def detect_schema(source: Source, first_prompt) -> str:
    """``processed`` if the file has open-r1's columns or a string prompt, ``raw`` for a message list."""
    if "solution" in source.columns or "source_prompt" in source.columns:
        return "processed"
    if isinstance(first_prompt, list):
        return "raw"
    return "processed"


def _raw_problem(messages, column: str = "prompt") -> str:
    """The user turn's text from a raw DAPO chat-message list."""
    if messages is None:
        raise RowProblem(column, "missing prompt (null)")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RowProblem(
            column, f"wrong type: expected a list of {{role, content}} messages, got {type(messages).__name__}"
        )
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        raise RowProblem(column, "empty prompt (no user message)")
    return require_text(users[0].get("content"), column)


def _source_index(row: dict) -> str:
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("source_index") is not None:  # this script's own output
        return str(extra["source_index"])
    if isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])
    return ""


def recorded_dataset(row) -> str | None:
    """The source dataset a file written by this package records (``extra_info.dataset`` beside its
    ``prompt_hash``), or None for any other input. A re-read of our own output keeps that provenance,
    instead of the hub id its chat-list prompts would suggest (the raw DAPO-Math-17k)."""
    extra = row.get("extra_info") if isinstance(row, dict) else None
    if isinstance(extra, dict) and extra.get("prompt_hash") and isinstance(extra.get("dataset"), str):
        return extra["dataset"]
    return None


def convert(
    source: Source,
    *,
    schema: str = "auto",
    language: str = "en",
    strict: bool = False,
    dataset_name: str | None = None,
    stream=None,
) -> tuple[list[dict], Summary]:
    """Convert DAPO rows to verl records (sorted by index) and a :class:`Summary`.

    ``dataset_name`` goes into ``extra_info.dataset``; by default it is the hub id of the detected
    schema, so a local copy of a hub file gives the same bytes as the hub download.
    Raises :class:`DataPrepError` for input-level problems (missing column, no valid row) and, with
    ``strict``, for the first bad row.
    """
    summary = Summary("dapo")
    log = BadRowLog(summary, strict, stream)
    records = iter(source.records)

    # Peek at the first row to tell the two schemas apart; it is processed like any other row.
    first = next(records, None)
    if first is None:
        raise DataPrepError(f"{source.name}: input has no rows")
    if schema == "auto":
        first_prompt = first.data.get("prompt") if isinstance(first.data, dict) else None
        schema = detect_schema(source, first_prompt)
    if schema == "processed":
        require_columns(source, ["prompt", "solution"], "DAPO-Math-17k-Processed")
        answer_column = "solution"
    elif schema == "raw":
        require_columns(source, ["prompt", "reward_model"], "raw DAPO-Math-17k")
        answer_column = "reward_model.ground_truth"
    else:
        raise DataPrepError(f"unknown schema {schema!r}")
    if dataset_name is None:
        dataset_name = recorded_dataset(first.data) or (HUB_DATASET if schema == "processed" else RAW_HUB_DATASET)

    dedup = Deduper(log, answer_column)

    def rows():
        yield first
        yield from records

    for rec in rows():
        summary.read += 1
        try:
            row = check_row_object(rec)
            if schema == "processed":
                problem = require_text(get_column(row, "prompt"), "prompt")
                answer = coerce_answer(get_column(row, "solution"), "solution")
            else:
                problem = _raw_problem(get_column(row, "prompt"))
                reward_model = get_column(row, "reward_model")
                if reward_model is None:
                    raise RowProblem(answer_column, "no answer (reward_model is null)")
                if not isinstance(reward_model, dict):
                    raise RowProblem(
                        "reward_model", f"wrong type: expected a struct, got {type(reward_model).__name__}"
                    )
                if "ground_truth" not in reward_model:
                    raise RowProblem(answer_column, "missing column in this row")
                answer = coerce_answer(reward_model["ground_truth"], answer_column)
            problem = strip_instructions(problem)
            if not problem:
                raise RowProblem("prompt", "empty prompt (only an instruction)")
        except RowProblem as issue:
            log.report(rec, issue)
            continue
        if language == "en" and contains_cjk(problem):
            summary.filtered += 1
            continue
        dedup.add(rec, Entry(problem, answer, _source_index(row), rec.row, rec.where))

    if not dedup.entries:
        raise DataPrepError(f"{source.name}: no valid rows to write ({summary.line()})")
    ordered = sorted(dedup.entries.items())  # by prompt hash: independent of input order/format
    out = build_records(ordered, data_source=DATA_SOURCE, ability=ABILITY, split="train", dataset=dataset_name)
    summary.written = len(out)
    summary.check()
    return out, summary


def load_hub(dataset: str, config: str | None, split: str) -> Source:
    """Load a DAPO split from the Hugging Face hub through the ``datasets`` library."""
    import datasets  # imported here: only the hub path needs it

    try:
        args = (dataset, config) if config else (dataset,)
        ds = datasets.load_dataset(*args, split=split)
    except ValueError as e:
        if "split" not in str(e).lower():
            raise DataPrepError(f"could not load {dataset} (config {config}, split {split}) from the hub: {e}") from e
        try:
            names = ", ".join(datasets.get_dataset_split_names(*args))
        except Exception:  # noqa: BLE001 - the listing is a courtesy; datasets' own message follows
            names = "see the message that follows"
        raise DataPrepError(
            f"--split {split!r}: {dataset} (config {config}) has no such split; the available splits: {names} ({e})"
        ) from e
    except Exception as e:  # network, auth, missing config: one clear message instead of a traceback
        raise DataPrepError(
            f"could not load {dataset} (config {config}, split {split}) from the hub: {e}; "
            "without hub access, pass a local copy with --input"
        ) from e
    return hub_source(f"{dataset}{':' + config if config else ''}[{split}]", ds)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--local_dir", required=True, help="output folder; train.parquet is written there")
    p.add_argument("--input", help="local .parquet/.jsonl/.json in either DAPO schema (no hub access needed)")
    p.add_argument(
        "--dataset",
        default=None,
        help=f"hub dataset id (default {HUB_DATASET}; the raw one is {RAW_HUB_DATASET}); with --input, only the "
        "name recorded in extra_info.dataset (default: the hub id of the detected schema)",
    )
    p.add_argument(
        "--config", default=None, help=f"hub config (default {HUB_CONFIG!r} for {HUB_DATASET}, none otherwise)"
    )
    p.add_argument(
        "--split",
        default=None,
        help="hub split (default train); a local --input file is one split, train, and takes no other",
    )
    p.add_argument("--schema", choices=["auto", "processed", "raw"], default="auto")
    p.add_argument(
        "--language",
        choices=["en", "all"],
        default="en",
        help="en: drop problems containing CJK ideographs (what the processed `en` config did); all: keep every row",
    )
    p.add_argument("--strict", action="store_true", help="any bad row is fatal (non-zero exit, nothing written)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """CLI entry point; returns the process exit code."""
    args = parse_args(argv)
    try:
        if args.input:
            if args.split not in (None, "train"):
                raise DataPrepError(
                    f"--split {args.split!r}: a local --input file ({args.input}) holds one split, 'train'; "
                    "the available splits: train (other splits are read from the hub, without --input)"
                )
            source = read_local(args.input)
        else:
            dataset = args.dataset or HUB_DATASET
            config = args.config if args.config is not None else (HUB_CONFIG if dataset == HUB_DATASET else None)
            source = load_hub(dataset, config, args.split or "train")
        records, summary = convert(
            source, schema=args.schema, language=args.language, strict=args.strict, dataset_name=args.dataset
        )
        dataset_name = records[0]["extra_info"]["dataset"]
        out = Path(os.path.expanduser(args.local_dir)) / OUTPUT_NAME
        metadata = {
            "set": "dapo",
            "dataset": dataset_name,
            "instruction": INSTRUCTION,
            "index_order": "sha256(normalised problem text)",
            "rows": summary.written,
        }
        write_parquet_atomic(to_table(records, metadata), out)
    except DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unreadable input, disk full, ...: any earlier output file is left intact
        print(f"error: {e} (no partial output left behind)", file=sys.stderr)
        return 2
    print(summary.line())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from verl_ext.interrupt import run_main

    run_main("dapo.py", main, detail=f"nothing written ({OUTPUT_NAME} is written only at the end, atomically)")
