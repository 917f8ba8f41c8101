"""Tests of the GDRO simulator (synthetic learner) and the plotting tool.

Small scenarios and few steps keep the whole file well under a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from recipe_helpers.paths import REPO

from recipe.gdro.lab.results import plot as gdro_plot
from recipe.gdro.lab.sim import plots as sim_plots
from recipe.gdro.lab.sim.methods import default_methods, parse_set_overrides
from recipe.gdro.lab.sim.scenario import ScenarioError, load_scenario, scenario_from_dict, shipped_scenarios
from recipe.gdro.lab.sim.simulate import run_experiment, run_one
from recipe.gdro.results.metrics_io import append_metrics_jsonl


def tiny(**over):
    """A small two-skill scenario: a common medium skill and a harder one."""
    d = {
        "name": "tiny",
        "num_prompts": 240,
        "num_eval_prompts": 200,
        "batch_size": 24,
        "n_mean": 4,
        "lr": 0.02,
        "transfer": 0.5,
        "steps": 40,
        "seeds": 1,
        "skills": [
            {"name": "common", "frequency": 0.8, "difficulty": {"mean": 0.0, "std": 1.0}},
            {"name": "hard", "frequency": 0.2, "difficulty": {"mean": -1.5, "std": 1.0}},
        ],
    }
    d.update(over)
    return scenario_from_dict(d, source="tiny.yaml")


RARE_HARD = {
    "name": "rare_hard_small",
    "num_prompts": 400,
    "num_eval_prompts": 200,
    "batch_size": 40,
    "n_mean": 4,
    "lr": 0.01,
    "transfer": 0.6,
    "steps": 80,
    "seeds": 1,
    "skills": [
        {"name": "core", "frequency": 0.95, "difficulty": {"mean": 3.0, "std": 0.8}},
        {"name": "rare_hard", "frequency": 0.05, "difficulty": {"mean": -1.5, "std": 0.5}},
    ],
}


# ------------------------------------------------------------------------------------ learner
def test_grpo_learner_improves_and_uses_verls_advantage(monkeypatch):
    import verl.trainer.ppo.core_algos as core_algos

    calls = []
    real = core_algos.compute_grpo_outcome_advantage

    def spy(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(core_algos, "compute_grpo_outcome_advantage", spy)
    sc = tiny()
    r = run_one(sc, "grpo", seed=0, steps=40)
    acc = np.asarray(r["curves"]["mean_accuracy"])
    assert acc[-1] > acc[0] + 0.10, f"plain GRPO did not improve the learner: {acc[0]:.3f} -> {acc[-1]:.3f}"
    assert acc[-1] > acc[20] > acc[0]
    # one call of verl's function per step, on the whole batch (B * n̄ responses)
    assert calls == [sc.batch_size * sc.n_mean] * 40


def test_total_rollouts_equal_across_methods(tmp_path):
    sc = tiny()
    res = run_experiment(sc, str(tmp_path), seeds=[0], steps=30, workers=1, progress=False, plots=False)
    assert set(res["methods"]) == set(default_methods())
    expected = 30 * sc.batch_size * sc.n_mean
    assert res["equal_total_rollouts"] is True
    for name, e in res["methods"].items():
        assert e["total_rollouts"] == expected, name
        # the recipe-format per-step file records the realised budget of every step
        recs = gdro_plot.read_metrics_jsonl(os.path.join(str(tmp_path), e["metrics_files"][0]))
        assert [r["sim/rollouts_total"] for r in recs] == [sc.batch_size * sc.n_mean] * 30
    # the rollout methods really did vary the per-prompt counts (otherwise equality is trivial)
    recs = gdro_plot.read_metrics_jsonl(os.path.join(str(tmp_path), res["methods"]["rollout_gdro"]["metrics_files"][0]))
    rpp = [
        v
        for r in recs
        for k, v in r.items()
        if k.endswith("/rollouts_per_prompt") and k.startswith("gdro/bin_") and np.isfinite(v)
    ]
    assert max(rpp) - min(rpp) > 0.5


def test_rollout_gdro_gives_rare_hard_skill_more_compute_than_its_data_share():
    sc = scenario_from_dict(RARE_HARD, source="rare_hard_small.yaml")
    k = [s.name for s in sc.skills].index("rare_hard")
    r = run_one(sc, "rollout_gdro", seed=0, steps=80)
    data, compute = r["skill_data_share"][k], r["skill_compute_share"][k]
    assert compute > 1.3 * data, f"rare hard skill: compute share {compute:.3f} vs data share {data:.3f}"
    # and uniform GRPO gives it exactly its data share
    g = run_one(sc, "grpo", seed=0, steps=20)
    assert g["skill_compute_share"][k] == pytest.approx(g["skill_data_share"][k])


def test_rare_hard_skill_bins_get_compute_share_above_data_share(tmp_path):
    """Bin view (what the plots show): the bins holding the rare skill's prompts, averaged over steps."""
    sc = scenario_from_dict(RARE_HARD, source="rare_hard_small.yaml")
    path = str(tmp_path / "m.jsonl")
    run_one(sc, "rollout_gdro", seed=0, steps=80, metrics_path=path)
    s = gdro_plot.Series.from_records(gdro_plot.read_metrics_jsonl(path))
    late = s.steps > 30  # after the first visits have binned the prompts
    hard_bins = ["bin_01", "bin_02", "bin_03"]  # initial p of the rare skill is ~0.1-0.35; the core sits in bins 8-9
    data = np.nansum([np.nan_to_num(s.values[f"gdro/{b}/data_share"][late]) for b in hard_bins], axis=0).mean()
    comp = np.nansum([np.nan_to_num(s.values[f"gdro/{b}/compute_share"][late]) for b in hard_bins], axis=0).mean()
    assert data > 0
    assert comp > 1.3 * data, f"hard bins: compute share {comp:.3f} vs data share {data:.3f}"


