"""CPU end-to-end test of the GDRO recipe inside verl 0.9.1's real v1 training loop.

verl cannot generate on CPU, so only the GPU workers (log-prob / update), the LLM server and the
checkpoint engine are stand-ins (tests/recipe_helpers/standins.py). Everything else is verl's own
code running for real: ``PPOTrainerSync.fit`` -> replay buffer -> ``_balance_batch`` -> old / ref
log-prob -> GRPO advantage -> actor update -> metrics -> checkpoint, TransferQueue (SimpleStorage,
one storage unit on a 2-CPU Ray), verl's ``AgentLoopWorkerTQ`` (which reads ``__rollout_n__`` and
writes trajectories) and verl's reward path ending in ``math_dapo`` on the scripted text responses.

Checked against an independent replay: a shadow :class:`verl_ext.GDROController` fed the same
prompt ids and outcomes must schedule the same counts and produce the weights by which verl's GRPO
advantages (recomputed with ``core_algos.compute_grpo_outcome_advantage``) are scaled, and verl
must put the advantages once per step (Prompt-GDRO scales them inside verl's advantage stage).
Also: a rollout worker ignoring ``__rollout_n__`` stops the run; failed sessions are counted; the
custom reward ``pkg://data_prep.reward_fn`` scores math and GPQA; validation lines reach the
metrics file and give a Table-1 row.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
tq = pytest.importorskip("transfer_queue")

from omegaconf import OmegaConf  # noqa: E402
from recipe_helpers import standins as S  # noqa: E402

from recipe.gdro.results.metrics_io import read_metrics_jsonl  # noqa: E402
from recipe.gdro.startup.cli import compose_config  # noqa: E402
from recipe.gdro.startup.recipe_config import split_gdro_section  # noqa: E402
from verl_ext import GDROController, gdro_config_from_dict  # noqa: E402

pytestmark = pytest.mark.slow

ANSWERS = [10, 11, 12, 13, 14, 15]
SOLVE_RATES = {0: 0.0, 1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0, 5: 0.5}
N_MEAN = 4


def overrides(work: Path, *extra: str, steps: int = 3, batch: int = 4, mini: int = 2) -> list[str]:
    return [
        f"data.train_files=[{work / 'train.parquet'}]",
        f"data.val_files=[{work / 'train.parquet'}]",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=128",
        "data.max_response_length=64",
        "data.dataloader_num_workers=0",
        "data.seed=7",
        "actor_rollout_ref.model.path=/nonexistent/tiny-model",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={N_MEAN}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.logger=[console]",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={work / 'ckpt'}",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "transfer_queue.backend.SimpleStorage.total_storage_size=4096",
        *extra,
    ]


def make_config(work: Path, *extra: str, **kw):
    config = compose_config(overrides(work, *extra, **kw))
    config.transfer_queue.enable = True
    OmegaConf.resolve(config)
    return config


@contextmanager
def capture_tracking():
    """Record what verl's fit logs through Tracking.log (step -> metrics dict)."""
    from verl.utils import tracking

    logged: dict[int, dict] = {}
    original = tracking.Tracking.log

    def log(self, data, step, *args, **kwargs):
        logged.setdefault(int(step), {}).update(data)
        return original(self, data, step, *args, **kwargs)

    tracking.Tracking.log = log
    try:
        yield logged
    finally:
        tracking.Tracking.log = original


