"""The learning benchmark (recipe/gdro/lab/experiments/bench_learning.py) on its own code path, for 2 steps:
its 30-step check that the shipped base learns through the CPU backend and the direct loop is too long
for the suite, so here the parts are checked, not the learning."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

pytest.importorskip("ray")

from recipe.gdro.lab.experiments.bench_cpu_step import weights_digest  # noqa: E402
from recipe.gdro.lab.experiments.bench_learning import gain, learning_gains  # noqa: E402
from recipe.gdro.lab.tinylm import model as tinylm  # noqa: E402


def test_the_learning_benchmark_runs_its_three_arms(tmp_path, monkeypatch):
    """Frontier prompts are picked from the shipped base and numbered; the backend trains at lr > 0 and
    stays bit for bit at the base's weights at lr 0 (the control); each arm reports a gain."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # the Ray that run_cpu starts sets it; undone after
    result = learning_gains(tmp_path, steps=2, prompts=16, lr=1e-3)
    assert set(result["gains"]) == {"backend", "backend_lr0", "direct"}
    assert all(-1.0 <= g <= 1.0 for g in result["gains"].values()), result["gains"]
    rows = pq.read_table(tmp_path / "frontier.parquet").to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == list(range(16))
    base = weights_digest(tinylm.load_model(tinylm.BASE_MODEL_DIR))
    assert weights_digest(result["trainers"]["backend_lr0"].actor_rollout_wg.model) == base
    assert weights_digest(result["trainers"]["backend"].actor_rollout_wg.model) != base
    assert len(result["trainers"]["backend"].scores) == 2


def test_a_gain_is_the_last_steps_mean_minus_the_first():
    assert gain([0.0] * 6 + [0.5] * 18 + [1.0] * 6) == 1.0
    assert gain([0.5, 0.25]) == -0.25  # a 2-step run: one step each side
