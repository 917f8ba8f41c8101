"""The tiny-LM study's v2 infrastructure (issue 33): per-prompt outcomes in every run file, the
held-out test split, endpoints recomputed from run files alone (exact pass@k, a declared hard tail,
the worst skill), Holm over methods x endpoints, provenance in the run key, and the power plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from recipe_helpers.paths import REPO

from recipe.gdro.lab.experiments import study
from recipe.gdro.lab.experiments.protocol import TINY_LM_V1, ProtocolError, load_protocol
from recipe.gdro.lab.results.outcomes import Endpoint, Tail, endpoint_value, pass_at_k

ENDPOINTS = {
    "pass@1": {"k": 1},
    "pass@8": {"k": 8},
    "tail pass@8": {"k": 8, "tail": {"skills": ["mul1x3"]}},
    "worst skill": {"k": 1, "worst_skill": True},
}


def _protocol(tmp_path: Path, **changes) -> Path:
    data = {
        "name": "smoke v2",
        "shape": {"steps": 2, "prompts": 4, "n": 2, "num_train": 16, "num_val": 12, "num_test": 20, "eval_every": 1},
        "eval_temperature": 1.0,
        "tuning": {"seeds": [100, 101], "lr_grid": [1e-3], "methods": ["grpo", "rollout_gdro"]},
        "endpoints": ENDPOINTS,
        "primary": {
            "reference": "grpo",
            "methods": ["rollout_gdro"],
            "metrics": list(ENDPOINTS),
            # two tuning seeds keep the smoke run small; the shipped rule's 4 is checked in test_power_plan...
            "power": {"mde": {e: 0.5 for e in ENDPOINTS}, "min_tuning_seeds": 2},
            "seed_pool": [0, 1],
        },
        "explore": {"seeds": [200], "criterion": "tail pass@8", "arms": [{"name": "rgdro", "method": "rollout_gdro"}]},
        "confirm": {"seeds": [300], "metrics": ["pass@8"]},
        "long": {"seeds": [400], "methods": ["grpo"], "regimes": {}},
    }
    data.update(changes)
    path = tmp_path / "smoke_v2.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_v2_run_files_hold_per_prompt_outcomes_and_provenance_and_report_rebuilds_from_them(tmp_path, capsys):
    proto, res = _protocol(tmp_path), tmp_path / "res"
    args = ["--protocol", str(proto), "--results", str(res), "--jobs", "1"]
    assert study.main(["primary", *args]) == 0
    assert study.main(["explore", *args]) == 0
    report = (res / "REPORT.md").read_text()
    # the exploratory table ranks arms by the declared criterion and shows every endpoint, on validation
    assert "| vs GRPO (tail pass@8, val) |" in report and "| pass@1 (val) | pass@8 (val) |" in report
    files = sorted((res / "runs").glob("primary-*.json"))
    assert len(files) == 4  # two methods x two seeds (the capped plan)
    stored = json.loads(files[0].read_text())
    run, config = stored["summary"], stored["config"]
    per = run["per_prompt"]
    assert len(per["test"]["id"]) == 20 and per["test"]["step"] == [0, 2] and per["val"]["step"] == [0, 1, 2]
    assert not set(per["test"]["id"]) & set(per["val"]["id"])
    # the validation p_i are what the run's exact metric averaged (rounded to 6 significant digits)
    assert np.mean(per["val"]["p"][-1]) == pytest.approx(run["final_exact"], rel=1e-5)
    assert config["code"]["commit"] and "clean" in config["code"] and run["code"] == config["code"]
    assert config["code"]["libraries"]["torch"] == torch.__version__
    assert config["method_config"]["rollout"]["n_mean"] == 2  # the method's YAML, n̄ ...
    assert config["method_config"]["rollout"]["allocator"] == "sqrt"  # ... and the defaults it leaves out
    # reproduce: the run made again by this code has the same numbers; a changed number is named
    capsys.readouterr()
    assert study.main(["reproduce", "--run", str(files[0])]) == 0
    assert f"{files[0]}: the same numbers (" in capsys.readouterr().out
    changed = tmp_path / "changed.json"
    changed.write_text(study.run_file_text({**stored, "summary": {**run, "final_exact": run["final_exact"] + 1e-9}}))
    assert study.main(["reproduce", "--run", str(changed)]) == 1
    assert f"{changed}: differs in final_exact (" in capsys.readouterr().out
    changed.write_text(json.dumps({"summary": {"arm": "grpo"}, "config": config}))
    assert study.main(["reproduce", "--run", str(changed)]) == 2
    assert capsys.readouterr().err == f"error: --run {changed}: the run file's summary has no stage, protocol_hash\n"
    assert study.main(["report", "--run", str(changed)]) == 2  # --run is reproduce's only
    assert capsys.readouterr().err == "error: --run FILE goes with the reproduce stage, and only with it\n"
    changed.write_text("[1, 2]")  # JSON, not a run file: the reader report uses refuses it too
    assert study.main(["reproduce", "--run", str(changed)]) == 2
    assert capsys.readouterr().err == f"error: --run {changed}: not a run summary of the study (unreadable)\n"
    # the endpoints from the file alone, by hand
    p, skills = np.array(per["test"]["p"][-1]), np.array(per["test"]["skill"])
    assert study.metric(run, "pass@8", 0.0, load_protocol(proto).endpoints) == pytest.approx(np.mean(1 - (1 - p) ** 8))
    assert study.metric(run, "tail pass@8", 0.0, load_protocol(proto).endpoints) == pytest.approx(
        np.mean(1 - (1 - p[skills == "mul1x3"]) ** 8)
    )
    assert "| pass@1 | pass@8 | tail pass@8 | worst skill |" in report  # side by side, per method
    base_p = np.array(per["test"]["p"][0])
    assert f"| base (no training) | {np.mean(base_p):.4f} | {np.mean(1 - (1 - base_p) ** 8):.4f} |" in report
    assert all(f"| rollout_gdro {e} |" in report for e in ENDPOINTS)  # Holm's family: methods x endpoints
    assert "SD bound" in report and "Run code: commit" in report
    # report: from the files alone, byte for byte, runs nothing; the test split serves only the primary
    # endpoints: without the other runs' test outcomes (the tuning runs the power plan reads) it is unchanged
    for path in [*(res / "runs").glob("tune-*.json"), *(res / "runs").glob("explore-*.json")]:
        other = json.loads(path.read_text())
        del other["summary"]["per_prompt"]["test"]
        path.write_text(study.run_file_text(other))
    assert study.main(["report", *args[:4]]) == 0 and (res / "REPORT.md").read_text() == report
    # a run made from a tree with uncommitted run-code changes is named (the others marked clean here:
    # this checkout may itself be dirty)
    for i, path in enumerate(sorted((res / "runs").glob("*.json"))):
        other = json.loads(path.read_text())
        other["config"]["code"] = {"commit": "c" * 40, "clean": True}
        if path == files[0]:
            other["config"]["code"] = {"commit": "d" * 40, "clean": False, "diff_sha256": "0" * 64}
        path.write_text(study.run_file_text(other))
    capsys.readouterr()
    assert study.main(["report", *args[:4]]) == 0
    out = capsys.readouterr().out
    assert f"uncommitted changes to the run code (1): {files[0].name}." in out
    assert "commit cccccccccccc (10 runs), commit dddddddddddd (1 run)" in out
    # a run file whose test split holds a validation prompt is refused, naming the file and the prompt
    bad = json.loads(files[1].read_text())
    leaked = bad["summary"]["per_prompt"]["val"]["id"][3]
    bad["summary"]["per_prompt"]["test"]["id"][0] = leaked
    files[1].write_text(study.run_file_text(bad))
    assert study.main(["report", *args[:4]]) == 2
    err = capsys.readouterr().err
    assert files[1].name in err and f"prompt {leaked!r} is in both the validation and the test split" in err


def test_v2_protocol_errors_name_the_key(tmp_path):
    with pytest.raises(ProtocolError, match=r"endpoints.t.tail.below: unknown key \(did you mean base_below\?\)"):
        load_protocol(_protocol(tmp_path, endpoints={"t": {"k": 8, "tail": {"below": 0.05}}}))
    with pytest.raises(ProtocolError, match="endpoints.pass@8: reads the test split: set shape.num_test > 0"):
        load_protocol(_protocol(tmp_path, shape={"steps": 2}, endpoints={"pass@8": {"k": 8}}))
    with pytest.raises(ProtocolError, match=r"primary.power: .*'floor'"):
        power = {"mde": {e: 0.01 for e in ENDPOINTS}, "floor": 0.01}
        load_protocol(
            _protocol(tmp_path, primary={**yaml.safe_load(_protocol(tmp_path).read_text())["primary"], "power": power})
        )


def test_the_run_key_holds_the_resolved_method_config_and_the_code(tmp_path):
    p = load_protocol(_protocol(tmp_path))
    code = {"commit": "a" * 40, "clean": True}
    base = study.run_config(p, "rollout_gdro", 1e-3, 0, code=code)
    edited = study.run_config(p, "rollout_gdro", 1e-3, 0, code=code, gdro={"binner": {"num_bins": 3}})
    assert study.config_key(base) != study.config_key(edited)  # a method's settings name its runs
    store = study.RunStore(tmp_path / "runs", p.hash)
    store.put(base, {"arm": "x", "stage": "tune", "seed": 0, "protocol_hash": p.hash, "final_exact": 0.5})
    assert store.get(base) is not None
    assert store.get(edited) is None
    # another commit: a stage runs it again; a report (code None) reads what was made
    assert store.get({**base, "code": {"commit": "b" * 40, "clean": True}}) is None
    assert store.get({**base, "code": None}) is not None
    # the v1 protocol's keys are unchanged: its committed runs are still found (test_study's report test)
    v1 = study.run_config(load_protocol(TINY_LM_V1), "grpo", 1e-4, 100, code=code)
    assert "code" not in v1 and "method_config" not in v1 and "num_test" not in v1["direct"]


def test_a_report_refuses_runs_of_two_protocols_in_one_line(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for i, h in enumerate(["a" * 64, "a" * 64, "b" * 64]):
        (runs / f"r{i}.json").write_text(json.dumps({"summary": {"protocol_hash": h}, "config": {}}))
    with pytest.raises(ProtocolError) as e:
        study.RunStore(runs, "c" * 64)
    msg = str(e.value)
    assert "\n" not in msg and "2 of protocol aaaaaaaaaaaaaaaa (r0.json, r1.json)" in msg
    assert "1 of protocol bbbbbbbbbbbbbbbb (r2.json)" in msg and "never mixes protocols" in msg


def test_the_run_code_list_covers_what_a_run_imports():
    """A module a run imports outside RUN_CODE would change runs without changing their key (a fresh
    process makes a one-step run, so modules imported inside functions count too)."""
    code = (
        "import sys, torch; torch.set_num_threads(1); from pathlib import Path;"
        "from recipe.gdro.lab.experiments.direct import run_direct;"
        "run_direct(dict(steps=1, prompts=2, n=2, num_train=4, num_val=6, num_test=6), log=lambda *_: None);"
        "r = Path.cwd().resolve(); files = {Path(m.__file__).resolve() for m in list(sys.modules.values())"
        " if getattr(m, '__file__', None)};"
        "env = Path(sys.prefix).resolve();"  # a venv inside the checkout (run_scripts/setup_env.sh's .venv)
        "print('\\n'.join(sorted(str(f.relative_to(r)) for f in files"
        " if f.is_relative_to(r) and not f.is_relative_to(env))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    loaded = [f for f in out.split() if (REPO / f).is_file()]
    assert "recipe/gdro/lab/experiments/direct.py" in loaded and "recipe/gdro/lab/tinylm/policy.py" in loaded
    outside = [f for f in loaded if not any(f == c or f.startswith(c + "/") for c in study.RUN_CODE)]
    assert outside == []
    assert all((REPO / c).exists() for c in study.RUN_CODE)  # no stale entry


def test_exact_pass_at_k_tail_and_worst_skill():
    assert pass_at_k([0.5, 0.0, 1.0], 1) == pytest.approx(0.5)
    assert pass_at_k([0.5], 3) == pytest.approx(1 - 0.5**3)
    assert pass_at_k([1e-12], 8) == pytest.approx(8e-12, rel=1e-6)  # no cancellation for a hard tail
    with pytest.raises(ValueError):
        pass_at_k([1.2], 1)
    run = {
        "per_prompt": {
            "test": {
                "id": ["a", "b", "c", "d"],
                "skill": ["s", "s", "t", "t"],
                "step": [0, 10],
                "p": [[0.9, 0.01, 0.02, 0.5], [0.95, 0.2, 0.1, 0.6]],
            }
        }
    }
    tail = Endpoint("tail", k=2, tail=Tail(base_below=0.05))  # prompts b and c, by the base's p
    assert endpoint_value(run, tail) == pytest.approx(np.mean([1 - 0.8**2, 1 - 0.9**2]))
    worst = Endpoint("worst", k=1, worst_skill=True)
    assert endpoint_value(run, worst) == pytest.approx(min(0.575, 0.35))  # every skill, no floor
    floored = Endpoint("worst", k=1, worst_skill=True, min_base=0.3)  # t's base 0.26: left out
    assert endpoint_value(run, floored) == pytest.approx(0.575)


def test_the_test_split_is_disjoint_from_validation_and_named_when_not():
    from data_prep import arith
    from recipe.gdro.lab.results.outcomes import check_disjoint

    val = arith.build_split(1000, 0, val=True)
    test = arith.build_test_split(500, 0, 1000)
    ids = {r["prompt"][-1]["content"] for r in test}
    assert len(ids) == 500 and not ids & {r["prompt"][-1]["content"] for r in val}
    assert all(arith.is_val_problem(i) for i in ids)  # never trained on (nor in the SFT data)
    assert val == arith.build_split(1000, 0, val=True)  # the validation split is unchanged by it
    with pytest.raises(ValueError, match=r"prompt '12\+34=' is in both the validation and the test split"):
        check_disjoint({"validation": ["1+1=", "12+34="], "test": ["12+34="]})
    with pytest.raises(Exception, match="mul1x2: 30 distinct test problems"):
        arith.build_test_split(600, 0, 1000)


def test_a_test_split_the_data_cannot_hold_is_refused_before_any_run(tmp_path, capsys):
    shape = {"steps": 2, "prompts": 4, "n": 2, "num_train": 16, "num_val": 1000, "num_test": 600}
    proto = _protocol(tmp_path, shape=shape)
    assert study.main(["tune", "--protocol", str(proto), "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "shape.num_test: skill mul1x2: 30 distinct test problems" in err and not (tmp_path / "r" / "runs").exists()


def test_holm_runs_over_methods_x_endpoints():
    from scipy import stats

    from recipe.gdro.lab.results.stats import paired_family

    rng = np.random.default_rng(1)
    diffs = {(m, e): list(rng.normal(mu, 0.01, 6)) for m, mu in (("a", 0.02), ("b", 0.0)) for e in ("pass@1", "pass@8")}
    family = paired_family(diffs, alpha=0.05)
    p = {k: stats.ttest_1samp(v, 0.0).pvalue for k, v in diffs.items()}
    order = sorted(p, key=p.get)  # Holm by hand: m = 4 = 2 methods x 2 endpoints
    expected = np.maximum.accumulate([min(1.0, (4 - i) * p[k]) for i, k in enumerate(order)])
    for k, want in zip(order, expected, strict=True):
        assert family[k].p == pytest.approx(p[k]) and family[k].p_holm == pytest.approx(want)
    assert family[("a", "pass@1")].rejected and not family[("b", "pass@8")].rejected


def test_power_plan_on_the_upper_confidence_bound_of_the_sd():
    from recipe.gdro.lab.results.stats import PowerRule, paired_t_power, plan_for_mdes, sd_upper_bound, seeds_for_mde

    # the bound covers the true SD in 80% of 4-seed samples (it is not the point estimate's 50%)
    rng = np.random.default_rng(0)
    draws = rng.normal(0.0, 1.0, size=(4000, 4))
    factor = sd_upper_bound([[0.0, 1.0, 2.0, 3.0]]).upper / sd_upper_bound([[0.0, 1.0, 2.0, 3.0]]).point
    assert np.mean(draws.std(axis=1, ddof=1) * factor >= 1.0) == pytest.approx(0.8, abs=0.02)
    # the seed count is the smallest with the target power at Holm's first step
    n, capped = seeds_for_mde(0.01, 0.01, 6)
    assert not capped and paired_t_power(0.01, 0.01, n, 0.05 / 6) >= 0.8 > paired_t_power(0.01, 0.01, n - 1, 0.05 / 6)
    diffs = {"pass@1": [[0.01, 0.0, -0.01, 0.005]] * 3, "pass@8": [[0.03, 0.0, -0.02, 0.01]] * 3}
    plan = plan_for_mdes(diffs, {"pass@1": 0.01, "pass@8": 0.02}, 3)
    assert plan.family_size == 6 and plan.n_seeds == max(e.seeds_needed for e in plan.endpoints)
    assert all(e.mde <= e.target_mde + 1e-9 for e in plan.endpoints)
    with pytest.raises(ValueError, match="3 tuning seeds; the power plan needs at least 4"):
        plan_for_mdes({"pass@1": [[0.01, 0.0, 0.02]]}, {"pass@1": 0.01}, 1, PowerRule())


def test_the_reference_is_tuned_over_its_shape_grids_extend_at_an_edge_and_a_mass_arm_equalises_the_step(tmp_path):
    """tiny_lm_v2's design, end to end on a smoke protocol: GRPO tuned over (prompts, n) at equal rollouts
    a step, every other method at its chosen shape; an lr chosen on a grid's edge extends the grid (once
    here); power seeds run at the tuned settings only; an arm at GRPO's advantage mass runs at the method's
    lr times the mass ratio of the tuning runs; the pass@k figure rebuilds byte for byte."""
    shapes = [{"prompts": 4, "n": 2}, {"prompts": 2, "n": 4}]
    tuning = {
        "seeds": [100, 101],
        "power_seeds": [102, 103],
        "lr_grid": [1e-3, 2e-3],
        "extend": 1,
        "reference_shapes": shapes,
        "methods": ["grpo", "rollout_gdro"],
    }
    arms = [{"name": "rgdro at grpo's mass", "method": "rollout_gdro", "lr_scale": "reference_mass"}]
    proto = _protocol(tmp_path, tuning=tuning, explore={"seeds": [200], "criterion": "pass@8", "arms": arms})
    res = tmp_path / "res"
    args = ["--protocol", str(proto), "--results", str(res), "--jobs", "1"]
    assert study.main(["primary", *args]) == 0 and study.main(["explore", *args]) == 0
    runs = [json.loads(p.read_text()) for p in sorted((res / "runs").glob("*.json"))]
    runs = [(r["summary"], r["config"]["direct"]) for r in runs if r["summary"]["stage"] != "baseline"]
    series: dict[tuple, dict[float, list[float]]] = {}
    for summary, direct in runs:
        if summary["stage"] == "tune" and summary["seed"] in (100, 101):
            key = (direct["method"], direct["prompts"], direct["n"])
            series.setdefault(key, {}).setdefault(direct["lr"], []).append(summary["final_exact"])
    best = {}
    for key, by_lr in series.items():
        assert all(len(v) == 2 for v in by_lr.values()) and set(by_lr) <= {5e-4, 1e-3, 2e-3, 4e-3}
        means = {lr: np.mean(v) for lr, v in by_lr.items()}
        best[key] = max(sorted(means), key=means.get)
        lrs = sorted(by_lr)
        # the choice is bracketed, or its side was extended as often as allowed (once)
        assert lrs[0] < best[key] < lrs[-1] or (best[key] == lrs[0] == 5e-4) or (best[key] == lrs[-1] == 4e-3)
        assert len(lrs) == 2 + (lrs[0] == 5e-4) + (lrs[-1] == 4e-3) and len(lrs) > 2  # an edge is always chosen first
    grpo = {k: v for k, v in series.items() if k[0] == "grpo"}
    assert {(k[1], k[2]) for k in grpo} == {(4, 2), (2, 4)}
    chosen = max(grpo, key=lambda k: (np.mean(grpo[k][best[k]]), -[(4, 2), (2, 4)].index(k[1:])))
    shape = chosen[1:]
    assert {k[1:] for k in series if k[0] == "rollout_gdro"} == {shape}  # every other method at GRPO's shape
    tuned = {"grpo": best[chosen], "rollout_gdro": best[("rollout_gdro", *shape)]}
    for summary, direct in runs:
        if summary["stage"] != "tune" or summary["seed"] in (102, 103):  # power seeds and later stages
            assert (direct["prompts"], direct["n"]) == shape
        if summary["stage"] == "tune" and summary["seed"] in (102, 103) or summary["stage"] == "primary":
            assert direct["lr"] == tuned[direct["method"]]
    mass = {
        m: np.mean([s["weighted_adv_token_mass"] for s, d in runs if s["stage"] == "tune" and d["method"] == m
                    and d["lr"] == tuned[m] and (d["prompts"], d["n"]) == shape])
        for m in tuned
    }  # fmt: skip
    arm = [d for s, d in runs if s["arm"] == "rgdro at grpo's mass"]
    assert len(arm) == 1 and arm[0]["lr"] == pytest.approx(tuned["rollout_gdro"] * mass["grpo"] / mass["rollout_gdro"])
    report = (res / "REPORT.md").read_text()
    assert f"{shape[0]} x {shape[1]} chosen; every other method runs at it" in report
    assert "| pass@1 | pass@2 | pass@4 | pass@8 | pass@16 | pass@32 |" in report
    figure = (res / study.PASS_AT_K_FIGURE).read_bytes()
    assert figure.startswith(b"<?xml") and b"dc:date" not in figure and b"Matplotlib v" not in figure
    (res / study.PASS_AT_K_FIGURE).unlink()
    assert study.main(["report", *args[:4]]) == 0
    assert (res / study.PASS_AT_K_FIGURE).read_bytes() == figure and (res / "REPORT.md").read_text() == report


def test_v2_design_keys_are_checked(tmp_path):
    tuning = {"seeds": [100, 101], "lr_grid": [1e-3], "methods": ["grpo", "rollout_gdro"]}
    bad_shapes = {**tuning, "reference_shapes": [{"prompts": 4, "n": 2}, {"prompts": 4, "n": 4}]}
    with pytest.raises(ProtocolError, match=r"tuning.reference_shapes: prompts x n differ: \[8, 16\]"):
        load_protocol(_protocol(tmp_path, tuning=bad_shapes))
    with pytest.raises(ProtocolError, match=r"tuning.reference_shapes\[0\].n: missing"):
        load_protocol(_protocol(tmp_path, tuning={**tuning, "reference_shapes": [{"prompts": 4}]}))
    with pytest.raises(ProtocolError, match="tuning.extend: extending the grid needs at least two lrs"):
        load_protocol(_protocol(tmp_path, tuning={**tuning, "extend": 1}))
    with pytest.raises(ProtocolError, match="seed 100 is also in tuning.seeds"):
        load_protocol(_protocol(tmp_path, tuning={**tuning, "power_seeds": [100]}))
    arms = [{"name": "x", "method": "rollout_gdro", "lr_scale": "grpo_mass"}]
    bad_scale = r"explore.arms\[0\].lr_scale: 'grpo_mass' must be a number >= 0 or reference_mass"
    with pytest.raises(ProtocolError, match=bad_scale):
        load_protocol(_protocol(tmp_path, explore={"seeds": [200], "arms": arms}))
    shipped = load_protocol()  # the current protocol, tiny_lm_v2
    assert shipped.data["name"] == "tiny_lm_v2" and shipped.results == "results/tiny_lm_study_v2"
    assert {s["prompts"] * s["n"] for s in shipped.tuning["reference_shapes"]} == {256}