def test_reproducible_for_a_fixed_seed(tmp_path):
    sc = tiny()
    a = run_one(sc, "joint_gdro", seed=3, steps=15, metrics_path=str(tmp_path / "a.jsonl"))
    b = run_one(sc, "joint_gdro", seed=3, steps=15, metrics_path=str(tmp_path / "b.jsonl"))
    c = run_one(sc, "joint_gdro", seed=4, steps=15)
    for key in a["curves"]:
        assert np.array_equal(a["curves"][key], b["curves"][key], equal_nan=True), key
    assert a["summary"] == b["summary"]
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    assert a["curves"]["mean_accuracy"] != c["curves"]["mean_accuracy"]
    # bandit (own RNG) is reproducible too
    x = run_one(sc, "rollout_gdro:rollout.allocator=bandit", seed=1, steps=10)
    y = run_one(sc, "rollout_gdro:rollout.allocator=bandit", seed=1, steps=10)
    for key in x["curves"]:
        assert np.array_equal(x["curves"][key], y["curves"][key], equal_nan=True), key


def test_methods_share_batches_and_reward_draws(monkeypatch):
    """Common random numbers: with the same seed every method sees the same batches, the same
    noise, and rewards coupled through the same uniform draw per (position, slot) — so where a
    method's pass rate p is lower, its reward is never 1 where the other's is 0."""
    from recipe.gdro.lab.sim import learner as learner_mod

    calls: dict[str, list] = {}
    real = learner_mod._LearnerBase.rollout

    def recording(self, ids, counts, step):
        out = real(self, ids, counts, step)
        calls.setdefault(self._method, []).append((ids.copy(), np.asarray(counts).copy(), out))
        return out

    monkeypatch.setattr(learner_mod._LearnerBase, "rollout", recording)
    real_init = learner_mod._LearnerBase.__init__
    sc = tiny()
    for method in ("grpo", "prompt_gdro", "rollout_gdro"):

        def init(self, *a, _m=method, **k):
            real_init(self, *a, **k)
            self._method = _m

        monkeypatch.setattr(learner_mod._LearnerBase, "__init__", init)
        run_one(sc, method, seed=0, steps=16)  # > one epoch (10 steps): GDRO acts once prompts are seen
    base = calls["grpo"]
    assert len(base) == 16
    for method in ("prompt_gdro", "rollout_gdro"):
        other = calls[method]
        differ = 0
        for (ids_a, n_a, a), (ids_b, n_b, b) in zip(base, other, strict=True):
            assert np.array_equal(ids_a, ids_b)  # same batches
            assert np.array_equal(a["zeta"], b["zeta"])  # same noise by batch position
            for i in range(len(ids_a)):
                k = min(n_a[i], n_b[i])
                ra = a["rewards"][a["pos"] == i][:k]
                rb = b["rewards"][b["pos"] == i][:k]
                # Same uniform U per slot: r = 1[U < p]. r_a > r_b needs p_a > p_b, and vice versa.
                assert not np.any((ra > rb) & (a["p"][i] <= b["p"][i]))
                assert not np.any((rb > ra) & (b["p"][i] <= a["p"][i]))
            differ += int(not np.array_equal(a["p"], b["p"]))
        assert differ > 0  # the policies did diverge, so the coupling was exercised
    assert not np.array_equal(calls["grpo"][-1][1], calls["rollout_gdro"][-1][1])  # counts differ


