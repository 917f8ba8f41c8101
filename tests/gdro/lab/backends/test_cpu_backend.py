"""The CPU backend (``gdro.backend=cpu``): verl 0.9.1's v1 loop training a real tiny LM on CPU.

Nothing here is scripted: the rollout server samples the model, verl's ``AgentLoopWorkerTQ`` runs the
sessions, the actor update is ``policy.ppo_update`` (verl's policy loss), weights sync to the rollout
after every step (that the shipped base learns through it over 30 steps is a benchmark:
recipe/gdro/lab/experiments/bench_learning.py, tested in tests/gdro/lab/experiments/test_bench_learning.py). Checked:

(i)   with Rollout-GDRO on, every prompt gets exactly its scheduled ``__rollout_n__`` generations
      (counted at the server) and that many rows reach the actor; the counts really vary;
(ii)  Prompt-GDRO's multipliers reach the loss: the backend's update equals ``ppo_update`` on verl's
      GRPO advantages pre-multiplied by the controller's multipliers, and differs from it without;
(iii) saving at step 2 and resuming gives the same weights, optimizer state, RNG and GDRO state at
      step 3 as the uninterrupted run;
(iv)  two runs of one seed are equal even when half the sessions reach the rollout server late.

They use an untrained tiny LM and a reward on the sampled text's length parity
(tests/recipe_helpers/cpu_reward.py), since an untrained model never writes an answer.
"""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
import random
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
tq = pytest.importorskip("transfer_queue")

from omegaconf import OmegaConf  # noqa: E402
from recipe_helpers import standins as S  # noqa: E402
from recipe_helpers.paths import HELPERS  # noqa: E402

from recipe.gdro.lab.backends.cpu import CPUBackend, prepare_cpu_config  # noqa: E402
from recipe.gdro.lab.backends.cpu_rollout import CPURolloutServer  # noqa: E402
from recipe.gdro.lab.backends.cpu_workers import CHECKPOINT_FILE  # noqa: E402
from recipe.gdro.lab.tinylm import model as tinylm  # noqa: E402
from recipe.gdro.lab.tinylm import policy  # noqa: E402
from recipe.gdro.startup.cli import compose_config  # noqa: E402
from recipe.gdro.task_runner import GDROTaskRunner  # noqa: E402
from verl_ext.controller import state_fingerprint  # noqa: E402

pytestmark = pytest.mark.slow

REWARD = HELPERS / "cpu_reward.py"


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tq_session(tmp_path_factory):
    work = tmp_path_factory.mktemp("tqinit")
    config = prepare_cpu_config(compose_config(base_overrides(work, work / "m", work / "t.parquet")))
    config.transfer_queue.enable = True
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    tq.init(config.transfer_queue)
    yield
    tq.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> Path:
    """An untrained tiny Qwen3 LM (hidden 32, 2 layers) with the tiny LM's tokenizer, saved to a folder."""
    folder = tmp_path_factory.mktemp("untrained")
    tok = tinylm.build_tokenizer()
    model = tinylm.build_model(tok, hidden_size=32, num_layers=2, intermediate_size=64, seed=3)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sum_data(tmp_path_factory) -> Path:
    """8 prompts ``a+b=`` (only characters the tiny tokenizer knows): every step sees all of them, so
    from step 2 on the binner has per-prompt accuracies to act on."""
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    rows = S.math_rows(list(range(8)))
    for k, row in enumerate(rows):
        a, b = k % 4, k // 4
        row["prompt"][0]["content"] = f"{a}+{b}="
        row["reward_model"]["ground_truth"] = str(a + b)
    S.write_parquet(str(path), rows)
    return path


def base_overrides(work: Path, model: Path, train: Path, *, batch: int = 8, steps: int = 3) -> list[str]:
    return [
        "gdro.backend=cpu",
        f"data.train_files=[{train}]",
        f"data.val_files=[{train}]",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "data.dataloader_num_workers=0",
        "data.seed=11",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // 2}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * 2}",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.logger=[console]",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={work / 'ckpt'}",
        "trainer.n_gpus_per_node=1",
    ]


