"""Entry point of the GDRO recipe for verl 0.9.1.

    python -m recipe.gdro.main_gdro [hydra overrides]                    # train
    python -m recipe.gdro.main_gdro size=8b method=rollout_gdro [...]    # the paper's launch (config groups)
    python -m recipe.gdro.main_gdro gdro.dry_run=true [hydra overrides]  # check + print the plan, exit
    python -m recipe.gdro.main_gdro gdro.dry_run=config [overrides]      # the same, data files not required
    python -m recipe.gdro.main_gdro --help                               # usage and the gdro.* keys
    python -m recipe.gdro.main_gdro --help-all                           # Hydra's help: every verl key

The Hydra config is ``recipe/gdro/config/gdro_trainer.yaml``: verl's ``ppo_trainer`` plus a
``gdro:`` section. Before Ray starts, :func:`recipe.gdro.startup.checks.prepare` validates the ``gdro``
section, refuses unsupported verl modes, checks the rollout budget against the batch and
mini-batch sizes, the training data's ``extra_info.index`` and that the reward reports ``acc``, and
runs verl's own config validation. A dry run stops there and prints the resolved ``gdro``
section, the relevant resolved verl keys and a one-screen plan; it needs no GPU, no Ray and no
downloaded model. A dry run (``gdro.dry_run=true``) and a real launch also require the data: every local training
and validation file must exist and be readable, and the training files must hold at least
``data.train_batch_size`` prompts; ``gdro.dry_run=config`` checks the configuration alone (files
that exist are still checked, missing ones are listed). A dry run composes the config without
Hydra's job runtime, so it leaves no ``outputs/<date>/<time>/`` folder behind.

Exit status: 0 on success; 2 for anything the start-up checks refuse, printed on one line that names
the key, file, row or value (an unknown or mistyped key, verl's included; a value out of range;
an impossible budget; an unsupported verl mode; bad prompt ids; a reward without ``acc``; data
files missing, unreadable, without ``data.prompt_key`` or smaller than a batch; an output path
that cannot be created; what verl's own validation refuses). A real launch runs the same checks
(plus a writable checkpoint folder, a local model folder, a Ray cluster for several nodes) before
Hydra's job runtime starts, so a refused launch leaves no ``outputs/`` folder. 1 only for a defect
of a check itself.

A launch checks once: :func:`entry` checks, Hydra's :func:`main` runs that checked config, and
:func:`run_from_config` writes what ``prepare`` built into ``config._gdro_checked``
(:func:`recipe.gdro.startup.checks.hand_over`), which the trainer, built inside verl's Ray TaskRunner from
``config`` alone, takes as is.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below: one line, no traceback (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("gdro")

import os
import sys
import threading
from typing import Optional, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

from recipe.gdro.checkpoints import GDRO_STATE_FILE, StorageFullError
from recipe.gdro.startup.checks import (
    DATA_LISTED,
    DATA_REQUIRED,
    GDRORecipeError,
    hand_over,
    join_existing_cluster,
    prepare,
)
from recipe.gdro.startup.cli import (
    CONFIG_NAME,
    DRY_RUN_CONFIG_ONLY,
    argv_dry_run,
    compose_config,
    dry_run_mode,
    format_help,
    report_compose_error,
)
from recipe.gdro.startup.folder_lock import FolderInUse, folder_holder, lock_output_folder, release_all
from recipe.gdro.startup.plan import format_plan, print_dry_run
from recipe.gdro.startup.ray_address import RayJoinError, check_ray_address, resolve_ray_address
from recipe.gdro.startup.shm import ShmLeftovers
from verl_ext import GDROConfigError, PromptIdError
from verl_ext.interrupt import (
    EndAtSignal,
    after_children_stopped,
    end_process,
    errors_as_interrupt,
    received,
    reinstall,
)

RUN_NAME_KEYS = ("trainer.project_name", "trainer.experiment_name", "trainer.default_local_dir")


def check_launch(config: DictConfig, *, stderr=None, what: str | None = None):
    """Every start-up check of a dry run or a launch, before Ray, a GPU or Hydra's job runtime (the
    preflight runs these too, ``what`` naming it in its messages).

    Returns ``(mode, prepared, cluster_lines)``, or an exit status (2) after printing one line that
    names the key, file or value at fault."""
    stderr = stderr or sys.stderr
    try:
        mode = dry_run_mode(config)
    except GDRORecipeError as e:
        print(f"gdro: error: {e}", file=stderr)
        return 2
    dry = mode is not None
    what = what or ("gdro dry run" if dry else "gdro")
    try:  # Ray's address parsed and probed first, before the slow imports and checks: a few seconds at most
        ray_address = check_ray_address(config, dry_run=dry)
    except GDRORecipeError as e:
        print(f"{what}: error: {e}", file=stderr)
        return 2

    import recipe.gdro.trainer  # noqa: F401 - registers "gdro_sync" in verl's trainer registry, which the checks read
    from recipe.gdro.backend_plugins import in_process_backend

    try:
        backend = in_process_backend(config)  # gdro.backend=cpu: the lab's plugin (recipe/gdro/backend_plugins.py)
        if backend is not None:  # the settings a 2-CPU Ray needs, before the checks and the plan show them
            backend.prepare_config(config)
        data_files = DATA_LISTED if mode == DRY_RUN_CONFIG_ONLY else DATA_REQUIRED
        prepared = prepare(config, data_files=data_files, launch=not dry)
    except (GDROConfigError, GDRORecipeError, PromptIdError) as e:
        print(f"{what}: error: {e}", file=stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a defect of a check, not of the config: say so, in one line
        print(f"{what}: start-up check failed unexpectedly: {type(e).__name__}: {e}", file=stderr)
        return 1
    if prepared.nothing_to_train:  # a relaunch of a finished run: no Ray, no workers (a dry run says so too)
        print(f"{what}: {prepared.nothing_to_train}", flush=True)
        if not dry:
            return 0
    # Cluster readiness (recipe.gdro.startup.cluster): attention kernel importable, code shipped to Ray workers.
    from recipe.gdro.startup.cluster import cluster_checks

    try:
        cluster_lines = [*cluster_checks(config, dry_run=dry).lines(), ray_address.line()]
        # One run per output folder: the lock is taken here, after the checks and before anything writes there
        cluster_lines += claim_output_folder(config, dry_run=dry)
    except (GDRORecipeError, FolderInUse) as e:
        print(f"{what}: error: {e}", file=stderr)
        return 2
    return mode, prepared, cluster_lines


def claim_output_folder(config: DictConfig, *, dry_run: bool) -> list[str]:
    """A launch locks ``trainer.default_local_dir`` for its process's life (:mod:`recipe.gdro.startup.folder_lock`;
    :class:`FolderInUse` when another live launch holds it); a dry run only says who holds it. Returns the
    plan's lines."""
    folder = OmegaConf.select(config, "trainer.default_local_dir", default=None)
    if not isinstance(folder, str) or not folder or "://" in folder:
        return []
    if dry_run:
        holder = folder_holder(folder)
        return [f"run lock     {folder} is in use by another launch ({holder}): a launch now is refused"] * bool(holder)
    lock = lock_output_folder(folder)
    return [lock.warning] if lock.warning else []


