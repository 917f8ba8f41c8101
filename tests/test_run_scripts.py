"""Launch scripts run_scripts/qwen3_<size>_<method>.sh (CPU only).

The 12 scripts' dry runs (``DRY_RUN=config``: the recipe's ``gdro.dry_run=config``, which composes
the Hydra config, runs verl's and GDRO's validation and prints the resolved config without
requiring the data files; ``DRY_RUN=1`` would also require them) are started
together in one session fixture, a few at a time, because each is a ~10 s Python process (most of
it importing torch/verl). Everything else uses a stub interpreter (``PYTHON=<stub>``) that only
records the command line the script would run, so it takes milliseconds.
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
RUN_SCRIPTS = REPO / "run_scripts"
COMMON = RUN_SCRIPTS / "common" / "gdro_common.sh"

# size -> (default model, rollout tensor-parallel size)
SIZES = {
    "1.7b": ("Qwen/Qwen3-1.7B-Base", 1),
    "4b": ("Qwen/Qwen3-4B-Base", 1),
    "8b": ("Qwen/Qwen3-8B-Base", 2),
}
# method -> (Prompt-GDRO on, Rollout-GDRO on, binner hysteresis)
METHODS = {
    "grpo": (False, False, 0.0),
    "prompt_gdro": (True, False, 0.03),
    "rollout_gdro": (False, True, 0.0),
    "joint_gdro": (True, True, 0.03),
}
GRID = [(size, method) for size in SIZES for method in METHODS]
EVAL_SETS = ["math500", "aime2024", "aime2025", "amc23", "minerva", "olympiadbench", "gpqa_diamond"]

# Every variable the launcher reads: cleared so the caller's environment cannot leak in.
LAUNCH_VARS = (
    "MODEL_PATH DATA_DIR TRAIN_FILE VAL_DIR EVAL_SETS CKPT_DIR NNODES N_GPUS_PER_NODE PROJECT_NAME "
    "EXPERIMENT_NAME LOGGER SAVE_FREQ MAX_CKPT_TO_KEEP ROLLOUT_TP GPU_MEMORY_UTILIZATION USE_DYNAMIC_BSZ "
    "ACTOR_PARAM_OFFLOAD ACTOR_OPTIMIZER_OFFLOAD REF_PARAM_OFFLOAD PPO_MICRO_BSZ_PER_GPU "
    "LOGPROB_MICRO_BSZ_PER_GPU PPO_MAX_TOKEN_LEN_PER_GPU LOGPROB_MAX_TOKEN_LEN_PER_GPU DRY_RUN PYTHON "
    "WANDB_API_KEY RAY_ADDRESS ATTN_IMPLEMENTATION TQ_STORAGE_UNITS PAPER_EXACT PREFLIGHT HF_HUB_OFFLINE "
    "GDRO_SHIP_CODE"
).split()

# The paper's protocol (App. A.1) as the dry run must print it, for every script.
PAPER_VALUES = {
    "data.train_batch_size": 256,
    "trainer.total_training_steps": 1000,
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.28,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 128,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "algorithm.adv_estimator": "grpo",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "data.max_prompt_length": 3200,
    "data.max_response_length": 4096,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.val_kwargs.n": 8,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0.6,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 0.8,
    "actor_rollout_ref.rollout.val_kwargs.top_k": 20,
    "trainer.test_freq": 50,
    "trainer.val_before_train": True,
    "trainer.resume_mode": "auto",
    "trainer.save_freq": 100,
    "trainer.use_v1": True,
    "reward.custom_reward_function.path": "pkg://data_prep.reward_fn",
    "reward.custom_reward_function.name": "compute_score",
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    # operations defaults (issue 11, items 6-7)
    "trainer.max_actor_ckpt_to_keep": 2,
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": 8,
}
# PAPER_EXACT=1: the Rollout-GDRO settings of the authors' released scripts (gdro.rollout.*)
PAPER_EXACT_ROLLOUT = {"allocator": "bandit", "bandit_eta": 0.65, "bandit_beta": 0.4, "n_min": 2, "n_max": 12}


def script_path(size: str, method: str) -> Path:
    return RUN_SCRIPTS / f"qwen3_{size}_{method}.sh"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def run_script(script: Path, args=(), *, env: dict[str, str], cwd: Path, timeout: float = 300):
    return subprocess.run(
        ["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def parse_dry_run(stdout: str) -> tuple[dict, dict]:
    """(resolved verl keys, resolved gdro section) from the recipe's dry-run printout."""
    lines = stdout.splitlines()
    start = lines.index("resolved config (relevant keys):")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("-----"))
    keys = yaml.safe_load("\n".join(lines[start + 1 : end]))
    gstart = lines.index("resolved gdro section:")
    gend = next(i for i in range(gstart + 1, len(lines)) if lines[i].startswith("====="))
    gdro = yaml.safe_load("\n".join(lines[gstart + 1 : gend]))["gdro"]
    return keys, gdro