@pytest.fixture(scope="module")
def tq_session(tmp_path_factory):
    """Ray (2 CPUs) + TransferQueue (SimpleStorage, one storage unit), shared by the module."""
    config = make_config(tmp_path_factory.mktemp("tqinit"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    tq.init(config.transfer_queue)
    yield
    tq.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def tokenizer():
    return S.build_tiny_tokenizer()


@pytest.fixture(scope="module")
def script():
    return S.Script(SOLVE_RATES)


def new_work(tmp_path_factory, name: str) -> Path:
    work = tmp_path_factory.mktemp(name)
    S.write_parquet(str(work / "train.parquet"), S.math_rows(ANSWERS))
    return work


JOINT = (
    "gdro.prompt.enable=true",
    "gdro.rollout.enable=true",
    "gdro.binner.num_bins=4",
    "gdro.rollout.variance_beta=1.0",
    "gdro.rollout.n_max=8",
    "trainer.save_freq=2",
    "trainer.resume_mode=disable",
)


@pytest.fixture(scope="module")
def joint_run(tq_session, tmp_path_factory, tokenizer, script):
    """Both adversaries on, 3 steps, checkpoints at steps 2 and 3."""
    from recipe.gdro.trainer import GDROTrainerSync

    work = new_work(tmp_path_factory, "joint")
    config = make_config(work, *JOINT)
    with capture_tracking() as logged:
        trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, script)
    return {"work": work, "config": config, "trainer": trainer, "manager": manager, "logged": logged}


def shadow_controller(config) -> GDROController:
    section = OmegaConf.to_container(config.gdro, resolve=True)
    return GDROController(
        gdro_config_from_dict(split_gdro_section(section)[0]),  # the controllers' keys (not dry_run, ...)
        num_prompts=len(ANSWERS),
        loss_agg_mode=config.actor_rollout_ref.actor.loss_agg_mode,
        max_response_length=config.data.max_response_length,
    )


def real_rows(update: dict) -> list[dict]:
    return [r for r in update["rows"] if not r["is_padding"]]


def replay_and_check(
    run: dict, script: S.Script, steps: list[int], shadow: GDROController, *, rollout: bool, abs_adv: bool = False
):
    """Replay the run with a shadow controller and check counts, groups and advantages step by step."""
    manager, trainer = run["manager"], run["trainer"]
    batches = {b["step"]: b for b in manager.batches}
    updates = {u["step"]: u for u in trainer.actor_rollout_wg.updates}
    assert sorted(batches) == steps and sorted(updates) == steps
    sessions_run = Counter((e["step"], e["uid"]) for e in manager.worker.script_log)
    for step in steps:
        batch, update = batches[step], updates[step]
        counts = shadow.schedule(batch["index"]).tolist()
        if rollout:
            assert batch["rollout_n"] == counts, f"step {step}: __rollout_n__ differs from the schedule"
        else:
            assert batch["rollout_n"] is None, "Rollout-GDRO off must not set __rollout_n__"
            counts = [N_MEAN] * len(batch["index"])
        assert sum(counts) == len(batch["index"]) * N_MEAN
        rows = real_rows(update)
        # realised = scheduled: sessions verl's worker ran, and rows (GRPO group sizes) reaching the actor
        group_size = Counter(r["uid"] for r in rows)
        for uid, n in zip(batch["uid"], counts, strict=True):
            assert sessions_run[(step, uid)] == n
            assert group_size[uid] == n
        assert len(rows) == sum(counts)
        assert update["num_rows"] % update["mini_batch_size"] == 0
        # verl's reward path (math_dapo) agrees with the script
        for r in rows:
            assert r["score"] == (1.0 if script.correct(r["index"], r["session"], step) else -1.0)
        # advantages = verl's GRPO advantage x the shadow controller's weight
        acc = np.array([script.correct(r["index"], r["session"], step) for r in rows])
        grpo = S.grpo_reference(update["rows"])
        mean_abs = np.abs([grpo[r["key"]] for r in rows]) if abs_adv else None
        # each uid is one visit of its prompt (a prompt may have two groups in a step), in fetch order
        visit = {uid: i for i, uid in enumerate(batch["uid"])}
        lengths = [float(r["mask"].sum()) for r in rows]
        mult = shadow.observe(
            [r["index"] for r in rows],
            acc,
            mean_abs,
            [visit[r["uid"]] for r in rows],
            response_length=lengths,
        )
        for r, m in zip(rows, mult, strict=True):
            expected = grpo[r["key"]] * m
            assert r["advantage"] == pytest.approx(expected, rel=1e-5, abs=1e-6), (step, r["index"], r["session"])
            tokens = r["advantage_tokens"] * r["mask"]
            assert np.allclose(tokens.numpy(), expected * r["mask"].numpy(), rtol=1e-5, atol=1e-6)
        for r in update["rows"]:
            if r["is_padding"]:
                assert float(r["advantage_tokens"].abs().sum()) == 0.0
    return shadow


# ------------------------------------------------------------------------------------------ tests
def test_joint_run_counts_groups_and_advantages(joint_run, script):
    shadow = shadow_controller(joint_run["config"])
    # With Prompt-GDRO on the trainer always passes |A| per response (read inside verl's advantage stage).
    replay_and_check(joint_run, script, [1, 2, 3], shadow, rollout=True, abs_adv=True)
    batches = joint_run["manager"].batches
    assert any(len(set(b["rollout_n"])) > 1 for b in batches), "Rollout-GDRO never varied the counts"
    # The controller in the trainer ended in the shadow's state (the shadow saw the responses in the
    # actor's row order, the trainer in (prompt, session) order: last-bit differences in the metrics).
    live = joint_run["trainer"].gdro.state_dict()
    assert_states_equal(live, shadow.state_dict(), approx_under=("state.metrics",))


def test_joint_run_logs_gdro_metrics(joint_run):
    logged = joint_run["logged"]
    assert sorted(logged) == [1, 2, 3]
    for step, metrics in logged.items():
        for key in (
            "gdro/mu",
            "gdro/se_proxy_reduction",
            "gdro/bin_00/adversary_prob",
            "gdro/unseen/data_share",
            "gdro/multiplier_max",
            "gdro/recipe/scheduled_rollouts",
            "gdro/recipe/padding_rows",
        ):
            assert key in metrics, (step, key)
        assert metrics["gdro/recipe/scheduled_rollouts"] == 4 * N_MEAN
        assert metrics["gdro/recipe/realised_rollouts"] == 4 * N_MEAN
        assert metrics["gdro/recipe/padding_rows"] == 0
        assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith("gdro/"))
    assert "gdro/unseen/adversary_weight" in logged[1]  # step 1: every prompt is unseen
    records = read_metrics_jsonl(joint_run["work"] / "ckpt" / "gdro_metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        logged_step = logged[record["step"]]
        gdro_logged = {k: v for k, v in logged_step.items() if k.startswith("gdro/")}
        finite = {k: v for k, v in record.items() if k != "step" and isinstance(v, float) and math.isfinite(v)}
        assert finite.keys() == gdro_logged.keys()
        for k, v in finite.items():
            assert v == pytest.approx(gdro_logged[k])
    # Every key the controller reports is in the file (NaN ones as null -> nan).
    assert "gdro/binner/unseen_in_batch" in records[0]


def assert_states_equal(a, b, path="state", approx_under=()):
    """Exact (bitwise) equality of two controller states; floats under ``approx_under`` to 1e-12."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_states_equal(a[k], b[k], f"{path}.{k}", approx_under)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_states_equal(x, y, f"{path}[{i}]", approx_under)
    elif isinstance(a, float) and any(path.startswith(p) for p in approx_under):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12), path
    else:
        assert a == b, path


def test_checkpoint_and_resume_reproduce_step_3(joint_run, tmp_path_factory, tokenizer, script, monkeypatch):
    from recipe.gdro.trainer import GDROTrainerSync

    src = joint_run["work"]
    ckpt_a = src / "ckpt"
    assert (ckpt_a / "global_step_2" / "gdro_state.pkl").exists()
    assert (ckpt_a / "global_step_3" / "gdro_state.pkl").exists()
    assert not list(ckpt_a.rglob(".gdro_state.*.tmp")), "atomic save left a temporary file"

    # Run B: a copy of A's experiment folder as it was after step 2 (plus A's metrics lines of step 3,
    # which the resume must drop and write again), resumed by verl's resume_mode=auto.
    work = new_work(tmp_path_factory, "resume")
    shutil.copytree(ckpt_a, work / "ckpt")
    shutil.rmtree(work / "ckpt" / "global_step_3")
    (work / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    # verl's file logger opens its file "wb": the resume keeps the earlier run's lines up to step 2
    verl_log = work / "verl_metrics.jsonl"
    old_lines = [json.dumps({"step": k, "data": {"run": "a", "k": k}}) + "\n" for k in (1, 2, 3)]
    verl_log.write_text("".join(old_lines))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(verl_log))
    extra = [o for o in JOINT if not o.startswith("trainer.resume_mode")] + ["trainer.resume_mode=auto"]
    config = make_config(work, *extra, "trainer.logger=[console,file]")
    trainer_b, manager_b = S.run_fit(GDROTrainerSync, config, tokenizer, script)
    trainer_b.logger.logger["file"].finish()
    log_lines = verl_log.read_text().splitlines(keepends=True)
    assert log_lines[:2] == old_lines[:2], "the resume truncated verl's file log"
    assert [json.loads(line)["step"] for line in log_lines[2:]] == [3] and '"run"' not in log_lines[2]

    assert any(p.endswith("global_step_2/actor") for p in trainer_b.actor_rollout_wg.loaded)
    assert [b["step"] for b in manager_b.batches] == [3]
    step3_a = next(b for b in joint_run["manager"].batches if b["step"] == 3)
    step3_b = manager_b.batches[0]
    assert step3_b["index"] == step3_a["index"]
    assert step3_b["rollout_n"] == step3_a["rollout_n"]

    def by_prompt_session(trainer):
        update = next(u for u in trainer.actor_rollout_wg.updates if u["step"] == 3)
        return {(r["index"], r["session"]): r["advantage"] for r in real_rows(update)}

    assert by_prompt_session(trainer_b) == by_prompt_session(joint_run["trainer"])

    with open(ckpt_a / "global_step_3" / "gdro_state.pkl", "rb") as f:
        state_a = pickle.load(f)
    with open(work / "ckpt" / "global_step_3" / "gdro_state.pkl", "rb") as f:
        state_b = pickle.load(f)
    assert_states_equal(state_b, state_a)

    records_a = read_metrics_jsonl(ckpt_a / "gdro_metrics.jsonl")
    lines_b = (work / "ckpt" / "gdro_metrics.jsonl").read_text().splitlines()
    assert len(lines_b) == 3, "the resumed run must rewind the metrics file to step 2, then append step 3"
    records_b = read_metrics_jsonl(work / "ckpt" / "gdro_metrics.jsonl")
    assert [r["step"] for r in records_b] == [1, 2, 3]
    skip = {"gdro/recipe/driver_ms"}
    a3 = {k: v for k, v in records_a[2].items() if k not in skip}
    b3 = {k: v for k, v in records_b[2].items() if k not in skip}
    assert a3.keys() == b3.keys()
    for k in a3:
        assert (math.isnan(a3[k]) and math.isnan(b3[k])) or a3[k] == b3[k], k


def test_resume_without_gdro_state_is_refused(joint_run, tmp_path_factory, tokenizer, script):
    from recipe.gdro.trainer import GDROTrainerSync

    work = new_work(tmp_path_factory, "nostate")
    shutil.copytree(joint_run["work"] / "ckpt" / "global_step_2", work / "ckpt" / "global_step_2")
    os.remove(work / "ckpt" / "global_step_2" / "gdro_state.pkl")
    (work / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    extra = [o for o in JOINT if not o.startswith("trainer.resume_mode")] + ["trainer.resume_mode=auto"]
    config = make_config(work, *extra)
    with pytest.raises(RuntimeError, match="gdro_state.pkl is missing"):
        S.run_fit(GDROTrainerSync, config, tokenizer, script)


def test_disabled_gdro_is_plain_verl_grpo(tq_session, tmp_path_factory, tokenizer, script):
    """Both adversaries off: the recipe trainer and verl's PPOTrainerSync train on identical advantages
    and rollout counts. Observe-only (the default) still logs the binner's gdro/* metrics and JSONL;
    gdro.observe=false leaves no GDRO trace at all."""
    from verl.trainer.ppo.v1 import PPOTrainerSync

    from recipe.gdro.trainer import GDROTrainerSync

    runs = {}
    variants = (
        ("plain", PPOTrainerSync, ["trainer.v1.trainer_mode=sync"]),  # verl's own registry key
        ("observe", GDROTrainerSync, []),
        ("blind", GDROTrainerSync, ["gdro.observe=false"]),
    )
    for name, cls, extra in variants:
        work = new_work(tmp_path_factory, name)
        config = make_config(work, "trainer.resume_mode=disable", "trainer.save_freq=-1", *extra, steps=2)
        with capture_tracking() as logged:
            trainer, manager = S.run_fit(cls, config, tokenizer, script)
        runs[name] = {"trainer": trainer, "manager": manager, "logged": logged, "work": work}
        assert all(b["rollout_n"] is None for b in manager.batches)

    plain = runs["plain"]
    for name in ("observe", "blind"):
        recipe = runs[name]
        assert [b["index"] for b in plain["manager"].batches] == [b["index"] for b in recipe["manager"].batches]
        for step in (1, 2):
            up_p = next(u for u in plain["trainer"].actor_rollout_wg.updates if u["step"] == step)
            up_r = next(u for u in recipe["trainer"].actor_rollout_wg.updates if u["step"] == step)
            adv_p = {(r["index"], r["session"]): r["advantage"] for r in up_p["rows"]}
            adv_r = {(r["index"], r["session"]): r["advantage"] for r in up_r["rows"]}
            assert adv_p == adv_r
            grpo = S.grpo_reference(up_r["rows"])
            for r in up_r["rows"]:
                assert r["advantage"] == pytest.approx(grpo[r["key"]], abs=1e-6)

    blind = runs["blind"]
    assert not (blind["work"] / "ckpt" / "gdro_metrics.jsonl").exists()
    for step_metrics in blind["logged"].values():
        assert not any(k.startswith("gdro/") for k in step_metrics)

    observe = runs["observe"]
    lines = (observe["work"] / "ckpt" / "gdro_metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert observe["trainer"].gdro.binner.seen_fraction() > 0
    for step, step_metrics in observe["logged"].items():
        assert step_metrics["gdro/multiplier_max"] == step_metrics["gdro/multiplier_min"] == 1.0
        # GRPO (observe-only) logs the per-prompt means too; with equal groups they equal verl's
        assert step_metrics["gdro/per_prompt/score_mean"] == pytest.approx(step_metrics["critic/score/mean"])
        assert step_metrics["gdro/per_prompt/response_length_mean"] == pytest.approx(
            step_metrics["response_length/mean"]
        )
        assert sum(v for k, v in step_metrics.items() if k.endswith("/data_share")) == pytest.approx(1.0)
        # Token accounting in a GRPO run too: the tokens of the rows the actor got; uniform = itself.
        up = next(u for u in observe["trainer"].actor_rollout_wg.updates if u["step"] == step)
        tokens = sum(float(r["mask"].sum()) for r in real_rows(up))
        assert step_metrics["gdro/tokens/generated"] == tokens > 0
        assert step_metrics["gdro/tokens/uniform_expected"] == pytest.approx(tokens)
        assert step_metrics["gdro/tokens/ratio_to_uniform"] == pytest.approx(1.0)
        assert step_metrics["gdro/tokens/truncation_rate"] == 0.0
        assert any(k.endswith("/response_length") for k in step_metrics)


def test_token_budget_generates_no_more_than_uniform(tq_session, tmp_path_factory, tokenizer):
    """Failures run longer (scripted filler): under rollout.budget=tokens the planned tokens never exceed
    uniform's and the generated tokens stay at or below the uniform expectation; budget=rollouts logs
    the same metrics (and the length state is the replayed one)."""
    from recipe.gdro.trainer import GDROTrainerSync

    script = S.Script(SOLVE_RATES, wrong_filler=6)
    ratios = {}
    for budget in ("rollouts", "tokens"):
        work = new_work(tmp_path_factory, f"budget_{budget}")
        config = make_config(
            work,
            "gdro.rollout.enable=true",
            f"gdro.rollout.budget={budget}",
            # scripted lengths are exact per (prompt, outcome): the prompt's own EMA, not the bin's mix
            "gdro.rollout.length_shrinkage=0.0",
            "gdro.binner.num_bins=4",
            "gdro.rollout.variance_beta=1.0",
            "gdro.rollout.variance_source=prompt",
            "gdro.rollout.n_max=8",
            "trainer.resume_mode=disable",
            "trainer.save_freq=-1",
            steps=4,
        )
        with capture_tracking() as logged:
            trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, script)
        run = {"trainer": trainer, "manager": manager}
        shadow = replay_and_check(run, script, [1, 2, 3, 4], shadow_controller(config), rollout=True)
        assert_states_equal(trainer.gdro.state_dict()["lengths"], shadow.state_dict()["lengths"])
        assert sorted(logged) == [1, 2, 3, 4]
        for step, m in logged.items():
            assert m["gdro/tokens/generated"] > 0 and m["gdro/tokens/uniform_expected"] > 0
            if budget == "tokens":
                assert m["gdro/tokens/planned_ratio"] <= 1.0 + 1e-9, step
        ratios[budget] = [logged[s]["gdro/tokens/ratio_to_uniform"] for s in (2, 3, 4)]
        assert any(len(set(b["rollout_n"])) > 1 for b in manager.batches[1:])
    # measured: rollouts 1.014 / 1.011 / 1.020, tokens 1.014 / 0.967 / 0.979 (the scripted outcomes are fixed)
    assert np.mean(ratios["tokens"]) <= 1.0 < np.mean(ratios["rollouts"]), ratios


def test_prompt_gdro_skips_padding_rows(tq_session, tmp_path_factory, tokenizer, script):
    """Prompt-GDRO only (loss signal mean |A|), B=3 with mini-batch 2: verl pads 12 rows to 16."""
    from recipe.gdro.trainer import GDROTrainerSync

    work = new_work(tmp_path_factory, "padding")
    config = make_config(
        work,
        "gdro.prompt.enable=true",
        "gdro.prompt.loss_signal=mean_abs_advantage",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        steps=2,
        batch=3,
    )
    advantage_puts = []
    original_put = tq.kv_batch_put

    def counting_put(*args, **kwargs):
        fields = kwargs.get("fields")
        if fields is not None and "advantages" in fields.keys():
            advantage_puts.append(len(kwargs["keys"]))
        return original_put(*args, **kwargs)

    tq.kv_batch_put = counting_put
    try:
        with capture_tracking() as logged:
            trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, script)
    finally:
        tq.kv_batch_put = original_put
    # One write of the advantages per step (verl's own, already scaled): Prompt-GDRO adds no put.
    assert advantage_puts == [16, 16]
    run = {"trainer": trainer, "manager": manager}
    shadow = shadow_controller(config)
    replay_and_check(run, script, [1, 2], shadow, rollout=False, abs_adv=True)
    assert len(set(np.round(trainer.gdro.prompt.scores, 12))) > 1, "the adversary never moved"
    for update in trainer.actor_rollout_wg.updates:
        assert update["num_rows"] == 16
        assert sum(r["is_padding"] for r in update["rows"]) == 4
    for step_metrics in logged.values():
        assert step_metrics["gdro/recipe/padding_rows"] == 4
        assert step_metrics["gdro/recipe/realised_rollouts"] == 12
        assert step_metrics["gdro/binner/nonfinite_rewards"] == 0


def test_task_runner_runs_the_recipe_trainer(tq_session, tmp_path_factory, tokenizer, script, monkeypatch):
    """GDROTaskRunner.run (what run_ppo starts as a Ray actor) with the GPU parts stood in."""
    from verl.trainer.ppo.v1 import PPOTrainerColocateAsync

    from recipe.gdro import task_runner as TR
    from recipe.gdro.trainer import GDROTrainerSync

    assert TR.select_trainer_cls(compose_config([])) is GDROTrainerSync
    assert TR.select_trainer_cls(compose_config(["trainer.v1.trainer_mode=colocate_async"])) is PPOTrainerColocateAsync
    assert hasattr(TR.GDROTaskRunnerActor, "remote")

    work = new_work(tmp_path_factory, "runner")
    config = compose_config(overrides(work, *JOINT, steps=1))  # unresolved, as run_ppo passes it
    managers = []

    def init_agent_loop_manager(self):
        self.agent_loop_manager = S.StandInAgentLoopManager(self.config, tokenizer, script)
        managers.append(self.agent_loop_manager)

    monkeypatch.setattr(TR, "select_trainer_cls", lambda cfg: S.standin_trainer_cls(GDROTrainerSync, tokenizer))
    monkeypatch.setattr(TR.GDROTaskRunner, "init_agent_loop_manager", init_agent_loop_manager)
    from recipe.gdro.startup import cluster

    # The stand-in workers hold no placement group: count no resource-pool CPUs / GPUs for them.
    real_check = cluster.check_transfer_queue_cpus
    monkeypatch.setattr(cluster, "RESOURCE_POOL_CPUS_PER_GPU", 0)
    monkeypatch.setattr(
        cluster,
        "check_transfer_queue_cpus",
        lambda config, cpus, runner_cpus=1, **_: real_check(config, cpus, runner_cpus),
    )
    monkeypatch.setattr(tq, "init", lambda conf=None: conf)  # keep the module's TransferQueue
    monkeypatch.setattr(tq, "close", lambda: None)
    (work / "ckpt").mkdir()
    (work / "ckpt" / "gdro_metrics.jsonl").write_text('{"step": 7, "gdro/mu": 1.0}\n')  # an earlier run's file
    S.clear_transfer_queue()
    runner = TR.GDROTaskRunner()
    try:
        runner.run(config)
    finally:
        for m in managers:
            m.close()
    assert runner.config.transfer_queue.enable is True
    assert [b["step"] for b in managers[0].batches] == [1]
    assert [r["step"] for r in read_metrics_jsonl(work / "ckpt" / "gdro_metrics.jsonl")] == [1]
    assert len(list((work / "ckpt").glob("gdro_metrics.jsonl.*.bak"))) == 1  # the old file, moved aside
    assert (work / "ckpt" / "global_step_1" / "gdro_state.pkl").exists()


# ---------------------------------------------------------------------------- group-size checks
def test_worker_ignoring_per_prompt_counts_stops_the_run(tq_session, tmp_path_factory, tokenizer, script):
    """A rollout worker that ignores ``__rollout_n__`` (every group gets rollout.n) is caught at the first
    step whose schedule varies, naming the prompt and both counts."""
    from recipe.gdro.trainer import GDROTrainerSync

    work = new_work(tmp_path_factory, "ignored_n")
    config = make_config(work, *JOINT)
    with pytest.raises(RuntimeError, match=r"prompt id \d+ \(uid .*\) was scheduled [1-3] rollouts but 4 responses"):
        S.run_fit(GDROTrainerSync, config, tokenizer, script, ignore_rollout_n=True)


def test_failed_sessions_are_counted_not_fatal(tq_session, tmp_path_factory, tokenizer):
    """Sessions whose agent loop returns nothing shrink their group; the step trains on the rest and
    ``gdro/recipe/failed_sessions`` counts them."""
    from recipe.gdro.trainer import GDROTrainerSync

    failing = S.Script(SOLVE_RATES, fail={(i, 1, 1) for i in range(len(ANSWERS))})  # session 1 of step 1
    work = new_work(tmp_path_factory, "failed")
    config = make_config(
        work, "gdro.prompt.enable=true", "trainer.resume_mode=disable", "trainer.save_freq=-1", steps=2
    )
    with capture_tracking() as logged:
        trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, failing)
    assert sorted(logged) == [1, 2]
    assert logged[1]["gdro/recipe/failed_sessions"] == 4  # one per prompt (4 prompts x 4 scheduled)
    assert logged[1]["gdro/recipe/realised_rollouts"] == 12
    assert logged[2]["gdro/recipe/failed_sessions"] == 0
    assert logged[2]["gdro/recipe/realised_rollouts"] == 16
    step1 = next(u for u in trainer.actor_rollout_wg.updates if u["step"] == 1)
    sizes = Counter(r["uid"] for r in real_rows(step1))
    assert sorted(sizes.values()) == [3, 3, 3, 3]
    assert not any(r["session"] == 1 for r in real_rows(step1))
    # the failed sessions reached neither the binner nor the actor: 12 responses observed at step 1
    records = read_metrics_jsonl(work / "ckpt" / "gdro_metrics.jsonl")
    assert records[0]["gdro/recipe/failed_sessions"] == 4


# -------------------------------------------------------- custom reward function + validation lines
# (data_source, ground truth, extra_info.index): training mixes DAPO math with GPQA; validation has every
# Table-1 set. Rates: 1.0 always right, 0.0 always wrong, 0.5 scripted by (index, session, step).
REWARD_TRAIN = [
    ("math_dapo", "10", 0),
    ("math_dapo", "11", 1),
    ("gpqa_diamond", "B", 2),
    ("gpqa_diamond", "D", 3),
    ("math_dapo", "12", 4),
    ("gpqa_diamond", "A", 5),
]
REWARD_VAL = [
    ("math500", "20", 10),
    ("aime2024", "21", 11),
    ("aime2025", "22", 12),
    ("amc23", "23", 13),
    ("minerva", "24", 14),
    ("olympiadbench", "25", 15),
    ("gpqa_diamond", "C", 16),
    ("gpqa_diamond", "A", 17),
]
REWARD_RATES = {
    0: 0.5,
    1: 1.0,
    2: 1.0,
    3: 0.5,
    4: 0.0,
    5: 0.5,
    10: 1.0,
    11: 0.0,
    12: 0.5,
    13: 0.5,
    14: 1.0,
    15: 0.5,
    16: 1.0,
    17: 0.5,
}


def test_custom_reward_fn_routes_math_and_gpqa_and_validation_is_recorded(tq_session, tmp_path_factory, tokenizer):
    """``reward.custom_reward_function.path=pkg://data_prep.reward_fn`` loaded by verl's reward path: math
    sets scored by math_dapo, GPQA by letter (math_dapo would score "Answer: (B) option B" wrong, verl's
    default router has no GPQA scorer). Validation (before training and at step 2) lands in the metrics
    file and gives a Table-1 row."""
    from recipe.gdro.lab.results import table as RT
    from recipe.gdro.results.metrics_io import read_validation_jsonl
    from recipe.gdro.trainer import GDROTrainerSync

    script = S.Script(REWARD_RATES)
    work = tmp_path_factory.mktemp("reward_fn")
    S.write_parquet(str(work / "train.parquet"), S.eval_rows(REWARD_TRAIN))
    S.write_parquet(str(work / "val.parquet"), S.eval_rows(REWARD_VAL))
    config = make_config(
        work,
        f"data.val_files=[{work / 'val.parquet'}]",
        "reward.custom_reward_function.path=pkg://data_prep.reward_fn",
        "reward.custom_reward_function.name=compute_score",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "trainer.val_before_train=true",
        "trainer.test_freq=2",
        "gdro.prompt.enable=true",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        steps=2,
    )
    trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, script)

    # training: every response's score is the script's truth, GPQA rows included
    train_sources = {idx: src for src, _, idx in REWARD_TRAIN}
    seen = Counter()
    for update in trainer.actor_rollout_wg.updates:
        for r in real_rows(update):
            truth = script.correct(r["index"], r["session"], update["step"])
            assert r["score"] == (1.0 if truth else -1.0), (train_sources[r["index"]], r["index"], r["session"])
            seen[(train_sources[r["index"]], truth)] += 1
    assert seen[("gpqa_diamond", True)] > 0 and seen[("gpqa_diamond", False)] > 0, seen

    # validation: per-set acc mean@2 and exact pass@2 from the script's outcomes
    val_batches = [b for b in manager.batches if b["validate"]]
    assert sorted({b["step"] for b in val_batches}) == [0, 2]
    records = read_validation_jsonl(work / "ckpt" / "gdro_metrics.jsonl")
    assert [r["val_step"] for r in records] == [0, 2]
    assert [r["step"] for r in read_metrics_jsonl(work / "ckpt" / "gdro_metrics.jsonl")] == [1, 2]
    for record in records:
        step = record["val_step"]
        by_source: dict[str, list[list[bool]]] = {}
        for src, _, idx in REWARD_VAL:
            by_source.setdefault(src, []).append([script.correct(idx, s, step) for s in range(2)])
        for src, groups in by_source.items():
            mean = np.mean([np.mean(g) for g in groups])
            assert record[f"val-core/{src}/acc/mean@2"] == pytest.approx(mean), (step, src)
            assert record[f"gdro/val/{src}/prompts"] == len(groups)
            assert record[f"gdro/val/{src}/acc/pass@2"] == pytest.approx(np.mean([any(g) for g in groups]))
    gpqa = [script.correct(16, s, 2) for s in range(2)] + [script.correct(17, s, 2) for s in range(2)]
    assert records[1]["val-core/gpqa_diamond/acc/mean@2"] == pytest.approx(np.mean(gpqa)) and any(gpqa)

    rows = RT.build_rows([str(work / "ckpt")], "last")
    assert rows[0].step == 2 and rows[0].k == 2 and rows[0].pass_source == "exact"
    assert rows[0].columns["MATH500"] == 1.0 and rows[0].columns["Minerva"] == 1.0
    assert rows[0].columns["AIME"] == pytest.approx((0.0 + records[1]["val-core/aime2025/acc/mean@2"]) / 2)


# ------------------------------------------------------------------------ a prompt twice in one step
def test_prompt_twice_in_one_step_is_two_visits(tq_session, tmp_path_factory, tokenizer, script):
    """6 prompts, B = 4, ``data.gen_batch_size=1`` (what ``sync_refill_failed_groups`` asks for): verl's
    ``_fetch_one_gen_batch`` restarts the dataloader inside step 2, so one step holds a prompt twice.
    The two groups are two visits (distinct uids), each scheduled, weighted and recorded by the binner."""
    from recipe.gdro.trainer import GDROTrainerSync

    work = new_work(tmp_path_factory, "twice")
    config = make_config(
        work,
        "gdro.prompt.enable=true",
        "data.gen_batch_size=1",
        "trainer.v1.sampler.sync_refill_failed_groups=true",
        "data.seed=9",  # step 2 fetches [2, 3] then, after the epoch restart, [2, 3] again
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        steps=3,
    )
    with capture_tracking() as logged:
        trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, script)
    batches = {b["step"]: b for b in manager.batches}
    repeated = [s for s, b in batches.items() if len(set(b["index"])) < len(b["index"])]
    assert repeated, f"no step held a prompt twice: {[b['index'] for b in manager.batches]}"
    shadow = shadow_controller(config)
    replay_and_check({"trainer": trainer, "manager": manager}, script, [1, 2, 3], shadow, rollout=False, abs_adv=True)
    assert_states_equal(trainer.gdro.state_dict(), shadow.state_dict(), approx_under=("state.metrics",))
    # the binner recorded both visits: 12 visits over 3 steps
    assert int(trainer.gdro.binner.visits_of(np.arange(len(ANSWERS))).sum()) == 12
    for s in repeated:
        assert logged[s]["gdro/recipe/repeated_prompts"] >= 1


# ----------------------------------------------------------------------------------- singleton groups
def test_singleton_groups_get_zero_advantage_and_are_counted(tq_session, tmp_path_factory, tokenizer):
    """Sessions 1-3 of prompts 0-2 fail at step 1, so their groups hold one response each. verl's GRPO
    gives such a group its raw ±1 reward as advantage; with an adversary on (here Prompt-GDRO, which
    would weight it further) the recipe zeroes it, and ``gdro/recipe/singleton_groups`` counts the
    groups. Observe-only leaves verl's advantages untouched and only counts them."""
    from recipe.gdro.trainer import GDROTrainerSync

    failing = S.Script(SOLVE_RATES, fail={(i, s, 1) for i in range(3) for s in (1, 2, 3)})
    for mode in (["gdro.prompt.enable=true"], []):
        work = new_work(tmp_path_factory, "singleton")
        config = make_config(work, *mode, "trainer.resume_mode=disable", "trainer.save_freq=-1", steps=2)
        with capture_tracking() as logged:
            trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, failing)
        step1 = next(u for u in trainer.actor_rollout_wg.updates if u["step"] == 1)
        rows = real_rows(step1)
        sizes = Counter(r["uid"] for r in rows)
        singles = {u for u, n in sizes.items() if n == 1}
        expected = sum(1 for i in manager.batches[0]["index"] if i < 3)
        assert len(singles) == expected >= 1, manager.batches[0]["index"]
        assert logged[1]["gdro/recipe/singleton_groups"] == expected
        assert logged[2]["gdro/recipe/singleton_groups"] == 0
        grpo = S.grpo_reference(step1["rows"])
        for r in rows:
            if r["uid"] in singles:
                assert abs(grpo[r["key"]]) == pytest.approx(1.0, abs=1e-5)  # what verl's GRPO gives it
                if mode:
                    assert float(r["advantage_tokens"].abs().sum()) == 0.0
                else:
                    assert r["advantage"] == pytest.approx(grpo[r["key"]], abs=1e-6)
        others = [r for r in rows if r["uid"] not in singles and grpo[r["key"]] != 0]
        assert others and all(r["advantage"] * grpo[r["key"]] > 0 for r in others)