def run_from_config(config: DictConfig, *, stdout=None, stderr=None, checked=None) -> int:
    """Check ``config`` (unless ``checked``, what :func:`check_launch` returned for it, is given); on a dry
    run print the plan, otherwise hand the checked result to the trainer (``hand_over``) and train.
    Returns the exit status."""
    stdout = stdout or sys.stdout
    if checked is None:
        checked = check_launch(config, stderr=stderr)
    if isinstance(checked, int):
        return checked
    mode, prepared, cluster_lines = checked
    if mode is not None:
        print_dry_run(config, prepared, GDRO_STATE_FILE, stream=stdout, cluster_lines=cluster_lines)
        return 0
    status = _train(config, prepared, cluster_lines, stdout)
    # The output folder's lock (claim_output_folder) ends with the launch. A launch that raises (an interrupt
    # still stopping the run's workers) keeps it until its process ends.
    release_all()
    return status


def _train(config: DictConfig, prepared, cluster_lines: list[str], stdout) -> int:
    """The checked launch: print the plan, hand the checked result over and train on the configured backend."""
    print(format_plan(config, prepared, GDRO_STATE_FILE), file=stdout)
    address = resolve_ray_address(config)  # checked and probed by check_launch
    joined = join_existing_cluster(config, environ={"RAY_ADDRESS": address.address} if address.joins else {})
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
    from recipe.gdro.trainer import WeightSyncTimeout

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


