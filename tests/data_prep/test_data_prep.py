"""Tests for data_prep/: DAPO train set, evaluation sets, custom reward function.

No hub access: every test writes small files in the real source schemas. The round trip goes
through verl's own RLHFDataset, verl's math_dapo scorer and verl's reward-loading code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recipe_helpers.paths import REPO

from data_prep import common, dapo, eval_sets

DAPO_PREFIX = common.KNOWN_PREFIXES[0] + "\n\n"
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# (problem, answer) pairs in DAPO's style: integer answers plus a few LaTeX ones.
PROBLEMS = [
    ("Find the remainder when $2^{100}$ is divided by $7$.", "2"),
    ("How many positive divisors does $360$ have?", "24"),
    ("Compute $\\frac{1}{2}+\\frac{1}{3}$. The answer is in the form $\\frac{m}{n}$; give $m+n$.", "11"),
    ("The side of an equilateral triangle is $4$. What is its height?", "2\\sqrt{3}"),
    ("Let $x$ satisfy $3x+5=20$. Find $x$.", "5"),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720"),
]


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def processed_row(i: int, problem: str, answer: str, wrapped: bool = False) -> dict:
    """A row of open-r1/DAPO-Math-17k-Processed (prompt optionally still in DAPO's template)."""
    content = DAPO_PREFIX + problem + DAPO_SUFFIX
    return {
        "prompt": content if wrapped else problem,
        "solution": answer,
        "data_source": "math_dapo",
        "source_prompt": [{"content": content, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"uuid-{i:04d}"},
    }


def raw_row(i: int, problem: str, answer: str) -> dict:
    """A row of BytedTsinghua-SIA/DAPO-Math-17k (chat prompt, answer in reward_model)."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"raw-{i:05d}"},
    }


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def run_dapo(tmp_path: Path, input_path: Path, *extra: str, out: str = "out") -> tuple[int, Path]:
    out_dir = tmp_path / out
    code = dapo.main(["--input", str(input_path), "--local_dir", str(out_dir), *extra])
    return code, out_dir / "train.parquet"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level tokenizer built offline (decode(encode(s)) == s), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<pad>", "<eos>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    hf.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return hf


def load_rlhf(files, tokenizer, tmp_path: Path, monkeypatch):
    """Load parquet files with verl's RLHFDataset, keeping the datasets cache inside tmp_path."""
    import datasets
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    cfg = OmegaConf.create({"max_prompt_length": 4096, "cache_dir": str(tmp_path / "verl_cache")})
    ds = RLHFDataset([str(f) for f in files], tokenizer, cfg)
    return [ds[i] for i in range(len(ds))]


# ------------------------------------------------------------------------------------------
# DAPO train set
# ------------------------------------------------------------------------------------------


def test_processed_schema_roundtrip_through_verl_rlhfdataset(tmp_path, tokenizer, monkeypatch, capsys):
    rows = [processed_row(i, p, a, wrapped=(i % 2 == 1)) for i, (p, a) in enumerate(PROBLEMS)]
    code, out = run_dapo(tmp_path, write_parquet(tmp_path / "processed.parquet", rows))
    assert code == 0
    assert "[dapo] summary: read=6 written=6 duplicates_merged=0 dropped=0" in capsys.readouterr().out

    written = read_rows(out)
    assert [r["extra_info"]["index"] for r in written] == list(range(len(PROBLEMS)))
    by_answer = {r["reward_model"]["ground_truth"]: r for r in written}
    for i, (problem, answer) in enumerate(PROBLEMS):
        r = by_answer[answer]
        assert r["data_source"] == "math_dapo"
        assert r["reward_model"] == {"style": "rule", "ground_truth": answer}
        assert r["prompt"] == [{"role": "user", "content": f"{problem} {common.INSTRUCTION}"}]
        assert r["extra_info"]["source_index"] == f"uuid-{i:04d}"
        assert r["extra_info"]["prompt_hash"] == common.prompt_hash(problem)
        # the DAPO "Answer:" template is gone; exactly one instruction remains
        assert "Answer:" not in r["prompt"][0]["content"]
        assert r["prompt"][0]["content"].count("\\boxed{}") == 1

    items = load_rlhf([out], tokenizer, tmp_path, monkeypatch)
    assert len(items) == len(PROBLEMS)
    for item in items:
        assert item["index"] == item["extra_info"]["index"]
        assert item["raw_prompt"][0]["role"] == "user"
    assert sorted(item["index"] for item in items) == list(range(len(PROBLEMS)))


def test_raw_schema_duplicates_merge_to_one_index_matching_processed(tmp_path, capsys):
    rng = np.random.default_rng(0)
    raw = [raw_row(k, p, a) for k in range(5) for p, a in PROBLEMS]  # every problem 5x
    raw = [raw[i] for i in rng.permutation(len(raw))]
    code, out = run_dapo(tmp_path, write_parquet(tmp_path / "raw.parquet", raw), out="raw")
    assert code == 0
    assert "read=30 written=6 duplicates_merged=24 dropped=0" in capsys.readouterr().out
    raw_rows = read_rows(out)
    assert all(r["extra_info"]["num_duplicates"] == 5 for r in raw_rows)
    assert all(r["extra_info"]["source_index"].startswith("raw-") for r in raw_rows)

    processed = [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)]
    code, out_p = run_dapo(tmp_path, write_parquet(tmp_path / "p.parquet", processed), out="proc")
    assert code == 0
    index_raw = {r["extra_info"]["prompt_hash"]: r["extra_info"]["index"] for r in raw_rows}
    index_proc = {r["extra_info"]["prompt_hash"]: r["extra_info"]["index"] for r in read_rows(out_p)}
    assert index_raw == index_proc  # same problem -> same id, whichever schema it came from
    assert sorted(index_raw.values()) == list(range(6))


def test_index_does_not_depend_on_row_order(tmp_path):
    rows = [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)]
    _, a = run_dapo(tmp_path, write_parquet(tmp_path / "a.parquet", rows), out="a")
    _, b = run_dapo(tmp_path, write_parquet(tmp_path / "b.parquet", rows[::-1]), out="b")
    ids = lambda path: {r["prompt"][0]["content"]: r["extra_info"]["index"] for r in read_rows(path)}  # noqa: E731
    assert ids(a) == ids(b)