# ---------------------------------------------------- checkpoint retention across restarts
def test_checkpoint_retention_deletes_only_this_runs_saves(joint_run, tmp_path_factory, tokenizer, script, caplog):
    """An experiment folder left by earlier processes holds global_step_1..3 and an abandoned later branch
    global_step_9. Resuming from step 3 (resume_path) with max_actor_ckpt_to_keep=2, the run saves 4, 5, 6:
    retention retires only its own oldest save (4); 1, 2, 3 (resumed from) and 9 are not this run's and
    stay byte for byte, and the start names 9 as kept."""
    from recipe.gdro.trainer import GDROTrainerSync

    work = new_work(tmp_path_factory, "retention")
    ckpt = work / "ckpt"
    shutil.copytree(joint_run["work"] / "ckpt", ckpt)
    shutil.copytree(ckpt / "global_step_2", ckpt / "global_step_1")  # an older process's checkpoint
    shutil.copytree(ckpt / "global_step_3", ckpt / "global_step_9")  # an abandoned later branch
    (ckpt / "global_step_9" / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for s in (1, 2, 3, 9) for p in (ckpt / f"global_step_{s}").rglob("*") if p.is_file()}
    extra = [o for o in JOINT if not o.startswith(("trainer.resume_mode", "trainer.save_freq"))]
    config = make_config(
        work,
        *extra,
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={ckpt / 'global_step_3'}",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2",
        steps=6,
    )
    with caplog.at_level("WARNING"):
        trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, script)
    assert [b["step"] for b in manager.batches] == [4, 5, 6]
    assert any(p.endswith("global_step_3/actor") for p in trainer.actor_rollout_wg.loaded)
    names = sorted(p.name for p in ckpt.glob("global_step_*"))
    assert names == [f"global_step_{s}" for s in (1, 2, 3, 5, 6, 9)]
    assert {p: p.read_bytes() for p in before} == before
    assert (ckpt / "global_step_6" / "gdro_state.pkl").exists() and (ckpt / "global_step_6" / "actor").is_dir()
    deleted = [r.getMessage() for r in caplog.records if "checkpoint retention (keep 2" in r.getMessage()]
    assert [m.rsplit("/", 1)[1] for m in deleted] == ["global_step_4"]
    kept = [r.getMessage() for r in caplog.records if "are kept" in r.getMessage()]
    assert len(kept) == 1 and "the newer checkpoints global_step_9 are kept" in kept[0]