def run(overrides: list[str], mixins: tuple = ()):
    config = prepare_cpu_config(compose_config(overrides))
    S.clear_transfer_queue()
    runner = GDROTaskRunner(CPUBackend(trainer_mixins=mixins, own_transfer_queue=False))
    assert runner.run(config) is None  # verl's path: a Ray actor's result is pickled; the trainer cannot be
    return runner.trainer, runner


class Recorder:
    """Trainer mixin: for each update, the model / optimizer before it, the batch it trained on,
    verl's rm_scores / uid / index / session of each row, and the controller's multipliers."""

    def init(self):
        super().init()
        self.records: list[dict] = []
        self.observed: dict[int, tuple] = {}
        wg = self.actor_rollout_wg
        real_update = wg.update_actor

        def update_actor(batch):
            before = {
                "model": copy.deepcopy(wg.model.state_dict()),
                "optimizer": copy.deepcopy(wg.optimizer.state_dict()),
            }
            data = wg.training_batch(batch)
            meta = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "index", "session_id"]
            )
            scores = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rm_scores"])
            out = real_update(batch)
            self.records.append(
                {
                    "step": int(self.global_steps),
                    "before": before,
                    "after": copy.deepcopy(wg.model.state_dict()),
                    "batch": {k: v.clone() for k, v in data.items()},
                    "uid": [str(u) for u in list(meta["uid"])],
                    "index": [int(i) for i in list(meta["index"])],
                    "session": [int(s) for s in list(meta["session_id"])],
                    "padding": [bool(t.get("is_padding", False)) for t in batch.tags],
                    "score": [float(r.sum()) for r in scores["rm_scores"].unbind()],
                    "mini_batch_size": int(batch.extra_info["mini_batch_size"]),
                }
            )
            return out

        wg.update_actor = update_actor
        if self.gdro is not None:
            real_observe = self.gdro.observe

            def observe(pids, acc, abs_adv=None, *args, **kwargs):
                mult = real_observe(pids, acc, abs_adv, *args, **kwargs)
                self.observed[int(self.global_steps)] = (np.asarray(pids).copy(), np.asarray(mult).copy())
                return mult

            self.gdro.observe = observe


def joint_overrides(work, model, train, *extra):
    return [
        *base_overrides(work, model, train),
        f"reward.custom_reward_function.path={REWARD}",
        "reward.custom_reward_function.name=compute_score",
        "gdro.prompt.enable=true",
        "gdro.rollout.enable=true",
        "gdro.binner.num_bins=3",
        "gdro.rollout.variance_beta=1.0",
        "gdro.rollout.n_min=2",
        "gdro.rollout.n_max=8",
        "gdro.prompt.min_group_prompts=0",
        "trainer.save_freq=2",
        "trainer.resume_mode=disable",
        *extra,
    ]


@pytest.fixture(scope="module")
def joint_run(tq_session, tmp_path_factory, untrained, sum_data):
    work = tmp_path_factory.mktemp("joint")
    trainer, runner = run(joint_overrides(work, untrained, sum_data), mixins=(Recorder,))
    return {"work": work, "trainer": trainer, "manager": runner.agent_loop_manager}


