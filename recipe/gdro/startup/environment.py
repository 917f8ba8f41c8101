"""The environment variables the recipe reads, parsed and checked in one place, before Ray starts.

Every variable the recipe's Python code reads is parsed here (or by the function named in its row),
so that a dry run refuses a bad value with one line naming the variable, instead of the trainer
refusing it after Ray, the workers and vLLM are up. The launch scripts' own variables (``DRY_RUN``,
``DATA_DIR``, ``EVAL_SETS``, ``NUM_TRAIN``, ...) are checked by the scripts themselves
(run_scripts/common/gdro_common.sh), because bash uses them before Python starts.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from recipe.gdro.startup.errors import GDRORecipeError

WEIGHT_SYNC_TIMEOUT_ENV = "GDRO_WEIGHT_SYNC_TIMEOUT"
WEIGHT_SYNC_TIMEOUT_DEFAULT = 900.0
CPU_THREADS_ENV = "GDRO_CPU_THREADS"
CPU_PLATFORM_ENV = "GDRO_CPU_PLATFORM"
SKIP_SHIMS_ENV = "GDRO_CPU_PLATFORM_SKIP_SHIMS"
LOGGING_LEVEL_ENV = "VERL_LOGGING_LEVEL"
# verl's own file logger's variables: the trainer reads them only to find the file verl writes (to keep its
# earlier lines on a resume); verl itself opens the file, and any value is one it accepts.
VERL_FILE_LOGGER_PATH_ENV = "VERL_FILE_LOGGER_PATH"
VERL_FILE_LOGGER_ROOT_ENV = "VERL_FILE_LOGGER_ROOT"
# TransferQueue's send/recv timeout in seconds (its default 200), forwarded to the run's workers
# (startup.cluster.FORWARDED_ENV); TransferQueue parses it with int() at import, inside Ray.
TQ_TIMEOUT_ENV = "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT"
# The shims of verl's CPU platform plugin (recipe/gdro/backends/cpu_platform.py, whose SHIMS are these
# functions: it imports this name) that GDRO_CPU_PLATFORM_SKIP_SHIMS may leave out.
CPU_PLATFORM_SHIMS = (
    "shim_process_group_backend",
    "shim_cpu_offload_pin_memory",
    "shim_vllm_cpu_weight_loader",
    "shim_vllm_pause_generation",
    "shim_fsdp2_save_to_cpu_copies",
    "shim_separate_async_logger_flush",
)
LOGGING_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")


def weight_sync_timeout(environ: Optional[Mapping[str, str]] = None) -> float:
    """``GDRO_WEIGHT_SYNC_TIMEOUT`` seconds (a positive, finite number), default 900."""
    environ = os.environ if environ is None else environ
    raw = environ.get(WEIGHT_SYNC_TIMEOUT_ENV, "")
    if not raw:
        return WEIGHT_SYNC_TIMEOUT_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise GDRORecipeError(f"{WEIGHT_SYNC_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as a container or ``taskset`` limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads(environ: Optional[Mapping[str, str]] = None, cpus: Optional[int] = None) -> int:
    """``GDRO_CPU_THREADS``: torch threads of the CPU backend's stand-ins, a whole number from 1 to the CPUs
    this process may use (:func:`usable_cpus`), default 1. More is refused, not clamped: the value is the
    user's explicit choice, and 100000 on 2 cores timed Ray's GCS out and crashed the run."""
    environ = os.environ if environ is None else environ
    raw = environ.get(CPU_THREADS_ENV, "")
    if not raw:
        return 1
    if not raw.strip().isdigit() or int(raw) < 1:
        raise GDRORecipeError(f"{CPU_THREADS_ENV}={raw!r}: expected a whole number of threads >= 1")
    cpus = usable_cpus() if cpus is None else cpus
    if int(raw) > cpus:
        raise GDRORecipeError(
            f"{CPU_THREADS_ENV}={raw!r}: this machine gives the run {cpus} CPU(s); set at most "
            f"{CPU_THREADS_ENV}={cpus} (or unset it: 1 thread, the CPU backend's default)"
        )
    return int(raw)


def _check_cpu_platform(environ: Mapping[str, str]) -> None:
    raw = environ.get(CPU_PLATFORM_ENV, "")
    if raw not in ("", "0", "1"):
        raise GDRORecipeError(f"{CPU_PLATFORM_ENV}={raw!r}: expected 0 (off) or 1 (on, the default)")
    raw = environ.get(SKIP_SHIMS_ENV, "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if names:
        known = sorted(CPU_PLATFORM_SHIMS)
        unknown = sorted(names - set(known))
        if unknown:
            raise GDRORecipeError(f"{SKIP_SHIMS_ENV}={raw!r} names no shim: {unknown}; the shims: {known}")


def _check_logging_level(environ: Mapping[str, str]) -> None:
    raw = environ.get(LOGGING_LEVEL_ENV, "")
    if raw and raw not in LOGGING_LEVELS:
        raise GDRORecipeError(f"{LOGGING_LEVEL_ENV}={raw!r}: expected one of {', '.join(LOGGING_LEVELS)}")


def _check_tq_timeout(environ: Mapping[str, str]) -> None:
    raw = environ.get(TQ_TIMEOUT_ENV, "")
    if raw and not (raw.strip().isdigit() and int(raw) >= 1):
        raise GDRORecipeError(f"{TQ_TIMEOUT_ENV}={raw!r}: expected a whole number of seconds >= 1")


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse (:class:`GDRORecipeError`, naming the variable) a bad value of any variable the recipe
    reads. The others are parsed elsewhere, where they act: ``GDRO_SHIP_CODE`` by
    :func:`recipe.gdro.startup.cluster.ship_code_to_workers` (run by the dry run too); ``RAY_ADDRESS`` parsed
    and probed by :func:`recipe.gdro.startup.ray_address.check_ray_address`, which reads Ray's own
    ``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` and ``RAY_USE_TLS`` as Ray's clients do, to
    probe the cluster with the launch's credentials."""
    environ = os.environ if environ is None else environ
    weight_sync_timeout(environ)
    cpu_threads(environ)
    _check_cpu_platform(environ)
    _check_logging_level(environ)
    _check_tq_timeout(environ)


__all__ = [
    "LOGGING_LEVELS",
    "WEIGHT_SYNC_TIMEOUT_DEFAULT",
    "WEIGHT_SYNC_TIMEOUT_ENV",
    "check_environment",
    "cpu_threads",
    "weight_sync_timeout",
]