# The launch entry() composed and checked, for @hydra.main to run: Hydra's main supplies the job runtime
# (working folder, logging) and composes the same overrides again; its copy lacks what the checks set
# (the cluster's runtime_env, the CPU backend's settings), so the checked config is the one that runs.
_CHECKED_LAUNCH: list = []


@hydra.main(config_path="config", config_name=CONFIG_NAME, version_base=None)
def main(config: DictConfig) -> None:
    if _CHECKED_LAUNCH:  # entry() checked this launch before Hydra's job runtime: run that, check nothing again
        checked_config, checked = _CHECKED_LAUNCH.pop()
        status = run_from_config(checked_config, checked=checked)
    else:  # Hydra's own flags (--cfg, --multirun, ...): this is the launch's one check
        status = run_from_config(config)
    if status:
        sys.exit(status)


def cli(argv: Optional[Sequence[str]] = None) -> int:
    """Programmatic equivalent of ``python -m recipe.gdro.main_gdro ARGV`` for a dry run (or a run
    started without Hydra's job runtime); returns the exit status."""
    argv = list(argv or ())
    try:
        config = compose_config(argv)
    except Exception as e:  # noqa: BLE001 - Hydra's own override errors (e.g. an unknown key)
        return report_compose_error(e, argv)
    return run_from_config(config)


def entry(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: ``--help`` is ours; dry runs compose the config without Hydra's job runtime
    (no ``outputs/`` folder); a training run is checked the same way first, then goes through
    ``@hydra.main`` as in verl, so a refused launch leaves no ``outputs/`` folder either. Unknown
    keys and refused values exit 2, naming them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--help", "-h") for a in argv):
        try:
            print(format_help())
        except BrokenPipeError:  # `--help | head`
            pass
        return 0
    if "--help-all" in argv:
        sys.argv = [sys.argv[0], *["--help" if a == "--help-all" else a for a in argv]]
        main()
        return 0
    if any(a.startswith("-") for a in argv):  # Hydra's own flags (--cfg, --multirun, ...): Hydra's job
        sys.argv = [sys.argv[0], *argv]
        main()
        return 0
    if argv_dry_run(argv):
        return cli(argv)
    try:
        config = compose_config(argv)  # fail fast, with our message, on an unknown key
    except Exception as e:  # noqa: BLE001
        return report_compose_error(e, argv)
    checked = check_launch(config)  # refused before Hydra's job runtime: no outputs/ folder is left
    if isinstance(checked, int):
        return checked
    _CHECKED_LAUNCH[:] = [(config, checked)]
    sys.argv = [sys.argv[0], *argv]
    try:
        main()
    finally:
        _CHECKED_LAUNCH.clear()
    return 0


if __name__ == "__main__":
    # Ctrl-C / SIGTERM: the run's finally blocks close the agent loop, TransferQueue and Ray, then one
    # line and exit 130 / 143, no process left (verl_ext.interrupt).
    from verl_ext.interrupt import run_main

    run_main("gdro", entry)
