"""Cluster readiness of the GDRO recipe: what a first real GPU run needs beyond a valid config.

Everything here runs on the driver before (or instead of) training, and most of it on a CPU:

* :func:`check_attention` -- the attention implementation verl's FSDP engine loads the actor and
  reference with (``actor_rollout_ref.model.override_config.attn_implementation``, default
  ``flash_attention_2`` in verl 0.9.1's ``HFModelConfig``) must be importable, else actor
  ``init_model`` fails with an ImportError minutes into the run;
* :func:`ship_code_to_workers` -- adds the directories of ``recipe``, ``verl_ext`` and
  ``data_prep`` to ``ray_kwargs.ray_init.runtime_env.py_modules``, which verl's ``run_ppo`` merges
  on top of its own runtime_env (``get_ppo_ray_runtime_env``) before ``ray.init``: Ray then ships
  the code to every worker on every node, so nodes without the checkout import it too;
* :func:`check_transfer_queue_cpus` -- verl's resource pool reserves {CPU: 3, GPU: 1} per GPU, and
  TransferQueue's SimpleStorage starts one 1-CPU Ray actor per storage unit plus a 1-CPU controller,
  next to verl's 1-CPU TaskRunner; with fewer Ray CPUs ``tq.init`` (or the placement groups) waits
  forever without an error, so this refuses it with the numbers;
* :func:`check_group_sizes` -- the preflight's comparison of scheduled per-prompt rollout counts
  with what the engine returned (``python -m recipe.gdro.preflight``).
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from recipe.gdro.startup.checks import GDRORecipeError

# --------------------------------------------------------------------------------------- attention
ATTN_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
# verl 0.9.1 workers/config/model.py: override_config.get("attn_implementation", "flash_attention_2")
VERL_DEFAULT_ATTN = "flash_attention_2"
# attn_implementation -> the module transformers imports for it. sdpa / eager need only torch.
ATTN_MODULES = {
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
    "sdpa": "torch",
    "eager": "torch",
}
SDPA_OVERRIDE = f"++{ATTN_KEY}=sdpa"


@dataclass
class AttentionCheck:
    implementation: str
    module: Optional[str]  # None: an implementation this check does not know (left to transformers)
    importable: Optional[bool]
    error: str = ""

    def describe(self) -> str:
        if self.module is None:
            return f"{self.implementation} (not checked: unknown to the recipe; transformers checks it)"
        if self.importable:
            return f"{self.implementation} ({self.module} importable)"
        return f"{self.implementation} ({self.module} NOT importable here: {self.error})"


def configured_attn_implementation(config: DictConfig) -> str:
    """The attention implementation verl's FSDP engine will request (``ATTN_KEY`` or verl's default)."""
    value = OmegaConf.select(config, ATTN_KEY, default=None)
    return str(value) if value is not None else VERL_DEFAULT_ATTN


def check_attention(config: DictConfig, *, strict: bool) -> AttentionCheck:
    """Import the module behind the configured attention implementation.

    ``strict`` raises :class:`GDRORecipeError` naming ``ATTN_KEY`` and the ``sdpa`` fallback when it
    fails; otherwise the failure is returned for the plan to print.
    """
    impl = configured_attn_implementation(config)
    module = ATTN_MODULES.get(impl)
    if module is None:
        return AttentionCheck(impl, None, None)
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, or a CUDA library error raised at import
        check = AttentionCheck(impl, module, False, f"{type(e).__name__}: {e}")
    else:
        return AttentionCheck(impl, module, True)
    if strict:
        default = " (verl's default)" if OmegaConf.select(config, ATTN_KEY, default=None) is None else ""
        raise GDRORecipeError(
            f"{ATTN_KEY}={impl}{default}: the actor and reference models are loaded with this attention "
            f"implementation, and its package `{module}` cannot be imported here ({check.error}). "
            "Install it (the `gpu` extra: flash-attn 2.8.3 through verl's flash-attn-cu130torch211 extra, "
            "built against the installed torch; docs/cluster.md, Install), or fall back to PyTorch SDPA with "
            "the override "
            f"{SDPA_OVERRIDE} (an argument of the launch scripts too)"
        )
    return check


def attention_must_import(dry_run: bool) -> bool:
    """A real launch always requires the attention package; a dry run only on a machine with CUDA
    (a dry run on a CPU laptop checks a GPU config, where flash-attn is never installed)."""
    if not dry_run:
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


# --------------------------------------------------------------------------------------- multi-node
SHIPPED_PACKAGES = ("recipe", "verl_ext", "data_prep")
SHIP_ENV = "GDRO_SHIP_CODE"
PY_MODULES_KEY = "ray_kwargs.ray_init.runtime_env.py_modules"


def package_dir(name: str) -> str:
    """The directory of this repository's ``name`` package, to ship to Ray workers.

    ``recipe`` is a namespace package (TransferQueue and other recipes install portions of it too, and
    an editable install lists a path hook, not a folder, in its ``__path__``): ship this repository's
    portion, the folder that holds this module's package ``recipe/gdro``.
    """
    module = importlib.import_module(name)
    path = getattr(module, "__file__", None)
    if path:
        return os.path.dirname(os.path.abspath(path))
    if name == "recipe":
        return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # <repo>/recipe
    raise GDRORecipeError(
        f"package {name!r} is a namespace package {list(getattr(module, '__path__', []))}; cannot ship it"
    )


def ship_code_to_workers(config: DictConfig, environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Add this repository's packages to ``ray_kwargs.ray_init.runtime_env.py_modules``.

    verl 0.9.1's ``run_ppo`` passes ``OmegaConf.merge(get_ppo_ray_runtime_env(config),
    ray_kwargs.ray_init.runtime_env)`` to ``ray.init``, so the job's every task and actor (TaskRunner,
    FSDP workers, reward workers, agent loops) gets the packages on its ``sys.path``, on any node.
    Entries the user already listed are kept (first). ``GDRO_SHIP_CODE=0`` disables it (e.g. when
    the package is installed at the same path on every node). Returns the directories added.
    """
    environ = os.environ if environ is None else environ
    ship = str(environ.get(SHIP_ENV, "1")).strip().lower()
    if ship not in ("", "0", "1", "true", "false"):
        raise GDRORecipeError(f"{SHIP_ENV}={environ.get(SHIP_ENV)!r} is not 0, 1, true or false")
    if ship in ("0", "false"):
        return []
    dirs = [package_dir(name) for name in SHIPPED_PACKAGES]
    existing = OmegaConf.select(config, PY_MODULES_KEY, default=None)
    current = [str(p) for p in (OmegaConf.to_container(existing) if existing is not None else [])]
    added = [d for d in dirs if d not in current]
    with open_dict(config):
        if OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env", default=None) is None:
            OmegaConf.update(config, "ray_kwargs.ray_init.runtime_env", {}, force_add=True)
        OmegaConf.update(config, PY_MODULES_KEY, current + added, force_add=True)
    return added