def test_deterministic_byte_identical_output(tmp_path):
    rows = [raw_row(k, p, a) for k in range(3) for p, a in PROBLEMS]
    src = write_parquet(tmp_path / "raw.parquet", rows)
    _, first = run_dapo(tmp_path, src, out="one")
    _, second = run_dapo(tmp_path, src, out="two")
    assert first.read_bytes() == second.read_bytes()
    # re-running into the same folder is idempotent too
    before = first.read_bytes()
    run_dapo(tmp_path, src, out="one")
    assert first.read_bytes() == before
    meta = pq.ParquetFile(first).metadata.metadata  # the file's key/value metadata
    assert set(meta) == {b"gdro_data_prep", b"ARROW:schema"}  # no pandas index, no timestamps
    assert json.loads(meta[b"gdro_data_prep"])["rows"] == 6
    assert b"pandas" not in first.read_bytes()


def test_runs_as_script_and_as_module(tmp_path):
    src = write_parquet(tmp_path / "p.parquet", [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)])
    outputs = []
    for n, cmd in enumerate(
        (["data_prep/dapo.py"], ["-m", "data_prep.dapo"]),
    ):
        out_dir = tmp_path / f"run{n}"
        proc = subprocess.run(
            [sys.executable, *cmd, "--input", str(src), "--local_dir", str(out_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "[dapo] summary: read=6 written=6 duplicates_merged=0 dropped=0" in proc.stdout
        outputs.append((out_dir / "train.parquet").read_bytes())
    assert outputs[0] == outputs[1]

    proc = subprocess.run(
        [sys.executable, "data_prep/eval_sets.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "--input_dir" in proc.stdout


def test_language_filter_drops_cjk_problems_only_when_asked(tmp_path, capsys):
    rows = [raw_row(0, p, a) for p, a in PROBLEMS] + [raw_row(1, "求 $1+1$ 的值。", "2")] * 2
    src = write_parquet(tmp_path / "raw.parquet", rows)
    code, out = run_dapo(tmp_path, src, out="en")
    assert code == 0 and len(read_rows(out)) == 6
    assert "read=8 written=6 duplicates_merged=0 dropped=0 filtered_non_english=2" in capsys.readouterr().out
    code, out = run_dapo(tmp_path, src, "--language", "all", out="all")
    assert code == 0 and len(read_rows(out)) == 7


# Bad rows: (description, bad row or JSONL line, column named in the message, drop reason).
GOOD = [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS[:3])]
BAD_CASES = [
    ("answer null", {**processed_row(9, "What is $7 \\cdot 6$?", "42"), "solution": None}, "solution", "no answer"),
    ("answer empty", {**processed_row(9, "What is $7 \\cdot 6$?", "42"), "solution": "  "}, "solution", "no answer"),
    ("prompt empty", {**processed_row(9, "x", "42"), "prompt": "   "}, "prompt", "empty prompt"),
    (
        "prompt only an instruction",
        {**processed_row(9, "x", "42"), "prompt": DAPO_PREFIX + DAPO_SUFFIX},
        "prompt",
        "empty prompt",
    ),
    ("prompt wrong type", {**processed_row(9, "x", "42"), "prompt": 1234}, "prompt", "wrong type"),
    (
        "answer wrong type",
        {**processed_row(9, "What is $7 \\cdot 6$?", "42"), "solution": {"value": 42}},
        "solution",
        "wrong type",
    ),
    (
        "column missing in row",
        {k: v for k, v in processed_row(9, "What is 6*7?", "42").items() if k != "solution"},
        "solution",
        "missing column in this row",
    ),
    ("invalid json", '{"prompt": "What is 6*7?", "solution": ', None, "invalid JSON"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_row_dropped_and_counted(tmp_path, capsys, case):
    _, bad, column, reason = case
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD[0], GOOD[1], bad, GOOD[2]])
    code, out = run_dapo(tmp_path, src)
    assert code == 0
    captured = capsys.readouterr()
    assert "row 2 (line 3)" in captured.err
    if column:
        assert f"column '{column}'" in captured.err
    assert "read=4 written=3 duplicates_merged=0 dropped=1" in captured.out
    assert f"(dropped: {reason}: 1)" in captured.out
    assert len(read_rows(out)) == 3


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_row_fatal_with_strict(tmp_path, capsys, case):
    _, bad, column, _ = case
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD[0], bad, GOOD[1]])
    code, out = run_dapo(tmp_path, src, "--strict")
    assert code != 0
    err = capsys.readouterr().err
    assert "row 1 (line 2)" in err and "--strict" in err
    if column:
        assert f"column '{column}'" in err
    assert not out.exists() and not out.parent.exists()


@pytest.mark.parametrize("strict", [False, True])
def test_raw_schema_bad_rows(tmp_path, capsys, strict):
    no_gt = raw_row(9, "What is 6*7?", "42")
    no_gt["reward_model"] = {"style": "rule"}
    bad_prompt = {**raw_row(9, "What is 6*7?", "42"), "prompt": "not a message list"}
    src = write_jsonl(tmp_path / "raw.jsonl", [raw_row(0, *PROBLEMS[0]), no_gt, bad_prompt, raw_row(0, *PROBLEMS[1])])
    code, out = run_dapo(tmp_path, src, *(["--strict"] if strict else []), "--schema", "raw")
    captured = capsys.readouterr()
    assert "row 1 (line 2), column 'reward_model.ground_truth'" in captured.err
    if strict:
        assert code != 0 and not out.exists()
    else:
        assert code == 0
        assert "row 2 (line 3), column 'prompt': wrong type" in captured.err
        assert "read=4 written=2 duplicates_merged=0 dropped=2" in captured.out


@pytest.mark.parametrize("strict", [False, True])
def test_missing_column_is_fatal_and_named(tmp_path, capsys, strict):
    rows = [{k: v for k, v in processed_row(i, p, a).items() if k != "solution"} for i, (p, a) in enumerate(PROBLEMS)]
    code, out = run_dapo(
        tmp_path,
        write_parquet(tmp_path / "p.parquet", rows),
        *(["--strict"] if strict else []),
        "--schema",
        "processed",
    )
    assert code != 0
    err = capsys.readouterr().err
    assert "missing column(s) 'solution'" in err and "in every row" in err
    assert not out.exists()


@pytest.mark.parametrize("strict", [False, True])
def test_conflicting_duplicate_answers(tmp_path, capsys, strict):
    rows = [raw_row(0, *PROBLEMS[0]), raw_row(1, *PROBLEMS[1]), raw_row(2, PROBLEMS[0][0], "3")]
    code, out = run_dapo(tmp_path, write_jsonl(tmp_path / "raw.jsonl", rows), *(["--strict"] if strict else []))
    captured = capsys.readouterr()
    assert "row 2 (line 3), column 'reward_model.ground_truth': conflicting duplicate" in captured.err
    if strict:
        assert code != 0 and not out.exists()
    else:
        assert code == 0 and "dropped=1" in captured.out
        assert {r["reward_model"]["ground_truth"] for r in read_rows(out)} == {"2", "24"}


def test_atomic_write_failure_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    src = write_parquet(tmp_path / "p.parquet", [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)])
    code, out = run_dapo(tmp_path, src)
    assert code == 0
    before = out.read_bytes()

    def failing_write(table, where, **kwargs):
        where.write(b"PAR1 half a file")  # the atomic writer's temporary file object
        raise OSError(28, "No space left on device")

    src2 = write_parquet(tmp_path / "p2.parquet", [processed_row(0, *PROBLEMS[0])])
    monkeypatch.setattr(common.pq, "write_table", failing_write)  # the disk fills up mid-write
    code, _ = run_dapo(tmp_path, src2)
    assert code != 0
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_bytes() == before  # the previous complete file is untouched
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.parquet"]  # no temp file left

    code, fresh = run_dapo(tmp_path, src2, out="fresh")
    assert code != 0
    assert not fresh.exists() and list(fresh.parent.iterdir()) == []


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_output_files_honour_the_umask(tmp_path, capsys, umask, expected):
    """Written files used to be 0600 (mkstemp's mode) whatever the umask: unreadable by other users
    and by Ray workers under other accounts on shared cluster storage."""
    src = write_parquet(tmp_path / "p.parquet", [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)])
    old = os.umask(umask)
    try:
        code, out = run_dapo(tmp_path, src)
    finally:
        os.umask(old)
    assert code == 0, capsys.readouterr().err
    assert out.stat().st_mode & 0o777 == expected
    assert pq.read_table(out).num_rows == len(PROBLEMS)


