"""The overhead benchmark runs against the current controllers and recipe (a tiny shape, not a timing)."""

from __future__ import annotations

import json
import subprocess
import sys

from recipe_helpers.paths import REPO


def test_bench_overhead_runs_and_prompt_gdro_adds_no_transferqueue_write():
    argv = ["--json", "--prompts", "16", "--n-mean", "4", "--tokens", "16", "--repeats", "1", "--steps", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.gdro.lab.experiments.bench_overhead", *argv, "--warmup", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    # No timing threshold on purpose: timings depend on the machine and its load, so the ratios are
    # only checked to be measured (> 0); what is pinned are integer counts (TransferQueue puts), the
    # same on every machine. Not a pinned_figures test (issue 28): nothing here varies with BLAS/SIMD.
    for key in ("gdro_over_grpo", "scale_1m_over_14k"):
        assert result[key] > 0, key
    assert set(result["recipe_over_grpo"]) == {"observe", "prompt", "rollout", "joint"}
    # verl's own single put of the advantages, and nothing more, in every mode
    for variant in ("plain", "observe", "prompt", "rollout", "joint"):
        assert result[f"recipe_{variant}_tq_puts"] == 1, variant
