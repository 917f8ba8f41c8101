"""Validation lines in the GDRO metrics file and the Table-1 command (recipe.gdro.lab.results.table)."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from recipe.gdro.lab.results import table as RT
from recipe.gdro.results.metrics_io import (
    append_metrics_jsonl,
    append_validation_jsonl,
    read_metrics_jsonl,
    read_validation_jsonl,
    rewind_metrics_jsonl,
    validation_pass_at_k,
)

SOURCES = ["math500", "aime2024", "aime2025", "amc23", "minerva", "olympiadbench", "gpqa_diamond"]


def val_record(means: dict[str, float], passes: dict[str, float], prompts: dict[str, int], k: int = 8) -> dict:
    record = {"val-aux/num_turns/mean": 2.0}
    for s in SOURCES:
        record[f"val-core/{s}/acc/mean@{k}"] = means[s]
        record[f"val-core/{s}/acc/best@{k}/mean"] = passes[s] - 0.05  # verl's (biased) bootstrap
        record[f"val-aux/{s}/acc/std@{k}"] = 0.1
        record[f"gdro/val/{s}/prompts"] = float(prompts[s])
        record[f"gdro/val/{s}/acc/pass@{k}"] = passes[s]
    return record


def uniform(value: float) -> dict[str, float]:
    return {s: value for s in SOURCES}


def test_pass_at_k_is_exact_and_counts_failed_sessions():
    # source a: prompt u1 2/4 correct, u2 0/4 -> pass@4 = (1 + 0)/2; source b: k=4 but u3 has 3 responses
    # and an expected count of 4 (one failed session = wrong): 1 correct of 4 -> pass@4 = 1.
    sources = ["a"] * 8 + ["b"] * 3 + ["c"]
    uids = ["u1"] * 4 + ["u2"] * 4 + ["u3"] * 3 + ["u4"]
    acc = [True, False, True, False, False, False, False, False, False, True, False, None]
    out = validation_pass_at_k(sources, uids, acc, {("b", "u3"): 4, ("a", "u1"): 4, ("c", "u4"): 2})
    assert out["gdro/val/a/prompts"] == 2 and out["gdro/val/a/acc/pass@4"] == 0.5
    assert out["gdro/val/b/prompts"] == 1 and out["gdro/val/b/acc/pass@4"] == 1.0
    assert "gdro/val/c/prompts" not in out  # no acc reported for c
    # unbiased estimator below n: n=4, c=1, k=2 would be 1 - C(3,2)/C(4,2) = 0.5; here k = max n per source.
    out = validation_pass_at_k(["s"] * 6, ["x"] * 4 + ["y"] * 2, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert out["gdro/val/s/acc/pass@4"] == pytest.approx((1.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="2 data sources, 1 uids"):
        validation_pass_at_k(["s", "s"], ["x"], [True, False])


def test_validation_lines_are_separate_from_training_lines_and_rewind(tmp_path):
    path = tmp_path / "gdro_metrics.jsonl"
    append_validation_jsonl(path, 0, {"val-core/math500/acc/mean@8": 0.25})
    for step in (1, 2, 3):
        append_metrics_jsonl(path, step, {"gdro/mu": float(step)})
        if step % 2 == 0:
            append_validation_jsonl(path, step, {"val-core/math500/acc/mean@8": 0.5 + step / 10})
    append_validation_jsonl(path, 4, {"val-core/math500/acc/mean@8": float("nan")})
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2, 3]
    assert all("val_step" not in r for r in read_metrics_jsonl(path))
    val = read_validation_jsonl(path)
    assert [r["val_step"] for r in val] == [0, 2, 4]
    assert val[1]["val-core/math500/acc/mean@8"] == pytest.approx(0.7)
    assert math.isnan(val[2]["val-core/math500/acc/mean@8"])
    # resume from global_step_2: step 3's training line and step 4's validation line go; step 2's stay
    assert rewind_metrics_jsonl(path, 2) == 2
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2]
    assert [r["val_step"] for r in read_validation_jsonl(path)] == [0, 2]
    with pytest.raises(ValueError, match="reserved"):
        append_validation_jsonl(path, 5, {"val_step": 1.0})
    with pytest.raises(ValueError, match="no metrics"):
        append_validation_jsonl(path, 5, {})


def write_run(path, records: list[tuple[int, dict]]):
    for step, record in records:
        append_metrics_jsonl(path, max(step, 1), {"gdro/mu": 0.1})
        append_validation_jsonl(path, step, record)


def test_table_rows_best_last_and_pooling(tmp_path):
    prompts = {
        "math500": 500,
        "aime2024": 30,
        "aime2025": 30,
        "amc23": 40,
        "minerva": 272,
        "olympiadbench": 675,
        "gpqa_diamond": 198,
    }
    means_50 = {**uniform(0.4), "aime2024": 0.1, "aime2025": 0.3}
    means_100 = uniform(0.5)  # the best mean over the six columns
    means_150 = uniform(0.45)
    passes = {**uniform(0.6), "math500": 0.9}
    run = tmp_path / "grpo_8b"
    run.mkdir()
    write_run(
        run / "gdro_metrics.jsonl",
        [
            (50, val_record(means_50, passes, prompts)),
            (100, val_record(means_100, passes, prompts)),
            (150, val_record(means_150, passes, prompts)),
        ],
    )
    (best,) = RT.build_rows([str(run)], "best")
    assert best.step == 100 and best.k == 8 and best.pass_source == "exact"
    assert best.columns["MATH500"] == 0.5
    pooled = (0.9 * 500 + 0.6 * (1745 - 500)) / 1745
    assert best.pass_at_k == pytest.approx(pooled)
    (last,) = RT.build_rows([str(run / "gdro_metrics.jsonl")], "last")
    assert last.step == 150
    (first,) = RT.build_rows([str(run)], "50")
    assert first.columns["AIME"] == pytest.approx(0.2)  # mean of 2024 and 2025
    text = RT.markdown([best, first])
    lines = text.splitlines()
    assert lines[1] == "| run | step | MATH500 | AIME | AMC | Minerva | Olympiad | GPQA | pass@8 |"
    assert lines[3] == f"| grpo_8b | 100 | 50.00 | 50.00 | 50.00 | 50.00 | 50.00 | 50.00 | {100 * pooled:.2f} |"
    assert lines[4].startswith("| grpo_8b | 50 | 40.00 | 20.00 | 40.00 |")


def test_pass_falls_back_to_verl_bootstrap_weighted_by_set_sizes(tmp_path):
    record = val_record(uniform(0.5), {**uniform(0.6), "gpqa_diamond": 0.8}, {s: 1 for s in SOURCES})
    for s in SOURCES:
        del record[f"gdro/val/{s}/prompts"], record[f"gdro/val/{s}/acc/pass@8"]
    path = tmp_path / "m.jsonl"
    append_validation_jsonl(path, 10, record)
    (row,) = RT.build_rows([str(path)])
    sizes = RT.SET_SIZES
    expected = sum((0.75 if s == "gpqa_diamond" else 0.55) * sizes[s] for s in SOURCES) / sum(sizes.values())
    assert row.pass_at_k == pytest.approx(expected) and row.pass_source == "verl-bootstrap"


def test_cli_markdown_csv_and_clear_errors(tmp_path, capsys):
    prompts = dict.fromkeys(SOURCES, 10)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    append_validation_jsonl(a, 20, val_record(uniform(0.3), uniform(0.5), prompts))
    append_validation_jsonl(b, 20, val_record(uniform(0.6), uniform(0.7), prompts))
    out_csv = tmp_path / "t.csv"
    assert RT.main([str(a), str(b), "--csv", str(out_csv)]) == 0
    printed = capsys.readouterr().out
    assert "| a.jsonl | 20 | 30.00 | 30.00 | 30.00 | 30.00 | 30.00 | 30.00 | 50.00 |" in printed
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == [str(a), str(b)]
    assert float(rows[1]["GPQA"]) == pytest.approx(60.0) and float(rows[1]["pass_at_k"]) == pytest.approx(70.0)

    # a training-only file: no validation lines
    train_only = tmp_path / "train.jsonl"
    append_metrics_jsonl(train_only, 1, {"gdro/mu": 0.1})
    assert RT.main([str(train_only)]) == 2
    assert "no validation lines" in capsys.readouterr().err
    # a missing benchmark is named
    record = val_record(uniform(0.3), uniform(0.5), prompts)
    del record["val-core/minerva/acc/mean@8"]
    missing = tmp_path / "missing.jsonl"
    append_validation_jsonl(missing, 5, record)
    assert RT.main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert "benchmark 'minerva' is missing" in err and "step 5" in err
    # an unvalidated step, a bad --step, a missing file
    assert RT.main([str(a), "--step", "7"]) == 2
    assert "validated steps: [20]" in capsys.readouterr().err
    assert RT.main([str(a), "--step", "worst"]) == 2
    assert "--step must be best, last or an integer" in capsys.readouterr().err
    assert RT.main([str(tmp_path / "nope")]) == 2
    assert "no such metrics file" in capsys.readouterr().err
    json.loads(a.read_text().splitlines()[0])  # the file stays plain JSON lines


def _two_validations(path):
    prompts = dict.fromkeys(SOURCES, 10)
    append_validation_jsonl(path, 10, val_record(uniform(0.3), uniform(0.5), prompts))
    append_validation_jsonl(path, 20, val_record(uniform(0.6), uniform(0.7), prompts))


def test_a_cut_last_line_is_named_not_silently_dropped(tmp_path, capsys):
    run = tmp_path / "gdro_metrics.jsonl"
    _two_validations(run)
    text = run.read_text()
    run.write_text(text[: len(text) - 40])  # the step-20 validation line is cut mid-write
    assert RT.main([str(run), "--step", "last"]) == 0
    captured = capsys.readouterr()
    assert f"| {tmp_path.name} | 10 |" in captured.out  # the last complete validation
    warnings_ = [ln for ln in captured.err.splitlines() if "warning" in ln]
    assert warnings_ == [
        f"results_table: warning: {run}: line 2 is cut (a run stopped mid-write?); that record is skipped"
    ]


@pytest.mark.parametrize("target", ["folder", "unwritable", "missing_parent_under_file"])
def test_bad_csv_path_is_an_error_before_any_output(tmp_path, capsys, target):
    run = tmp_path / "gdro_metrics.jsonl"
    _two_validations(run)
    if target == "folder":
        csv_path = tmp_path / "a_folder"
        csv_path.mkdir()
    elif target == "unwritable":
        csv_path = Path("/proc/gdro_no_such_dir/t.csv")  # not creatable, even as root
    else:
        (tmp_path / "plain_file").write_text("x")
        csv_path = tmp_path / "plain_file" / "t.csv"
    assert RT.main([str(run), "--csv", str(csv_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and str(csv_path) in captured.err and captured.err.count("\n") == 1
    assert not (csv_path.is_file())


def test_parquet_or_non_utf8_metrics_file_is_named(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), parquet)
    assert RT.main([str(parquet)]) == 2
    err = capsys.readouterr().err
    assert f"{parquet}: is a parquet file" in err and "codec" not in err
    binary = tmp_path / "gdro_metrics.jsonl"
    _two_validations(binary)
    binary.write_bytes(binary.read_bytes().replace(b"{", b"\xb5{", 2))
    assert RT.main([str(binary)]) == 2
    assert f"{binary}: line 1: not UTF-8" in capsys.readouterr().err


def test_a_wrongly_typed_field_is_named_by_file_line_and_field(tmp_path, capsys):
    """A step "zero" or a metric "high" (a hand-edited or foreign file): results.table and results.plot
    refuse it with one line naming the file, the line and the field ("invalid literal for int()" before),
    and write nothing."""
    from recipe.gdro.lab.results import plot as RP

    run = tmp_path / "gdro_metrics.jsonl"
    _two_validations(run)
    append_metrics_jsonl(run, 1, {"gdro/mu": 0.1})
    good = run.read_text().splitlines()
    for bad_line, field in (
        ('{"val_step": "zero", "val-core/math500/acc/mean@8": 0.5}', "val_step"),
        ('{"step": 2, "gdro/mu": "high"}', "gdro/mu"),
        ('{"step": 2.5, "gdro/mu": 0.2}', "step"),
    ):
        run.write_text("\n".join([good[0], bad_line, *good[1:]]) + "\n")
        before = run.read_bytes()
        assert RT.main([str(run)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{run}: line 2: field '{field}'" in err and "invalid literal" not in err, err
        out = tmp_path / "plots"
        assert RP.main([str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{run}: line 2: field '{field}'" in err, err
        assert not out.exists() and run.read_bytes() == before


def test_list_sets_shows_what_a_run_validated_on(tmp_path, capsys):
    """``--list-sets``: the sets of each run, the steps, k, prompts and the Table 1 column; for a run
    without Table 1's sets (any CPU run) it says which are missing instead of failing."""
    full = tmp_path / "full"
    _two_validations(full / "gdro_metrics.jsonl")
    cpu = tmp_path / "cpu" / "gdro_metrics.jsonl"
    for step in (0, 10):
        append_validation_jsonl(
            cpu, step, {"val-core/arith_add2/acc/mean@1": 0.4, "gdro/val/arith_add2/prompts": 105.0}
        )
    assert RT.main([str(cpu)]) == 2  # the table itself needs the seven sets
    assert "--list-sets" in capsys.readouterr().err
    assert RT.main([str(full), str(cpu.parent), "--list-sets"]) == 0
    out = capsys.readouterr().out
    assert "| full | aime2024 | 10, 20 | mean@8 | 10 | AIME |" in out
    assert "| cpu | arith_add2 | 0, 10 | mean@1 | 105 | - |" in out
    assert "full: has every set Table 1 needs" in out
    assert "cpu: Table 1 also needs math500, aime2024" in out