def test_hub_loading_uses_datasets_with_the_processed_en_config(tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert dapo.main(["--local_dir", str(tmp_path / "hub")]) == 0
    assert calls == [("open-r1/DAPO-Math-17k-Processed", "en", "train")]
    rows = read_rows(tmp_path / "hub" / "train.parquet")
    assert len(rows) == 6 and rows[0]["extra_info"]["dataset"] == "open-r1/DAPO-Math-17k-Processed"

    calls.clear()
    assert eval_sets.main(["--local_dir", str(tmp_path / "ev"), "--sets", "minerva,gpqa_diamond"]) != 0  # wrong cols
    assert calls == [("math-ai/minervamath", None, "test")]


def test_hub_failure_gives_a_clear_message(tmp_path, monkeypatch, capsys):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert dapo.main(["--local_dir", str(tmp_path / "a")]) != 0
    assert "pass a local copy with --input" in capsys.readouterr().err
    assert eval_sets.main(["--local_dir", str(tmp_path / "b"), "--sets", "aime2024"]) != 0
    assert "pass local files with --input_dir" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=80).filter(lambda s: s.strip()))
def test_instruction_stripping_is_idempotent(text):
    problem = common.strip_instructions(text)
    assert common.strip_instructions(problem) == problem
    wrapped = common.user_prompt(problem)[0]["content"]
    if problem:
        assert common.strip_instructions(wrapped) == problem  # re-processing never doubles it
        assert common.strip_instructions(DAPO_PREFIX + problem + DAPO_SUFFIX) == problem


