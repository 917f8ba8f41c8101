"""GDRO on verl's asynchronous trainers (issue 46), cheap: the recipe's trainer built from a composed config as
verl builds it (no Ray, no TransferQueue: its one read of ``extra_fields`` and its one ``kv_clear`` are handed in),
the controller, the schedule that lives across steps and verl's own replay buffer class.

Checked: every dispatch (a step's batch, the warm-up window, a refill) holds Σn = k·n̄; a group is observed once,
trained steps after its dispatch or evicted; the in-flight map stays at verl's window and is never aged out; the
state with groups in flight round-trips field by field; each actor update keeps uniform GRPO's optimizer steps."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from omegaconf import OmegaConf

from recipe.gdro.startup.cli import compose_config
from recipe.gdro.trainer_step import GDROStep, GroupSchedule, PinnedExtraInfo, StepPlan
from verl_ext import GDROController

B, N_MEAN, PROMPTS = 4, 4, 12


def config_of(*overrides: str):
    return compose_config(
        [
            "mode=colocate_async",
            "method=joint_gdro",
            f"data.train_batch_size={B}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            f"actor_rollout_ref.rollout.n={N_MEAN}",
            *overrides,
        ]
    )


@pytest.fixture()
def trainer():
    from recipe.gdro.trainer import GDROTrainerColocateAsync

    t = GDROTrainerColocateAsync(config_of())
    t.gdro = GDROController(t.gdro_config, PROMPTS)
    t.global_steps = 1
    return t


def extra(acc: bool) -> dict:
    return {"reward_extra_info": {"acc": acc}}


def acc_of(key: str) -> bool:
    """A deterministic outcome per trajectory key ``p{pid}d{visit}_{session}_0``: prompts 0, 3, 6, ... always
    solved, 1, 4, 7, ... never, the others every other session."""
    pid, session = int(key[1:].split("d")[0]), int(key.split("_")[1])
    return (pid % 3 == 0) or (pid % 3 == 2 and session % 2 == 0)


def reader(keys: list[str]) -> list:
    return [extra(acc_of(k)) for k in keys]


def dispatch(t, pids: list[int]) -> list[str]:
    """What the mixin's ``_next_train_batch`` does with a fetched batch (verl's dataloader fetch left out)."""
    uids = [f"p{pid}d{t._gdro_schedule.fetches + i}" for i, pid in enumerate(pids)]
    counts = t.gdro.schedule(pids)
    t._gdro_schedule.add(uids, np.asarray(pids), counts, int(t.global_steps), N_MEAN)
    return uids


def trajectories(t, uids: list[str], drop_one: bool = False) -> tuple[list[str], list[dict]]:
    """Each group's ``count`` sessions as verl keys them, with verl's tags (one session missing if ``drop_one``)."""
    keys = []
    for u in uids:
        n = t._gdro_schedule.groups[u].count
        keys += [f"{u}_{s}_0" for s in range(n - (1 if drop_one else 0))]
    return keys, [{"response_len": 3} for _ in keys]


def train(t, uids: list[str]) -> GDROStep:
    """The mixin's advantage stage on the recipe's side: the plan (groups taken out of the schedule), the
    evicted groups since the last step, one observe."""
    keys, tags = trajectories(t, uids)
    plan = StepPlan.build(keys, tags, t._gdro_schedule, reader, N_MEAN)
    evicted, lost = t._gdro_schedule.take_evicted()
    step = GDROStep(plan, False, True, lost=lost, evicted=evicted, train_step=int(t.global_steps))
    step.observe(t.gdro, np.ones(len(plan.session_uids)))
    step.finish(t.gdro, *t._gdro_schedule.take_fetch_side())
    return step


def test_every_dispatch_step_warm_up_and_refill_holds_the_budget(trainer):
    """Σn = k·n̄ for the warm-up window, a step's batch and refills of 1 and 3 prompts, with counts that differ;
    a dispatch that misses it is refused before generation."""
    t = trainer
    for _ in range(3):  # the controller sees those prompts: the next counts differ
        train(t, dispatch(t, list(range(PROMPTS))))
    for size in (B, 1, 3, 2 * B):
        uids = dispatch(t, list(range(size)))
        counts = [t._gdro_schedule.groups[u].count for u in uids]
        assert sum(counts) == size * N_MEAN, (size, counts)
    assert t._gdro_schedule.fetch_metrics["gdro/recipe/dispatches"] == 4
    assert any(t._gdro_schedule.groups[u].count != N_MEAN for u in t._gdro_schedule.groups), "counts never differed"
    with pytest.raises(RuntimeError, match="a dispatch of 2 prompts was scheduled 7 rollouts, not 2 x n̄=4"):
        t._gdro_schedule.add(["x", "y"], np.array([0, 1]), np.array([3, 4]), 1, N_MEAN)


def test_a_group_is_observed_once_trained_steps_later_or_evicted(trainer, monkeypatch):
    """colocate_async's pattern: a warm-up window of one batch, then each step dispatches B and trains the B
    oldest finished groups; one group a step is evicted by verl's replay buffer (stale). Every group reaches the
    controller exactly once (binner visits = groups trained + groups evicted), the controller steps once a step,
    the lag is one step, and the in-flight map stays at the window: nothing ages a group out."""
    from verl.trainer.ppo.v1 import replay_buffer as rb

    t = trainer
    cleared: list[str] = []
    monkeypatch.setattr(rb.tq, "kv_clear", lambda **kw: cleared.extend(kw["keys"]))  # TransferQueue's forget
    t._read_extra_fields = lambda partition: reader  # TransferQueue's read of extra_fields
    queue = dispatch(t, [0, 1, 2, 3])  # the warm-up window
    trained = evicted = 0
    for step in range(1, 21):
        t.global_steps = step
        queue += dispatch(t, [(step * B + i) % PROMPTS for i in range(B)])
        stale = queue.pop(0)  # verl evicts it: its trajectories are handed over, then cleared
        keys, tags = trajectories(t, [stale], drop_one=step % 2 == 0)
        t.replay_buffer.partitions["train"] = dict(zip(keys, tags, strict=True))
        t.replay_buffer._clear_groups("train", {stale})
        queue.append(dispatch(t, [step % PROMPTS])[0])  # verl's refill of k = 1
        batch, queue = queue[:B], queue[B:]
        s = train(t, batch)
        trained, evicted = trained + len(batch), evicted + 1
        assert s.metrics["gdro/recipe/evicted_groups"] == 1
        assert s.metrics["gdro/recipe/trained_scheduled_rollouts"] == s.metrics["gdro/recipe/realised_rollouts"]
        assert s.metrics["gdro/recipe/lag_max"] <= 1
        assert len(t._gdro_schedule.groups) == B  # the window: what verl keeps in flight, no more
        with pytest.raises(RuntimeError, match="not scheduled by this trainer"):
            StepPlan.build([f"{batch[0]}_0_0"], [{}], t._gdro_schedule, reader, N_MEAN)
    assert t.gdro.step == 20
    assert int(t.gdro.binner.visits_of(np.arange(PROMPTS)).sum()) == trained + evicted
    assert stale in {k.split("_")[0] for k in cleared}  # verl's clear still ran, after the hand-over


def test_an_evicted_group_with_no_trajectory_is_lost_not_dropped_later(trainer):
    t = trainer
    t._read_extra_fields = lambda partition: reader
    (uid,) = dispatch(t, [5])
    t._gdro_on_evict({uid}, [], [])
    assert uid not in t._gdro_schedule.groups
    assert [g.prompt_id for g in t._gdro_schedule.evicted_lost] == [5]
    assert t._gdro_lost_groups() == []  # the asynchronous trainers give no group up by age


def test_the_state_with_groups_in_flight_round_trips_field_by_field(tmp_path, trainer):
    """The in-flight map (uid -> prompt, count, dispatch step, visit) is saved with the controller and restored
    field by field; the resume record (gdro_resume.jsonl) names every field, the in-flight ones included."""
    from recipe_helpers.real_path import assert_restored_as_saved

    from recipe.gdro import gdro_state
    from recipe.gdro.checkpoints import GDRO_STATE_FILE
    from recipe.gdro.startup.resume import save_gdro_state

    t = trainer
    train(t, dispatch(t, [0, 1, 2, 3]))
    inflight = dispatch(t, [4, 5, 6, 7]) + dispatch(t, [8])
    folder = tmp_path / "global_step_3"
    folder.mkdir()
    save_gdro_state(t.gdro, str(folder / GDRO_STATE_FILE), None, t._gdro_schedule.state_dict())
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    trainer_config = OmegaConf.create({"default_local_dir": str(tmp_path), "resume_mode": "auto"})
    controller, schedule = GDROController(t.gdro_config, PROMPTS), GroupSchedule()
    gdro_state.restore_controller(controller, t.gdro_config, trainer_config, 3, False, schedule)
    assert schedule.groups == t._gdro_schedule.groups and list(schedule.groups) == inflight
    assert schedule.fetches == t._gdro_schedule.fetches
    assert_restored_as_saved(tmp_path, 3)
    saved = pickle.loads((folder / GDRO_STATE_FILE).read_bytes())
    assert saved["inflight"]["uids"] == inflight and saved["inflight"]["count"].sum() == 5 * N_MEAN


def test_each_actor_update_keeps_grpos_optimizer_steps(trainer):
    """Whatever the trained batch's rows, verl's actor update runs K = train_batch_size / ppo_mini_batch_size
    optimizer steps over equal shares of them: the rows are padded to dp · K · micro-batch only (verl pads to
    lcm(dp, ppo_mini_batch_size · n) and cuts ppo_mini_batch_size · n rows a step, so 17 rows would be 2 steps
    of 8 rows and a third of padding), and the worker gets mini_batch_size = rows / K."""
    from transfer_queue import KVBatchMeta

    t = trainer
    assert t._get_required_batch_multiple(1) == 2 * 2  # K = 4 / 2 mini-batches of whole micro-batches of 2
    assert t._get_required_batch_multiple(2) == 8
    # a micro-batch larger than GRPO's mini-batch (the in-process CPU backend's 128) pads no further than verl would
    t.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 128
    assert t._get_required_batch_multiple(1) == 2 * 8
    t.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    sent = []

    class ActorWorkers:  # the GPU worker group's one call, recorded (its extra_info as Ray pickles it)
        def update_actor(self, batch):
            sent.append(pickle.loads(pickle.dumps(batch.extra_info)))
            return {"metrics": {"mfu": 0.0, "pg_loss": [0.1, 0.2]}}

    t.actor_rollout_wg, metrics = ActorWorkers(), {}
    batch = KVBatchMeta(partition_id="train", keys=[f"k{i}" for i in range(20)], tags=[{}] * 20)
    t._gdro_step = None
    t._update_actor(batch, metrics)
    (info,) = sent
    assert type(info) is dict and info["mini_batch_size"] == info["global_batch_size"] == 10
    assert info["epochs"] == 1 and "temperature" in info  # the rest is verl's
    assert metrics["gdro/recipe/optimizer_steps"] == 2 and metrics["actor/pg_loss"] == pytest.approx(0.15)
    assert type(batch.extra_info) is dict
    with pytest.raises(RuntimeError, match="21 rows does not split into 2"):
        t._update_actor(KVBatchMeta(partition_id="train", keys=[f"k{i}" for i in range(21)], tags=[{}] * 21), {})


def test_pinned_extra_info_survives_verls_update():
    info = PinnedExtraInfo({"a": 1}, {"mini_batch_size": 10})
    info.update({"mini_batch_size": 64, "epochs": 1})
    assert info == {"a": 1, "mini_batch_size": 10, "epochs": 1}
    assert type(pickle.loads(pickle.dumps(info))) is dict


def test_the_recipes_keys_pick_the_recipes_trainers_on_verls_loops():
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from recipe.gdro.trainer import GDROTrainerColocateAsync, GDROTrainerSeparateAsync
    from recipe.gdro.trainer_step import EvictionObserver

    assert get_trainer_cls("gdro_colocate_async") is GDROTrainerColocateAsync
    assert get_trainer_cls("gdro_separate_async") is GDROTrainerSeparateAsync
    assert issubclass(GDROTrainerColocateAsync, PPOTrainerColocateAsync)
    assert issubclass(GDROTrainerSeparateAsync, PPOTrainerSeparateAsync)
    t = GDROTrainerColocateAsync(config_of())
    assert t.trainer_mode == "colocate_async" and t.trainer_key == "gdro_colocate_async"
    assert isinstance(t.replay_buffer, ReplayBufferAsync) and isinstance(t.replay_buffer, EvictionObserver)
