"""The tiny-LM study harness (recipe/gdro/lab/experiments/study.py, protocol.py): the pre-registered
protocol, its spent-seed ledger, the committed run summaries and the report regenerated from them,
and the whole harness end to end on a smoke protocol."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml
from recipe_helpers.paths import REPO

from recipe.gdro.lab.experiments import study
from recipe.gdro.lab.experiments.protocol import PROTOCOL_DIR, TINY_LM_V1, Ledger, ProtocolError, load_protocol

RESULTS = REPO / "results" / "tiny_lm_study"
RESULTS_V2 = REPO / "results" / "tiny_lm_study_v2"


def test_the_shipped_protocol_is_valid_and_its_evaluation_seeds_are_unspent_by_other_protocols():
    """The committed ledger: no evaluation seed of the shipped protocol was spent by another protocol
    (the pre-protocol study's seeds 0-7 included), and the current protocol (v2) spends none of v1's."""
    p = load_protocol(TINY_LM_V1)
    ledger = Ledger(RESULTS / "spent_seeds.yaml")
    seeds = [*p.primary["seed_pool"], *p.confirm["seeds"]]
    assert ledger.conflicts(p.hash, seeds) == {}
    assert {0, 1, 2, 3, 4, 5, 6, 7} <= {s for e in ledger.entries() for s in e["seeds"]}
    assert set(p.tuning["methods"]) == {"grpo", "prompt_gdro", "rollout_gdro", "joint_gdro"}
    assert any(a.warm_start > 0 for a in p.arms()) and any(a.control for a in p.arms())
    # exploratory arms run on seeds that tuned nothing (no winner's curse)
    assert not set(p.explore["seeds"]) & set(p.tuning["seeds"])
    v2 = load_protocol()
    assert ledger.conflicts(v2.hash, [*v2.primary["seed_pool"], *v2.confirm["seeds"]]) == {}
    assert not {*v2.explore["seeds"], *v2.tuning["seeds"]} & {*p.explore["seeds"], *p.tuning["seeds"]}


def test_the_committed_report_is_what_the_committed_runs_give():
    """README/docs tables regenerate from the repository alone: `study report` on results/tiny_lm_study
    reproduces its REPORT.md byte for byte, and every run summary holds the fields the issue names."""
    p = load_protocol(TINY_LM_V1)
    s = study.Study(p, RESULTS, jobs=0, log=lambda *_: None)
    assert study.report(s).rstrip("\n") + "\n" == (RESULTS / "REPORT.md").read_text(encoding="utf-8")
    need = {"method", "stage", "seed", "lr", "protocol_hash", "started_at", "base_exact", "final_exact"}
    need |= {"final_sampled", "tokens", "rollouts"}
    for path in (RESULTS / "runs").glob("*.json"):
        summary = json.loads(path.read_text())["summary"]
        fields = {"best_exact", "exact_by_temperature", "protocol_hash"} if summary["stage"] == "baseline" else need
        assert fields <= set(summary) and summary["protocol_hash"] == p.hash, path


def test_the_committed_v2_report_and_figure_are_what_the_committed_runs_give():
    """Issue 33's "done when": `study report` rebuilds v2's REPORT.md and pass_at_k.svg byte for byte from
    the committed runs; each primary run file holds the per-prompt test outcomes, the code commit, the
    resolved method config and the protocol hash; the protocol was committed before the first primary
    run started; GRPO raised the hard tail's pass@8 by at least 0.05 on the evaluation seeds."""
    import subprocess
    from datetime import datetime

    from recipe.gdro.lab.results.outcomes import endpoint_value

    p = load_protocol()
    s = study.Study(p, RESULTS_V2, jobs=0, log=lambda *_: None)
    assert study.report(s).rstrip("\n") + "\n" == (RESULTS_V2 / "REPORT.md").read_text(encoding="utf-8")
    assert study.report_figure(s) == (RESULTS_V2 / study.PASS_AT_K_FIGURE).read_text(encoding="utf-8")
    primary = [json.loads(f.read_text()) for f in (RESULTS_V2 / "runs").glob("primary-*.json")]
    assert len(primary) == 4 * len(p.primary["seed_pool"])
    for stored in primary:
        run, config = stored["summary"], stored["config"]
        assert len(run["per_prompt"]["test"]["id"]) == p.shape["num_test"] and run["protocol_hash"] == p.hash
        assert config["code"]["commit"] and config["code"]["clean"] and config["method_config"]["rollout"]
    log = [
        "git",
        "-C",
        str(REPO),
        "log",
        "--follow",  # the protocol moved under recipe/gdro/lab/ (issue 43): its first commit, not the move
        "--diff-filter=A",
        "--format=%cI",
        "--",
        "recipe/gdro/lab/experiments/protocols/tiny_lm_v2.yaml",
    ]
    committed = datetime.fromisoformat(
        subprocess.run(log, capture_output=True, text=True, check=True).stdout.split()[-1]
    )
    assert committed < min(datetime.fromisoformat(r["summary"]["started_at"]) for r in primary)
    tail = p.endpoints["tail pass@8"]
    grpo = [r["summary"] for r in primary if r["summary"]["method"] == "grpo"]
    gains = [endpoint_value(r, tail) - endpoint_value(r, tail, "base") for r in grpo]
    assert min(gains) >= 0.05, gains


def _protocol(tmp_path: Path, filename: str = "smoke.yaml", **changes) -> Path:
    data = {
        "name": "smoke",
        "shape": {"steps": 3, "prompts": 4, "n": 2, "num_train": 16, "num_val": 12, "eval_every": 1},
        "eval_temperature": 1.0,
        "tuning": {"seeds": [100, 101], "lr_grid": [1e-4, 1e-3], "methods": ["grpo", "rollout_gdro"]},
        "primary": {
            "reference": "grpo",
            "methods": ["rollout_gdro"],
            "metrics": ["final_exact"],
            "power": {"target": 0.8, "floor": 0.01, "fraction": 0.25},
            "seed_pool": [0, 1],
        },
        "explore": {
            "seeds": [200],
            "reference": "grpo",
            "arms": [
                {"name": "rollout_gdro, warm start k=1", "method": "rollout_gdro", "warm_start": 1},
                {"name": "grpo at lr 0", "method": "grpo", "lr_scale": 0.0, "control": True},
            ],
        },
        "confirm": {"seeds": [300], "metrics": ["final_exact", "final_exact_worst"]},
        "long": {"seeds": [400], "methods": ["grpo", "rollout_gdro"], "regimes": {"pool": {"num_train": 8}}},
        "solvable": 0.0,
    }
    data.update(changes)
    path = tmp_path / filename
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_protocol_errors_name_the_key(tmp_path):
    with pytest.raises(ProtocolError, match="each seed has one role"):
        load_protocol(_protocol(tmp_path, long={"seeds": [100], "methods": ["grpo"], "regimes": {}}))
    with pytest.raises(ProtocolError, match="'joint' is not in config/method"):
        load_protocol(
            _protocol(tmp_path, tuning={"seeds": [100, 101], "lr_grid": [1e-4], "methods": ["grpo", "joint"]})
        )
    with pytest.raises(ProtocolError, match="explore.arms"):
        load_protocol(_protocol(tmp_path, explore={"seeds": [200], "arms": [{"name": "x", "method": "joint_gdro"}]}))
    assert study.main(["tune", "--protocol", str(tmp_path / "none.yaml"), "--results", str(tmp_path)]) == 2


def test_lrs_written_without_a_dot_are_numbers(tmp_path):
    """PyYAML reads ``5e-5`` as a string (YAML 1.1); the shipped grid is written so, and the tuning table
    once failed on it after every run had finished."""
    tuning = {"seeds": [100, 101], "methods": ["grpo", "rollout_gdro"]}
    assert yaml.safe_load("[5e-5, 1.0e-4]") == ["5e-5", 1e-4]
    path = _protocol(tmp_path, tuning={**tuning, "lr_grid": ["5e-5", 1e-4]})
    assert load_protocol(path).tuning["lr_grid"] == [5e-5, 1e-4]
    assert all(isinstance(lr, float) for lr in load_protocol(TINY_LM_V1).tuning["lr_grid"])
    path = _protocol(tmp_path, tuning={**tuning, "lr_grid": ["fast"]})
    with pytest.raises(ProtocolError, match=r"tuning.lr_grid\[0\]: 'fast' is not a number"):
        load_protocol(path)


def test_the_typed_schema_refuses_unknown_keys_wrong_types_and_out_of_range_values(tmp_path):
    """Issue 43 item 4: the protocol is a typed schema (pydantic, as the GDRO config and the scenario are):
    a misspelt key, a string for a number or a value out of its Range is one line naming the key (full
    path) and the value; ``shape:`` takes DirectConfig's own fields but those the study sets per run."""
    from recipe.gdro.lab.experiments.direct import DirectConfig
    from recipe.gdro.lab.experiments.protocol import PER_RUN

    base = yaml.safe_load(_protocol(tmp_path).read_text())
    shape, primary, explore = base["shape"], base["primary"], base["explore"]
    refused = {
        # unknown keys, with the key they were likely meant for
        r"confirm.alhpa: unknown key \(did you mean alpha\?\)": {"confirm": {**base["confirm"], "alhpa": 0.05}},
        r"solvabel: unknown key \(did you mean solvable\?\)": {"solvabel": 0.1},
        r"shape.num_tset: unknown key \(did you mean num_test\?\); the keys under shape: model_path, steps": {
            "shape": {**shape, "num_tset": 10}
        },
        r"shape.lr: unknown key": {"shape": {**shape, "lr": 1e-3}},  # set per run (tuned), not by the shape
        # a string where a number must be
        r"primary.alpha: '0.05' must be a number": {"primary": {**primary, "alpha": "0.05"}},
        r"shape.steps: '3' must be an integer": {"shape": {**shape, "steps": "3"}},
        # out of range
        r"solvable: 1.5 must lie in \[0, 1\]": {"solvable": 1.5},
        r"explore.arms\[0\].warm_start: -1 must be an integer >= 0": {
            "explore": {**explore, "arms": [{**explore["arms"][0], "warm_start": -1}]}
        },
        r"long.regimes.pool.num_train: 0 must be an integer >= 1": {
            "long": {**base["long"], "regimes": {"pool": {"num_train": 0}}}
        },
        r"explore.seeds\[0\]: -200 must be an integer >= 0": {"explore": {**explore, "seeds": [-200]}},
        # v1's power rule has no PowerRule field beside it (that is the mde plan's)
        r"primary.power.target_power: a setting of the mde plan": {
            "primary": {**primary, "power": {**primary["power"], "target_power": 0.9}}
        },
    }
    for message, change in refused.items():
        with pytest.raises(ProtocolError, match=message) as e:
            load_protocol(_protocol(tmp_path, **change))
        assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path / "smoke.yaml"))
    # every DirectConfig field but the per-run ones is a shape key, with no list of them in protocol.py
    every = {f.name: getattr(DirectConfig(), f.name) for f in dataclasses.fields(DirectConfig) if f.name not in PER_RUN}
    assert load_protocol(_protocol(tmp_path, shape={**every, **shape})).shape["num_train"] == shape["num_train"]


