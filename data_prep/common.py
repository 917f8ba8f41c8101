"""Shared pieces of the data-prep scripts: prompt text, row validation, output schema, atomic writes.

Every file this package writes (the DAPO train set and each evaluation set) has the same fixed
Arrow schema (:data:`OUTPUT_SCHEMA`), so verl can load several of them as one dataset: verl's
``RLHFDataset`` concatenates all ``data.val_files`` with ``datasets.concatenate_datasets``, which
refuses files whose columns or struct fields differ.

Bad input is reported per row as ``row N, column 'C': what is wrong`` (rows are numbered from 0
in input order; JSONL rows also give their line number). With ``strict=True`` the first bad row
raises :class:`DataPrepError`; otherwise bad rows are dropped and counted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from verl_ext.atomic import atomic_replace

# The one answer-format instruction used for every math prompt (the GDRO authors' suffix).
# verl's math_dapo scorer reads a Minerva "Answer: ..." line first, then the last \boxed{}.
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

# Instruction wrappers found in the sources, removed before ours is appended so that no prompt
# carries two competing answer formats. The first two are the raw DAPO-Math-17k template.
KNOWN_PREFIXES = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
)
KNOWN_SUFFIXES = (
    'Remember to put your answer on its own line after "Answer:".',
    INSTRUCTION,
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Let's think step by step and output the final answer within \\boxed{}",
)

# CJK ideographs; the same ranges open-r1 used to split DAPO-Math-17k into `en` and `cn`.
_CJK_RE = re.compile(r"[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff]")

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("data_source", pa.string(), nullable=False),
        pa.field(
            "prompt",
            pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])),
            nullable=False,
        ),
        pa.field("ability", pa.string(), nullable=False),
        pa.field(
            "reward_model",
            pa.struct([pa.field("style", pa.string()), pa.field("ground_truth", pa.string())]),
            nullable=False,
        ),
        pa.field(
            "extra_info",
            pa.struct(
                [
                    pa.field("index", pa.int64()),  # dense 0..N-1, unique per distinct prompt
                    pa.field("split", pa.string()),
                    pa.field("dataset", pa.string()),  # source dataset id
                    pa.field("source_index", pa.string()),  # the source's own id, as a string
                    pa.field("source_row", pa.int64()),  # row of the first occurrence in the input
                    pa.field("prompt_hash", pa.string()),  # sha256 of the normalised problem text
                    pa.field("num_duplicates", pa.int64()),  # input rows merged into this one
                    pa.field("answer", pa.string()),  # reference answer text (GPQA: the option text)
                ]
            ),
            nullable=False,
        ),
    ]
)

# How many bad-row messages are echoed to stderr before they are only counted.
MAX_PRINTED_ISSUES = 20


class DataPrepError(Exception):
    """A fatal input problem (or, with ``--strict``, any bad row). The CLI exits non-zero."""


class RowProblem(ValueError):
    """Raised by the per-row converters; carries the offending column."""

    def __init__(self, column: str | None, message: str):
        super().__init__(message)
        self.column = column
        self.message = message


# --------------------------------------------------------------------------------------------
# Text handling
# --------------------------------------------------------------------------------------------


def strip_instructions(text: str) -> str:
    """Remove known answer-format instructions from the start/end of a problem statement.

    Also normalises line endings and Unicode (NFC) and strips outer whitespace. Idempotent.
    """
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n")).strip()
    changed = True
    while changed:
        changed = False
        for prefix in KNOWN_PREFIXES:
            if text.startswith(prefix):
                text, changed = text[len(prefix) :].strip(), True
        for suffix in KNOWN_SUFFIXES:
            if text.endswith(suffix):
                text, changed = text[: -len(suffix)].strip(), True
    return text


def prompt_hash(problem: str) -> str:
    """Content hash of a normalised problem statement (the dedup key and the index sort key)."""
    return hashlib.sha256(problem.encode("utf-8")).hexdigest()


def contains_cjk(text: str) -> bool:
    """True if the text contains a CJK ideograph (used for the English-only filter)."""
    return _CJK_RE.search(text) is not None


def user_prompt(problem: str, instruction: str = INSTRUCTION) -> list[dict[str, str]]:
    """The chat prompt for a problem: one user turn, problem then the instruction."""
    return [{"role": "user", "content": f"{problem} {instruction}"}]


def require_text(value: Any, column: str, what: str = "prompt") -> str:
    """Validate a text field; return it stripped. Raise :class:`RowProblem` if missing/empty/wrong type."""
    if value is None:
        raise RowProblem(column, f"missing {what} (null)")
    if not isinstance(value, str):
        raise RowProblem(column, f"wrong type: expected a string {what}, got {type(value).__name__}")
    text = value.strip()
    if not text:
        raise RowProblem(column, f"empty {what}")
    return text


def _strip_math_delimiters(text: str) -> str:
    text = text.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            return text[len(left) : -len(right)].strip()
    return text


def coerce_answer(value: Any, column: str, *, allow_list: bool = False) -> str:
    """Turn a source answer into the ground-truth string verl's math_dapo scorer compares against.

    math_dapo's ``\\boxed{}`` path compares the boxed text to the ground truth verbatim, so the
    ground truth must be the bare expression: integers stay integers (AMC stores 27.0), and
    surrounding ``$...$`` is removed (OlympiadBench). A list (OlympiadBench ``final_answer``) is
    joined with ", " when it holds several answers.
    """
    if value is None:
        raise RowProblem(column, "no answer (null)")
    if isinstance(value, bool):
        raise RowProblem(column, "wrong type: expected a string or number answer, got bool")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RowProblem(column, f"no answer ({value})")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        text = _strip_math_delimiters(value)
        if not text:
            raise RowProblem(column, "no answer (empty string)")
        return text
    if isinstance(value, (list, tuple)) and allow_list:
        parts = []
        for item in value:
            if not isinstance(item, str):
                raise RowProblem(
                    column, f"wrong type: expected a list of strings, got an item of type {type(item).__name__}"
                )
            if _strip_math_delimiters(item):
                parts.append(_strip_math_delimiters(item))
        if not parts:
            raise RowProblem(column, "no answer (empty list)")
        return ", ".join(parts)
    raise RowProblem(column, f"wrong type: expected a string or number answer, got {type(value).__name__}")


def get_column(row: dict, column: str) -> Any:
    """``row[column]``; a key absent from this row (possible in JSONL) is a :class:`RowProblem`."""
    if column not in row:
        raise RowProblem(column, "missing column in this row")
    return row[column]


# --------------------------------------------------------------------------------------------
# Input
# --------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One input row: its 0-based position, its fields, and a human-readable location."""

    row: int
    data: dict
    where: str