# ---------------------------------------------------------- per-prompt-weighted metrics
def per_prompt_means(update: dict) -> tuple[float, float]:
    """(score, response length) averaged within each group (uid), then over the groups."""
    groups: dict[str, list[tuple[float, int]]] = {}
    for r in real_rows(update):
        groups.setdefault(r["uid"], []).append((r["score"], len(r["mask"])))
    score = np.mean([np.mean([s for s, _ in g]) for g in groups.values()])
    length = np.mean([np.mean([n for _, n in g]) for g in groups.values()])
    return float(score), float(length)


def test_per_prompt_weighted_score_and_length_beside_verls(joint_run):
    """Under Rollout-GDRO verl's critic/score/mean and response_length/mean weigh a prompt by its rollout
    count; gdro/per_prompt/* average each group first. Both are logged and written to the metrics file."""
    logged = joint_run["logged"]
    records = {r["step"]: r for r in read_metrics_jsonl(joint_run["work"] / "ckpt" / "gdro_metrics.jsonl")}
    differs = False
    for update in joint_run["trainer"].actor_rollout_wg.updates:
        step = update["step"]
        score, length = per_prompt_means(update)
        rows = real_rows(update)
        assert logged[step]["critic/score/mean"] == pytest.approx(np.mean([r["score"] for r in rows]))
        assert logged[step]["gdro/per_prompt/score_mean"] == pytest.approx(score)
        assert logged[step]["gdro/per_prompt/response_length_mean"] == pytest.approx(length)
        assert records[step]["gdro/per_prompt/score_mean"] == pytest.approx(score)
        differs |= abs(score - logged[step]["critic/score/mean"]) > 1e-6
    assert differs, "per-prompt and per-response score means never differed under Rollout-GDRO"