def test_a_changed_protocol_cannot_reuse_spent_seeds(tmp_path):
    ledger = Ledger(tmp_path / "spent_seeds.yaml")
    ledger.path.write_text("# spent seeds\nspent: []\n")
    ledger.spend("aaaa", "primary", [0, 1])
    ledger.spend("aaaa", "primary", [0, 1, 2])  # the same protocol may extend its own entry
    assert [e["seeds"] for e in ledger.entries()] == [[0, 1], [2]]
    assert ledger.path.read_text().startswith("# spent seeds\n")
    with pytest.raises(ProtocolError, match="seed 1 was spent by protocol aaaa"):
        ledger.spend("bbbb", "confirm", [1, 5])
    assert ledger.conflicts("bbbb", [5, 6]) == {}


def test_the_study_end_to_end_on_a_smoke_protocol(tmp_path, capsys):
    """tune -> primary (power plan, ledger) -> explore (warm start, control) -> confirm -> long; then
    the report from the run summaries alone, and the refusals (another protocol's runs, report with
    runs missing)."""
    proto = _protocol(tmp_path)
    res = tmp_path / "res"
    args = ["--protocol", str(proto), "--results", str(res), "--jobs", "1"]
    assert study.main(["report", *args[:4]]) == 2  # no runs folder at all: refused, nothing created
    assert "no runs folder" in capsys.readouterr().err and not res.exists()
    assert study.main(["tune", *args]) == 0
    runs = res / "runs"
    assert len(list(runs.glob("tune-*.json"))) == 2 * 2 * 2  # methods x lrs x tuning seeds
    (baseline,) = [json.loads(p.read_text())["summary"] for p in runs.glob("baseline-*.json")]
    assert baseline["best_exact"] == max(baseline["exact_by_temperature"].values())
    assert set(baseline["exact_by_temperature"]) == {f"{t:g}" for t in study.BASELINE_TEMPERATURES}
    summary = json.loads(next(runs.glob("tune-*.json")).read_text())["summary"]
    for key in ("method", "stage", "seed", "lr", "protocol_hash", "started_at", "base_exact", "final_exact"):
        assert key in summary
    assert 0 < summary["final_exact"] < 1 and summary["rollouts"] == 3 * 4 * 2
    assert summary["protocol_hash"] == load_protocol(proto).hash
    assert study.main(["primary", *args]) == 0
    out = capsys.readouterr().out
    assert "minimum detectable effect" in out and "p (Holm)" in out
    ledger = Ledger(res / "spent_seeds.yaml")
    assert ledger.entries()[0]["stage"] == "primary" and set(ledger.entries()[0]["seeds"]) <= {0, 1}
    assert study.main(["explore", *args]) == 0
    warm = [json.loads(p.read_text())["summary"] for p in runs.glob("explore-rollout_gdro_warm*.json")]
    # the warm start's 16 rollouts are 2 steps of 8: the run trains 1 step and spends the same budget
    assert warm and warm[0]["steps_trained"] == 1 and warm[0]["rollouts"] == 3 * 4 * 2
    assert study.main(["confirm", *args]) == 0
    assert study.main(["long", *args]) == 0
    first = (res / "REPORT.md").read_text()
    for section in ("## Tuning", "## Cold start", "## Primary", "## Exploratory arms", "## Confirmation"):
        assert section in first
    assert "Not run yet" not in first
    assert first.count("Decoding baseline (no training)") == 5  # beside every table of a comparison
    n_runs = len(list(runs.glob("*.json")))
    # the report: from the summaries alone, byte-identical, runs nothing
    assert study.main(["report", *args[:4]]) == 0 and (res / "REPORT.md").read_text() == first
    assert len(list(runs.glob("*.json"))) == n_runs
    # a changed protocol: its runs would mix hashes, refused; its evaluation seeds are spent
    other = _protocol(tmp_path, "edited.yaml", name="smoke, edited")
    assert study.main(["report", "--protocol", str(other), "--results", str(res)]) == 2
    assert "never mixes protocols" in capsys.readouterr().err
    assert Ledger(res / "spent_seeds.yaml").conflicts(load_protocol(other).hash, [0, 1]) != {}
    # a report asked for while a run is missing says which stage is not run
    (next(runs.glob("long-*.json"))).unlink()
    assert study.main(["report", *args[:4]]) == 0
    assert "## Regimes\n\nNot run yet" in (res / "REPORT.md").read_text()