# Ray workers on other nodes (and every worker of a cluster the launch joins) inherit the environment of
# *their* `ray start`, not the driver's: what the run's workers read is forwarded through the job's
# runtime_env. The hub switches; the weight-sync bound (read by the TaskRunner); TransferQueue's
# send/recv timeout (read in the TaskRunner: a storage unit on a lost node stalls a step that long, 200 s
# by default); verl's file logger's path (opened in the TaskRunner).
FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "GDRO_WEIGHT_SYNC_TIMEOUT",
    "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT",
    "VERL_FILE_LOGGER_PATH",
    "VERL_FILE_LOGGER_ROOT",
)
ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"


def forward_worker_env(config: DictConfig, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Copy the set ``FORWARDED_ENV`` variables into ``ray_kwargs.ray_init.runtime_env.env_vars``
    (values the user set there win). Returns what was forwarded."""
    environ = os.environ if environ is None else environ
    forwarded = {k: str(environ[k]) for k in FORWARDED_ENV if environ.get(k) not in (None, "")}
    if not forwarded:
        return {}
    existing = OmegaConf.select(config, ENV_VARS_KEY, default=None)
    current = dict(OmegaConf.to_container(existing)) if existing is not None else {}
    forwarded = {k: v for k, v in forwarded.items() if k not in current}
    with open_dict(config):
        OmegaConf.update(config, ENV_VARS_KEY, {**current, **forwarded}, force_add=True)
    return forwarded


# --------------------------------------------------------------------------------------- TransferQueue
TQ_UNITS_KEY = "transfer_queue.backend.SimpleStorage.num_data_storage_units"
TQ_CONTROLLER_CPUS = 1  # TransferQueue's controller actor
RUNNER_CPUS = 1  # verl's TaskRunner actor (run_ppo starts it with Ray's default of 1 CPU)


def tq_storage_units(config: DictConfig) -> Optional[int]:
    if OmegaConf.select(config, "transfer_queue.backend.storage_backend", default="SimpleStorage") != "SimpleStorage":
        return None
    units = OmegaConf.select(config, TQ_UNITS_KEY, default=None)
    return int(units) if units is not None else None


# verl 0.9.1's ResourcePoolManager (single_controller/ray/base.py) builds each GPU's placement-group
# bundle as {CPU: max_colocate_count, GPU: 1} with max_colocate_count = 3 by default, one STRICT_PACK
# placement group of n_gpus_per_node bundles per node.
RESOURCE_POOL_CPUS_PER_GPU = 3


def tq_cpus_needed(units: int, runner_cpus: float = RUNNER_CPUS) -> float:
    """Ray CPUs TransferQueue and the TaskRunner need: storage units + controller + the TaskRunner."""
    return units + TQ_CONTROLLER_CPUS + runner_cpus


def resource_pool_cpus(config: DictConfig) -> int:
    """Ray CPUs verl's GPU resource pool reserves: 3 per GPU (``RESOURCE_POOL_CPUS_PER_GPU``)."""
    return RESOURCE_POOL_CPUS_PER_GPU * int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)


