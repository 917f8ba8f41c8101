"""The studies' one runner: a list of jobs run through a run cache and a process pool, and the one
learning-rate choice both studies tune with.

:func:`run_all` serves the simulator (``recipe.gdro.sim.simulate.run_experiment``, no cache) and the
tiny-LM study (``recipe.gdro.experiments.study``, cached under ``results/tiny_lm_study/runs``): the
cached jobs are read back, the rest run ``workers`` at a time in forked processes (one torch thread
each: the workers share the cores), results are stored as each finishes (an interrupted study keeps
what finished), and Ctrl-C stops the pool at once. :func:`choose_lr` is the tuning rule.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Optional

import numpy as np

from recipe.gdro.results.stats import RunCache


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