def test_a_run_key_does_not_name_the_checkout(tmp_path):
    """A fresh clone elsewhere must find the committed runs: the shipped base is keyed by its repo path."""
    p = load_protocol(_protocol(tmp_path))
    c = study.run_config(p, "grpo", 1e-4, 0)
    # keyed by the path the committed runs were made with (study.MOVED_PATHS), read from where the base is now
    assert c["direct"]["model_path"] == "recipe/gdro/tinylm/base"
    assert Path(study.local_path(c["direct"]["model_path"])) == study.REPO / "recipe/gdro/lab/tinylm/base"
    assert study.portable_path(tmp_path) == str(tmp_path.resolve())  # outside the repo: kept absolute


def test_exploratory_arms_are_confirmed_only_if_they_gained(tmp_path):
    p = load_protocol(_protocol(tmp_path))
    s = study.Study(p, tmp_path / "r", jobs=0)
    assert study.chosen_arm(s, {"rollout_gdro, warm start k=1": [-0.01], "grpo at lr 0": [0.05]}) is None
    assert study.chosen_arm(s, {"rollout_gdro, warm start k=1": [0.002], "grpo at lr 0": [0.05]}) == (
        "rollout_gdro, warm start k=1"
    )


def test_tokens_to_target_keeps_censored_seeds():
    run = {"curve": [[0, 0, 0, 0.9, 0.5], [1, 100, 8, 0.9, 0.55], [2, 200, 16, 0.9, 0.6]], "tokens": 200}
    assert study.tokens_to(run, 0.55) == pytest.approx(100)
    assert math.isinf(study.tokens_to(run, 0.7))  # censored at 200, reported, not dropped


