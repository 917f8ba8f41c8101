"""What a run prints: library notices that repeat shown once, verl's raw dictionaries kept off the console.

Three filters, each aimed at named messages (nothing else a library logs or warns is hidden):

* :class:`OnceFilter` on the ``transfer_queue.utils.common`` logger: TransferQueue logs ``target_num_threads 8
  should not exceed total physical CPU cores 2`` at every put and get of a client or storage unit on a machine
  with fewer than ``TQ_NUM_THREADS`` (default 8) physical cores (hundreds of lines a run on 2 cores); each
  process shows it once;
* a warnings filter for verl's notices that its optional engines (torchtitan, veomni, automodel, mindspeed,
  megatron) are not installed, in the Ray workers only: the launching process shows them once, each worker
  would print all five again when it imports verl;
* :func:`drop_lines` around the trainer's ``fit``: verl prints its whole validation dictionary at the start
  (``Initial validation metrics: {...}``) and at the end (``Final validation metrics: ...``); the metrics file
  holds the same figures and the run ends with :mod:`recipe.gdro.results.summary` instead.

:func:`install_log_filters` installs the first two in the process that calls it; a launch on Ray also
runs it in every Ray worker (Ray's ``worker_process_setup_hook``, set by :func:`quiet_ray_workers`).
"""

from __future__ import annotations

import io
import logging
import re
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from omegaconf import DictConfig, OmegaConf, open_dict

ONCE_LOGGERS = ("transfer_queue.utils.common",)
OPTIONAL_ENGINE_NOTICE = r"(torchtitan|veomni|automodel|mindspeed|megatron) engine is not available"
# verl's pprint of its raw validation dictionaries (trainer_base.PPOTrainer.fit): a quoted string, which pprint
# splits into a parenthesised run of quoted lines when it is longer than 80 characters
VERL_RAW_DICT_LINES = ("Initial validation metrics:", "Final validation metrics:")
SETUP_HOOK_KEY = "ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"


class OnceFilter(logging.Filter):
    """Passes each distinct message the first time this process logs it, drops its repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def install_log_filters() -> None:
    """The once-filter on :data:`ONCE_LOGGERS` (once per process: calling again adds nothing)."""
    for name in ONCE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OnceFilter) for f in logger.filters):
            logger.addFilter(OnceFilter())


def setup_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook``: the once-filter, and verl's optional-engine notices, which the
    launching process showed already."""
    install_log_filters()
    warnings.filterwarnings("ignore", message=OPTIONAL_ENGINE_NOTICE, category=UserWarning)


def quiet_ray_workers(config: DictConfig) -> None:
    """Have every Ray worker of the launch run :func:`setup_ray_worker` at start (unless the config names a
    hook of its own), and install the filters in this process."""
    install_log_filters()
    if OmegaConf.select(config, SETUP_HOOK_KEY, default=None) is None:
        with open_dict(config):
            OmegaConf.update(config, SETUP_HOOK_KEY, f"{__name__}.setup_ray_worker", force_add=True)


class _LineFilter(io.TextIOBase):
    """A text stream that writes whole lines to ``target``, except a printed string (``'...'``, or pprint's
    parenthesised run of quoted lines, ``("..." ... "...")``) that starts with one of ``texts``."""

    def __init__(self, target, texts: Sequence[str]):
        super().__init__()
        self._target, self._texts, self._pending, self._in_block = target, tuple(texts), "", False
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def _keep(self, line: str) -> bool:
        if self._in_block:  # inside pprint's parentheses: up to the line that closes them
            self._in_block = not line.rstrip().endswith(")")
            return False
        if not line.lstrip("(").lstrip("'\"").startswith(self._texts):
            return True
        self._in_block = line.startswith("(") and not line.rstrip().endswith(")")
        return False

    def write(self, text: str) -> int:
        with self._lock:
            lines = re.split(r"(?<=\n)", self._pending + text)
            self._pending = "" if lines[-1].endswith("\n") else lines.pop()
            self._target.write("".join(line for line in lines if line and self._keep(line)))
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def close_pending(self) -> None:
        with self._lock:
            if self._pending and self._keep(self._pending):
                self._target.write(self._pending)
            self._pending = ""
        self._target.flush()

    def fileno(self) -> int:
        return self._target.fileno()


@contextmanager
def drop_lines(texts: Sequence[str] = VERL_RAW_DICT_LINES) -> Iterator[None]:
    """Inside, a string printed or pprinted to ``sys.stdout`` that starts with one of ``texts`` is not shown."""
    original = sys.stdout
    stream = _LineFilter(original, texts)
    sys.stdout = stream
    try:
        yield
    finally:
        sys.stdout = original
        stream.close_pending()
