"""Unit tests of the runtime fixes of issue 18 (items 1-8) that need no Ray: the controller's visits,
checkpoint retention, the CPU / KV-cache arithmetic, the rollout-count comparison, the storage marker."""

from __future__ import annotations

import numpy as np
import pytest

from verl_ext import GDROController, gdro_config_from_dict


# ------------------------------------------------------------------ item 1: a prompt twice in a step
def _controller(**prompt):
    cfg = gdro_config_from_dict({"prompt": {"enable": True, **prompt}, "rollout": {"n_mean": 4}})
    return GDROController(cfg, num_prompts=4)


def test_two_visits_of_one_prompt_are_two_observations():
    """Prompt 1 twice in one step (visits 1 and 3): both visits reach the binner, in visit order; the
    adversary sees each as its own group; each visit's responses get their own multipliers."""
    ctl = _controller()
    counts = ctl.schedule([0, 1, 2, 1])
    assert counts.tolist() == [4, 4, 4, 4]
    pid = [0] * 4 + [1] * 4 + [2] * 4 + [1] * 4
    visit = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    acc = [True, False, False, False] + [True] * 4 + [False] * 4 + [False, False, True, True]
    mult = ctl.observe(pid, np.array(acc), np.ones(16), response_visit_ids=visit)
    assert mult.shape == (16,)
    assert ctl.binner.visits_of([0, 1, 2, 3]).tolist() == [1, 2, 1, 0]
    # window of prompt 1 holds both visits: 4 + 2 correct of 8
    c, n = ctl.binner.window_sums([1])
    assert (int(c[0]), int(n[0])) == (6, 8)
    # the same visits recorded one step at a time give the same binner state
    ref = _controller()
    ref.binner.update([0, 1, 2], [1, 4, 0], [4, 4, 4])
    ref.binner.update([1], [2], [4])
    assert np.array_equal(ref.binner.state_dict()["ring"], ctl.binner.state_dict()["ring"])
    assert np.array_equal(ref.binner.state_dict()["meta"], ctl.binner.state_dict()["meta"])
    # without visit ids the two groups of prompt 1 would merge into one group of 8 responses
    merged = _controller()
    merged.schedule([0, 1, 2, 1])
    merged.observe(pid, np.array(acc), np.ones(16))
    assert merged.binner.visits_of([1]).tolist() == [1]


def test_visit_ids_must_not_mix_prompts():
    ctl = _controller()
    with pytest.raises(ValueError, match="visit 0 holds responses of more than one prompt id"):
        ctl.observe([0, 1], np.array([True, False]), np.ones(2), response_visit_ids=[0, 0])