# ------------------------------------------------------------------------------------ plotting
def _capture_titles(monkeypatch):
    titles = []
    real_save = gdro_plot.save_figure

    def save(fig, path):
        sup = fig._suptitle.get_text() if fig._suptitle is not None else ""
        titles.append((os.path.basename(path), sup + " " + " ".join(ax.get_title() for ax in fig.axes)))
        return real_save(fig, path)

    monkeypatch.setattr(gdro_plot, "save_figure", save)
    return titles


def test_simulator_outputs_and_plots(tmp_path, monkeypatch):
    titles = _capture_titles(monkeypatch)
    sc = tiny()
    out = tmp_path / "sim"
    res = run_experiment(
        sc,
        str(out),
        methods=["grpo", "prompt_gdro", "rollout_gdro"],
        seeds=[0, 1],
        steps=30,
        workers=1,
        progress=False,
        plots=True,
    )
    data = json.loads((out / "results.json").read_text())
    assert data["synthetic_learner"] is True and "SYNTHETIC" in data["note"]
    for e in data["methods"].values():
        for key in (
            "mean_accuracy",
            "worst_skill_accuracy",
            "pass_at_8",
            "total_rollouts",
            "se_reduction",
            "variance_reduction",
            "efficiency",
            "advantage_mass_ratio",
            "curves",
        ):
            assert key in e
        assert len(e["curves"]["mean_accuracy"]["mean"]) == 31
        assert e["mean_accuracy_std"] >= 0
    assert data["methods"]["rollout_gdro"]["se_reduction"] != 0.0
    assert (
        data["methods"]["grpo"]["se_reduction"] == 0.0 and data["methods"]["prompt_gdro"]["variance_reduction"] == 0.0
    )
    report = (out / "report.md").read_text()
    assert report.splitlines()[0].lower().count("synthetic") == 1 and "| rollout_gdro |" in report
    assert "**prompt_gdro** vs GRPO:" in report and "paired, 2 seeds, 95% CI" in report
    assert "DESIGN" not in report
    pngs = {p.name for p in out.glob("*.png")}
    for name in (
        "accuracy_curves.png",
        "skill_compute_share.png",
        "prompt_gdro_traveling_wave.png",
        "grpo_bins.png",
        "rollout_gdro_compute_share.png",
        "rollout_gdro_rollouts_per_bin.png",
        "rollout_gdro_mu.png",
    ):
        assert name in pngs and (out / name).stat().st_size > 5000, name
    assert titles and all("synthetic" in t.lower() for _, t in titles), titles
    assert res["methods"]["grpo"]["total_rollouts"] == 30 * sc.batch_size * sc.n_mean

    # the standalone plotting tool re-renders a simulator folder
    again = tmp_path / "replot"
    assert sim_plots.main([str(out), "--out", str(again)]) == 0
    assert (again / "prompt_gdro_traveling_wave.png").stat().st_size > 5000


def _fake_training_run(path: str, steps: int = 25) -> None:
    """Drive a real GDROController with random outcomes and log it with the recipe's own writer."""
    from verl_ext import GDROController, gdro_config_from_dict

    cfg = gdro_config_from_dict({"prompt": {"enable": True}, "rollout": {"enable": True, "allocator": "sqrt"}})
    ctl = GDROController(cfg, 200)
    rng = np.random.default_rng(0)
    p_true = rng.beta(0.7, 0.7, size=200)
    for step in range(1, steps + 1):
        ids = rng.choice(200, size=32, replace=False)
        counts = ctl.schedule(ids)
        rep = np.repeat(ids, counts)
        acc = rng.random(len(rep)) < p_true[rep]
        ctl.observe(rep, acc, response_abs_advantage=rng.random(len(rep)))
        m = ctl.metrics()
        if step == 1:
            m["gdro/se_proxy_reduction"] = float("nan")  # a missing value, as a real run may log
        append_metrics_jsonl(path, step, m)