# ------------------------------------------------ the preflight's round through verl's agent loop
def test_preflight_round_counts_the_sessions_verl_puts_into_transfer_queue(
    tq_session, tmp_path_factory, tokenizer, script
):
    """The preflight's GPU round (recipe.gdro.preflight.agent_loop_round) on CPU: two prompts with
    __rollout_n__ = 2 and 12 go through the trainer's own _submit_batch_to_rollout into verl's
    AgentLoopWorkerTQ (stand-in LLM), and the sessions that reach TransferQueue are counted per prompt.
    A worker ignoring __rollout_n__ (every prompt gets rollout.n = 4) makes the check fail: it can fail."""
    from recipe.gdro.preflight import agent_loop_round
    from recipe.gdro.trainer import GDROTrainerSync

    for ignore, expect_ok in ((False, True), (True, False)):
        work = new_work(tmp_path_factory, "preflight_round")
        config = make_config(work, *JOINT, "gdro.rollout.n_max=12")
        S.clear_transfer_queue()
        manager = S.StandInAgentLoopManager(config, tokenizer, script, ignore_rollout_n=ignore)
        try:
            trainer = S.standin_trainer_cls(GDROTrainerSync, tokenizer)(config=config)
            trainer.init()
            trainer.agent_loop_manager = manager
            report = agent_loop_round(trainer, [2, 12], timeout=120)
        finally:
            manager.close()
        assert report.ok is expect_ok, report.describe()
        assert report.scheduled == {"#0": 2, "#1": 12}
        assert report.realised == ({"#0": 2, "#1": 12} if expect_ok else {"#0": 4, "#1": 4})
        assert manager.batches[0]["rollout_n"] == [2, 12]
        # the round leaves nothing behind in TransferQueue
        assert not any((tq.kv_list() or {}).get("train", {}) or {})


