"""Issue 45 item 1: the tiny-LM runs record their allocation per evaluation interval (rollouts per skill and
bin, all-fail and all-pass groups, tokens), and ``study report`` shows the tail's share of it; runs made
before the record print nothing new (their reports rebuild byte for byte: test_study.py)."""

from __future__ import annotations

import numpy as np
import torch

from recipe.gdro.lab.experiments import study
from recipe.gdro.lab.experiments.direct import run_direct


def test_a_run_records_what_each_skill_and_bin_was_given_per_interval():
    torch.set_num_threads(1)
    steps, prompts, n = 5, 6, 4
    result = run_direct(
        dict(
            steps=steps,
            prompts=prompts,
            n=n,
            num_train=12,
            num_val=6,
            eval_every=2,
            method="rollout_gdro_failure_weighted",
        ),
        log=lambda *_: None,
    )
    allocation = result["allocation"]
    assert [a["step"] for a in allocation] == [2, 4, 5] and [a["steps"] for a in allocation] == [2, 2, 1]
    for a in allocation:
        by_skill, by_bin = np.array(list(a["by_skill"].values())), np.array(list(a["by_bin"].values()))
        # prompts and rollouts: every step's batch, once by skill and once by bin
        assert by_skill[:, 0].sum() == by_bin[:, 0].sum() == a["steps"] * prompts
        assert by_skill[:, 1].sum() == by_bin[:, 1].sum() == a["steps"] * prompts * n
        assert np.all(by_skill[:, 2] + by_skill[:, 3] <= by_skill[:, 0])
        assert by_skill[:, 2:].sum() == by_bin[:, 2:].sum()
    assert list(allocation[0]["by_bin"]) == ["unseen"]  # step 1 and 2 of 12 prompts: nothing seen before
    assert sum(a["tokens"] for a in allocation) == result["curve"][-1]["tokens"]
    # the realised rollouts are the scheduled ones: the history's per-step count
    assert [h["train/rollouts"] for h in result["history"]] == [prompts * n] * steps


def _run(allocations):
    return {"allocation": allocations}


def test_the_report_shows_the_tails_rollouts_and_groups_without_gradient_and_nothing_for_old_runs():
    interval = {
        "step": 10,
        "steps": 10,
        "tokens": 5000,
        # [prompts, rollouts, all-fail groups, all-pass groups]
        "by_bin": {"bin_00": [20, 120, 12, 0], "bin_05": [40, 120, 2, 6], "unseen": [20, 80, 5, 1]},
        "by_skill": {"add1": [50, 180, 4, 7], "mul1x3": [30, 140, 15, 0]},
    }
    lines = study.allocation_text([("rollout_gdro_failure_weighted", [_run([interval]), _run([interval])])])
    text = "\n".join(lines)
    row = [line for line in lines if line.startswith("| rollout_gdro_failure_weighted |")]
    # tail: 120 / 20 = 6 rollouts a prompt, 12 of 20 groups without gradient (all failing), 25% of prompts;
    # other seen 120 / 40, unseen 80 / 20, 5000 tokens over 10 steps
    assert row[0] == "| rollout_gdro_failure_weighted | 6.00 | 0.600 | 0.600 | 25% | 3.00 | 4.00 | 500 |"
    assert "| rollout_gdro_failure_weighted | 3.60 / 0.080 | 4.67 / 0.500 |" in text
    assert study.allocation_text([("grpo", [_run([interval]), {"tokens": 1}])]) == []


def test_settings_added_since_v2_stay_out_of_its_run_keys_and_another_value_is_refused():
    """tiny_lm_v2's committed runs are found by their keys (test_study.py rebuilds its report): the
    fixed_tail_share settings, added after them, are left out of its keys at their defaults."""
    import pytest

    from recipe.gdro.lab.experiments.protocol import load_protocol

    v2 = load_protocol()
    assert v2.data["name"] == "tiny_lm_v2"
    rollout = study.run_config(v2, "rollout_gdro", 1e-3, 0)["method_config"]["rollout"]
    assert "tail_threshold" not in rollout and "tail_share_factor" not in rollout and rollout["allocator"] == "sqrt"
    with pytest.raises(ValueError, match=r"gdro.rollout.tail_threshold=0.2: this protocol's runs predate it"):
        study.run_config(v2, "rollout_gdro", 1e-3, 0, gdro={"rollout": {"tail_threshold": 0.2}})
