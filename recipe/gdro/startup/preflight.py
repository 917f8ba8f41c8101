"""Preflight of a GDRO launch on the GPU cluster: about a minute, before hours of training.

    PREFLIGHT=1 bash run_scripts/qwen3_8b_rollout_gdro.sh        # the launch's exact overrides
    python -m recipe.gdro.startup.preflight [hydra overrides]            # the same, by hand

It runs, in order, and stops at the first failure (exit 2, or 1 for a config Hydra/verl rejects):

1. the recipe's start-up checks (:func:`recipe.gdro.startup.checks.prepare`, as a real launch);
2. the attention implementation of the actor / reference is importable on this node
   (:func:`recipe.gdro.startup.cluster.check_attention`, strict);
3. this node can run vLLM: CUDA visible and ``vllm`` importable (a CPU machine stops here, cleanly);
4. Ray with the launch's runtime_env (the code shipped through ``py_modules``): on every alive node a
   task imports ``recipe.gdro.trainer``, ``verl_ext``, ``data_prep.reward_fn`` and the attention
   package, and the cluster has the CPUs TransferQueue's storage units need;
5. vLLM on the model (the launch's TP, memory fraction and lengths) for ONE prompt submitted twice
   with two different rollout counts (``gdro.rollout.n_min`` and ``n_max``), and the returned group
   sizes are compared with the scheduled ones (:func:`recipe.gdro.startup.cluster.check_group_sizes`).

Step 5 checks the engine honours per-request counts; the counts verl's agent loop realises from
``__rollout_n__`` are checked at every training step by the trainer itself.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recipe.gdro.startup.checks import GDROConfigError, GDRORecipeError, PromptIdError, prepare
from recipe.gdro.startup.cluster import (
    ATTN_MODULES,
    check_attention,
    check_group_sizes,
    check_transfer_queue_cpus,
    cluster_checks,
    configured_attn_implementation,
)

PROBE_MODULES = ("recipe.gdro.trainer", "verl_ext", "data_prep.reward_fn")
PREFLIGHT_PROMPT = (
    "What is the remainder when 2^10 is divided by 7? Let's think step by step and output the final "
    "answer within \\boxed{}."
)
PREFLIGHT_MAX_TOKENS = 64


class PreflightError(RuntimeError):
    """A preflight step failed; the message says which and what to do."""


def log(msg: str, stream=None) -> None:
    print(f"[gdro-preflight] {msg}", file=stream or sys.stdout, flush=True)


# --------------------------------------------------------------------------------------- plan
def scheduled_counts(config: DictConfig, gdro) -> dict[str, int]:
    """The two per-prompt rollout counts the preflight asks for: Rollout-GDRO's bounds, or n̄ and n̄ + 1."""
    n = int(config.actor_rollout_ref.rollout.n)
    low, high = (gdro.rollout.n_min, gdro.rollout.n_max) if gdro.rollout.enable else (n, n + 1)
    if low == high:
        high = low + 1
    return {"a": int(low), "b": int(high)}


def plan_lines(config: DictConfig, counts: dict[str, int]) -> list[str]:
    rollout = config.actor_rollout_ref.rollout
    return [
        f"model {config.actor_rollout_ref.model.path}; vLLM TP {rollout.tensor_model_parallel_size}, "
        f"gpu_memory_utilization {rollout.gpu_memory_utilization}, "
        f"max_model_len {int(rollout.prompt_length) + int(rollout.response_length)}",
        f"one prompt submitted twice with n = {counts['a']} and n = {counts['b']} (max_tokens "
        f"{PREFLIGHT_MAX_TOKENS}); the returned group sizes must equal them",
        f"every Ray node imports {', '.join(PROBE_MODULES)} and "
        f"{ATTN_MODULES.get(configured_attn_implementation(config), '(attention not checked)')}",
    ]


