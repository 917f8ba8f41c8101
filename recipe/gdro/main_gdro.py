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
downloaded model. A dry run (``gdro.dry_run=true``) and a real launch also require the data (every
local file readable, the training files at least ``data.train_batch_size`` prompts);
``gdro.dry_run=config`` checks the configuration alone.

Exit status: 0 on success; 2 for anything the start-up checks refuse, printed on one line that names
the key, file, row or value; 1 only for a defect of a check itself.

A launch composes its config once (:func:`cli`: ``compose_config``, no Hydra job runtime, so no
``outputs/`` folder) and checks it once; :func:`run_from_config` writes what ``prepare`` built into
``config._gdro_checked`` (:func:`recipe.gdro.startup.checks.hand_over`), which the trainer takes as is.
Hydra's own flags (``--cfg``, ``--multirun``, ``--help-all``) go through ``@hydra.main`` (:func:`main`),
which composes instead. The run itself (Ray, a lost node, an interrupt) is :mod:`recipe.gdro.launch`.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below: one line, no traceback (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("gdro")

import logging
import sys
from typing import Optional, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

from recipe.gdro.checkpoints import GDRO_STATE_FILE
from recipe.gdro.launch import train
from recipe.gdro.startup.checks import DATA_LISTED, DATA_REQUIRED, GDRORecipeError, prepare
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
from recipe.gdro.startup.plan import print_dry_run
from recipe.gdro.startup.ray_address import check_ray_address
from verl_ext import GDROConfigError, PromptIdError


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
    status = train(config, prepared, cluster_lines, stdout)
    # The output folder's lock (claim_output_folder) ends with the launch. A launch that raises (an interrupt
    # still stopping the run's workers) keeps it until its process ends.
    release_all()
    return status


# Hydra's job logging (its default job_logging: INFO on stdout), which a launch had when @hydra.main ran it;
# the launch now runs without Hydra's job runtime, so it writes no outputs/<date>/<time>/ folder.
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


@hydra.main(config_path="config", config_name=CONFIG_NAME, version_base=None)
def main(config: DictConfig) -> None:
    """Hydra's own flags (--cfg, --multirun, --help-all): Hydra composes, this is the launch's one check."""
    status = run_from_config(config)
    if status:
        sys.exit(status)


def cli(argv: Optional[Sequence[str]] = None, *, log: bool = False) -> int:
    """Programmatic equivalent of ``python -m recipe.gdro.main_gdro ARGV`` (a dry run or a training run):
    the config composed once, checked once, run; returns the exit status. ``log``: Hydra's job logging."""
    argv = list(argv or ())
    try:
        config = compose_config(argv)  # the launch's one compose: an unknown key is refused here, exit 2
    except Exception as e:  # noqa: BLE001 - Hydra's own override errors (e.g. an unknown key)
        return report_compose_error(e, argv)
    if log:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stdout)
    return run_from_config(config)


def entry(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: ``--help`` is ours; Hydra's own flags go to Hydra; anything else is one compose
    and one check (:func:`cli`), before any Ray or GPU time, with no ``outputs/`` folder. Unknown keys and
    refused values exit 2, naming them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--help", "-h") for a in argv):
        try:
            print(format_help())
        except BrokenPipeError:  # `--help | head`
            pass
        return 0
    if any(a.startswith("-") for a in argv):  # --help-all (Hydra's --help), --cfg, --multirun, ...: Hydra's job
        sys.argv = [sys.argv[0], *["--help" if a == "--help-all" else a for a in argv]]
        main()
        return 0
    return cli(argv, log=not argv_dry_run(argv))  # a training launch logs as under Hydra's job runtime


if __name__ == "__main__":
    # Ctrl-C / SIGTERM: the run's finally blocks close the agent loop, TransferQueue and Ray, then one
    # line and exit 130 / 143, no process left (verl_ext.interrupt).
    from verl_ext.interrupt import run_main

    run_main("gdro", entry)
