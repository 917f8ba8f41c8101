"""The resolved config of each paper launch (run_scripts/qwen3_<size>_<method>.sh), for the fixture
tests/fixtures/launch_configs.json and the test that compares today's launches with it.

A launch is run with a stand-in interpreter that records the argv the script would exec, under a
fixed environment (temporary paths and HOME, ``DRY_RUN=config``); that argv is composed exactly
as ``python -m recipe.gdro.main_gdro`` composes it (:func:`recipe.gdro.startup.cli.compose_config`)
and resolved. What is stored per launch is its difference from the recipe's bare config (no
overrides), as flattened ``dotted.key: value`` pairs: equal differences from the same base mean
equal resolved configs, and the file stays a few thousand lines instead of ~1,000 keys x 26.

    python tests/recipe_helpers/launch_configs.py --write    # regenerate the fixture
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "launch_configs.json"
SIZES = ("1.7b", "4b", "8b")
METHODS = ("grpo", "prompt_gdro", "rollout_gdro", "joint_gdro")
ABSENT = "<absent>"
TMP = "<TMP>"

# Every variable a launch script reads, or refuses (the aliases it no longer reads): cleared so the
# caller's environment cannot leak in.
LAUNCH_VARS = (
    "MODEL_PATH DATA_DIR TRAIN_FILE VAL_DIR EVAL_SETS CKPT_DIR NNODES N_GPUS_PER_NODE PROJECT_NAME "
    "EXPERIMENT_NAME LOGGER SAVE_FREQ MAX_CKPT_TO_KEEP ROLLOUT_TP GPU_MEMORY_UTILIZATION USE_DYNAMIC_BSZ "
    "ACTOR_PARAM_OFFLOAD ACTOR_OPTIMIZER_OFFLOAD REF_PARAM_OFFLOAD PPO_MICRO_BSZ_PER_GPU "
    "LOGPROB_MICRO_BSZ_PER_GPU PPO_MAX_TOKEN_LEN_PER_GPU LOGPROB_MAX_TOKEN_LEN_PER_GPU DRY_RUN PYTHON "
    "WANDB_API_KEY RAY_ADDRESS ATTN_IMPLEMENTATION TQ_STORAGE_UNITS PAPER_EXACT PREFLIGHT HF_HUB_OFFLINE "
    "GDRO_SHIP_CODE VIRTUAL_ENV"
).split()

# Launches beyond the 12 x {paper_exact off, on}: the variables the launcher still reads, every
# Hydra override that replaced a removed variable, and arguments that must win over the script's.
EXTRA_CASES: dict[str, tuple[str, str, dict[str, str], tuple[str, ...]]] = {
    "overrides_layout": (
        "8b",
        "joint_gdro",
        {"EVAL_SETS": "math500,aime2024"},
        (
            "actor_rollout_ref.model.path=/models/my-qwen3",
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=4",
            "trainer.project_name=myproj",
            "trainer.experiment_name=myexp",
            "trainer.logger=[console,tensorboard]",
            "trainer.save_freq=20",
            "trainer.max_actor_ckpt_to_keep=null",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
            "actor_rollout_ref.actor.use_dynamic_bsz=false",
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            "actor_rollout_ref.ref.fsdp_config.param_offload=false",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8000",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=9000",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=9000",
            "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=2",
            "paper_exact=on",
        ),
    ),
    "args_win": (
        "1.7b",
        "rollout_gdro",
        {"DATA_DIR": "data with space", "VAL_DIR": "/val"},
        (
            "launch.ckpt_root=/ck",
            "data.train_batch_size=128",
            "trainer.test_freq=25",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "gdro.binner.hysteresis=0.05",
            "gdro.rollout.allocator=bandit",
            "actor_rollout_ref.rollout.n=8",
        ),
    ),
}


def launches() -> dict[str, tuple[str, str, dict[str, str], tuple[str, ...]]]:
    """name -> (size, method, environment, arguments) of every launch the fixture holds."""
    out = {}
    for size in SIZES:
        for method in METHODS:
            out[f"{size}_{method}"] = (size, method, {}, ())
            out[f"{size}_{method}_paper_exact"] = (size, method, {}, ("paper_exact=on",))
    out.update(EXTRA_CASES)
    return out


def launch_argv(size: str, method: str, env: dict[str, str], args, tmp: Path) -> list[str]:
    """The argv ``bash run_scripts/qwen3_<size>_<method>.sh ARGS`` execs, after ``python``."""
    stub = tmp / "python_stub"
    record = tmp / "argv.bin"
    stub.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > '{record}'\n")
    stub.chmod(0o755)
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    full_env.update(
        HOME=str(home),
        PYTHON=str(stub),
        DRY_RUN="config",
        DATA_DIR=str(tmp / "data"),
        GDRO_USE_CURRENT_ENV="1",
        CUDA_VISIBLE_DEVICES="",
    )
    full_env.update(env)
    script = REPO / "run_scripts" / f"qwen3_{size}_{method}.sh"
    if record.exists():
        record.unlink()
    proc = subprocess.run(["bash", str(script), *args], env=full_env, cwd=tmp, capture_output=True, text=True)
    if proc.returncode != 0 or not record.exists():
        raise RuntimeError(f"{script.name} exited {proc.returncode}: {proc.stderr[-2000:]}")
    argv = [a.decode() for a in record.read_bytes().split(b"\0")[:-1]]
    assert argv[:2] == ["-m", "recipe.gdro.main_gdro"], argv[:2]
    return argv[2:]


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def resolved(overrides, tmp: Path) -> dict[str, Any]:
    """The composed, resolved config as flat ``key: value`` pairs, ``tmp`` written as ``<TMP>``."""
    from omegaconf import OmegaConf

    from recipe.gdro.startup.cli import compose_config

    container = OmegaConf.to_container(compose_config(list(overrides)), resolve=True)
    text = json.dumps(container, sort_keys=True).replace(str(tmp), TMP)
    return flatten(json.loads(text))


def difference(config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    diff = {k: v for k, v in config.items() if base.get(k, ABSENT) != v or k not in base}
    diff.update({k: ABSENT for k in base if k not in config})
    return dict(sorted(diff.items()))


def launch_configs() -> dict[str, dict[str, Any]]:
    """name -> the launch's resolved config as its difference from the bare recipe config."""
    with tempfile.TemporaryDirectory(prefix="gdro_launch_") as d:
        tmp = Path(d).resolve()
        home = os.environ.get("HOME")
        os.environ["HOME"] = str(tmp / "home")  # the config's ${oc.env:HOME} resolves as the launch's would
        try:
            base = resolved([], tmp)
            return {
                name: difference(resolved(launch_argv(size, method, env, args, tmp), tmp), base)
                for name, (size, method, env, args) in launches().items()
            }
        finally:
            if home is None:
                os.environ.pop("HOME", None)
            else:
                os.environ["HOME"] = home


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {FIXTURE.relative_to(REPO)}")
    ns = parser.parse_args(argv)
    configs = launch_configs()
    text = json.dumps(configs, indent=1, sort_keys=True) + "\n"
    if ns.write:
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(text)
        print(f"wrote {FIXTURE} ({len(configs)} launches)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    # run as a script (no pytest, so no `pythonpath` setting): the repository root, for `recipe.gdro`
    sys.path.insert(0, str(REPO))
    sys.exit(main())