# ------------------------------------------------------------------------------------------
# Evaluation sets
# ------------------------------------------------------------------------------------------

GPQA_ROWS = [
    {
        "Pre-Revision Question": "q",
        "Question": "Which particle mediates the electromagnetic force?",
        "Correct Answer": "Photon",
        "Incorrect Answer 1": "Gluon",
        "Incorrect Answer 2": "W boson",
        "Incorrect Answer 3": "Graviton",
        "Explanation": "QED.",
        "Subdomain": "Physics (general)",
        "High-level domain": "Physics",
        "Record ID": "rec001",
    },
    {
        "Pre-Revision Question": "q",
        "Question": "What is the oxidation state of Mn in KMnO4?",
        "Correct Answer": "+7",
        "Incorrect Answer 1": "+2",
        "Incorrect Answer 2": "+4",
        "Incorrect Answer 3": "+6",
        "Explanation": "K is +1, O is -2.",
        "Subdomain": "Inorganic Chemistry",
        "High-level domain": "Chemistry",
        "Record ID": "rec002",
    },
    {
        "Pre-Revision Question": "q",
        "Question": "Which base pairs with adenine in DNA?",
        "Correct Answer": "Thymine",
        "Incorrect Answer 1": "Uracil",
        "Incorrect Answer 2": "Cytosine",
        "Incorrect Answer 3": "Guanine",
        "Explanation": "A-T.",
        "Subdomain": "Molecular Biology",
        "High-level domain": "Biology",
        "Record ID": "rec003",
    },
]

# Each set in its real hub schema: (rows, file format, expected ground truths).
EVAL_FIXTURES = {
    "math500": (
        [
            {
                "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
                "solution": "... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
                "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                "subject": "Precalculus",
                "level": 2,
                "unique_id": "test/precalculus/807.json",
            },
            {
                "problem": "What is $\\frac{14}{3}$ simplified as a fraction?",
                "solution": "...",
                "answer": "\\frac{14}{3}",
                "subject": "Algebra",
                "level": 1,
                "unique_id": "test/algebra/1.json",
            },
        ],
        "parquet",
        ["\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{14}{3}"],
    ),
    "aime2024": (
        [
            {
                "id": 60,
                "problem": "Every morning Aya goes for a $9$-kilometer-long walk...",
                "solution": "...",
                "answer": "204",
                "url": "https://artofproblemsolving.com/x",
                "year": "2024",
            }
        ],
        "parquet",
        ["204"],
    ),
    "aime2025": (
        [
            {
                "problem_idx": 1,
                "problem": "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b$.",
                "answer": 70,
                "problem_type": ["Number Theory"],
            },
            {
                "problem_idx": 2,
                "problem": "On $\\triangle ABC$ points $A,D,E$, and $B$ lie that order...",
                "answer": 588,
                "problem_type": ["Geometry"],
            },
        ],
        "parquet",
        ["70", "588"],
    ),
    "amc23": (
        [
            {
                "id": 0,
                "question": "Cities $A$ and $B$ are $45$ miles apart. How many miles from City $A$ will they meet?",
                "answer": 27.0,
                "url": "https://x",
            },
            {
                "id": 1,
                "question": "Positive real numbers satisfy $y^3=x^2$ and $(y-x)^2=4y^2$. What is $x+y$?",
                "answer": 36.0,
                "url": "https://x",
            },
        ],
        "parquet",
        ["27", "36"],
    ),
    "minerva": (
        [
            {
                "question": "Each of the two Magellan telescopes has a diameter of $6.5 \\mathrm{~m}$. "
                "Compute the angular resolution in arcseconds.",
                "answer": "0.49",
            },
            {
                "question": "Compute the wavelength in meters of light with frequency $3 \\times 10^{14}$ Hz.",
                "answer": "1e-6",
            },
        ],
        "jsonl",
        ["0.49", "1e-6"],
    ),
    "olympiadbench": (
        [
            {
                "id": 1606,
                "question": "Xenia and Sergey play a game. Find the smallest $n$.",
                "solution": ["..."],
                "final_answer": ["$\\frac{1}{2}$"],
                "context": None,
                "image_1": None,
                "modality": "Text-only",
                "difficulty": "Competition",
                "is_multiple_answer": False,
                "unit": None,
                "answer_type": "Numerical",
                "error": None,
                "question_type": "Open-ended",
                "subfield": "Algebra",
                "subject": "Math",
                "language": "English",
            },
            {
                "id": 1607,
                "question": "Find all real $x$ with $x^2=9$.",
                "solution": ["..."],
                "final_answer": ["$3$", "$-3$"],
                "context": None,
                "image_1": None,
                "modality": "Text-only",
                "difficulty": "Competition",
                "is_multiple_answer": True,
                "unit": None,
                "answer_type": "Numerical",
                "error": None,
                "question_type": "Open-ended",
                "subfield": "Algebra",
                "subject": "Math",
                "language": "English",
            },
        ],
        "jsonl",
        ["\\frac{1}{2}", "3, -3"],
    ),
    "gpqa_diamond": (GPQA_ROWS, "parquet", None),
}