def write_train_parquet(path: Path, n: int = 8) -> None:
    """A tiny training file in data_prep's schema: unique extra_info.index, math_dapo rows."""
    rows = {
        "data_source": ["math_dapo"] * n,
        "prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(n)],
        "ability": ["math"] * n,
        "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(n)],
        "extra_info": [{"index": i} for i in range(n)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), path)


# ------------------------------------------------------------------------------------ dry runs
CUSTOM_ARGS = (
    "data.train_batch_size=128",
    "trainer.test_freq=25",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "gdro.binner.hysteresis=0.05",
    "gdro.rollout.allocator=bandit",
)
TYPO_CASES = {
    # Hydra refuses an unknown key of the struct config. (The '+gdro.rollout.n_mn=2' form, which
    # Hydra accepts and the recipe's gdro validation refuses, is covered by test_recipe_config.py.)
    "hydra_gdro": ("gdro.rollout.n_mn=2", "gdro.rollout.n_mn"),
}


def _needed_jobs(session) -> set:
    """The dry runs the selected tests of this module use (all of them in a normal run)."""
    needed = set()
    for item in session.items:
        name = getattr(item, "originalname", item.name)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if name == "test_dry_run_resolves_paper_protocol":
            needed.add((params["size"], params["method"]))
        elif name == "test_environment_and_argument_overrides_win":
            needed.add("custom")
        elif name == "test_paper_exact_reproduces_the_released_rollout_settings":
            needed.update({"paper_exact", ("8b", "rollout_gdro")})
        elif name == "test_mistyped_override_fails_naming_the_key":
            needed.add(("typo", params["case"]))
    return needed


@pytest.fixture(scope="session")
def dry_runs(request, tmp_path_factory):
    """Start the selected tests' dry runs at once (a few in parallel); tests pick their result."""
    tmp = tmp_path_factory.mktemp("run_scripts")
    empty_data = tmp / "no_data"  # a config-only dry run must not need the data files
    empty_data.mkdir()
    base = clean_env(
        DRY_RUN="config", PYTHON=sys.executable, DATA_DIR=str(empty_data), CKPT_DIR=str(tmp / "ckpt"), LOGGER="console"
    )
    custom_data = tmp / "custom_data"
    write_train_parquet(custom_data / "train.parquet")
    custom_env = clean_env(
        DRY_RUN="config",  # 8 prompts < batch 128 and no eval files: listed, not refused
        PYTHON=sys.executable,
        MODEL_PATH="/models/my-qwen3",
        DATA_DIR=str(custom_data),
        EVAL_SETS="math500,aime2024",
        CKPT_DIR=str(tmp / "custom_ckpt"),
        NNODES="2",
        N_GPUS_PER_NODE="4",
        PROJECT_NAME="myproj",
        EXPERIMENT_NAME="myexp",
        LOGGER="console,tensorboard",
    )
    jobs = {(size, method): (script_path(size, method), (), base) for size, method in GRID}
    jobs["custom"] = (script_path("1.7b", "rollout_gdro"), CUSTOM_ARGS, custom_env)
    jobs["paper_exact"] = (script_path("8b", "rollout_gdro"), (), {**base, "PAPER_EXACT": "1"})
    for name, (arg, _) in TYPO_CASES.items():
        jobs[("typo", name)] = (script_path("1.7b", "rollout_gdro"), (arg,), base)
    needed = _needed_jobs(request.session)
    workers = max(2, os.cpu_count() or 2)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    futures = {key: pool.submit(run_script, s, a, env=e, cwd=tmp) for key, (s, a, e) in jobs.items() if key in needed}
    yield {"futures": futures, "tmp": tmp, "custom_data": custom_data}
    pool.shutdown(wait=True)


