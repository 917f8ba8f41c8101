"""The GDRO trainer's step objects (recipe.gdro.trainer_step): the schedule that lives across steps, the plan
of one batch and the advantage stage's scaling. Cheap: numpy, torch and verl's DataProto; no Ray, no
TransferQueue (the plan's one TransferQueue read is handed in as a function)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from verl.protocol import DataProto

from recipe.gdro.trainer_step import GDROStep, GroupSchedule, StepPlan, check_group_sizes
from verl_ext import GDROConfig, GDROController, gdro_config_from_dict


def extra(acc):
    return {"reward_extra_info": {"acc": acc, "score": float(acc)}}


def plan_of(schedule, keys, acc, tags=None, n_mean=4):
    outcome = dict(zip(keys, acc, strict=True))
    tags = tags or [{} for _ in keys]
    return StepPlan.build(keys, tags, schedule, lambda final: [extra(outcome[k]) for k in final], n_mean)


def test_a_group_arriving_steps_after_its_fetch_is_still_scheduled():
    """The uid map lives until each group is observed: an asynchronous trainer trains a prompt fetched at step 1
    in step 3, after the fetches of steps 2 and 3 (the sync trainer's map forgot it at the next fetch)."""
    schedule = GroupSchedule()
    schedule.add(["a"], np.array([5]), np.array([2]), step=1, n_mean=2)
    schedule.add(["b"], np.array([6]), np.array([2]), step=2, n_mean=2)
    schedule.add(["c"], np.array([7]), np.array([2]), step=3, n_mean=2)
    plan = plan_of(schedule, ["a_0_0", "a_1_0"], [True, False])
    assert plan.session_pid.tolist() == [5, 5] and plan.session_visit.tolist() == [0, 0]
    assert list(schedule.groups) == ["b", "c"]  # taken once observed, the others kept
    with pytest.raises(RuntimeError, match="not scheduled by this trainer .*'a'"):
        plan_of(schedule, ["a_0_0"], [True])  # observed once: a second arrival is refused
    assert [g.prompt_id for g in schedule.drop(2)] == [6] and list(schedule.groups) == ["c"]


def test_the_plan_reads_sessions_final_turns_padding_and_the_canonical_order():
    schedule = GroupSchedule()
    schedule.add(["u", "v"], np.array([9, 3]), np.array([3, 2]), step=1, n_mean=2.5)
    keys = ["u_1_0", "u_1_1", "v_0_0", "pad_0_0", "u_0_0", "v_1_0"]
    tags = [{}, {}, {}, {"is_padding": True}, {}, {}]
    plan = plan_of(schedule, keys, [None, True, False, None, False, True], tags=tags)
    assert plan.session_uids == ["u", "v", "u", "v"] and plan.padding_rows == 1
    assert plan.row_session.tolist() == [0, 0, 1, -1, 2, 3]
    assert plan.session_final_row.tolist() == [1, 2, 4, 5]  # the last turn of a multi-turn session
    assert plan.acc.tolist() == [True, False, False, True]
    assert plan.order.tolist() == [1, 3, 2, 0]  # (prompt id, visit, session number)
    assert plan.failed_sessions == 1 and plan.session_singleton.tolist() == [False] * 4  # u: 2 of 3 came back
    fetch, _ = schedule.take_fetch_side()
    assert fetch["gdro/recipe/scheduled_rollouts"] == 5 and fetch["gdro/recipe/budget_target"] == 5
    assert schedule.take_fetch_side()[0] == {}


def test_a_group_larger_than_its_count_is_refused():
    schedule = GroupSchedule()
    schedule.add(["u", "v"], np.array([1, 2]), np.array([2, 6]), step=1, n_mean=4)
    with pytest.raises(RuntimeError, match="prompt id 1 .*scheduled 2 rollouts but 3 responses"):
        check_group_sizes(dict(schedule.groups), Counter(["u"] * 3), 4)


def test_prompt_weights_and_singletons_scale_the_advantage_rows():
    config = gdro_config_from_dict({"prompt": {"enable": True}})
    controller = GDROController(config, 4)
    schedule = GroupSchedule()
    schedule.add(["u", "s"], np.array([0, 2]), np.array([2, 2]), step=1, n_mean=2)
    keys = ["u_0_0", "u_1_0", "s_0_0"]  # s: one of its two sessions failed, a singleton group
    plan = plan_of(schedule, keys, [True, False, True])
    step = GDROStep(plan, adjust=True, zero_singletons=True)
    mask = torch.ones(3, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0]])
    data = DataProto.from_dict(tensors={"advantages": adv, "returns": adv, "response_mask": mask})
    step.in_advantage_stage(controller, prompt_weights=True)(data, keys)
    assert step.session_tokens.tolist() == [2.0, 2.0, 2.0]
    multiplier = step.row_multiplier_of_key()
    assert multiplier["s_0_0"] == 0.0 and multiplier["u_0_0"] == multiplier["u_1_0"] > 0
    assert torch.equal(data.batch["advantages"][2], torch.zeros(2))
    assert torch.equal(data.batch["returns"], adv)  # verl's returns stay GRPO's
    metrics = step.finish(controller, {}, 0.0)
    assert metrics["gdro/recipe/singleton_groups"] == 1 and metrics["gdro/recipe/failed_sessions"] == 1
    assert step.take_metrics() and step.take_metrics() == {}
    with pytest.raises(RuntimeError, match="other keys"):
        step.read_advantages(data, list(reversed(keys)))


def test_without_an_adversary_nothing_is_scaled():
    controller = GDROController(GDROConfig(), 2)
    schedule = GroupSchedule()
    schedule.add(["u"], np.array([1]), np.array([1]), step=1, n_mean=1)
    plan = plan_of(schedule, ["u_0_0"], [True])
    step = GDROStep(plan, adjust=False, zero_singletons=False)
    data = DataProto.from_dict(tensors={"advantages": torch.ones(1, 3), "response_mask": torch.ones(1, 3)})
    step.in_advantage_stage(controller, prompt_weights=False)(data, ["u_0_0"])
    assert step.row_multiplier is None and step.row_multiplier_of_key() == {"u_0_0": 1.0}
    assert step.observe(controller, None).tolist() == [1.0]