def write_eval_inputs(folder: Path, overrides: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (rows, fmt, _) in EVAL_FIXTURES.items():
        rows = (overrides or {}).get(name, rows)
        if fmt == "parquet":
            write_parquet(folder / f"{name}.parquet", rows)
        else:
            write_jsonl(folder / f"{name}.jsonl", rows)
    return folder


@pytest.fixture(scope="module")
def eval_out(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval")
    inputs = write_eval_inputs(base / "raw")
    code = eval_sets.main(["--local_dir", str(base / "out"), "--input_dir", str(inputs)])
    assert code == 0
    return base / "out"


def test_eval_sets_rows_and_data_sources(eval_out):
    assert sorted(p.name for p in eval_out.iterdir()) == sorted(f"{n}.parquet" for n in eval_sets.EVAL_SETS)
    for name, (source_rows, _, truths) in EVAL_FIXTURES.items():
        rows = read_rows(eval_out / f"{name}.parquet")
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(source_rows)))
        assert {r["data_source"] for r in rows} == {name}
        assert all(r["extra_info"]["dataset"] == eval_sets.EVAL_SETS[name].hub_id for r in rows)
        if truths is not None:
            assert [r["reward_model"]["ground_truth"] for r in rows] == truths
            assert all(r["prompt"][0]["content"].endswith(" " + common.INSTRUCTION) for r in rows)
    math500 = read_rows(eval_out / "math500.parquet")
    assert math500[0]["extra_info"]["source_index"] == "test/precalculus/807.json"


def _math_responses(truth: str) -> tuple[list[str], list[str]]:
    right = [f"We compute carefully.\nThus the result is $\\boxed{{{truth}}}$.", f"Some work.\nAnswer: {truth}"]
    wrong = [
        "We compute carefully.\nThus the result is $\\boxed{123456}$.",
        "Some work.\nAnswer: 123456",
        "I do not know.",
    ]
    return right, wrong


def test_math_sets_scored_by_math_dapo_through_reward_fn(eval_out):
    from verl.utils.reward_score import default_compute_score, math_dapo

    from data_prep import reward_fn

    for name in eval_sets.EVAL_SETS:
        if eval_sets.EVAL_SETS[name].kind != "math":
            continue
        for row in read_rows(eval_out / f"{name}.parquet"):
            gt = row["reward_model"]["ground_truth"]
            right, wrong = _math_responses(gt)
            for response in right:
                result = reward_fn.compute_score(row["data_source"], response, gt, row["extra_info"])
                assert result["score"] == 1.0 and result["acc"] is True, (name, response, result)
                assert result == math_dapo.compute_score(response, gt)
            for response in wrong:
                result = reward_fn.compute_score(row["data_source"], response, gt, row["extra_info"])
                assert result["score"] == -1.0 and result["acc"] is False, (name, response, result)
        # verl's own router would not score these names with math_dapo (the reason for reward_fn)
        if not name.startswith("aime"):
            with pytest.raises(NotImplementedError):
                default_compute_score(name, "\\boxed{1}", "1")


def test_train_rows_scored_by_verl_default_math_dapo_and_reward_fn(tmp_path):
    from verl.utils.reward_score import default_compute_score

    from data_prep import reward_fn

    _, out = run_dapo(
        tmp_path, write_parquet(tmp_path / "p.parquet", [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)])
    )
    for row in read_rows(out):
        gt = row["reward_model"]["ground_truth"]
        right, wrong = _math_responses(gt)
        for fn in (default_compute_score, reward_fn.compute_score):
            for response in right:
                assert fn(row["data_source"], response, gt, row["extra_info"])["score"] == 1.0
            for response in wrong:
                res = fn(row["data_source"], response, gt, row["extra_info"])
                assert res["score"] == -1.0 and res["acc"] is False


def test_gpqa_rows_options_and_scoring(eval_out):
    from data_prep import reward_fn

    rows = read_rows(eval_out / "gpqa_diamond.parquet")
    assert [r["extra_info"]["source_index"] for r in rows] == ["rec001", "rec002", "rec003"]
    for row, src in zip(rows, GPQA_ROWS, strict=True):
        letter = row["reward_model"]["ground_truth"]
        content = row["prompt"][0]["content"]
        assert letter in "ABCD" and row["ability"] == "science"
        assert f"\n{letter}) {src['Correct Answer']}\n" in content  # the letter points at the right option
        for wrong in ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"):
            assert f") {src[wrong]}\n" in content
        assert content.endswith(eval_sets.GPQA_INSTRUCTION)
        assert row["extra_info"]["answer"] == src["Correct Answer"]
        other = next(c for c in "ABCD" if c != letter)
        for response, expected in [
            (f"Reasoning...\nThe answer is $\\boxed{{{letter}}}$", 1.0),
            (f"Reasoning...\n\\boxed{{\\text{{({letter})}}}}", 1.0),
            (f"Reasoning...\nAnswer: {letter}) {src['Correct Answer']}", 1.0),
            (f"Reasoning...\nThe answer is $\\boxed{{{other}}}$", -1.0),
            (f"Reasoning...\n\\boxed{{{src['Correct Answer']}}}", -1.0),  # the text, not the letter
            ("no idea", -1.0),
        ]:
            result = reward_fn.compute_score("gpqa_diamond", response, letter, row["extra_info"])
            assert result["score"] == expected and result["acc"] is (expected > 0), (response, result)
            assert set(result) == {"score", "acc", "pred"}