@dataclass
class Source:
    """Rows of one input (a local file or a hub split) plus the columns it has."""

    name: str
    columns: list[str]
    records: Iterator[Record]


def _record_where(row: int, line: int | None = None) -> str:
    return f"row {row}" if line is None else f"row {row} (line {line})"


def read_local(path: str | os.PathLike) -> Source:
    """Open a local ``.parquet``, ``.jsonl`` or ``.json`` (a list of objects) file.

    Parquet is streamed in record batches, so the raw 1.8M-row DAPO-Math-17k file does not need
    to fit in memory as Python objects. A JSONL line that is not a JSON object is reported as a
    bad row rather than aborting the read.
    """
    path = Path(path)
    if path.is_dir():
        raise DataPrepError(f"input is a directory, not a file: {path} (give the .parquet, .jsonl or .json file)")
    if not path.is_file():
        raise DataPrepError(f"input file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path, "rb") as f:
            if f.read(4) == b"PAR1":
                raise DataPrepError(f"{path}: is a parquet file, not {suffix[1:].upper()} text; rename it to .parquet")
    if suffix == ".parquet":
        try:
            pf = pq.ParquetFile(path)
        except pa.ArrowException as e:
            raise DataPrepError(f"{path}: not a readable parquet file: {e}") from e
        columns = list(pf.schema_arrow.names)

        def parquet_records() -> Iterator[Record]:
            row = 0
            try:
                for batch in pf.iter_batches(batch_size=8192):
                    for data in batch.to_pylist():
                        yield Record(row, data, _record_where(row))
                        row += 1
            except pa.ArrowException as e:
                raise DataPrepError(f"{path}: parquet read failed after {row} rows: {e}") from e

        return Source(str(path), columns, parquet_records())
    if suffix in (".jsonl", ".json"):
        rows: list[Record] = []
        if suffix == ".jsonl":
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    line = _decode_line(path, raw, lineno)
                    if not line.strip():
                        continue
                    row = len(rows)
                    try:
                        data = json.loads(line)
                    except json.JSONDecodeError as e:
                        data = _BadJson(f"invalid JSON: {e.msg}")
                    rows.append(Record(row, data, _record_where(row, lineno)))
        else:
            with open(path, "rb") as f:
                blob = f.read()
            try:
                text = blob.decode("utf-8")
            except UnicodeDecodeError as e:
                line = blob[: e.start].count(b"\n") + 1
                raise DataPrepError(
                    f"{path}: line {line}: not UTF-8 text (byte 0x{blob[e.start]:02x} at byte offset {e.start})"
                ) from None
            try:
                items = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataPrepError(f"{path}: invalid JSON: {e}") from e
            if not isinstance(items, list):
                raise DataPrepError(f"{path}: expected a JSON list of row objects")
            rows = [Record(i, item, _record_where(i)) for i, item in enumerate(items)]
        columns: list[str] = []
        for rec in rows:
            if isinstance(rec.data, dict) and not isinstance(rec.data, _BadJson):
                columns.extend(k for k in rec.data if k not in columns)
        return Source(str(path), columns, iter(rows))
    raise DataPrepError(f"unsupported input format {suffix!r} for {path} (use .parquet, .jsonl or .json)")


def _decode_line(path: Path, raw: bytes, lineno: int) -> str:
    """One JSONL line as text; a byte that is not UTF-8 is an input error naming the file and line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataPrepError(
            f"{path}: line {lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        ) from None


class _BadJson(dict):
    """Placeholder for an unparsable JSONL line; the converters report it as a bad row."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message


def check_row_object(rec: Record) -> dict:
    """Return the row's fields, or raise :class:`RowProblem` if the row is not an object."""
    if isinstance(rec.data, _BadJson):
        raise RowProblem(None, rec.data.message)
    if not isinstance(rec.data, dict):
        raise RowProblem(None, f"wrong type: expected a JSON object per row, got {type(rec.data).__name__}")
    return rec.data


def require_columns(source: Source, columns: list[str], what: str) -> None:
    """Fail (always fatal) if a required column is absent from the whole input."""
    missing = [c for c in columns if c not in source.columns]
    if missing:
        raise DataPrepError(
            f"{source.name}: missing column(s) {', '.join(repr(c) for c in missing)} required by the "
            f"{what} schema, in every row; columns present: {', '.join(source.columns) or '(none)'}"
        )


def hub_source(name: str, dataset: Any) -> Source:
    """Wrap a ``datasets.Dataset`` (already loaded from the hub) as a :class:`Source`."""

    def records() -> Iterator[Record]:
        for row, data in enumerate(dataset):
            yield Record(row, data, _record_where(row))

    return Source(name, list(dataset.column_names), records())


# --------------------------------------------------------------------------------------------
# Bookkeeping
# --------------------------------------------------------------------------------------------


@dataclass
class Summary:
    """Row counts of one conversion; ``read == written + duplicates_merged + dropped + filtered``."""

    name: str
    read: int = 0
    written: int = 0
    duplicates_merged: int = 0
    dropped: int = 0
    filtered: int = 0  # rows removed on purpose (the English-only filter), not errors
    drop_reasons: Counter = field(default_factory=Counter)

    def line(self) -> str:
        """The one-line summary printed by the CLIs."""
        text = (
            f"[{self.name}] summary: read={self.read} written={self.written} "
            f"duplicates_merged={self.duplicates_merged} dropped={self.dropped}"
        )
        if self.filtered:
            text += f" filtered_non_english={self.filtered}"
        if self.drop_reasons:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.drop_reasons.items()))
            text += f" (dropped: {reasons})"
        return text

    def check(self) -> None:
        """Assert the counts add up (a cheap guard against a row silently going missing)."""
        total = self.written + self.duplicates_merged + self.dropped + self.filtered
        assert total == self.read, f"row accounting mismatch in {self.name}: {self} (sum {total})"