def _result(dry_runs, key) -> subprocess.CompletedProcess:
    return dry_runs["futures"][key].result()


@pytest.mark.parametrize("size,method", GRID, ids=[f"{s}_{m}" for s, m in GRID])
def test_dry_run_resolves_paper_protocol(dry_runs, size, method):
    proc = _result(dry_runs, (size, method))
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    assert "dry run OK" in proc.stdout
    keys, gdro = parse_dry_run(proc.stdout)

    wrong = {k: (keys.get(k, "<absent>"), v) for k, v in PAPER_VALUES.items() if keys.get(k, "<absent>") != v}
    assert not wrong, f"resolved (got, expected): {wrong}"
    # bool/int/float distinctions (True == 1 in Python): the switches must really be booleans
    assert keys["actor_rollout_ref.actor.use_kl_loss"] is True
    assert keys["actor_rollout_ref.rollout.val_kwargs.do_sample"] is True

    model, tp = SIZES[size]
    assert keys["actor_rollout_ref.model.path"] == model
    assert keys["actor_rollout_ref.rollout.tensor_model_parallel_size"] == tp
    assert 0.3 <= keys["actor_rollout_ref.rollout.gpu_memory_utilization"] <= 0.9
    assert keys["trainer.experiment_name"] == f"qwen3_{size}_{method}"
    assert keys["trainer.project_name"] == "gdro"
    ckpt = dry_runs["tmp"] / "ckpt"
    assert keys["trainer.default_local_dir"] == f"{ckpt}/gdro/qwen3_{size}_{method}"

    data_dir = dry_runs["tmp"] / "no_data"
    assert keys["data.train_files"] == f"{data_dir}/train.parquet"
    assert keys["data.val_files"] == [f"{data_dir}/eval/{name}.parquet" for name in EVAL_SETS]

    prompt_on, rollout_on, hysteresis = METHODS[method]
    assert keys["gdro.prompt.enable"] is prompt_on and gdro["prompt"]["enable"] is prompt_on
    assert keys["gdro.rollout.enable"] is rollout_on and gdro["rollout"]["enable"] is rollout_on
    assert gdro["rollout"]["n_mean"] == 4  # the mean budget n̄ = rollout.n
    assert gdro["binner"]["num_bins"] == 10
    assert gdro["binner"]["window"] == 50
    assert gdro["binner"]["hysteresis"] == hysteresis
    assert gdro["dry_run"] is True
    # the budget divides: no padded rows
    assert "1024 responses/step" in proc.stdout
    assert "padding rows/step: 0" in proc.stdout