def test_large_n_max_runs_end_to_end_with_budget_and_batch_shape(tq_session, tmp_path_factory, tokenizer):
    """n_max = 32 at n̄ = 4 (8× a uniform share; the default 12 caps a prompt at 3×): one mixed prompt
    among five solved-or-unsolvable ones gets more than 12 rollouts, Σ n stays B·n̄ and verl's
    mini-batches stay whole."""
    from recipe.gdro.trainer import GDROTrainerSync

    script = S.Script({0: 0.0, 1: 1.0, 2: 0.0, 3: 1.0, 4: 0.5, 5: 1.0})
    work = new_work(tmp_path_factory, "nmax32")
    extra = (
        "gdro.rollout.enable=true",
        "gdro.rollout.n_max=32",
        "gdro.rollout.variance_source=prompt",
        "gdro.binner.num_bins=4",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
    )
    config = make_config(work, *extra, batch=6, steps=3)
    trainer, manager = S.run_fit(GDROTrainerSync, config, tokenizer, script)
    run = {"manager": manager, "trainer": trainer}
    replay_and_check(run, script, [1, 2, 3], shadow_controller(config), rollout=True)
    counts = [b["rollout_n"] for b in manager.batches]
    assert all(sum(c) == 6 * N_MEAN and min(c) >= 2 and max(c) <= 32 for c in counts)
    assert max(max(c) for c in counts) > 12, counts