class BadRowLog:
    """Collects bad rows: fatal at the first one with ``strict``, otherwise dropped and counted."""

    def __init__(self, summary: Summary, strict: bool, stream=None):
        self.summary = summary
        self.strict = strict
        self.stream = stream if stream is not None else sys.stderr
        self.messages: list[str] = []

    def report(self, rec: Record, problem: RowProblem) -> None:
        """Record one bad row (raises :class:`DataPrepError` in strict mode)."""
        column = f", column '{problem.column}'" if problem.column else ""
        message = f"{self.summary.name}: {rec.where}{column}: {problem.message}"
        if self.strict:
            raise DataPrepError(message + " (--strict: aborting, nothing written)")
        self.messages.append(message)
        self.summary.dropped += 1
        reason = problem.message.split(":")[0].split(" (")[0]
        self.summary.drop_reasons[reason] += 1
        if len(self.messages) <= MAX_PRINTED_ISSUES:
            print(f"warning: dropped {message}", file=self.stream)
        elif len(self.messages) == MAX_PRINTED_ISSUES + 1:
            print("warning: further bad rows are only counted", file=self.stream)


@dataclass
class Entry:
    """One distinct prompt collected during a conversion."""

    problem: str
    ground_truth: str
    source_index: str
    source_row: int
    where: str
    prompt_content: str | None = None  # set when the prompt is not problem + INSTRUCTION (GPQA)
    answer_text: str | None = None
    count: int = 1