# --------------------------------------------------------------------------------------- GPU / vLLM
def require_gpu_and_vllm() -> None:
    """Refuse to go on without CUDA or vLLM (the rest of the preflight needs both)."""
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except Exception as e:  # noqa: BLE001
        raise PreflightError(f"torch cannot be imported: {type(e).__name__}: {e}") from None
    if not cuda:
        raise PreflightError(
            "no CUDA device visible (torch.cuda.is_available() is False): the preflight starts vLLM on the model "
            "and must run on a GPU node of the cluster. On a CPU machine use DRY_RUN=1 (checks the config only)"
        )
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise PreflightError(
            f"vllm cannot be imported ({type(e).__name__}: {e}): install the GPU extra (docs/cluster.md, Install)"
        ) from None


# --------------------------------------------------------------------------------------- Ray nodes
def ray_init_kwargs(config: DictConfig) -> dict[str, Any]:
    """What verl 0.9.1's ``run_ppo`` passes to ``ray.init``: its default runtime_env merged with
    ``ray_kwargs.ray_init`` (where :func:`recipe.gdro.startup.cluster.ship_code_to_workers` put py_modules)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    ray_init = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.get("runtime_env", {}))
    kwargs = OmegaConf.to_container(OmegaConf.create({**ray_init, "runtime_env": runtime_env}), resolve=True)
    return {k: v for k, v in kwargs.items() if v is not None}


def import_probe(modules: Sequence[str]) -> dict[str, Any]:
    """Runs on a Ray worker: import each module, report its file (or the error) and the node."""
    import importlib
    import socket

    result: dict[str, Any] = {"host": socket.gethostname(), "modules": {}}
    for name in modules:
        try:
            result["modules"][name] = {"ok": True, "file": importlib.import_module(name).__file__}
        except Exception as e:  # noqa: BLE001
            result["modules"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return result


def probe_nodes(config: DictConfig, modules: Sequence[str], *, timeout: float = 300) -> dict[str, dict]:
    """Start (or join) Ray with the launch's runtime_env and run :func:`import_probe` on every alive node.

    Returns node id -> probe result. Raises :class:`PreflightError` if a node cannot import a module.
    The caller owns ``ray.shutdown()``.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        ray.init(**ray_init_kwargs(config))
    probe = ray.remote(num_cpus=0)(import_probe)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    refs = {
        node: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(list(modules))
        for node in nodes
    }
    try:
        results = dict(zip(refs, ray.get(list(refs.values()), timeout=timeout), strict=True))
    except Exception as e:  # noqa: BLE001 - e.g. the probe itself cannot be unpickled: recipe not importable
        raise PreflightError(
            f"Ray workers cannot run the recipe's code: {type(e).__name__}: {e}. The code reaches workers through "
            "ray_kwargs.ray_init.runtime_env.py_modules (GDRO_SHIP_CODE=1, the default) or an install at the same "
            "path on every node"
        ) from None
    failed = [
        f"node {node[:12]} ({r['host']}): {name}: {m['error']}"
        for node, r in results.items()
        for name, m in r["modules"].items()
        if not m["ok"]
    ]
    if failed:
        raise PreflightError("modules not importable on Ray workers:\n  " + "\n  ".join(failed))
    return results


# --------------------------------------------------------------------------------------- vLLM
def local_model_path(config: DictConfig) -> str:
    from verl.utils.fs import copy_to_local

    return copy_to_local(str(config.actor_rollout_ref.model.path))