def test_environment_and_argument_overrides_win(dry_runs):
    proc = _result(dry_runs, "custom")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    keys, gdro = parse_dry_run(proc.stdout)
    # arguments beat the script's own settings (256, 50, TP 1, hysteresis 0, allocator default)
    assert keys["data.train_batch_size"] == 128
    assert keys["trainer.test_freq"] == 25
    assert keys["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 2
    assert gdro["binner"]["hysteresis"] == 0.05
    assert gdro["rollout"]["allocator"] == "bandit"
    # the rest of the protocol is untouched
    assert keys["actor_rollout_ref.rollout.n"] == 4
    assert keys["actor_rollout_ref.actor.clip_ratio_high"] == 0.28
    # environment variables
    assert keys["actor_rollout_ref.model.path"] == "/models/my-qwen3"
    assert keys["trainer.nnodes"] == 2
    assert keys["trainer.n_gpus_per_node"] == 4
    assert keys["trainer.project_name"] == "myproj"
    assert keys["trainer.experiment_name"] == "myexp"
    assert keys["trainer.logger"] == ["console", "tensorboard"]
    data = dry_runs["custom_data"]
    assert keys["data.train_files"] == f"{data}/train.parquet"
    assert keys["data.val_files"] == [f"{data}/eval/math500.parquet", f"{data}/eval/aime2024.parquet"]
    assert keys["trainer.default_local_dir"] == f"{dry_runs['tmp']}/custom_ckpt/myproj/myexp"
    # the training file existed, so the recipe checked its prompt ids and probed the reward
    # function the script wires (data_prep.reward_fn must report `acc`)
    assert "extra_info.index unique" in proc.stdout
    assert "acc probe: math_dapo: ['acc'" in proc.stdout
    assert "data note    data.train_files hold 8 prompt(s)" in proc.stdout


def test_paper_exact_reproduces_the_released_rollout_settings(dry_runs):
    exact = _result(dry_runs, "paper_exact")
    assert exact.returncode == 0, f"exit {exact.returncode}\n{exact.stdout[-3000:]}\n{exact.stderr[-3000:]}"
    assert "| PAPER_EXACT" in exact.stderr
    keys, gdro = parse_dry_run(exact.stdout)
    assert {k: gdro["rollout"][k] for k in PAPER_EXACT_ROLLOUT} == PAPER_EXACT_ROLLOUT
    assert keys["data.max_prompt_length"] == 3200 and keys["data.max_response_length"] == 4096
    assert "Rollout-GDRO ON   allocator=bandit, n(x) in [2, 12]" in exact.stdout
    # everything else is the same run as without PAPER_EXACT
    default = _result(dry_runs, ("8b", "rollout_gdro"))
    default_keys, default_gdro = parse_dry_run(default.stdout)
    assert default_gdro["rollout"]["allocator"] == "sqrt" and default_gdro["rollout"]["bandit_eta"] == 5.0
    assert keys == default_keys
    assert {**gdro, "rollout": None} == {**default_gdro, "rollout": None}


@pytest.mark.parametrize("case", sorted(TYPO_CASES))
def test_mistyped_override_fails_naming_the_key(dry_runs, case):
    arg, name = TYPO_CASES[case]
    proc = _result(dry_runs, ("typo", case))
    assert proc.returncode != 0
    assert "dry run OK" not in proc.stdout
    # the key is named in an error message (not merely echoed in the printed command line)
    messages = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("    ")]
    assert any(name in line for line in messages), proc.stderr[-3000:]


# ------------------------------------------------------------------------------------ shell only
def test_scripts_parse_with_bash_n():
    scripts = sorted(RUN_SCRIPTS.glob("*.sh")) + [COMMON]
    assert len(scripts) >= 13
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


def test_grid_is_complete_and_settings_live_in_one_place():
    found = {p.name for p in RUN_SCRIPTS.glob("qwen3_*.sh")}
    assert found == {f"qwen3_{s}_{m}.sh" for s, m in GRID}
    for size, method in GRID:
        path = script_path(size, method)
        assert path.stat().st_mode & stat.S_IXUSR, f"{path} is not executable"
        text = path.read_text()
        body = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
        # nothing but the shared launcher: no setting is copied into the per-run scripts
        assert body == [
            "set -euo pipefail",
            'source "$(dirname "${BASH_SOURCE[0]}")/common/gdro_common.sh"',
            f'gdro_launch {size} {method} "$@"',
        ], body


@pytest.fixture()
def stub_python(tmp_path):
    """An interpreter stand-in that records its argv (NUL-separated) and exits 0."""
    out = tmp_path / "argv.bin"
    stub = tmp_path / "python_stub"
    stub.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > '{out}'\n")
    stub.chmod(0o755)

    def read():
        if not out.exists():
            return None
        argv = out.read_bytes().split(b"\0")[:-1]
        out.unlink()
        return [a.decode() for a in argv]

    return stub, read


def _data_dir_with_files(root: Path) -> Path:
    data = root / "data with space"
    (data / "eval").mkdir(parents=True)
    (data / "train.parquet").write_bytes(b"")
    for name in EVAL_SETS:
        (data / "eval" / f"{name}.parquet").write_bytes(b"")
    return data


