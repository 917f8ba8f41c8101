"""The studies' one runner: a list of jobs run through a run cache and a process pool, and the one
learning-rate choice both studies tune with.

:func:`run_all` serves the simulator (``recipe.gdro.lab.sim.simulate.run_experiment``, no cache) and the
tiny-LM study (``recipe.gdro.lab.experiments.study``, cached under ``results/tiny_lm_study/runs``): the
cached jobs are read back, the rest run ``workers`` at a time in forked processes (one torch thread
each: the workers share the cores), results are stored as each finishes (an interrupted study keeps
what finished), and Ctrl-C stops the pool at once. :func:`choose_lr` is the tuning rule.
:func:`code_state` is a run's code provenance (the commit of the code it executes, and whether that
code had uncommitted changes), which a study records in each run and keys its cache on.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Optional

import numpy as np

from recipe.gdro.lab.results.stats import RunCache


class MissingRuns(RuntimeError):
    """A stage asked to run nothing (``workers=0``: a report) but runs are missing from the cache."""


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop at once: drop the queued jobs and end the running ones (Ctrl-C)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.kill()


def _in_worker(fn: Callable[[Any], Any], job: Any) -> Any:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the pool
    import torch

    torch.set_num_threads(1)
    return fn(job)


def run_all(
    jobs: Sequence[Any],
    fn: Callable[[Any], Any],
    *,
    workers: int,
    cache: Optional[RunCache] = None,
    key: Callable[[Any], Mapping[str, Any]] = lambda job: job,
    on_done: Optional[Callable[[Any, Any], None]] = None,
    describe: Callable[[Any], str] = repr,
) -> list[Any]:
    """``[fn(job) for job in jobs]``, in order: cached jobs (``cache.get(key(job))``) read back, the
    rest run ``workers`` at a time (in this process when 1); ``on_done(job, result)`` after each
    new run (after it is cached). ``workers=0`` runs nothing and raises :class:`MissingRuns` naming
    the first job missing."""
    results: dict[int, Any] = {}
    if cache is not None:
        for i, job in enumerate(jobs):
            got = cache.get(key(job))
            if got is not None:
                results[i] = got
    todo = [i for i in range(len(jobs)) if i not in results]
    if todo and workers == 0:
        raise MissingRuns(
            f"{len(todo)} of {len(jobs)} runs are not in the cache (first: {describe(jobs[todo[0]])}); "
            "run the stage that makes them"
        )

    def done(i: int, result: Any) -> None:
        results[i] = result
        if cache is not None:
            cache.put(key(jobs[i]), result)
        if on_done is not None:
            on_done(jobs[i], result)

    if workers <= 1 or len(todo) <= 1:
        for i in todo:
            done(i, fn(jobs[i]))
    else:
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=workers, mp_context=ctx))
            futures = {pool.submit(_in_worker, fn, jobs[i]): i for i in todo}
            try:
                for f in as_completed(futures):
                    done(futures[f], f.result())
            except KeyboardInterrupt:
                _stop_pool(pool)
                raise
    return [results[i] for i in range(len(jobs))]


def choose_lr(scores: Mapping[float, Sequence[float]], prefer: str = "smaller") -> float:
    """The tuning rule of both studies: the lr (or lr multiplier) of best mean score over the tuning
    seeds; ties go to the smaller one (``prefer="smaller"``) or to the one closest to 1 on a log
    scale (``prefer="nearest_one"``, for multipliers of a base lr)."""
    if not scores:
        raise ValueError("no lr to choose from")
    means = {float(lr): float(np.mean(v)) for lr, v in scores.items()}
    if prefer == "smaller":
        return max(sorted(means), key=lambda lr: means[lr])
    if prefer == "nearest_one":
        return max(means, key=lambda g: (means[g], -abs(np.log(g))))
    raise ValueError(f"prefer={prefer!r}: use 'smaller' or 'nearest_one'")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def code_state(repo: str | Path, paths: Sequence[str]) -> dict[str, Any]:
    """The provenance of code under ``paths`` (relative to the git checkout ``repo``):

    * ``commit``: the last commit that changed any of ``paths`` (``git log -1 -- paths``), so that
      committing results or docs does not change it; None outside a git checkout;
    * ``clean``: no tracked change and no untracked file under ``paths`` (``git status --porcelain``);
    * ``diff_sha256`` (only when not clean): the SHA-256 of ``git diff HEAD`` and the untracked file
      names and contents under ``paths``, so two different uncommitted states never share a key.
    """
    repo = Path(repo)
    try:
        commit = _git(repo, "log", "-1", "--format=%H", "--", *paths).strip() or None
        status = _git(repo, "status", "--porcelain", "--untracked-files=all", "--", *paths)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "clean": False, "diff_sha256": None}
    if not status.strip():
        return {"commit": commit, "clean": True}
    h = hashlib.sha256(_git(repo, "diff", "HEAD", "--", *paths).encode("utf-8"))
    for name in sorted(_git(repo, "ls-files", "--others", "--exclude-standard", "--", *paths).splitlines()):
        h.update(name.encode("utf-8") + b"\0")
        with contextlib.suppress(OSError):
            h.update((repo / name).read_bytes())
    return {"commit": commit, "clean": False, "diff_sha256": h.hexdigest()}
