"""A checked launch's run: the plan printed, the checked result handed to the trainer, verl's ``run_ppo``
(or the in-process backend of ``gdro.backend``) run with the recipe's task runner, and the ways it ends in
one line: an interrupt (the run's clean-up, then exit 130 / 143; ``verl_ext.interrupt``), a lost node
(:class:`_LostNodeWatch`), a weight sync that ran out, a full disk. :mod:`recipe.gdro.main_gdro` checks
the launch and calls :func:`train`.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from recipe.gdro.checkpoints import GDRO_STATE_FILE, StorageFullError
from recipe.gdro.startup.checks import (
    GDRORecipeError,
    hand_over,
    join_existing_cluster,
)
from recipe.gdro.startup.plan import format_plan
from recipe.gdro.startup.ray_address import RayJoinError, resolve_ray_address
from recipe.gdro.startup.shm import ShmLeftovers
from verl_ext.interrupt import (
    EndAtSignal,
    after_children_stopped,
    end_process,
    errors_as_interrupt,
    received,
    reinstall,
)

RUN_NAME_KEYS = ("trainer.project_name", "trainer.experiment_name", "trainer.default_local_dir")


def train(config: DictConfig, prepared, cluster_lines: list[str], stdout) -> int:
    """The checked launch: print the plan, hand the checked result over and train on the configured backend."""
    print(format_plan(config, prepared, GDRO_STATE_FILE), file=stdout)
    address = resolve_ray_address(config)  # checked and probed by check_launch
    joined = join_existing_cluster(config, joins=address.joins)
    print("\n".join([*cluster_lines, *joined]), file=stdout, flush=True)
    for key in RUN_NAME_KEYS:  # resolved here (${oc.env:HOME}, the groups' names), not on a Ray node
        OmegaConf.update(config, key, OmegaConf.select(config, key), merge=False)
    hand_over(config, prepared)  # the trainer uses what was checked here; nothing re-checks it
    from recipe.gdro.results.summary import before_training, print_run_summary

    before_training(config)  # library notices once, the interrupt line names the checkpoint (results/summary.py)

    from recipe.gdro.backend_plugins import backend_name

    if backend_name(config) != "verl":  # gdro.backend=cpu: the tiny LM on CPU stand-ins (docs/cpu_backend.md)
        from recipe.gdro.task_runner import run_cpu

        try:
            run_cpu(config, ray_address=address.address if address.joins else None)
        except RayJoinError as e:
            print(f"gdro: error: {e}", file=sys.stderr, flush=True)
            return 2
        except StorageFullError as e:  # a checkpoint or metrics write found the disk full
            print(f"gdro: error: {e}", file=sys.stderr, flush=True)
            return 1
        print_run_summary(config)
        return 0

    # vLLM's shared-memory queues outlive its processes when Ray stops them with a signal: removed at the
    # end of the run, whichever way it ends (startup/shm.py)
    leftovers = ShmLeftovers()

    def release(wait: float) -> None:
        # leaving Ray is bounded: after a signal Ray's own processes may be gone already (a local Ray)
        leaving = threading.Thread(target=_disconnect_ray, daemon=True)
        leaving.start()
        leaving.join(timeout=3.0)
        leftovers.remove(wait=wait)

    cancel = after_children_stopped(lambda: release(wait=5.0))
    interrupted = False
    try:
        # an error the signal caused (a Ray actor stopped under it, a wrapped interrupt) is the interrupt:
        # Hydra would print it as a failed job and exit 1
        with errors_as_interrupt():
            status = _run_on_ray(config, stderr=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True  # interrupted_exit stops the children first, then releases
        raise
    finally:
        if not interrupted:
            cancel()
            release(wait=10.0)
    if status == 0:  # after Ray is left: the last lines (the workers' forwarded output has ended)
        print_run_summary(config)
    return status


def _disconnect_ray() -> None:
    """Leave Ray (a joined cluster then stops this job's workers) unless it is already gone."""
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - an unreachable GCS: nothing to leave
        pass


def _run_on_ray(config: DictConfig, stderr) -> int:
    """verl's ``run_ppo`` with the recipe's task runner; a lost node and a weight sync that ran out are
    reported in one line (exit 1)."""
    from verl.trainer.main_ppo import run_ppo

    from recipe.gdro.task_runner import GDROTaskRunnerActor
    from recipe.gdro.weight_sync import WeightSyncTimeout

    task_runner = _AfterRayInit(GDROTaskRunnerActor, config)
    try:
        run_ppo(config, task_runner_class=task_runner)
    except SystemExit as e:  # Ray's SIGTERM handler during ray.init: the same end as the signal's
        if not task_runner.started:
            task_runner.during_init.exit_if_signalled(e)
        raise
    except Exception as e:  # noqa: BLE001 - a lost node and a bounded weight sync that ran out are ours to report
        if received() is not None:  # the interrupt's doing: run_from_config ends it as one
            raise
        if task_runner.refused is not None:  # the cluster cannot place the run (_AfterRayInit): no actor started
            print(f"gdro: error: {task_runner.refused}", file=stderr, flush=True)
            return 2
        if not task_runner.started:  # ray.init itself failed: the cluster refused or never answered
            print(f"gdro: error: {RayJoinError.from_init_error(config, e)}", file=stderr, flush=True)
            return 2
        lost = _lost_nodes(e, task_runner.nodes_at_start)
        if not task_runner.watch.claim():  # the watch is ending the run over a lost node: its line is the one
            threading.Event().wait()
        if lost:
            print(f"main_gdro: error: {_lost_node_line(config, lost, e)}", file=stderr, flush=True)
            return 1
        full = _find_cause(e, StorageFullError)  # a checkpoint or metrics write found the disk full
        if full is not None:
            print(f"gdro: error: {full}", file=stderr, flush=True)
            return 1
        cause = _find_cause(e, WeightSyncTimeout)
        if cause is None:
            raise
        print(f"main_gdro: error: WeightSyncTimeout: {cause}", file=stderr, flush=True)
        return 1
    finally:
        task_runner.close()
        if not task_runner.watch.claim():
            threading.Event().wait()
    return 0


LOST_NODE_GRACE_S = 10.0  # once Ray marks a node of the run dead, the run's own error path has this long


class _LostNodeWatch:
    """Ends the run when a node it started on dies and the run does not end by itself.

    A lost node usually reaches the driver as an actor error (reported by :func:`_run_on_ray`), but a step
    can wait on it much longer: a TransferQueue storage unit on the dead node makes every put retry until its
    send/recv timeout, sample after sample (measured: > 180 s with a 20 s timeout). A thread asks Ray's GCS
    every ``poll`` s; once it lists a node of ``nodes`` dead (Ray's health check takes ~10 s) and the run has
    not ended ``grace`` s later, it ends the process with the one lost-node line, exit 1, after the clean-up
    a signal gets (:func:`verl_ext.interrupt.end_process`). Whoever reports first, this thread or the run's
    error path (:meth:`claim`), is the only one to."""

    def __init__(self, config: DictConfig, nodes: set[str], poll: float = 2.0, grace: float = LOST_NODE_GRACE_S):
        self._config, self._nodes, self._poll, self._grace = config, nodes, poll, grace
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._fired = False
        threading.Thread(target=self._run, name="gdro-lost-node-watch", daemon=True).start()

    def claim(self) -> bool:
        """Stop the watch; False when it already took over the ending of the run."""
        with self._lock:
            self._stopped.set()
            return not self._fired

    def _run(self) -> None:

        while not self._stopped.wait(self._poll):
            try:
                lost = _dead_nodes(self._nodes)
            except Exception:  # noqa: BLE001 - the GCS busy or gone: asked again, the run's own path may end it
                continue
            if not lost:
                continue
            if self._stopped.wait(self._grace):  # the run ended by itself
                return
            with self._lock:
                if self._stopped.is_set():
                    return
                self._fired = True
            detail = f"the run did not stop within {self._grace:.0f} s of Ray marking the node dead"
            end_process(f"main_gdro: error: {_lost_node_line(self._config, lost, None, detail)}", 1)


def _dead_nodes(among: set[str] | None) -> list[dict]:
    """The nodes ``ray.nodes()`` lists dead, of ``among`` (node ids) when given."""
    import ray

    return [n for n in ray.nodes() if not n.get("Alive", True) and (among is None or n.get("NodeID") in among)]


def _lost_nodes(error: BaseException, nodes_at_start: set[str] | None = None, wait: float = 20.0) -> list[dict]:
    """The Ray nodes of this run that are dead (``ray.nodes()``; of ``nodes_at_start``, the nodes alive when the
    run started, when known: a node lost before, still listed dead, is not this run's), when Ray is still
    connected. An actor that died or became unreachable, or on several nodes any error, often reaches the
    driver before Ray's GCS marks its node dead (measured: ~10 s after a node was killed), so for such an
    error the GCS is asked again for ``wait`` s (on several nodes an error unrelated to a node is reported
    that much later)."""
    try:
        import time

        import ray
        import ray.exceptions as rex

        if not ray.is_initialized():
            return []
        faults = (rex.RayActorError, rex.ActorUnavailableError, rex.NodeDiedError, rex.ObjectLostError)
        chain, seen = [], set()
        while error is not None and id(error) not in seen:  # the error, Ray's wrapped cause, Python's chain
            seen.add(id(error))
            chain.append(error)
            cause = getattr(error, "cause", None)
            error = cause if isinstance(cause, BaseException) else (error.__cause__ or error.__context__)
        node_fault = any(isinstance(e, faults) for e in chain)
        # On several nodes any error may be a lost node's: the surviving FSDP rank fails first, in a collective
        # ("Connection reset by peer", a plain RuntimeError), seconds before Ray's GCS marks the node dead.
        several = nodes_at_start is not None and len(nodes_at_start) > 1
        deadline = time.monotonic() + (wait if node_fault or several else 0.0)
        while True:
            lost = _dead_nodes(nodes_at_start)
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(1.0)
    except Exception:  # noqa: BLE001 - the GCS itself is gone: nothing to name
        return []


def _lost_node_line(config: DictConfig, lost: list[dict], error: BaseException | None, detail: str = "") -> str:
    """One line for a run that ended because a node died: which node, the last complete checkpoint, what to do."""
    from recipe.gdro.checkpoints import newest_complete

    nodes = ", ".join(f"{n.get('NodeID', '?')[:12]} ({n.get('NodeManagerAddress', '?')})" for n in lost)
    root = str(config.trainer.default_local_dir)
    newest = newest_complete(root)
    resume = f"the last complete checkpoint is {newest}" if newest else f"no complete checkpoint in {root}"
    if error is not None:
        detail = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}"
    done = _last_logged_step(os.path.join(root, OmegaConf.select(config, "gdro.metrics_file", default="") or ""))
    during = f"step {done + 1}" if done is not None else "the run"
    return (
        f"lost Ray node{'s' if len(lost) > 1 else ''} {nodes} during {during} ({detail}); "
        f"{resume}; bring the node back and relaunch the same command to resume"
    )