def test_the_direct_loop_names_an_unusable_device(capsys):
    import torch

    from recipe.gdro.lab.experiments import direct

    assert direct.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert direct.main(["--device", "cuda", "--steps", "1"]) == 2
        assert "--device: device='cuda': CUDA is not available" in capsys.readouterr().err
    assert direct.main(["--device", "tpu9", "--steps", "1"]) == 2


def test_the_direct_cli_trains_and_writes_its_result(tmp_path):
    """The documented command end to end (it once refused every invocation: gdro passed twice)."""
    from recipe.gdro.lab.experiments import direct

    out = tmp_path / "r.json"
    argv = ["--steps", "1", "--prompts", "4", "--n", "2", "--num_train", "16", "--num_val", "12"]
    assert direct.main([*argv, "--method", "joint_gdro", "--gdro", "rollout.budget=tokens", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["gdro"] == {"rollout": {"budget": "tokens"}}
    assert len(result["history"]) == 1 and 0.0 <= result["final_exact"] <= 1.0


def test_the_direct_cli_is_its_dataclass_and_keeps_its_flags():
    from recipe.gdro.lab.experiments import direct

    args = direct.parse_args(
        ["--method", "joint_gdro", "--steps", "7", "--num_train", "32", "--gdro", "rollout.budget=tokens"]
        + ["--gdro", "binner.num_bins=6", "--warm-start", "2"]
    )
    assert (args.method, args.steps, args.num_train, args.warm_start) == ("joint_gdro", 7, 32, 2)
    assert args.gdro == ["rollout.budget=tokens", "binner.num_bins=6"]
    gdro = direct.method_gdro("joint_gdro", 4, {"rollout": {"budget": "tokens"}})
    assert gdro["binner"]["hysteresis"] == 0.03 and gdro["rollout"]["n_mean"] == 4 and gdro["prompt"]["enable"]
    with pytest.raises(SystemExit):
        direct.parse_args(["--method", "joint"])
    with pytest.raises(ValueError, match="whole number of steps"):
        direct.warm_steps(direct.DirectConfig(warm_start=1, num_train=10, prompts=4, n=2, steps=5))


def test_a_run_summary_with_a_nan_result_is_named_with_its_field(tmp_path, capsys):
    """Before: scipy's "function value is NaN", naming neither the file nor the field."""
    committed = sorted((RESULTS / "runs").glob("primary-grpo-*.json"))[0]
    stored = json.loads(committed.read_text())
    stored["summary"]["final_exact_by_skill"]["add2"] = float("nan")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / committed.name).write_text(json.dumps(stored, allow_nan=True))
    assert study.main(["report", "--protocol", str(TINY_LM_V1), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {runs / committed.name}: summary field 'final_exact_by_skill.add2' is nan, not a finite number: "
        "the run's result is unusable; remove the file and run its stage again"
    )
    # the NaN the harness writes by design (no step to average) is not refused
    assert study.non_finite_field({"unseen_share": float("nan"), "curve": [{"exact": 0.5}]}) is None
    assert study.non_finite_field({"curve": [{"exact": float("inf")}]}) == ("curve[0].exact", float("inf"))


def test_study_results_below_a_file_is_named(tmp_path, capsys):
    """Before: "no runs folder ...; run the tune stage first"."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for stage in ("report", "tune"):
        assert study.main([stage, "--results", str(blocker / "r")]) == 2
        assert capsys.readouterr().err.strip() == f"error: --results {blocker / 'r'}: {blocker} is a file, not a folder"


@pytest.mark.parametrize(("stage", "spent"), [("primary", [1]), ("confirm", [300])])
def test_a_spent_evaluation_seed_is_refused_before_any_run(tmp_path, capsys, stage, spent):
    """Issue 44 item 6: a stage whose declared evaluation seeds another protocol spent was refused only after
    the tune stage had rerun its runs (18 of them, > 120 s, in the shipped protocol); now before any run."""
    proto = _protocol(tmp_path)
    res = tmp_path / "res"
    Ledger(res / "spent_seeds.yaml").spend("aaaa", stage, spent)
    assert study.main([stage, "--protocol", str(proto), "--results", str(res), "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert f"evaluation seed {spent[0]} was spent by protocol aaaa" in err and f"of {stage}'s" in err
    assert not list((res / "runs").glob("*.json"))  # no tune run, no baseline: nothing ran


def test_a_report_on_another_shipped_protocols_folder_names_the_protocol_flag(tmp_path, capsys):
    """Issue 44 item 6: ``study report`` on v1's results with v2 (the default protocol) said "move the old runs
    to their own folder"; they are in their own folder, and --protocol is the fix."""
    import shutil

    v1 = tmp_path / "tiny_lm_study"
    shutil.copytree(study.REPO / "results" / "tiny_lm_study" / "runs", v1 / "runs")
    assert study.main(["report", "--results", str(v1)]) == 2
    err = capsys.readouterr().err
    assert "pass --protocol recipe/gdro/lab/experiments/protocols/tiny_lm.yaml" in err and "move the old" not in err
    assert study.main(["report", "--results", str(v1), "--protocol", str(PROTOCOL_DIR / "tiny_lm.yaml")]) == 0