def test_gpqa_shuffle_is_seeded_by_question():
    q, correct, wrong = "What?", "yes", ["no", "maybe", "never"]
    assert eval_sets.gpqa_layout(q, correct, wrong) == eval_sets.gpqa_layout(q, correct, wrong)
    letters = {eval_sets.gpqa_layout(f"Question {i}?", correct, wrong)[1] for i in range(40)}
    assert letters == set("ABCD")  # not always the same slot
    options, letter = eval_sets.gpqa_layout(q, correct, wrong)
    assert options["ABCD".index(letter)] == correct and sorted(options) == sorted([correct, *wrong])


def test_eval_sets_load_together_through_verl_rlhfdataset(eval_out, tokenizer, tmp_path, monkeypatch):
    files = sorted(eval_out.glob("*.parquet"))
    items = load_rlhf(files, tokenizer, tmp_path, monkeypatch)  # one concatenated dataset, like data.val_files
    assert len(items) == sum(len(rows) for rows, _, _ in EVAL_FIXTURES.values())
    assert {item["data_source"] for item in items} == set(eval_sets.EVAL_SETS)
    for item in items:
        assert item["index"] == item["extra_info"]["index"]


def test_eval_sets_deterministic(tmp_path, eval_out):
    inputs = write_eval_inputs(tmp_path / "raw")
    assert eval_sets.main(["--local_dir", str(tmp_path / "again"), "--input_dir", str(inputs)]) == 0
    for name in eval_sets.EVAL_SETS:
        assert (tmp_path / "again" / f"{name}.parquet").read_bytes() == (eval_out / f"{name}.parquet").read_bytes()


EVAL_BAD = [
    (
        "aime2025",
        {"problem_idx": 3, "problem": "Find $n$.", "answer": None, "problem_type": ["Algebra"]},
        "answer",
        "no answer",
    ),
    (
        "olympiadbench",
        {**EVAL_FIXTURES["olympiadbench"][0][0], "id": 9, "question": "Other?", "final_answer": []},
        "final_answer",
        "no answer",
    ),
    ("amc23", {"id": 5, "question": "", "answer": 3.0, "url": "u"}, "question", "empty prompt"),
    ("minerva", {"question": ["not", "a", "string"], "answer": "1"}, "question", "wrong type"),
    (
        "gpqa_diamond",
        {**GPQA_ROWS[0], "Question": "Another?", "Incorrect Answer 2": "Photon"},
        "Correct Answer",
        "ambiguous options",
    ),
]


@pytest.mark.parametrize("case", EVAL_BAD, ids=[c[0] for c in EVAL_BAD])
@pytest.mark.parametrize("strict", [False, True])
def test_eval_sets_bad_rows(tmp_path, capsys, case, strict):
    name, bad, column, reason = case
    rows, fmt, _ = EVAL_FIXTURES[name]
    inputs = write_eval_inputs(tmp_path / "raw", {name: [*rows, bad]})
    out = tmp_path / "out"
    code = eval_sets.main(["--local_dir", str(out), "--input_dir", str(inputs), *(["--strict"] if strict else [])])
    captured = capsys.readouterr()
    assert f"{name}: row {len(rows)}" in captured.err and f"column '{column}'" in captured.err
    if strict:
        assert code != 0 and not out.exists()  # no set is written when one fails
    else:
        assert code == 0
        assert (
            f"[{name}] summary: read={len(rows) + 1} written={len(rows)} duplicates_merged=0 dropped=1"
            f" (dropped: {reason}: 1)" in captured.out
        )
        assert len(read_rows(out / f"{name}.parquet")) == len(rows)


def test_eval_sets_missing_column_or_file_is_fatal(tmp_path, capsys):
    inputs = write_eval_inputs(
        tmp_path / "raw",
        {"gpqa_diamond": [{k: v for k, v in r.items() if k != "Incorrect Answer 3"} for r in GPQA_ROWS]},
    )
    code = eval_sets.main(["--local_dir", str(tmp_path / "out"), "--input_dir", str(inputs)])
    assert code != 0 and "missing column(s) 'Incorrect Answer 3'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

    os.remove(inputs / "amc23.parquet")
    code = eval_sets.main(["--local_dir", str(tmp_path / "out"), "--input_dir", str(inputs), "--sets", "amc23"])
    assert code != 0 and "no local file for set 'amc23'" in capsys.readouterr().err

    code = eval_sets.main(["--local_dir", str(tmp_path / "out"), "--input_dir", str(inputs), "--sets", "mmlu"])
    assert code != 0 and "unknown set" in capsys.readouterr().err