def _last_logged_step(metrics_path: str) -> int | None:
    """The last step the run's metrics file (``gdro.metrics_file``) holds, or None (no file, none written
    yet, unreadable): read by the project's reader, its warnings kept off the one line."""
    import warnings

    from recipe.gdro.results.metrics_io import read_metrics_jsonl

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = read_metrics_jsonl(metrics_path)
    except (OSError, ValueError):
        return None
    return int(rows[-1]["step"]) if rows else None


class _NoWatch:
    """Before the task runner starts (or without Ray's node list) nothing is watched."""

    @staticmethod
    def claim() -> bool:
        return True


class _AfterRayInit:
    """verl's ``run_ppo`` calls ``ray.init`` and builds the task runner right after, in this thread, through
    ``task_runner_class.remote()`` (or ``.options(...)``). There:

    * the handlers of :mod:`verl_ext.interrupt` go back: ``ray.init`` replaced the SIGTERM handler with Ray's
      (``sys.exit`` raised inside ``ray.get``: a C++ abort, exit 134 and a crash dump, with Ray's processes
      left to die on their own), so SIGTERM ends the run as Ctrl-C does (one line, exit 143);
    * the alive nodes are noted (``nodes_at_start``): a node lost during the run is one of them, not a node
      of the cluster that died before (a joined cluster keeps listing it dead), and :class:`_LostNodeWatch`
      watches them."""

    def __init__(self, actor_cls, config: DictConfig):
        self._actor_cls = actor_cls
        self._config = config
        self.nodes_at_start: set[str] | None = None
        self.watch = _NoWatch()
        self.started = False
        self.refused: GDRORecipeError | None = None  # the resource check's refusal, reported by _run_on_ray
        # a signal while ray.init waits on the cluster ends the launch at once, not when ray.init returns
        self.during_init = EndAtSignal("gdro", "while ray.init was connecting to Ray; no training had started").start()

    def _started(self) -> None:
        self.during_init.stop()
        self.started = True
        reinstall()
        # the Ray resources the run needs, checked here on the driver: a refusal is one line, exit 2 (_run_on_ray),
        # before verl's TaskRunner actor, rather than a RayTaskError out of it
        from recipe.gdro.task_runner import VerlBackend

        try:
            VerlBackend().check_cluster(self._config, runner_cpus=1)
        except GDRORecipeError as e:
            self.refused = e
            raise
        try:
            import ray

            self.nodes_at_start = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - without the list a lost node is looked for among every dead node
            self.nodes_at_start = None
        if self.nodes_at_start and isinstance(self.watch, _NoWatch):
            self.watch = _LostNodeWatch(self._config, self.nodes_at_start)

    def close(self) -> None:
        """Stop the signal watch of ``ray.init`` (the run ended before the task runner started)."""
        self.during_init.stop()

    def remote(self, *args, **kwargs):
        self._started()
        return self._actor_cls.remote(*args, **kwargs)

    def options(self, *args, **kwargs):
        self._started()
        return self._actor_cls.options(*args, **kwargs)


def _find_cause(error: BaseException, cls: type) -> Optional[BaseException]:
    """``error`` or the first of its causes that is a ``cls`` (Ray wraps an actor's exception in a
    ``RayTaskError`` whose ``cause`` is the original; Python chains ``__cause__`` / ``__context__``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        original = getattr(error, "cause", None)
        if isinstance(original, cls):
            return original
        if isinstance(error, cls) and not hasattr(error, "cause"):
            return error
        error = original if isinstance(original, BaseException) else (error.__cause__ or error.__context__)
    return None