def cluster_cpus_needed(config: DictConfig, runner_cpus: float = RUNNER_CPUS) -> float:
    """Every Ray CPU a run reserves at start-up: verl's resource pool, TransferQueue, the TaskRunner."""
    units = tq_storage_units(config)
    tq_part = tq_cpus_needed(units, 0) if units is not None else 0
    return resource_pool_cpus(config) + tq_part + runner_cpus


def check_transfer_queue_cpus(
    config: DictConfig,
    cluster_cpus: float,
    runner_cpus: float = RUNNER_CPUS,
    node_resources: Optional[Sequence[Mapping[str, float]]] = None,
) -> None:
    """Refuse a layout the Ray cluster cannot place: ``tq.init`` would wait forever, verl's resource pool
    would wait for its placement groups.

    Counted: verl's resource pool ({CPU: 3, GPU: 1} per GPU), TransferQueue's SimpleStorage (one 1-CPU
    actor per storage unit plus a 1-CPU controller) and ``runner_cpus``, the CPUs the caller itself
    holds (1 inside verl's TaskRunner actor, 0 on a driver). With ``node_resources`` (each alive node's
    Ray resources) at least ``trainer.nnodes`` nodes must each hold one node's placement group:
    ``n_gpus_per_node`` GPUs and 3 CPUs per GPU.
    """
    units = tq_storage_units(config)
    if units is not None and units < 1:
        raise GDRORecipeError(f"{TQ_UNITS_KEY}={units} must be >= 1")
    pool = resource_pool_cpus(config)
    need = cluster_cpus_needed(config, runner_cpus)
    n_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    if cluster_cpus < need:
        tq_text = (
            f"TransferQueue {tq_cpus_needed(units, 0):g} ({TQ_UNITS_KEY}={units}: one 1-CPU actor per storage unit "
            "plus a 1-CPU controller), "
            if units is not None
            else ""
        )
        raise GDRORecipeError(
            f"this run needs >= {need:g} Ray CPUs; this Ray cluster has {cluster_cpus:g}: verl's resource pool "
            f"{pool} ({{CPU: {RESOURCE_POOL_CPUS_PER_GPU}, GPU: 1}} per GPU x {n_gpus} GPUs, "
            f"trainer.n_gpus_per_node x trainer.nnodes), {tq_text}verl's TaskRunner {runner_cpus:g}. Without "
            f"them tq.init or the placement groups wait forever. Lower {TQ_UNITS_KEY} "
            "or give Ray more CPUs (a one-node Ray: ray_kwargs.ray_init.num_cpus; a cluster: ray start --num-cpus=N "
            "on each node, run_scripts/ray_node.sh --num-cpus N)"
        )
    if node_resources is not None:
        per_node = int(config.trainer.n_gpus_per_node)
        nnodes = int(config.trainer.nnodes)
        fit = [
            r
            for r in node_resources
            if r.get("GPU", 0) >= per_node and r.get("CPU", 0) >= RESOURCE_POOL_CPUS_PER_GPU * per_node
        ]
        if len(fit) < nnodes:
            seen = "; ".join(f"CPU {r.get('CPU', 0):g}, GPU {r.get('GPU', 0):g}" for r in node_resources)
            raise GDRORecipeError(
                f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={per_node}: verl places one placement group "
                f"of {per_node} bundles {{CPU: {RESOURCE_POOL_CPUS_PER_GPU}, GPU: 1}} on each node, so "
                f"{nnodes} node(s) need >= {per_node} GPUs and >= {RESOURCE_POOL_CPUS_PER_GPU * per_node} CPUs "
                f"each; {len(fit)} of the Ray nodes do ({seen}). Start each node with them (ray start "
                f"--num-gpus={per_node} --num-cpus=N, run_scripts/ray_node.sh --num-gpus {per_node} --num-cpus N; "
                "on the CPU platform the GPU is a logical one), or lower trainer.nnodes / trainer.n_gpus_per_node"
            )