def test_real_launch_runs_exactly_the_dry_run_overrides(tmp_path, stub_python):
    stub, read = stub_python
    data = _data_dir_with_files(tmp_path)
    env = clean_env(PYTHON=str(stub), DATA_DIR=str(data), LOGGER="console")
    user = ["trainer.save_freq=20", "gdro.rollout.n_max=8"]
    script = script_path("8b", "rollout_gdro")

    real = run_script(script, user, env=env, cwd=tmp_path)
    assert real.returncode == 0, real.stderr
    real_argv = read()
    dry = run_script(script, user, env={**env, "DRY_RUN": "1"}, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    dry_argv = read()

    assert real_argv[:2] == ["-m", "recipe.gdro.main_gdro"]
    assert dry_argv == real_argv + ["gdro.dry_run=true"]
    assert "gdro.dry_run=true" not in real_argv
    # the user's overrides come after every override of the script, in order
    assert real_argv[-len(user) :] == user
    # paths with spaces reach Hydra as one quoted value
    assert f"data.train_files='{data}/train.parquet'" in real_argv


def test_real_launch_refuses_missing_data_before_starting_python(tmp_path, stub_python):
    stub, read = stub_python
    env = clean_env(PYTHON=str(stub), DATA_DIR=str(tmp_path / "nothing"), LOGGER="console")
    proc = run_script(script_path("4b", "prompt_gdro"), env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{tmp_path}/nothing/train.parquet" in proc.stderr
    assert "data_prep/dapo.py" in proc.stderr
    assert read() is None  # the interpreter was never started


@pytest.mark.parametrize(
    "size,env_extra,needle",
    [
        ("8b", {"NNODES": "3"}, "not divisible by the data-parallel size"),  # 1024 responses / 24 GPUs
        ("1.7b", {"N_GPUS_PER_NODE": "6"}, "not divisible by the data-parallel size"),
        ("8b", {"N_GPUS_PER_NODE": "1"}, "not divisible by the rollout tensor-parallel size"),  # 8B: TP 2
        ("1.7b", {"ROLLOUT_TP": "3"}, "not divisible by the rollout tensor-parallel size"),
        ("4b", {"NNODES": "two"}, "NNODES must be a positive integer"),
        ("4b", {"PPO_MAX_TOKEN_LEN_PER_GPU": "4096"}, "must hold one full sequence"),
    ],
    ids=["nnodes3", "gpus6", "8b_on_1_gpu", "tp3", "nnodes_text", "token_budget"],
)
def test_launcher_refuses_layouts_that_do_not_divide(tmp_path, stub_python, size, env_extra, needle):
    stub, read = stub_python
    env = clean_env(PYTHON=str(stub), DRY_RUN="1", **env_extra)
    proc = run_script(script_path(size, "grpo"), env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert read() is None


def test_dry_run_modes_reach_the_recipe(tmp_path, stub_python):
    """DRY_RUN=1 -> gdro.dry_run=true (config and data checked); DRY_RUN=config -> gdro.dry_run=config."""
    stub, read = stub_python
    cases = (("1", "gdro.dry_run=true"), ("true", "gdro.dry_run=true"), ("config", "gdro.dry_run=config"))
    for value, expected in cases:
        env = clean_env(PYTHON=str(stub), DRY_RUN=value, DATA_DIR=str(tmp_path / "nothing"), LOGGER="console")
        proc = run_script(script_path("1.7b", "grpo"), env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert read()[-1] == expected, value


def test_defaults_without_environment(tmp_path, stub_python):
    stub, read = stub_python
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(PYTHON=str(stub), DRY_RUN="1", HOME=str(home))
    proc = run_script(script_path("8b", "joint_gdro"), env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = read()
    assert f"data.train_files='{home}/data/dapo/train.parquet'" in argv
    assert "actor_rollout_ref.model.path='Qwen/Qwen3-8B-Base'" in argv
    # checkpoints outside the repository, a bounded number of them (issue 11, item 7)
    assert f"trainer.default_local_dir='{home}/gdro_ckpt/gdro/qwen3_8b_joint_gdro'" in argv
    assert "trainer.max_actor_ckpt_to_keep=2" in argv
    assert "transfer_queue.backend.SimpleStorage.num_data_storage_units=8" in argv
    assert not any("attn_implementation" in a for a in argv)  # verl's default unless asked
    assert "trainer.logger=[console]" in argv  # no wandb credentials in this HOME
    assert "no wandb credentials" in proc.stderr

    proc = run_script(script_path("8b", "joint_gdro"), env={**env, "WANDB_API_KEY": "x"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "trainer.logger=[console,wandb]" in read()


def test_launcher_checks_defer_to_arguments(tmp_path, stub_python):
    """Values overridden by arguments are not checked against the environment's defaults."""
    stub, read = stub_python
    data = _data_dir_with_files(tmp_path)
    other = tmp_path / "elsewhere" / "train.parquet"
    other.parent.mkdir()
    other.write_bytes(b"")
    (data / "train.parquet").unlink()
    env = clean_env(PYTHON=str(stub), DATA_DIR=str(data), LOGGER="console")
    # the training file comes from an argument: the missing $DATA_DIR/train.parquet does not matter
    proc = run_script(script_path("4b", "grpo"), [f"data.train_files={other}"], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert read()[-1] == f"data.train_files={other}"
    # 3 nodes x 8 GPUs do not divide 256 x 4, but they do divide the batch given as arguments
    args = ["data.train_batch_size=384", "actor_rollout_ref.actor.ppo_mini_batch_size=192"]
    proc = run_script(script_path("4b", "grpo"), args, env={**env, "NNODES": "3", "DRY_RUN": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert read()[-3:] == [*args, "gdro.dry_run=true"]


def test_operations_environment(tmp_path, stub_python):
    """MAX_CKPT_TO_KEEP, TQ_STORAGE_UNITS and ATTN_IMPLEMENTATION reach the command line; bad values stop."""
    stub, read = stub_python
    env = clean_env(PYTHON=str(stub), DRY_RUN="1", LOGGER="console")
    script = script_path("4b", "grpo")
    proc = run_script(
        script,
        env={**env, "MAX_CKPT_TO_KEEP": "0", "TQ_STORAGE_UNITS": "1", "ATTN_IMPLEMENTATION": "sdpa"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    argv = read()
    assert "trainer.max_actor_ckpt_to_keep=null" in argv  # 0 = keep all
    assert "transfer_queue.backend.SimpleStorage.num_data_storage_units=1" in argv
    assert "++actor_rollout_ref.model.override_config.attn_implementation=sdpa" in argv
    for var, value, needle in [
        ("MAX_CKPT_TO_KEEP", "-1", "MAX_CKPT_TO_KEEP must be a non-negative integer"),
        ("TQ_STORAGE_UNITS", "0", "TQ_STORAGE_UNITS must be a positive integer"),
        ("ATTN_IMPLEMENTATION", "sdpa x", "ATTN_IMPLEMENTATION has unexpected characters"),
    ]:
        proc = run_script(script, env={**env, var: value}, cwd=tmp_path)
        assert proc.returncode == 2 and needle in proc.stderr, (var, proc.stderr)
        assert read() is None


def test_preflight_runs_the_launch_overrides_through_the_preflight_module(tmp_path, stub_python):
    stub, read = stub_python
    data = _data_dir_with_files(tmp_path)
    env = clean_env(PYTHON=str(stub), DATA_DIR=str(data), LOGGER="console")
    script = script_path("8b", "rollout_gdro")
    assert run_script(script, env=env, cwd=tmp_path).returncode == 0
    real = read()
    proc = run_script(script, env={**env, "PREFLIGHT": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| PREFLIGHT" in proc.stderr
    pre = read()
    assert pre == ["-m", "recipe.gdro.startup.preflight", *real[2:]]
    proc = run_script(script, env={**env, "PREFLIGHT": "1", "DRY_RUN": "1"}, cwd=tmp_path)
    assert proc.returncode == 2 and "exclusive" in proc.stderr
    assert read() is None


def test_local_model_path_must_be_a_model(tmp_path, stub_python):
    stub, read = stub_python
    data = _data_dir_with_files(tmp_path)
    model = tmp_path / "models" / "qwen3-4b"
    model.mkdir(parents=True)
    env = clean_env(PYTHON=str(stub), DATA_DIR=str(data), LOGGER="console", MODEL_PATH=str(model))
    proc = run_script(script_path("4b", "grpo"), env=env, cwd=tmp_path)
    assert proc.returncode == 2 and f"no config.json in {model}" in proc.stderr
    assert read() is None
    (model / "config.json").write_text("{}")
    proc = run_script(script_path("4b", "grpo"), env={**env, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"actor_rollout_ref.model.path='{model}'" in read()
    # an HF id with HF_HUB_OFFLINE: a reminder that it must be cached on every node
    proc = run_script(
        script_path("4b", "grpo"), env={**env, "MODEL_PATH": "Qwen/Qwen3-4B-Base", "HF_HUB_OFFLINE": "1"}, cwd=tmp_path
    )
    assert proc.returncode == 0 and "must already be in the hub cache of every node" in proc.stderr
    assert read() is not None