def test_eval_sets_hub_ids(tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split))
        set_name = next(s.name for s in eval_sets.EVAL_SETS.values() if s.hub_id == name)
        return datasets.Dataset.from_list(EVAL_FIXTURES[set_name][0])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert eval_sets.main(["--local_dir", str(tmp_path / "out")]) == 0
    assert calls == [
        ("HuggingFaceH4/MATH-500", None, "test"),
        ("HuggingFaceH4/aime_2024", None, "train"),
        ("MathArena/aime_2025", None, "train"),
        ("math-ai/amc23", None, "test"),
        ("math-ai/minervamath", None, "test"),
        ("math-ai/olympiadbench", None, "test"),
        ("Idavidrein/gpqa", "gpqa_diamond", "train"),
    ]


# ------------------------------------------------------------------------------------------
# Reward function wiring in verl 0.9.1
# ------------------------------------------------------------------------------------------


def test_reward_fn_routes_every_data_source_we_write():
    from data_prep import reward_fn

    math_sets = {n for n, s in eval_sets.EVAL_SETS.items() if s.kind == "math"}
    mc_sets = {n for n, s in eval_sets.EVAL_SETS.items() if s.kind == "mc"}
    assert reward_fn.MATH_DATA_SOURCES == math_sets | {dapo.DATA_SOURCE}
    assert reward_fn.GPQA_DATA_SOURCES == mc_sets
    # other sources fall through to verl's default router
    assert reward_fn.compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    with pytest.raises(NotImplementedError):
        reward_fn.compute_score("no_such_source", "x", "y")


def test_reward_fn_through_verl_config_and_naive_reward_manager(tokenizer):
    """The documented Hydra overrides, composed on verl's ppo_trainer, load and run our function."""
    import torch
    from hydra import compose, initialize_config_module
    from verl import DataProto
    from verl.trainer.ppo.reward import get_custom_reward_fn, load_reward_manager

    overrides = {
        "pkg": "reward.custom_reward_function.path=pkg://data_prep.reward_fn",
        "file": f"reward.custom_reward_function.path={REPO / 'data_prep' / 'reward_fn.py'}",
    }
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        configs = {
            k: compose(config_name="ppo_trainer", overrides=[v, "reward.custom_reward_function.name=compute_score"])
            for k, v in overrides.items()
        }
    fn = get_custom_reward_fn(configs["pkg"])
    assert fn(data_source="aime2025", solution_str="\\boxed{70}", ground_truth="70", extra_info={})["score"] == 1.0

    manager = load_reward_manager(configs["file"], tokenizer)
    for data_source, response, truth, expected in [
        ("math500", "so the answer is \\boxed{\\frac{14}{3}}", "\\frac{14}{3}", 1.0),
        ("olympiadbench", "so the answer is \\boxed{7}", "\\frac{1}{2}", -1.0),
        ("gpqa_diamond", "Answer: C", "C", 1.0),
        ("gpqa_diamond", "\\boxed{A}", "C", -1.0),
    ]:
        ids = tokenizer.encode(response)
        pad = 4
        data = DataProto.from_dict(
            tensors={
                "prompts": torch.tensor([[1, 2, 3]]),
                "responses": torch.tensor([ids + [tokenizer.pad_token_id] * pad]),
                "attention_mask": torch.tensor([[1, 1, 1] + [1] * len(ids) + [0] * pad]),
            },
            non_tensors={
                "data_source": np.array([data_source], dtype=object),
                "reward_model": np.array([{"ground_truth": truth, "style": "rule"}], dtype=object),
                "extra_info": np.array([{"index": 0}], dtype=object),
            },
        )
        result = manager.loop.run_until_complete(manager.run_single(data))
        assert result["reward_score"] == expected, (data_source, response, result)
        assert result["reward_extra_info"]["acc"] is (expected > 0)


# ---------------------------------------------------------------- unreadable inputs (issue 18, items 16-17)
def _raw_jsonl_bytes() -> bytes:
    return b"".join(json.dumps(raw_row(i, p, a)).encode() + b"\n" for i, (p, a) in enumerate(PROBLEMS))


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_non_utf8_input_is_a_one_line_error_naming_file_and_line(tmp_path, capsys, kind, strict):
    good = _raw_jsonl_bytes()
    lines = good.splitlines(keepends=True)
    if kind == "jsonl":
        blob = lines[0] + lines[1].replace(b'"', b'"\xb5', 1) + b"".join(lines[2:])
        line = 2
    else:
        items = [json.loads(x) for x in lines]
        text = json.dumps(items, indent=1).encode()
        cut = text.index(b"\n", text.index(b"\n") + 1)  # after the second line
        blob, line = text[:cut] + b"\xb5" + text[cut:], 2
    path = tmp_path / f"raw.{kind}"
    path.write_bytes(blob)
    code, out = run_dapo(tmp_path, path, *(["--strict"] if strict else []))
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.parent.exists()
    assert err.count("\n") == 0 and str(path) in err and f"line {line}" in err and "not UTF-8" in err, err