# --------------------------------------------------------------------------------------- group sizes
@dataclass
class GroupSizeReport:
    scheduled: dict[Any, int]
    realised: dict[Any, int]
    mismatched: dict[Any, tuple[int, int]]  # prompt -> (scheduled, realised)
    unexpected: list[Any]  # prompts in the output that were never scheduled

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.unexpected

    def describe(self) -> str:
        lines = [f"prompt {k}: scheduled {n}, got {self.realised.get(k, 0)}" for k, n in self.scheduled.items()]
        lines += [f"prompt {k}: got {self.realised[k]} responses, never scheduled" for k in self.unexpected]
        return "; ".join(lines)


def check_group_sizes(scheduled: Mapping[Any, int], realised_keys: Sequence[Any]) -> GroupSizeReport:
    """Compare each prompt's scheduled rollout count with the responses returned for it.

    ``realised_keys`` has one entry per returned response (its prompt's key). A count that differs
    in either direction is a mismatch: the preflight has no failed sessions to excuse a short group.
    """
    counts = Counter(realised_keys)
    scheduled = {k: int(v) for k, v in scheduled.items()}
    mismatched = {k: (n, counts.get(k, 0)) for k, n in scheduled.items() if counts.get(k, 0) != n}
    unexpected = [k for k in counts if k not in scheduled]
    return GroupSizeReport(scheduled, dict(counts), mismatched, unexpected)