def test_plot_reads_a_recipe_metrics_file(tmp_path, monkeypatch):
    titles = _capture_titles(monkeypatch)
    run = tmp_path / "run" / "gdro_metrics.jsonl"
    _fake_training_run(str(run))
    assert "null" in run.read_text()  # NaN written as null by the recipe's writer
    out = tmp_path / "plots"
    assert gdro_plot.main([str(run), "--out", str(out)]) == 0
    for name in (
        "traveling_wave.png",
        "weight_vs_share_per_bin.png",
        "rollouts_per_bin.png",
        "compute_share.png",
        "mu.png",
    ):
        assert (out / name).stat().st_size > 5000, name
    # a real run is not labelled synthetic
    assert titles and all("synthetic" not in t.lower() for _, t in titles)


def test_plot_cli_errors(tmp_path):
    assert gdro_plot.main([str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "gdro/mu": 0.1}\nnot json\n{"step": 3}\n')
    assert gdro_plot.main([str(bad), "--out", str(tmp_path / "o")]) == 2


# ------------------------------------------------------------------------------------ scenarios / CLI
def test_shipped_scenarios_load():
    names = shipped_scenarios()
    assert {"dapo_like", "rare_hard_skill", "unsolvable_share"} <= set(names)
    for n in names:
        sc = load_scenario(n)
        assert sc.skills and sc.batch_size <= sc.num_prompts
    assert load_scenario(None).name == "dapo_like"


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"batch_sise": 3}, "batch_sise"),
        ({"lr": "fast"}, "lr='fast'"),
        ({"steps": 0}, "steps=0"),
        ({"skills": [{"name": "a", "frequency": -1, "difficulty": {"mean": 0, "std": 1}}]}, "skills[0].frequency"),
        ({"skills": [{"name": "a", "frequency": 1, "difficulty": {"mean": 0, "sd": 1}}]}, "skills[0].difficulty.sd"),
        (
            {"skills": [{"name": "a", "frequency": 1, "difficulty": {"mixture": [{"weight": 1, "mean": 0}]}}]},
            "skills[0].difficulty.mixture[0].std",
        ),
        ({"skills": [{"name": "a b", "frequency": 1, "difficulty": {"mean": 0, "std": 1}}]}, "skills[0].name"),
        ({"gdro": {"prompt": {"loss_signal": "bogus"}}}, "prompt.loss_signal"),
        ({"gdro": {"binner": {"windo": 5}}}, "gdro.binner.windo"),
        ({"gdro": {"prompt": {"enable": True}}}, "gdro.prompt.enable"),
        ({"batch_size": 10_000}, "batch_size=10000"),
    ],
)
def test_scenario_errors_name_the_key(patch, needle):
    base = {
        "num_prompts": 100,
        "batch_size": 10,
        "lr": 0.1,
        "steps": 5,
        "skills": [{"name": "a", "frequency": 1, "difficulty": {"mean": 0, "std": 1}}],
    }
    base.update(patch)
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(base, source="bad.yaml")
    assert needle in str(e.value) and "bad.yaml" in str(e.value)


def test_set_overrides_parse_and_reject():
    assert parse_set_overrides(["prompt.loss_signal=failure_rate", "binner.num_bins=6"]) == {
        "prompt": {"loss_signal": "failure_rate"},
        "binner": {"num_bins": 6},
    }
    with pytest.raises(ValueError, match="enable"):
        parse_set_overrides(["prompt.enable=true"])
    with pytest.raises(ValueError, match="KEY"):
        parse_set_overrides(["foo.bar=1"])


