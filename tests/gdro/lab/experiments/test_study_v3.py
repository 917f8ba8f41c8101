"""Issue 45's "done when" for protocol tiny_lm_v3: `study report` rebuilds results/tiny_lm_study_v3/REPORT.md
and its pass@k figure byte for byte from the committed run files; the protocol's commit precedes every v3
run; its evaluation seeds are recorded as spent and no other protocol spent them; the report shows, per
method, the tail's rollouts per prompt and the share of its groups with no gradient. Cost: about 10 s
(reads the committed runs; nothing is trained)."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime

from recipe_helpers.paths import REPO

from recipe.gdro.lab.experiments import study
from recipe.gdro.lab.experiments.protocol import TINY_LM_V3, Ledger, load_protocol

RESULTS_V3 = REPO / "results" / "tiny_lm_study_v3"


def _runs() -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((RESULTS_V3 / "runs").glob("*.json"))]


def test_the_committed_v3_report_and_figure_are_what_the_committed_runs_give():
    p = load_protocol(TINY_LM_V3)
    s = study.Study(p, RESULTS_V3, jobs=0, log=lambda *_: None)
    report = study.report(s)
    assert report.rstrip("\n") + "\n" == (RESULTS_V3 / "REPORT.md").read_text(encoding="utf-8")
    assert study.report_figure(s) == (RESULTS_V3 / study.PASS_AT_K_FIGURE).read_text(encoding="utf-8")
    # the mechanism reads off the report: the tail's rollouts per prompt and its groups without gradient
    assert "| method | tail rollouts / prompt | tail groups with no gradient |" in report
    # the positive control's verdict and the token rule read off it too
    assert "Positive control: rollout_gdro_fixed_tail_share " in report and "above +2% (a token-matched" in report
    for stored in _runs():
        run, config = stored["summary"], stored["config"]
        assert run["protocol_hash"] == p.hash
        if run["stage"] == "primary":
            assert len(run["per_prompt"]["test"]["id"]) == p.shape["num_test"] and run["allocation"]
            assert config["code"]["clean"] and config["direct"]["mix"] == p.shape["mix"]


def test_the_v3_protocol_was_committed_before_its_first_run_and_its_seeds_are_spent_once():
    p = load_protocol(TINY_LM_V3)
    log = ["git", "-C", str(REPO), "log", "--follow", "--diff-filter=A", "--format=%cI", "--", str(TINY_LM_V3)]
    committed = datetime.fromisoformat(
        subprocess.run(log, capture_output=True, text=True, check=True).stdout.split()[-1]
    )
    started = [datetime.fromisoformat(r["summary"]["started_at"]) for r in _runs()]
    assert started and committed < min(started)
    ledger = Ledger(RESULTS_V3 / "spent_seeds.yaml")
    spent = {s for e in ledger.entries() if e["protocol"] == p.hash for s in e["seeds"]}
    primary = {r["summary"]["seed"] for r in _runs() if r["summary"]["stage"] == "primary"}
    assert primary and primary <= spent <= set(p.primary["seed_pool"])
    for other in ("tiny_lm_study", "tiny_lm_study_v2"):  # v1 and v2 untouched: none of their seeds reused
        assert Ledger(REPO / "results" / other / "spent_seeds.yaml").conflicts(p.hash, sorted(spent)) == {}


def test_the_control_verdict_and_the_token_rule_read_the_family(tmp_path):
    """A control whose primary endpoint Holm rejects upward lets the other verdicts stand; an arm above +2% of
    the reference's tokens is named as needing a token-matched comparison; a family without a control
    (v2) prints neither."""
    from recipe.gdro.lab.results.stats import FamilyRow

    p = load_protocol(TINY_LM_V3)
    s = study.Study(p, tmp_path, jobs=0, log=lambda *_: None)
    methods = [p.primary["reference"], *p.primary["methods"]]
    tokens = {m: 1000.0 for m in methods} | {"rollout_gdro_failure_weighted": 1030.0}
    runs = {(m, 0): {"tokens": tokens[m]} for m in methods}
    row = FamilyRow(0.05, 0.02, 0.08, 6, 0.001, 0.004, True)
    text = "\n".join(study.control_text(s, runs, [0], {"rollout_gdro_fixed_tail_share tail pass@8": row}))
    assert (
        "rollout_gdro_failure_weighted +3.0%" in text and "comparison needed): rollout_gdro_failure_weighted." in text
    )
    assert "raised tail pass@8 (+0.0500, 95% CI [+0.0200, +0.0800], Holm p 0.004)" in text and "verdicts stand" in text
    v2 = study.Study(load_protocol(), tmp_path / "v2", jobs=0, log=lambda *_: None)
    assert study.control_text(v2, {}, [], {}) == []