# ---------------------------------------------------------------------------------------- (i)
def test_every_prompt_gets_its_scheduled_rollout_count(joint_run):
    trainer, manager = joint_run["trainer"], joint_run["manager"]
    server = trainer.cpu_server
    dispatched = [d for d in manager.dispatched if not d["validate"]]
    assert [d["step"] for d in dispatched] == [1, 2, 3]
    records = {r["step"]: r for r in trainer.records}
    varied = False
    for d in dispatched:
        assert sum(d["counts"]) == 8 * 4  # Σ n(x) = B · n̄
        rows = Counter(
            u for u, pad in zip(records[d["step"]]["uid"], records[d["step"]]["padding"], strict=True) if not pad
        )
        for uid, n in zip(d["uids"], d["counts"], strict=True):
            assert server.requests_by_uid[uid] == n, f"step {d['step']}: {uid} generated != scheduled {n}"
            assert rows[uid] == n, f"step {d['step']}: {uid} reached the actor {rows[uid]} times, scheduled {n}"
        varied |= len(set(d["counts"])) > 1
    assert varied, "Rollout-GDRO never scheduled unequal counts; the test would not notice a worker ignoring them"
    # every response is a real sample: generated lengths vary and the log-probs are the actor's
    lengths = {int(m.sum()) for m in records[3]["batch"]["response_mask"]}
    assert len(lengths) > 1


# ---------------------------------------------------------------------------------------- (ii)
def grpo_advantages(record) -> torch.Tensor:
    """verl's GRPO advantage of each row (core_algos.compute_grpo_outcome_advantage), broadcast over tokens."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    mask = record["batch"]["response_mask"]
    rewards = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        if n:
            rewards[i, n - 1] = record["score"][i]
    uid = np.array(record["uid"], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=uid)
    return adv


def multipliers_by_row(record, observed) -> torch.Tensor:
    """The controller's multiplier of each row: it observed sessions in (prompt id, session) order."""
    pids, mult = observed
    by_pid: dict[int, list[float]] = defaultdict(list)
    for p, m in zip(pids.tolist(), mult.tolist(), strict=True):
        by_pid[int(p)].append(float(m))
    out = torch.ones(len(record["uid"]), dtype=torch.float64)
    sessions: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for row, (pid, session, pad) in enumerate(zip(record["index"], record["session"], record["padding"], strict=True)):
        if not pad:
            sessions[pid].append((session, row))
    for pid, items in sessions.items():
        for k, (_, row) in enumerate(sorted(items)):
            out[row] = by_pid[pid][k]
    return out


def replay_update(trainer, record, advantages) -> dict:
    wg = trainer.actor_rollout_wg
    model = copy.deepcopy(wg.model)
    model.load_state_dict(record["before"]["model"])
    optimizer = policy.make_optimizer(
        model, lr=float(wg.actor_config.optim.lr), weight_decay=float(wg.actor_config.optim.weight_decay)
    )
    optimizer.load_state_dict(record["before"]["optimizer"])
    batch = dict(record["batch"])
    batch["advantages"] = advantages.to(batch["advantages"].dtype) * batch["response_mask"]
    policy.ppo_update(model, optimizer, batch, actor_config=wg.actor_config, mini_batch_size=record["mini_batch_size"])
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_prompt_gdro_multipliers_reach_the_loss(joint_run):
    trainer = joint_run["trainer"]
    record = next(r for r in trainer.records if r["step"] == 3)
    mult = multipliers_by_row(record, trainer.observed[3])
    real = [not p for p in record["padding"]]
    assert float(mult[real].max() - mult[real].min()) > 0.05, "multipliers all equal: nothing to detect"
    grpo = grpo_advantages(record)
    scaled = grpo * mult.unsqueeze(-1).to(grpo.dtype)
    mask = record["batch"]["response_mask"].bool()
    # what the actor received is verl's GRPO advantage x the multiplier
    torch.testing.assert_close(record["batch"]["advantages"][mask], scaled[mask].float(), rtol=1e-5, atol=1e-6)
    with_mult = replay_update(trainer, record, scaled)
    without = replay_update(trainer, record, grpo)
    assert max_diff(with_mult, record["after"]) < 1e-6
    assert max_diff(without, record["after"]) > 1e-4