# --------------------------------------------------------------------------------------- KV cache
# Shapes from the models' config.json (hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim, vocab_size, tie_word_embeddings).
# What the three Qwen3-Base sizes share; each entry below lists only where it differs.
_QWEN3_COMMON = dict(
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768
)
KNOWN_MODELS = {
    name: {**_QWEN3_COMMON, **own}
    for name, own in {
        "Qwen/Qwen3-1.7B-Base": dict(
            hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16
        ),
        "Qwen/Qwen3-4B-Base": dict(
            hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32
        ),
        "Qwen/Qwen3-8B-Base": dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            tie_word_embeddings=False,
        ),
    }.items()
}
ASSUMED_GPU_GIB = 79.2  # an "80 GB" A100 / H100 as torch reports it
NON_KV_OVERHEAD_GIB = 3.0  # assumed per GPU: profiling activations, NCCL buffers
# Assumed (not measured) per GPU for the CUDA graphs verl's vLLM server captures (rollout.enforce_eager
# defaults to false; cudagraph_mode FULL_AND_PIECEWISE in vllm_async_server.py), counted inside the budget.
CUDA_GRAPH_GIB = 1.5
GIB = 2**30


def model_shape(model_path: str) -> Optional[dict]:
    """The model's config.json fields the estimate needs: a local directory's, else a known hub id's."""
    local = os.path.join(os.path.expanduser(model_path), "config.json")
    if os.path.isfile(local):
        import json

        with open(local) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        try:
            keys = [k for k in KNOWN_MODELS["Qwen/Qwen3-8B-Base"] if k not in ("head_dim", "max_position_embeddings")]
            return {k: cfg[k] for k in keys} | {
                "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                "max_position_embeddings": cfg.get("max_position_embeddings"),
            }
        except KeyError:
            return None
    return KNOWN_MODELS.get(model_path)