def test_parquet_named_jsonl_and_a_directory_are_named(tmp_path, capsys):
    parquet = tmp_path / "raw.parquet"
    write_parquet(parquet, [raw_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)])
    disguised = tmp_path / "raw.jsonl"
    disguised.write_bytes(parquet.read_bytes())
    code, out = run_dapo(tmp_path, disguised)
    err = capsys.readouterr().err
    assert code == 2 and "is a parquet file" in err and str(disguised) in err and not out.parent.exists()
    folder = tmp_path / "a_folder"
    folder.mkdir()
    code, _ = run_dapo(tmp_path, folder)
    err = capsys.readouterr().err
    assert code == 2 and "is a directory" in err and "not found" not in err


def test_eval_sets_non_utf8_input_is_named(tmp_path, capsys):
    inputs = write_eval_inputs(tmp_path / "raw")
    jsonl = next(p for p in sorted(inputs.iterdir()) if p.suffix == ".jsonl")
    jsonl.write_bytes(b"\xff" + jsonl.read_bytes())
    for strict in ([], ["--strict"]):
        code = eval_sets.main(["--local_dir", str(tmp_path / "out"), "--input_dir", str(inputs), *strict])
        err = capsys.readouterr().err
        assert code == 2 and f"{jsonl}: line 1: not UTF-8" in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ silent choices (issue 27)
def test_silent_choices_are_refused_and_nothing_is_written(tmp_path, capsys):
    """A --split a local --input cannot have, and two local files for one evaluation set, are refused
    (exit 2) naming the split and the available ones / both files; no output folder is made."""
    src = tmp_path / "dapo.jsonl"
    write_jsonl(src, [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)])
    out = tmp_path / "out"
    code = dapo.main(["--local_dir", str(out), "--input", str(src), "--split", "nosuchsplit"])
    err = capsys.readouterr().err
    assert code == 2 and "'nosuchsplit'" in err and "available splits: train" in err, err
    assert not out.exists()
    assert dapo.main(["--local_dir", str(out), "--input", str(src), "--split", "train"]) == 0  # the one it has
    capsys.readouterr()

    inputs = write_eval_inputs(tmp_path / "raw")
    rows, fmt, _ = EVAL_FIXTURES["math500"]
    write_jsonl(inputs / "math500.jsonl", rows) if fmt == "parquet" else write_parquet(inputs / "math500.parquet", rows)
    code = eval_sets.main(["--local_dir", str(tmp_path / "eval"), "--input_dir", str(inputs), "--sets", "math500"])
    err = capsys.readouterr().err
    assert code == 2 and "math500.parquet" in err and "math500.jsonl" in err and "keep one" in err, err
    assert not (tmp_path / "eval").exists()


def test_dapo_rereading_its_own_output_keeps_the_source_dataset(tmp_path, capsys):
    """Our output's chat-list prompts look like the raw DAPO-Math-17k; the provenance it records
    (extra_info.dataset, source_index, the file's metadata) is kept, not replaced by the raw hub id."""
    src = write_parquet(tmp_path / "p.parquet", [processed_row(i, p, a) for i, (p, a) in enumerate(PROBLEMS)])
    code, first = run_dapo(tmp_path, src)
    assert code == 0
    code, second = run_dapo(tmp_path, first, out="again")
    assert code == 0, capsys.readouterr().err
    before, after = read_rows(first), read_rows(second)
    assert {r["extra_info"]["dataset"] for r in after} == {dapo.HUB_DATASET}
    assert [r["extra_info"]["source_index"] for r in after] == [r["extra_info"]["source_index"] for r in before]
    assert [r["prompt"] for r in after] == [r["prompt"] for r in before]
    assert json.loads(pq.read_schema(second).metadata[b"gdro_data_prep"])["dataset"] == dapo.HUB_DATASET


def test_eval_sets_name_repeated_and_conflicting_source_ids(tmp_path, capsys):
    """A source id on two rows is warned about by name (the rows are still kept or merged by their text);
    a conflicting duplicate's drop names both rows' source ids."""
    rows, _, _ = EVAL_FIXTURES["amc23"]
    twin = {**rows[0], "question": "A different question with the same id?", "answer": 5.0}
    conflict = {**rows[1], "id": 77, "answer": 99.0}
    inputs = write_eval_inputs(tmp_path / "raw", {"amc23": [*rows, twin, conflict]})
    code = eval_sets.main(["--local_dir", str(tmp_path / "out"), "--input_dir", str(inputs), "--sets", "amc23"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"warning: amc23: 1 source id(s) in column 'id' on several rows: '0' (rows 0, {len(rows)})" in err
    assert "conflicting duplicate: same prompt as row 1" in err and "(source id '1')" in err
    assert "(source id '77'); the first is kept" in err
    assert len(read_rows(tmp_path / "out" / "amc23.parquet")) == len(rows) + 1


def test_eval_sets_refuse_an_empty_item_in_sets(tmp_path, capsys):
    inputs = write_eval_inputs(tmp_path / "raw")
    for sets in ("math500,", "", ",amc23", "math500,,amc23"):
        code = eval_sets.main(["--local_dir", str(tmp_path / "out"), "--input_dir", str(inputs), "--sets", sets])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith(f"error: --sets {sets!r} has an empty item"), (sets, err)
    assert not (tmp_path / "out").exists()
