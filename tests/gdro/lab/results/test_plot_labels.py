"""The run plots a person reads (issue 42, item 8): titled by the run, a log axis whose ticks read, and the
square-root law's caption on rollouts_per_bin.png. The figures are the real ones of ``results.plot``; each
is read as it is saved."""

from __future__ import annotations

import pytest

from recipe.gdro.lab.results import plot as P
from recipe.gdro.results.metrics_io import append_metrics_jsonl

# a real-path joint run's shadow price over its 10 steps (tiny_joint_gdro.sh, trainer.total_training_steps=10)
MU = [0.0156, 0.0147, 0.0138, 0.0131, 0.0133, 0.0125, 0.0118, 0.0112, 0.0109, 0.0105]


@pytest.fixture
def saved(monkeypatch):
    """Every figure results.plot saves: (file name, its titles, its y tick labels per axes)."""
    figures = []
    original = P.save_figure

    def recording(fig, path):
        fig.canvas.draw()
        titles = [t.get_text() for t in fig.texts] + [ax.get_title() for ax in fig.axes]
        ticks = [[t.get_text() for t in ax.get_yticklabels() if t.get_text()] for ax in fig.axes]
        figures.append((path.rsplit("/", 1)[-1], titles, ticks))
        return original(fig, path)

    monkeypatch.setattr(P, "save_figure", recording)
    return figures


def test_plots_are_titled_by_the_run_with_a_readable_mu_axis_and_the_sqrt_law_caption(tmp_path, saved):
    run = tmp_path / "tiny_joint_gdro"
    for step, mu in enumerate(MU, start=1):
        line = {"gdro/mu": mu, "gdro/se_proxy_reduction": 0.1, "gdro/rollouts_per_prompt": 4.0}
        for b, (share, n) in enumerate([(0.2, 2.0), (0.5, 6.0), (0.3, 3.0)]):
            line |= {f"gdro/bin_{b:02d}/data_share": share, f"gdro/bin_{b:02d}/rollouts_per_prompt": n}
            line |= {f"gdro/bin_{b:02d}/compute_share": share * n / 4.0}
        append_metrics_jsonl(run / "gdro_metrics.jsonl", step, line)
    P.plot_path(str(run / "gdro_metrics.jsonl"), str(tmp_path / "plots"))
    by_name = {name: (titles, ticks) for name, titles, ticks in saved}
    assert {"rollouts_per_bin.png", "mu.png"} <= set(by_name)
    for titles, _ in by_name.values():  # before: "GDRO training run: gdro_metrics.jsonl"
        assert any(t.startswith("GDRO training run: tiny_joint_gdro\n") for t in titles), titles
    mu_titles, mu_ticks = by_name["mu.png"]
    assert len(mu_ticks[0]) >= 3, mu_ticks[0]  # before: one label ("0.01") over 0.0105-0.0156
    assert any("√(p_b(1−p_b))" in t and "fewer" in t for t in by_name["rollouts_per_bin.png"][0])


@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [
        (0.001, 10.0, None),  # wide: the 1-2-5 ticks (plenty)
        (0.012, 0.09, [0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09]),  # 1-2-5 gives 0.02, 0.05: 1..9 steps
        (0.0105, 0.0156, [0.011, 0.012, 0.013, 0.014, 0.015]),  # narrower than a factor 2: plain steps
    ],
)
def test_log_ticks(lo, hi, expected):
    assert P.log_ticks(lo, hi) == expected


def test_run_name():
    assert P.run_name("/x/out/gdro/tiny_grpo/gdro_metrics.jsonl") == "tiny_grpo"
    assert P.run_name("sim_out/rollout_gdro_seed0.jsonl") == "rollout_gdro_seed0"