def approx_params(shape: Mapping[str, Any]) -> int:
    """Dense decoder parameter count: embeddings (x2 if untied) + per layer q/k/v/o and a gated MLP."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    attn = h * shape["num_attention_heads"] * hd * 2 + h * shape["num_key_value_heads"] * hd * 2
    mlp = 3 * h * shape["intermediate_size"]
    emb = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    return emb + shape["num_hidden_layers"] * (attn + mlp)


@dataclass
class KVEstimate:
    tokens_per_replica: float
    bytes_per_token_per_gpu: float
    weights_gib_per_gpu: float
    kv_gib_per_gpu: float
    gpu_gib: float
    replicas: int
    sequences_per_replica: float
    max_seq_len: int
    overhead_gib: float = NON_KV_OVERHEAD_GIB
    max_model_len: Optional[int] = None  # vLLM's, as verl's server sets it (None: unknown)
    device: str = f"an assumed {ASSUMED_GPU_GIB:.1f} GiB GPU (none visible here)"  # what gpu_gib is the memory of
    explicit: bool = False  # the cache size is rollout.engine_kwargs.vllm.kv_cache_memory_bytes, not a fraction

    @property
    def worst_case_tokens_per_replica(self) -> float:
        return self.sequences_per_replica * self.max_seq_len

    def line(self, gmu: float) -> str:
        graphs = "CUDA graphs assumed" if self.overhead_gib > NON_KV_OVERHEAD_GIB else "eager"
        if self.explicit:
            source = f"set: engine_kwargs.vllm.kv_cache_memory_bytes = {self.kv_gib_per_gpu:.3g} GiB"
        else:
            source = (
                f"estimate: {gmu} x {self.gpu_gib:.1f} GiB of {self.device} - {self.weights_gib_per_gpu:.1f} GiB "
                f"weights - {self.overhead_gib:g} GiB overhead ({graphs})"
            )
        text = (
            f"kv cache     ~{self.tokens_per_replica / 1e3:.0f}k tokens per vLLM replica ({source}, "
            f"at {self.bytes_per_token_per_gpu / 1024:.0f} KiB/token/GPU) vs "
            f"{self.sequences_per_replica:g} sequences x {self.max_seq_len} tokens = "
            f"{self.worst_case_tokens_per_replica / 1e6:.2f}M per replica if all ran to the limit "
            f"({self.replicas} replicas): "
            + (
                "fits"
                if self.tokens_per_replica >= self.worst_case_tokens_per_replica
                else "vLLM queues what does not fit (docs/cluster.md)"
            )
        )
        if self.max_model_len is not None:
            text += f"; max_model_len {self.max_model_len}: " + (
                "one sequence fits"
                if self.tokens_per_replica >= self.max_model_len
                else "vLLM refuses to start (the KV cache holds less than one max_model_len sequence); set "
                "actor_rollout_ref.rollout.max_model_len"
            )
        return text


def kv_cache_estimate(
    config: DictConfig, gpu_gib: Optional[float] = None, device: Optional[str] = None
) -> Optional[KVEstimate]:
    """vLLM's KV-cache capacity per replica, and what a step would need if every sequence ran to the limit.

    tokens = (gpu_memory_utilization x GPU memory - bf16 weights / TP - overhead) / (KV bytes per token / TP),
    KV bytes per token = 2 (K, V) x layers x KV heads x head_dim x 2 bytes; overhead is ``NON_KV_OVERHEAD_GIB``
    plus the assumed ``CUDA_GRAPH_GIB`` unless ``rollout.enforce_eager``. ``gpu_gib`` and ``device`` name the
    card (default: an assumed 80 GB one). A cache size set in bytes (``rollout.engine_kwargs.vllm.
    kv_cache_memory_bytes``, as the CPU platform's ``size=tiny`` does) is what vLLM allocates instead.
    None for an unknown model.
    """
    shape = model_shape(str(OmegaConf.select(config, "actor_rollout_ref.model.path", default="")))
    if shape is None:
        return None
    rollout = config.actor_rollout_ref.rollout
    tp = int(rollout.tensor_model_parallel_size)
    gmu = float(rollout.gpu_memory_utilization)
    gpu_gib = gpu_gib or ASSUMED_GPU_GIB
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2 / tp
    weights = approx_params(shape) * 2 / tp / GIB
    # verl's server captures CUDA graphs unless rollout.enforce_eager (default false)
    eager = bool(OmegaConf.select(config, "actor_rollout_ref.rollout.enforce_eager", default=False))
    overhead = NON_KV_OVERHEAD_GIB + (0.0 if eager else CUDA_GRAPH_GIB)
    kv_gib = gmu * gpu_gib - weights - overhead
    explicit = OmegaConf.select(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes")
    if explicit is not None:
        kv_gib = float(explicit) / GIB
    n_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    replicas = max(n_gpus // tp, 1)
    rows = int(config.data.train_batch_size) * int(rollout.n)
    seq = int(rollout.prompt_length) + int(rollout.response_length)
    return KVEstimate(
        max(kv_gib, 0) * GIB / per_token,
        per_token,
        weights,
        kv_gib,
        gpu_gib,
        replicas,
        rows / replicas,
        seq,
        overhead_gib=overhead,
        max_model_len=vllm_max_model_len(config, shape),
        device=device or KVEstimate.device,
        explicit=explicit is not None,
    )


def vllm_max_model_len(config: DictConfig, shape: Mapping[str, Any]) -> Optional[int]:
    """vLLM's ``max_model_len`` as verl 0.9.1's server sets it (``vllm_async_server.py``, ``_validate_configs``):
    ``actor_rollout_ref.rollout.max_model_len`` if set, else the model's ``max_position_embeddings``."""
    value = OmegaConf.select(config, "actor_rollout_ref.rollout.max_model_len", default=None)
    if value is not None:
        return int(value)
    mpe = shape.get("max_position_embeddings")
    return int(mpe) if mpe else None


def _local_gpu() -> tuple[Optional[float], Optional[str]]:
    """This node's GPU memory (GiB) and name when CUDA is visible, else (None, None): the estimate then
    assumes an 80 GB card and says so."""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.total_memory / GIB, f"this node's {props.name}"
    except Exception:  # noqa: BLE001
        pass
    return None, None


# --------------------------------------------------------------------------------------- start-up
@dataclass
class ClusterPlan:
    attention: AttentionCheck
    attention_required: bool
    shipped: list[str]
    tq_units: Optional[int]
    forwarded_env: Optional[dict] = None
    kv_line: str = ""
    pool_cpus: Optional[int] = None
    cpus_needed: float = 0.0

    def lines(self) -> list[str]:
        out = [f"attention    {ATTN_KEY.split('.', 1)[1]} = {self.attention.describe()}"]
        if self.attention.importable is False and not self.attention_required:
            out.append(
                "             (no CUDA here, so a dry run only reports it; the real launch refuses it. "
                f"Fallback: {SDPA_OVERRIDE})"
            )
        if self.shipped:
            out.append(
                f"workers      Ray runtime_env py_modules ships {', '.join(SHIPPED_PACKAGES)} to every node "
                f"({SHIP_ENV}=0 to rely on an install at the same path on every node)"
            )
        else:
            out.append(f"workers      code NOT shipped ({SHIP_ENV}=0): every node needs this repository installed")
        if self.forwarded_env:
            pairs = ", ".join(f"{k}={v}" for k, v in self.forwarded_env.items())
            out.append(f"             runtime_env env_vars forwards {pairs} to every worker")
        if self.kv_line:
            out.append(self.kv_line)
        if self.tq_units is not None:
            out.append(
                f"transferq    SimpleStorage with {self.tq_units} storage unit(s): needs >= "
                f"{tq_cpus_needed(self.tq_units):g} Ray CPUs with the TaskRunner"
            )
        if self.pool_cpus is not None:
            out.append(
                f"ray cpus     verl's resource pool reserves {{CPU: {RESOURCE_POOL_CPUS_PER_GPU}, GPU: 1}} per GPU "
                f"({self.pool_cpus} CPUs); with TransferQueue and the TaskRunner the run needs >= "
                f"{self.cpus_needed:g} Ray CPUs (checked when Ray is up)"
            )
        return out


def cluster_checks(config: DictConfig, *, dry_run: bool, environ: Optional[Mapping[str, str]] = None) -> ClusterPlan:
    """The start-up checks of this module that need no Ray: attention import and code shipping.

    The CPU backend (``gdro.backend=cpu``) loads the tiny LM itself, so it never requires the attention package."""
    environ = os.environ if environ is None else environ
    cpu_backend = str(OmegaConf.select(config, "gdro.backend", default="verl")) == "cpu"
    required = attention_must_import(dry_run) and not cpu_backend
    attention = check_attention(config, strict=required)
    shipped = ship_code_to_workers(config, environ)
    forwarded = forward_worker_env(config, environ)
    kv_line = ""
    if OmegaConf.select(config, "actor_rollout_ref.rollout.name", default=None) == "vllm" and not cpu_backend:
        try:
            estimate = kv_cache_estimate(config, *_local_gpu())
        except Exception:  # noqa: BLE001 - an estimate must never stop a launch
            estimate = None
        if estimate is not None:
            kv_line = estimate.line(float(config.actor_rollout_ref.rollout.gpu_memory_utilization))
    return ClusterPlan(
        attention,
        required,
        shipped,
        tq_storage_units(config),
        forwarded,
        kv_line,
        pool_cpus=resource_pool_cpus(config),
        cpus_needed=cluster_cpus_needed(config),
    )


__all__ = [
    "ATTN_KEY",
    "AttentionCheck",
    "ClusterPlan",
    "FORWARDED_ENV",
    "GroupSizeReport",
    "KVEstimate",
    "PY_MODULES_KEY",
    "SDPA_OVERRIDE",
    "SHIPPED_PACKAGES",
    "TQ_UNITS_KEY",
    "attention_must_import",
    "check_attention",
    "check_group_sizes",
    "check_transfer_queue_cpus",
    "cluster_cpus_needed",
    "cluster_checks",
    "configured_attn_implementation",
    "forward_worker_env",
    "kv_cache_estimate",
    "model_shape",
    "package_dir",
    "ship_code_to_workers",
    "resource_pool_cpus",
    "tq_cpus_needed",
    "tq_storage_units",
]