def test_cli_end_to_end(tmp_path):
    scen = tmp_path / "mini.yaml"
    d = {
        "name": "mini",
        "num_prompts": 120,
        "num_eval_prompts": 60,
        "batch_size": 12,
        "lr": 0.02,
        "steps": 8,
        "seeds": 1,
        "skills": [
            {"name": "a", "frequency": 3, "difficulty": {"mean": 0, "std": 1}},
            {
                "name": "b",
                "frequency": 1,
                "difficulty": {"mixture": [{"weight": 1, "mean": -2, "std": 1}, {"weight": 1, "mean": 1, "std": 0.5}]},
                "unsolvable": 0.1,
            },
        ],
    }
    scen.write_text(yaml.safe_dump(d))
    out = tmp_path / "o"
    cmd = [
        sys.executable,
        "-m",
        "recipe.gdro.lab.sim.simulate",
        "--scenario",
        str(scen),
        "--out",
        str(out),
        "--seeds",
        "2",
        "--methods",
        "grpo",
        "joint_gdro",
        "--set",
        "binner.num_bins=6",
        "--workers",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "synthetic learner" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == [0, 1] and set(res["methods"]) == {"grpo", "joint_gdro"}
    assert res["methods"]["joint_gdro"]["gdro_config"]["binner"]["num_bins"] == 6
    assert (out / "metrics" / "joint_gdro" / "seed1.jsonl").exists()
    assert (out / "joint_gdro_traveling_wave.png").stat().st_size > 5000

    bad = subprocess.run(
        [sys.executable, "-m", "recipe.gdro.lab.sim.simulate", "--scenario", "no_such_scenario", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "no_such_scenario" in bad.stderr


# ------------------------------------------------------------------------------------ issue 10
def test_shared_learner_updates_interfere_and_can_forget():
    """Practising one skill moves every skill whose feature overlaps it; anti-aligned skills lose ability."""
    from recipe.gdro.lab.sim.learner import SharedLearner

    sc = scenario_from_dict(
        {
            **RARE_HARD,
            "skills": [{"name": f"s{i}", "frequency": 1, "difficulty": {"mean": 0, "std": 1}} for i in range(6)],
            "learner": {"rep_dim": 2, "feature_overlap": 0.0, "curvature": 0.0, "forgetting": 0.0},
        },
        source="six.yaml",
    )
    lrn = SharedLearner(sc, seed=0)
    gram = lrn.features @ lrn.features.T
    a, b = np.unravel_index(np.argmin(gram), gram.shape)
    assert gram[a, b] < 0  # 6 unit vectors in 2-D cannot all be pairwise non-negative
    ids = np.flatnonzero(lrn.skill_of == a)[:5]
    before = lrn.ability().copy()
    zeta = np.zeros((len(ids), 33))
    lrn._apply(ids, np.full(len(ids), 0.1), np.zeros(len(ids)), zeta)
    after = lrn.ability()
    assert after[a] > before[a]  # the practised skill improves
    assert after[b] < before[b]  # an anti-aligned skill is forgotten
    # capacity: the weight norm never exceeds C
    lrn.lp.capacity = 0.2
    for _ in range(50):
        lrn._apply(ids, np.full(len(ids), 0.1), np.zeros(len(ids)), zeta)
    assert np.linalg.norm(lrn.w) <= 0.2 + 1e-12


def test_shared_learner_curvature_and_noise_hurt():
    """A step's squared norm costs general competence; noise scales with advantage mass."""
    from recipe.gdro.lab.sim.learner import SharedLearner

    sc = tiny(grad_noise=1.0, learner={"curvature": 1.0})
    lrn = SharedLearner(sc, seed=0)
    ids = np.arange(10)
    zeta = np.random.default_rng(0).standard_normal((10, 33))
    lrn._apply(ids, np.zeros(10), np.full(10, 0.05), zeta)  # a pure-noise step
    assert lrn.b < 0  # damage from curvature
    assert np.linalg.norm(lrn.w) > 0  # the noise moved the representation


def test_grpo_has_an_interior_best_learning_rate_on_the_shared_learner():
    """The new learner must punish too-large steps (the logistic learner does not)."""
    sc = tiny(grad_noise=1.0, steps=60)
    acc = {
        g: np.mean([run_one(sc, "grpo", s, lr_scale=g)["summary"]["mean_accuracy"] for s in (0, 1)])
        for g in (0.25, 2.0, 64.0)
    }
    assert acc[2.0] > acc[0.25] + 0.02, acc  # too small: slow
    assert acc[2.0] > acc[64.0] + 0.05, acc  # too large: hurts
    logi = {g: run_one(sc, "grpo", 0, lr_scale=g, learner="logistic")["summary"]["mean_accuracy"] for g in (2.0, 64.0)}
    assert logi[64.0] >= logi[2.0] - 0.01, logi  # the old learner is never hurt by a bigger step


def test_se_figures_use_true_variances_in_the_steady_state_window():
    from recipe.gdro.lab.sim.simulate import steady_state_start

    sc = tiny()
    assert steady_state_start(sc, 40) == 11  # 240 prompts / 24 per batch = 10 warm-up steps
    assert steady_state_start(sc, 5) == 1
    g = run_one(sc, "grpo", 0, steps=30)
    assert g["summary"]["se_reduction"] == 0.0 and g["summary"]["variance_reduction"] == 0.0
    r = run_one(sc, "rollout_gdro", 0, steps=30)
    se = np.asarray(r["curves"]["true_se_reduction"][1:])
    orc = np.asarray(r["curves"]["oracle_se_reduction"][1:])
    assert np.all(se <= orc + 1e-9)  # nothing beats the per-prompt oracle
    lo = steady_state_start(sc, 30)
    assert r["summary"]["se_reduction"] == pytest.approx(np.mean(r["curves"]["true_se_reduction"][lo:]))
    assert r["summary"]["efficiency"] == pytest.approx(
        r["summary"]["se_reduction"] / r["summary"]["oracle_se_reduction"]
    )


def test_paired_ci():
    from recipe.gdro.lab.results.stats import paired_ci

    mean, lo, hi, n = paired_ci([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    # d = 1, 2, 3: mean 2, sd 1, t(0.975, 2) = 4.30265 (tables) → half-width 4.30265 / sqrt(3)
    assert (mean, n) == (2.0, 3)
    half = 4.302653 / np.sqrt(3)
    assert hi - mean == pytest.approx(half, rel=1e-6) and mean - lo == pytest.approx(half, rel=1e-6)
    assert np.isnan(paired_ci([1.0], [0.0])[1])
    # 41 seeds: t(0.975, 40) = 2.02108, not the normal 1.96
    d = np.tile([1.0, -1.0], 21)[:41]
    mean, lo, hi, n = paired_ci(d, np.zeros(41))
    assert hi - mean == pytest.approx(2.021075 * d.std(ddof=1) / np.sqrt(41), rel=1e-6)


def test_lr_scale_and_tuned_lr_lookup(tmp_path):
    from recipe.gdro.lab.experiments.sweep import load_plan, tune_methods
    from recipe.gdro.lab.sim.methods import TUNED_LR_COLUMNS, TUNED_LR_FILE, lookup_tuned_lr

    LR_GRID = load_plan().lr_grid

    r = run_one(tiny(), "grpo", 0, steps=2, lr_scale=2.0)
    assert r["lr"] == pytest.approx(0.04) and r["lr_scale"] == 2.0
    # the shipped table (written by sim_sweep tune) has the documented columns and every shipped scenario
    import csv

    with open(TUNED_LR_FILE, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == TUNED_LR_COLUMNS
        rows = list(reader)
    for scen in shipped_scenarios():
        got = lookup_tuned_lr(scen, "shared", tune_methods())
        assert set(got.values()) <= set(LR_GRID)
    assert all(r["grid"] == " ".join(f"{g:g}" for g in LR_GRID) for r in rows)
    with pytest.raises(ValueError, match="no tuned lr"):
        lookup_tuned_lr("no_such", "shared", ["grpo"])


def test_docs_tables_have_the_format_the_commands_write():
    """Every results table in docs/simulator.md is pasted from a command's output: same header."""
    from recipe.gdro.lab.experiments.sweep import COMPARE_HEADER, DEFAULTS_HEADER, lr_curve_header
    from recipe.gdro.lab.sim.simulate import RESULTS_HEADER

    LR_CURVE_HEADER = lr_curve_header()

    docs = open(os.path.join(REPO, "docs", "simulator.md"), encoding="utf-8").read()
    assert COMPARE_HEADER in docs, "the headline table is sim_sweep's headline.md"
    # and every other table in the docs is descriptive (no numbers measured by hand)
    lines = docs.splitlines()
    headers = {
        ln for ln, nxt in zip(lines, lines[1:] + [""], strict=True) if ln.startswith("| ") and nxt.startswith("|---")
    }
    descriptive = {"| scenario | shape |", "| method | Prompt-GDRO | Rollout-GDRO |"}
    assert headers <= {COMPARE_HEADER, DEFAULTS_HEADER, LR_CURVE_HEADER, RESULTS_HEADER} | descriptive, headers
    assert "DESIGN" not in docs


def test_set_parsing_by_omegaconf_lists_and_last_wins():
    got = parse_set_overrides(
        [
            "gdro.binner.bin_edges=[0,0.1,0.2,0.4,0.6,0.8,0.9,1]",
            "prompt.lagged=true",
            "prompt.normalize=all_responses",
            "prompt.normalize=advantage_mass",
        ]
    )
    assert got == {
        "binner": {"bin_edges": [0, 0.1, 0.2, 0.4, 0.6, 0.8, 0.9, 1]},
        "prompt": {"lagged": True, "normalize": "advantage_mass"},
    }


def test_cli_set_typo_fails_fast_without_output_folder(tmp_path):
    out = tmp_path / "never"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from recipe.gdro.lab.sim.simulate import main; "
            f"rc = main(['--set', 'prompt.nrmalize=x', '--out', {str(out)!r}]); "
            "print('verl imported' if 'verl.trainer.ppo.core_algos' in sys.modules else 'verl not imported'); "
            "sys.exit(rc)",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "prompt.nrmalize" in proc.stderr
    assert "verl not imported" in proc.stdout
    assert not out.exists()
    helptext = subprocess.run(
        [sys.executable, "-m", "recipe.gdro.lab.sim.simulate", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for scen in shipped_scenarios():
        assert scen in helptext


def test_plot_refuses_results_json(tmp_path, capsys):
    f = tmp_path / "results.json"
    f.write_text("{}")
    assert gdro_plot.main([str(f)]) == 2
    err = capsys.readouterr().err
    assert "metrics JSONL" in err and "simulator output folder" in err


def test_rolling_is_a_trailing_nan_mean():
    x = np.array([[1.0, np.nan, 3.0, 5.0], [np.nan, np.nan, 2.0, 4.0]])
    got = gdro_plot.rolling(x, 2)
    want = np.array([[1.0, 1.0, 3.0, 4.0], [np.nan, np.nan, 2.0, 3.0]])
    assert np.allclose(got, want, equal_nan=True)


def test_plot_refuses_bad_inputs_before_writing(tmp_path, capsys):
    """--out on an existing file, a parquet input, and a run with no per-bin data: a named error, exit
    2, and no output folder left behind."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = tmp_path / "run" / "gdro_metrics.jsonl"
    _fake_training_run(str(run))
    taken = tmp_path / "taken.png"
    taken.write_text("x")
    assert gdro_plot.main([str(run), "--out", str(taken)]) == 2
    assert f"--out {taken} is an existing file" in capsys.readouterr().err
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.table({"a": [1]}), parquet)
    assert gdro_plot.main([str(parquet), "--out", str(tmp_path / "p")]) == 2
    assert f"{parquet}: is a parquet file" in capsys.readouterr().err and not (tmp_path / "p").exists()
    bare = tmp_path / "bare.jsonl"
    append_metrics_jsonl(str(bare), 1, {"gdro/mu": 0.1})
    assert gdro_plot.main([str(bare), "--out", str(tmp_path / "empty")]) == 2
    assert "no per-bin GDRO metrics" in capsys.readouterr().err
    assert not (tmp_path / "empty").exists()


def _sim_cmd(out, *extra):
    return [sys.executable, "-m", "recipe.gdro.lab.sim.simulate", "--out", str(out), "--no-plots", "--quiet", *extra]


def test_simulate_refuses_an_out_file_and_zero_workers(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("x")
    for argv, fragment in (
        (_sim_cmd(taken, "--steps", "1", "--seeds", "1"), f"--out {taken} is an existing file"),
        (_sim_cmd(tmp_path / "o", "--workers", "0"), "--workers 0 must be >= 1"),
    ):
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert taken.read_text() == "x" and not (tmp_path / "o").exists()


def test_ctrl_c_stops_the_simulator_at_once_and_keeps_the_old_outputs(tmp_path):
    """SIGINT mid-run: exit 130 within seconds, no traceback, the previous outputs untouched and no
    partial folder left (the run writes into a temporary sibling folder, moved into place at the end)."""
    import signal
    import time

    out = tmp_path / "sim"
    out.mkdir()
    (out / "report.md").write_text("OLD REPORT")
    argv = _sim_cmd(out, "--scenario", "dapo_like", "--steps", "3000", "--seeds", "2", "--workers", "2")
    # Default SIGINT handling in the child even when this test runs in the background (where a
    # shell sets SIGINT to ignored, and the child would inherit that).
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline:  # wait until the workers are writing step metrics
            if any(p.stat().st_size > 0 for p in tmp_path.glob(".sim.partial-*/metrics/*/*.jsonl")):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the simulator wrote no metrics within 240 s")
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        stopped_after = time.time() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted" in err
    assert stopped_after < 8, stopped_after
    assert sorted(p.name for p in out.iterdir()) == ["report.md"] and (out / "report.md").read_text() == "OLD REPORT"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sim"]  # no partial or backup folder left


def test_methods_are_the_registry_files_and_variants_are_overrides_on_them():
    """One definition of a method: the simulator's gdro config is config/method/<name>.yaml's (e.g. the
    shipped hysteresis 0.03 of Prompt-GDRO and joint GDRO), and a variant only adds overrides."""
    from omegaconf import OmegaConf

    from recipe.gdro.config.registry import METHOD_DIR, method_names
    from recipe.gdro.lab.sim.methods import build_gdro_dict

    sc = tiny()
    assert method_names() == (
        "grpo",
        "prompt_gdro",
        "rollout_gdro",
        "rollout_gdro_failure_weighted",
        "rollout_gdro_fixed_tail_share",
        "joint_gdro",
        "joint_gdro_failure_weighted",
    )
    assert build_gdro_dict(sc, "joint_gdro_failure_weighted", {}, seed=0)["rollout"]["allocator"] == "failure_weighted"
    for name in method_names():
        shipped = OmegaConf.to_container(OmegaConf.load(METHOD_DIR / f"{name}.yaml"))["gdro"]
        got = build_gdro_dict(sc, name, {}, seed=0)
        assert got["binner"]["hysteresis"] == shipped["binner"]["hysteresis"], name
        assert (
            got["prompt"]["enable"] == shipped["prompt"]["enable"]
            and got["rollout"]["enable"] == shipped["rollout"]["enable"]
        )
    assert build_gdro_dict(sc, "prompt_gdro", {}, seed=0)["binner"]["hysteresis"] == 0.03
    bandit = build_gdro_dict(sc, "rollout_gdro:rollout.allocator=bandit", {"binner": {"num_bins": 6}}, seed=0)
    assert bandit["rollout"]["allocator"] == "bandit" and bandit["binner"]["num_bins"] == 6
    assert bandit["rollout"]["enable"] and not bandit["prompt"]["enable"]
    # a --set override wins over the method's file, but never switches an adversary
    assert build_gdro_dict(sc, "prompt_gdro", {"binner": {"hysteresis": 0.0}}, seed=0)["binner"]["hysteresis"] == 0.0
    with pytest.raises(ValueError, match="rollout.enable is what defines a method"):
        build_gdro_dict(sc, "grpo:rollout.enable=true", {}, seed=0)
    with pytest.raises(ValueError, match="unknown method 'joint'"):
        build_gdro_dict(sc, "joint", {}, seed=0)
    from recipe.gdro.lab.sim.simulate import main

    assert main(["--methods", "joint", "--out", "/nonexistent/never"]) == 2


def test_sweep_bad_input_is_one_line_as_in_simulate(tmp_path, capsys):
    """A bad scenario (ScenarioError) or tuned-lr table (ValueError) exits 2 with one line, no traceback; a
    table path below a file is named as such, not as a table still to tune."""
    from recipe.gdro.lab.experiments.sweep import main as sweep_main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad_scenario = tmp_path / "bad.yaml"
    bad_scenario.write_text("name: bad\nskills: 3\n")
    cases = [
        (["study", "--scenarios", "nope"], "error: scenario 'nope': no such file"),
        (["study", "--scenarios", str(bad_scenario)], "error: "),
        (["study", "--table", str(blocker / "t.csv")], f"error: {blocker}/t.csv: {blocker} is a file, not a folder"),
        (["study", "--table", str(tmp_path / "none.csv")], f"error: {tmp_path}/none.csv: no tuned-lr table"),
    ]
    for argv, start in cases:
        assert sweep_main([*argv, "--seeds", "1", "--steps", "1", "--quiet", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(start) and "\n" not in err, (argv, err)