class Deduper:
    """Merges rows whose normalised problem text is identical.

    A repeat with the same ground truth is merged (counted in ``duplicates_merged``); a repeat
    with a *different* ground truth is a bad row: which answer is right cannot be decided here.
    """

    def __init__(self, log: BadRowLog, answer_column: str):
        self.log = log
        self.answer_column = answer_column
        self.entries: dict[str, Entry] = {}

    def add(self, rec: Record, entry: Entry) -> None:
        """Add one validated row."""
        key = prompt_hash(entry.problem)
        first = self.entries.get(key)
        if first is None:
            self.entries[key] = entry
            return
        if first.ground_truth != entry.ground_truth:
            self.log.report(
                rec,
                RowProblem(
                    self.answer_column,
                    f"conflicting duplicate: same prompt as {first.where} (source id {first.source_index!r}) but "
                    f"answer {entry.ground_truth!r} instead of {first.ground_truth!r} (source id "
                    f"{entry.source_index!r}); the first is kept",
                ),
            )
            return
        first.count += 1
        self.log.summary.duplicates_merged += 1


def build_records(
    entries: list[tuple[str, Entry]],
    *,
    data_source: str,
    ability: str,
    split: str,
    dataset: str,
) -> list[dict]:
    """Output rows for ``(hash, entry)`` pairs already in index order (index = position)."""
    out = []
    for index, (key, e) in enumerate(entries):
        content = e.prompt_content if e.prompt_content is not None else user_prompt(e.problem)[0]["content"]
        out.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": content}],
                "ability": ability,
                "reward_model": {"style": "rule", "ground_truth": e.ground_truth},
                "extra_info": {
                    "index": index,
                    "split": split,
                    "dataset": dataset,
                    "source_index": e.source_index,
                    "source_row": e.source_row,
                    "prompt_hash": key,
                    "num_duplicates": e.count,
                    "answer": e.answer_text if e.answer_text is not None else e.ground_truth,
                },
            }
        )
    return out


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def to_table(records: list[dict], metadata: dict | None = None, schema: pa.Schema = OUTPUT_SCHEMA) -> pa.Table:
    """Records -> Arrow table with the fixed schema and deterministic (timestamp-free) metadata.

    ``schema`` is :data:`OUTPUT_SCHEMA` except for sets that extend it (``arith.py`` appends
    ``extra_info.skill``).
    """
    table = pa.Table.from_pylist(records, schema=schema)
    if metadata:
        table = table.replace_schema_metadata({"gdro_data_prep": json.dumps(metadata, sort_keys=True)})
    return table


def write_parquet_atomic(table: pa.Table, path: str | os.PathLike) -> None:
    """Write a parquet file so that ``path`` is either the old file or the complete new one.

    Uses the project's one atomic writer (:func:`verl_ext.atomic.atomic_replace`: a temporary file
    in the same folder, fsync, rename; removed on failure). The file gets the umask's permissions
    (0644 under umask 022), so other users and Ray workers on shared storage can read it.
    """
    # Fixed writer options: same table -> same bytes (no pandas index, no timestamps).
    with atomic_replace(path, "wb") as f:
        pq.write_table(table, f, compression="zstd", use_dictionary=True, write_statistics=True)
