"""Training data the controller would take but should not silently (issue 44 item 5): sparse prompt ids that
size its per-prompt arrays far beyond the prompt count, and one prompt text under several ids. Each is a
warning of the dry run (and the launch) naming the file, the ids and the cost; before, both passed without
a word (one id of 4.9M among 640 prompts made every gdro_state.pkl 1.1 GB)."""

from __future__ import annotations

from pathlib import Path

from recipe_helpers import standins as S
from recipe_helpers.overrides import paper_overrides

from recipe.gdro.main_gdro import cli


def dry_run_warnings(capsys, rows: list[dict], tmp_path: Path) -> list[str]:
    data = S.write_parquet(str(tmp_path / "train.parquet"), rows)
    code = cli([*paper_overrides(Path(data)), f"trainer.default_local_dir={tmp_path / 'run'}"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return [line for line in out.err.splitlines() if line.startswith("[gdro] warning:")]


def test_sparse_prompt_ids_are_warned_with_the_memory_they_take(capsys, tmp_path):
    rows = S.math_rows(list(range(256)), index=[*range(255), 4_000_000])
    (line,) = dry_run_warnings(capsys, rows, tmp_path)
    assert "the largest extra_info.index is 4000000 for 256 prompts" in line
    assert "824 MiB (in memory and in every gdro_state.pkl) instead of 0.1 MiB" in line
    assert "Number the prompts 0..N-1" in line


def test_one_prompt_text_under_two_ids_is_warned(capsys, tmp_path):
    rows = S.math_rows(list(range(256)))
    rows[5]["prompt"] = rows[3]["prompt"]
    (line,) = dry_run_warnings(capsys, rows, tmp_path)
    assert "1 prompt(s) repeat the prompt text of another extra_info.index (e.g. ids 3 and 5)" in line
    assert "Deduplicate the data" in line


def test_dense_distinct_prompts_warn_nothing(capsys, tmp_path):
    assert dry_run_warnings(capsys, S.math_rows(list(range(256))), tmp_path) == []
