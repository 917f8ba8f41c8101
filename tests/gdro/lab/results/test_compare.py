"""``python -m recipe.gdro.lab.results.compare``: runs side by side (issue 42, item 7). The runs are metrics files
written by the recipe's own writer (metrics_io), laid out as a real-path run and a quick start lay them out."""

from __future__ import annotations

import subprocess
import sys

import pytest
from recipe_helpers.paths import REPO

from recipe.gdro.lab.results import compare
from recipe.gdro.results.metrics_io import append_metrics_jsonl, append_validation_jsonl


def write_run(folder, val: dict[int, dict[str, float]], prompts: dict[str, int], rollout_gdro: bool) -> None:
    """A run's gdro_metrics.jsonl: validation lines (verl's val-core keys + the trainer's prompt counts) and
    training lines (GRPO: 4 rollouts a prompt everywhere; Rollout-GDRO: 2..8 per bin and a moving μ)."""
    path = folder / "gdro_metrics.jsonl"
    for step in range(0, max(val) + 1):
        if step:
            line = {"gdro/rollouts_per_prompt": 4.0, "gdro/per_prompt/score_mean": 0.3 + 0.01 * step}
            line["gdro/tokens/generated"] = 1000.0
            for b in range(3):
                line[f"gdro/bin_{b:02d}/rollouts_per_prompt"] = (2.0 + 3 * b) if rollout_gdro else 4.0
            if rollout_gdro:
                line["gdro/mu"] = 0.01 * step
                line["gdro/se_proxy_reduction"] = 0.2
            append_metrics_jsonl(path, step, line)
        if step in val:
            record = {f"val-core/{s}/acc/mean@1": v for s, v in val[step].items()}
            record.update({f"gdro/val/{s}/prompts": float(n) for s, n in prompts.items()})
            append_validation_jsonl(path, step, record)


@pytest.fixture
def two_runs(tmp_path):
    prompts = {"add2": 30, "mul1x2": 10}
    grpo = tmp_path / "tiny_real_path_out" / "gdro_tiny" / "tiny_grpo"
    gdro = tmp_path / "tiny_real_path_out" / "gdro_tiny" / "tiny_joint_gdro"
    for folder in (grpo, gdro):
        folder.mkdir(parents=True)
    start = {"add2": 0.5, "mul1x2": 0.1}
    write_run(grpo, {0: start, 5: {"add2": 0.7, "mul1x2": 0.2}, 10: {"add2": 0.6, "mul1x2": 0.3}}, prompts, False)
    write_run(gdro, {0: start, 5: {"add2": 0.55, "mul1x2": 0.4}, 10: {"add2": 0.65, "mul1x2": 0.35}}, prompts, True)
    return grpo, gdro


def test_compare_writes_a_table_and_a_figure_labelled_by_run(two_runs, tmp_path, capsys):
    grpo, gdro = two_runs
    out = tmp_path / "report" / "compare.md"
    out.parent.mkdir()
    assert compare.main([str(grpo), str(gdro / "gdro_metrics.jsonl"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    text = out.read_text()
    assert text in printed
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    # header: one final/best pair per run, labelled by the run's folder
    assert "tiny_grpo final | tiny_grpo best | tiny_joint_gdro final | tiny_joint_gdro best" in rows["data source"]
    assert rows["add2"] == "| add2 | 0.600 (step 10) | 0.700 (step 5) | 0.650 (step 10) | 0.650 (step 10) |"
    assert rows["mul1x2"] == "| mul1x2 | 0.300 (step 10) | 0.300 (step 10) | 0.350 (step 10) | 0.400 (step 5) |"
    # pooled by prompts: GRPO final (30*0.6 + 10*0.3)/40 = 0.525, best at step 5 (30*0.7+10*0.2)/40 = 0.575
    pooled = "| all prompts | 0.525 (step 10) | 0.575 (step 5) | 0.575 (step 10) | 0.575 (step 10) |"
    assert rows["all prompts"] == pooled
    # GDRO figures: GRPO has no μ and one rollout count; Rollout-GDRO's per-bin range and mean reduction
    assert rows["tiny_grpo"] == "| tiny_grpo | 10 | 3 | 4.00 | 4.00-4.00 | - | - | - | 10,000 |"
    assert rows["tiny_joint_gdro"] == "| tiny_joint_gdro | 10 | 3 | 4.00 | 2.00-8.00 | - | 0.1000 | 20.0% | 10,000 |"
    figure = out.parent / "compare.png"
    assert figure.stat().st_size > 10_000 and figure.read_bytes()[:4] == b"\x89PNG"


def test_a_folder_of_runs_is_every_run_in_it_and_equal_names_get_their_parent(two_runs, tmp_path):
    grpo, gdro = two_runs
    other = tmp_path / "second" / "tiny_grpo"
    other.mkdir(parents=True)
    (other / "gdro_metrics.jsonl").write_bytes((grpo / "gdro_metrics.jsonl").read_bytes())
    runs = compare.read_runs([str(grpo.parent), str(other)])
    assert [r.label for r in runs] == ["gdro_tiny/tiny_grpo", "tiny_joint_gdro", "second/tiny_grpo"]


def test_a_folder_without_metrics_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "empty_run").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "recipe.gdro.lab.results.compare", str(tmp_path / "empty_run")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"compare: error: {tmp_path / 'empty_run'}: no gdro_metrics.jsonl")
    assert r.stdout == "" and not (REPO / "compare.png").exists()