def vllm_group_sizes(config: DictConfig, counts: dict[str, int]) -> tuple[list[str], dict[str, Any]]:
    """Generate for one prompt twice (n = counts['a'], counts['b']); return one key per response + facts."""
    from vllm import LLM, SamplingParams

    rollout = config.actor_rollout_ref.rollout
    t0 = time.monotonic()
    llm = LLM(
        model=local_model_path(config),
        tensor_parallel_size=int(rollout.tensor_model_parallel_size),
        gpu_memory_utilization=float(rollout.gpu_memory_utilization),
        max_model_len=int(rollout.prompt_length) + int(rollout.response_length),
        trust_remote_code=bool(config.actor_rollout_ref.model.get("trust_remote_code", False)),
        enforce_eager=True,  # start fast: no CUDA graph capture for a one-prompt check
    )
    started = time.monotonic() - t0
    keys = list(counts)
    params = [
        SamplingParams(n=counts[k], temperature=float(rollout.temperature), max_tokens=PREFLIGHT_MAX_TOKENS, seed=i)
        for i, k in enumerate(keys)
    ]
    outputs = llm.generate([PREFLIGHT_PROMPT] * len(keys), params)
    realised = [k for k, out in zip(keys, outputs, strict=True) for _ in out.outputs]
    generated = time.monotonic() - t0 - started
    facts: dict[str, Any] = {"engine_start_s": round(started, 1), "generate_s": round(generated, 1)}
    try:  # KV-cache capacity vLLM allocated (tokens per replica), to compare with docs/cluster.md
        cache = llm.llm_engine.vllm_config.cache_config
        facts["kv_cache_tokens"] = int(cache.num_gpu_blocks) * int(cache.block_size)
    except Exception:  # noqa: BLE001 - an engine version without these attributes
        pass
    return realised, facts


# --------------------------------------------------------------------------------------- main
def run_preflight(config: DictConfig, *, stdout=None, stderr=None) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        prepared = prepare(config)
    except (GDROConfigError, GDRORecipeError, PromptIdError) as e:  # the start-up checks refuse: 2, as a launch
        print(f"gdro preflight: error: {e}", file=stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - verl's validation raises assertions, ValueErrors, Hydra errors...
        print(f"gdro preflight: verl config validation failed: {type(e).__name__}: {e}", file=stderr)
        return 1
    counts = scheduled_counts(config, prepared.gdro)
    log("plan:", stdout)
    for line in plan_lines(config, counts):
        log(f"  {line}", stdout)
    try:
        log("1/4 start-up checks passed (" + ", ".join(prepared.verl_checks) + ")", stdout)
        plan = cluster_checks(config, dry_run=False)
        log(f"2/4 attention: {plan.attention.describe()}", stdout)
        require_gpu_and_vllm()
        log("    CUDA + vLLM available", stdout)
        import ray

        try:
            attn = ATTN_MODULES.get(configured_attn_implementation(config))
            results = probe_nodes(config, [*PROBE_MODULES, *([attn] if attn else [])])
            nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
            check_transfer_queue_cpus(config, ray.cluster_resources().get("CPU", 0), node_resources=nodes)
            log(f"3/4 {len(results)} Ray node(s) import the recipe; TransferQueue CPUs OK", stdout)
        finally:
            ray.shutdown()
        realised, facts = vllm_group_sizes(config, counts)
        report = check_group_sizes(counts, realised)
        log(f"4/4 vLLM: {report.describe()}; {facts}", stdout)
        if not report.ok:
            raise PreflightError(f"vLLM's group sizes differ from the scheduled counts: {report.describe()}")
    except (GDRORecipeError, PreflightError) as e:
        print(f"gdro preflight: error: {e}", file=stderr)
        return 2
    log("preflight OK", stdout)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from recipe.gdro.startup.cli import compose_config

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config = compose_config(args)
    except Exception as e:  # noqa: BLE001 - Hydra's own override errors (e.g. an unknown key)
        print(f"gdro preflight: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return run_preflight(config)


__all__ = [
    "PROBE_MODULES",
    "PreflightError",
    "check_attention",
    "import_probe",
    "plan_lines",
    "probe_nodes",
    "ray_init_kwargs",
    "require_gpu_and_vllm",
    "run_preflight",
    "scheduled_counts",
]


if __name__ == "__main__":
    sys.exit(main())