def test_a_file_holding_two_runs_is_refused_naming_the_line(tmp_path, capsys):
    """Steps back at the file's first step are a second run appended to the first (a fresh start in the same
    folder): the table and the plot refuse it naming the line, instead of silently keeping the later run's
    steps. A copy that missed a resume's rewind (steps repeated after the resume point) still reads, as before."""
    from recipe.gdro.lab.results import plot as RP

    run = tmp_path / "gdro_metrics.jsonl"
    for step in (1, 2, 3):
        append_metrics_jsonl(run, step, {"gdro/mu": 0.1 * step})
    append_validation_jsonl(run, 3, val_record(uniform(0.5), uniform(0.8), {s: 10 for s in SOURCES}))
    for step in (1, 2):  # the second run
        append_metrics_jsonl(run, step, {"gdro/mu": 5.0})
    message = f"{run}: line 5: step 1 again after step 3 (line 3): the file holds two runs (the first from line 1)"
    for reader in (read_metrics_jsonl, read_validation_jsonl):
        with pytest.raises(ValueError, match=re.escape(message)):
            reader(run)
    assert RT.main([str(run)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"results_table: error: {message}")
    assert RP.main([str(run), "--out", str(tmp_path / "plots")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {message}")
    # resumed at step 2 without the rewind: step 3 written twice, the later line wins
    resumed = tmp_path / "resumed.jsonl"
    for step, mu in ((1, 0.1), (2, 0.2), (3, 0.3), (3, 0.9), (4, 0.4)):
        append_metrics_jsonl(resumed, step, {"gdro/mu": mu})
    assert [r["gdro/mu"] for r in read_metrics_jsonl(resumed)] == [0.1, 0.2, 0.9, 0.4]


def test_literal_nan_and_infinity_are_read_as_missing_with_a_warning_by_name(tmp_path, capsys):
    """This writer writes null; a literal NaN / Infinity (a foreign or hand-made file) was plotted with only
    matplotlib's overflow warning. It is read as missing, and the tools warn naming file, line and field."""
    from recipe.gdro.lab.results import plot as RP
    from recipe.gdro.results.metrics_io import NonFiniteValueWarning

    run = tmp_path / "gdro_metrics.jsonl"
    _two_validations(run)
    run.write_text(
        run.read_text().replace('"val-aux/num_turns/mean": 2.0', '"val-aux/num_turns/mean": Infinity', 1)
        + '{"step": 1, "gdro/mu": NaN}\n'
    )
    with pytest.warns(NonFiniteValueWarning, match=r"line 1 field 'val-aux/num_turns/mean' = inf"):
        records = read_validation_jsonl(run)
    assert math.isnan(records[0]["val-aux/num_turns/mean"])
    with pytest.warns(NonFiniteValueWarning, match=r"2 literal NaN/Infinity value\(s\)"):
        assert math.isnan(read_metrics_jsonl(run)[0]["gdro/mu"])
    assert RT.main([str(run)]) == 0
    err = capsys.readouterr().err
    assert f"results_table: warning: {run}: 2 literal NaN/Infinity value(s)" in err and "Overflow" not in err
    RP.main([str(run), "--out", str(tmp_path / "plots")])
    assert f"warning: {run}: 2 literal NaN/Infinity value(s)" in capsys.readouterr().err


def test_a_metrics_file_with_only_a_validation_line_says_so(tmp_path, capsys):
    """Issue 44 item 6: a run that validated at step 0 and has not finished a step writes only a validation
    line; results.plot said "no metrics records", as for an empty file."""
    from recipe.gdro.lab.results import plot as RP
    from recipe.gdro.results.metrics_io import append_validation_jsonl

    path = tmp_path / "gdro_metrics.jsonl"
    append_validation_jsonl(path, 0, {"val-core/math/acc/mean@1": 0.4})
    assert RP.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {path}: validation records only (at step 0), no training step yet: plot it once the run has "
        "logged a step"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert RP.main([str(empty)]) == 2 and "no metrics records" in capsys.readouterr().err