# ---------------------------------------------------------------------------------------- (iii)
def assert_same(a, b, where: str) -> None:
    """Recursive exact equality of nested state (dicts, lists, arrays, tensors, scalars)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{where} differs"
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, float) and a != a:
        assert b != b, f"{where} differs"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_resume_at_step_2_equals_the_uninterrupted_run(joint_run, tmp_path_factory, untrained, sum_data):
    first = joint_run["work"] / "ckpt"
    work = tmp_path_factory.mktemp("resumed")
    run(
        joint_overrides(
            work,
            untrained,
            sum_data,
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={first}/global_step_2",
        )
    )
    second = work / "ckpt"
    # the state as restored, field by field, is the state the step-2 save wrote (the trainer's resume record)
    [record] = [json.loads(line) for line in (second / "gdro_resume.jsonl").read_text().splitlines()]
    saved = pickle.loads((first / "global_step_2" / "gdro_state.pkl").read_bytes())
    assert record["resumed_at_step"] == 2 and record["fields"] == state_fingerprint(saved)
    a = torch.load(first / "global_step_3" / "actor" / CHECKPOINT_FILE, weights_only=False)
    b = torch.load(second / "global_step_3" / "actor" / CHECKPOINT_FILE, weights_only=False)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weights differ at {k}"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for p in sa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[p][name]), torch.as_tensor(sb[p][name])), f"optimizer {name} differs"
    assert torch.equal(a["rng"]["rollout"], b["rng"]["rollout"])
    ga = pickle.loads((first / "global_step_3" / "gdro_state.pkl").read_bytes())
    gb = pickle.loads((second / "global_step_3" / "gdro_state.pkl").read_bytes())
    assert_same(ga, gb, "gdro_state")
    # and the run did train: step 3's weights differ from step 2's
    c = torch.load(first / "global_step_2" / "actor" / CHECKPOINT_FILE, weights_only=False)
    assert any(not torch.equal(a["model"][k], c["model"][k]) for k in a["model"])


def test_config_is_the_documented_switch():
    config = compose_config(["gdro.backend=cpu"])
    assert OmegaConf.select(config, "gdro.backend") == "cpu"
    from recipe.gdro.startup.recipe_config import recipe_config_from_dict
    from verl_ext import GDROConfigError

    assert recipe_config_from_dict({"backend": "cpu"}).backend == "cpu"
    with pytest.raises(GDROConfigError, match="backend"):
        recipe_config_from_dict({"backend": "tpu"})


# ---------------------------------------------------------------------------------------- reproducibility
class _JitteredServer(CPURolloutServer):
    """Half the sessions, drawn afresh in every run (OS entropy), reach the server 0.5 s late: a server
    that batched whatever had arrived after a pause would sample different batches in the two runs."""

    async def _generate(self, *args, **kwargs):
        if random.SystemRandom().random() < 0.5:
            await asyncio.sleep(0.5)
        return await super()._generate(*args, **kwargs)


class _Jittered:
    rollout_server_cls = _JitteredServer


def test_two_runs_of_one_seed_are_equal_whatever_the_session_timing(tq_session, tmp_path_factory, untrained, sum_data):
    """GRPO, 3 steps, twice in one process (new uids, new timing): identical scores, weights and batches."""
    results = []
    for k in range(2):
        work = tmp_path_factory.mktemp(f"repro{k}")
        overrides = [
            *base_overrides(work, untrained, sum_data),
            f"reward.custom_reward_function.path={REWARD}",
            "reward.custom_reward_function.name=compute_score",
        ]
        trainer, _ = run(overrides, mixins=(_Jittered, Recorder))
        results.append(trainer)
    a, b = results
    assert [r["score"] for r in a.records] == [r["score"] for r in b.records]
    assert len({s for r in a.records for s in r["score"]}) > 1  # the reward varies, so the scores say something
    for k, v in a.actor_rollout_wg.model.state_dict().items():
        assert torch.equal(v, b.actor_rollout_wg.model.state_dict()[k]), f"weights differ at {k}"
    assert a.cpu_server.stats["batches"] == b.cpu_server.stats["batches"] == 3  # one sampling batch a step
