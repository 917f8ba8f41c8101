"""The tiny-LM study: GDRO against a tuned GRPO on a real learner, under a pre-registered protocol.

Usage (from the repository root)::

    python -m recipe.gdro.lab.experiments.study tune      # the lr grid per method, tuning seeds
    python -m recipe.gdro.lab.experiments.study primary   # the power plan, then the evaluation seeds, Holm
    python -m recipe.gdro.lab.experiments.study explore   # exploratory arms, on seeds that tuned nothing
    python -m recipe.gdro.lab.experiments.study confirm   # the best arm (if it gained) vs GRPO, fresh seeds
    python -m recipe.gdro.lab.experiments.study long      # regimes: a long horizon, a small pool
    python -m recipe.gdro.lab.experiments.study report    # every table again, from the committed runs only
    python -m recipe.gdro.lab.experiments.study reproduce --run FILE  # one committed run again: same numbers?

The plan is data: ``--protocol`` (default ``recipe/gdro/lab/experiments/protocols/tiny_lm_v2.yaml``; v1 is
``tiny_lm.yaml``, v3 ``tiny_lm_v3.yaml``), whose comments state the rules: the task mix (``shape.mix``),
seeds, the lr grid (extended at an edge with ``tuning.extend``), the reference's shapes
(``tuning.reference_shapes``: GRPO tuned over prompts x n at equal rollouts a step; every other method runs at
its choice), the power seeds, the arms, the primary family, the power rule, the confirmation rule.
``--results`` defaults to the protocol's ``results:`` folder. Every run is
:func:`recipe.gdro.lab.experiments.direct.run_direct` on a method of ``config/method/`` (the shipped
settings), scored by the exact teacher-forced probability of the answer (``recipe.gdro.lab.tinylm.exact``, the
primary metric) and by one sampled draw (secondary).

Each finished run is a small JSON in ``--results`` ``/runs/``:
method, stage, seed, lr, protocol_hash, started_at, base_exact, final_exact, final_sampled, tokens,
rollouts and the few curves the tables need. They are the run cache (a stage resumes by running
only what is missing, on any machine, from the committed files) and the only input of
``report``, which rewrites ``REPORT.md`` from them. Runs of another protocol hash are refused (one
line naming them; move them to their own folder); evaluation seeds are spent through
``spent_seeds.yaml`` (:mod:`recipe.gdro.lab.experiments.protocol`). Every stage checks that compared runs
had equal rollouts (:func:`recipe.gdro.lab.results.stats.check_equal_budgets`).

Since protocol tiny_lm_v1 (whose committed runs keep their format: :data:`PRE_PROVENANCE`), a run
file also holds ``per_prompt``, every evaluated prompt's exact p_i (validation at each evaluation,
the held-out test split, ``shape.num_test``, before and after), from which the protocol's declared
``endpoints`` (pass@k, a hard tail, the worst skill: :mod:`recipe.gdro.lab.results.outcomes`) are
computed by ``report`` with no rerun; and its provenance, which keys the cache: ``method_config``,
the method's fully resolved ``gdro`` section, and ``code``, the last commit of the code a run
executes (:data:`RUN_CODE`) and whether it had uncommitted changes (a run whose code differs is run
again and replaces the file; ``report`` reads runs of any code and names the commits and the runs
made from a modified tree). With ``primary.power.mde`` the primary stage plans its seeds per
endpoint on the SD's upper confidence bound (:func:`recipe.gdro.lab.results.stats.plan_for_mdes`) and
runs Holm over methods x endpoints; the report then also tabulates pass@k for k = 1..32 on the test
split and writes the figure ``pass_at_k.svg`` beside ``REPORT.md`` (the same bytes from the same runs).

Since issue 45 a run file also holds ``allocation``: per evaluation interval, the rollouts, all-fail and
all-pass groups given to each skill and bin, and the tokens (``direct.AllocationRecord``). The primary
and exploratory sections then tabulate, per method, the tail's (the hardest bin's) rollouts per prompt
and share of groups without gradient, and each skill's rollouts per prompt and all-fail share
(:func:`allocation_text`); runs without the record (v1, v2) print nothing new. The record is not in the
run key; new GDROConfig fields are kept out of older protocols' keys (:data:`METHOD_FIELDS_ADDED`).
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below: one line, no traceback (verl_ext.interrupt)
    from verl_ext.interrupt import install

    install("study")

import argparse
import dataclasses
import hashlib
import json
import math
import re
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from recipe.gdro.lab.experiments.protocol import TINY_LM_PROTOCOL, Ledger, Protocol, ProtocolError, load_protocol
from recipe.gdro.lab.results.outcomes import Endpoint, check_disjoint, endpoint_value
from recipe.gdro.lab.results.runner import MissingRuns, choose_lr, code_state, run_all
from recipe.gdro.lab.results.stats import (
    BudgetMismatch,
    PowerRule,
    budget_to_reach,
    canonical_json,
    censored_budgets,
    check_equal_budgets,
    minimum_detectable_effect,
    paired_ci,
    paired_family,
    plan_for_mdes,
    plan_seeds,
)
from recipe.gdro.lab.results.table import markdown_table
from verl_ext.atomic import atomic_replace, blocking_file

REPO = Path(__file__).resolve().parents[4]
DEFAULT_RESULTS = REPO / "results" / "tiny_lm_study"
STAGES = ("tune", "primary", "explore", "confirm", "long", "report", "reproduce")
# The code a run executes: recipe.gdro.lab.experiments.direct, every repository module a run imports
# (tests/gdro/lab/experiments/test_study_v2.py checks the list against a fresh process that makes a run)
# and the data it reads (the base model, the method YAMLs). Files, not whole packages: an edit to
# code no run executes (verl_ext/interrupt.py, the trainer) leaves the committed runs valid. Its last
# commit and cleanliness (recipe.gdro.lab.results.runner.code_state) are recorded in each run and key the
# cache; committing run files, docs or the report code does not change them.
RUN_CODE = (
    "REQUIRED_VERL.txt",
    *(f"data_prep/{m}.py" for m in ("__init__", "arith", "common", "reward_fn")),
    *(f"verl_ext/{m}.py" for m in ("__init__", "atomic", "binner", "config", "controller", "prompt_gdro")),
    *(f"verl_ext/{m}.py" for m in ("rollout_gdro", "tokens")),
    "recipe/gdro/__init__.py",
    "recipe/gdro/moved.py",
    "recipe/gdro/lab/__init__.py",
    *(f"recipe/gdro/backends/{m}.py" for m in ("__init__", "cpu_platform", "cpu_platform_plugin")),
    "recipe/gdro/config/__init__.py",
    "recipe/gdro/config/registry.py",
    "recipe/gdro/config/method",
    *(f"recipe/gdro/lab/tinylm/{m}.py" for m in ("__init__", "exact", "model", "policy", "tasks")),
    "recipe/gdro/lab/tinylm/base",
    "recipe/gdro/lab/experiments/__init__.py",
    "recipe/gdro/lab/experiments/direct.py",
    "recipe/gdro/lab/results/__init__.py",
    "recipe/gdro/lab/results/outcomes.py",
)
# Protocols whose runs predate provenance: their run keys hold neither the code nor the resolved
# method config, and leave out the DirectConfig fields added since (at their defaults), so their
# committed runs keep their keys and their report reproduces.
PRE_PROVENANCE = {"de92e537eada808fb0827977c801216493b1c65952d97cc31f31cfd369635283": "tiny_lm_v1"}
ADDED_SINCE_V1 = ("num_test", "mix")
# protocols/tiny_lm_v2.yaml as committed (its runs keep their keys)
TINY_LM_V2_HASH = "19de5196a5dcd9557c186a2c8cffbb616fd0052a382dbb62c2148b53d19d70be"
# DirectConfig fields added after a provenance protocol's runs were made: its run keys leave them out
# while they are at their defaults (the committed runs keep their keys); another value is refused.
DIRECT_FIELDS_ADDED = {TINY_LM_V2_HASH: ("mix",)}
# Controller settings (verl_ext's GDROConfig, ``section.field``) added after a protocol's runs were made:
# its run keys (``method_config``) leave them out while they are at their defaults, so the committed runs
# keep their keys and their report reproduces; a run of that protocol with another value is refused.
METHOD_FIELDS_ADDED = {
    # tiny_lm_v2: failure_weighted's and fixed_tail_share's settings (issue 45)
    TINY_LM_V2_HASH: (
        "rollout.failure_weight_k",
        "rollout.tail_threshold",
        "rollout.tail_share_factor",
    ),
}


# ------------------------------------------------------------------------------------ the runs
def run_config(
    protocol: Protocol,
    method: str,
    lr: float,
    seed: int,
    *,
    shape: dict[str, Any] | None = None,
    gdro: dict[str, Any] | None = None,
    warm_start: int = 0,
    device: str = "cpu",
    code: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The full, JSON-able configuration of one run (its key in the run store): the DirectConfig, the
    method's fully resolved ``gdro`` section (``method_config``: verl_ext's GDROConfig with every field,
    from the method's YAML, the overrides and the defaults; editing a method's YAML changes the key)
    and ``code`` (:func:`recipe.gdro.lab.results.runner.code_state` of :data:`RUN_CODE`, with the versions
    of :data:`RUN_LIBRARIES`; None asks for a run made by any code, as a report does). Runs of
    :data:`PRE_PROVENANCE` protocols have neither."""
    from recipe.gdro.lab.experiments.direct import DirectConfig, method_gdro

    direct = asdict(
        DirectConfig(
            method=method,
            lr=float(lr),
            seed=int(seed),
            gdro=gdro or {},
            warm_start=int(warm_start),
            temperature=protocol.eval_temperature,
            device=device,
            **{**protocol.shape, **(shape or {})},
        )
    )
    direct["model_path"] = portable_path(direct["model_path"])
    config = {"direct": direct, "exact_temperature": protocol.eval_temperature}
    defaults = {f.name: f.default for f in dataclasses.fields(DirectConfig)}
    if protocol.hash in PRE_PROVENANCE:
        for name in ADDED_SINCE_V1:
            if direct[name] != defaults[name]:
                raise ValueError(f"{name}={direct[name]}: protocol {PRE_PROVENANCE[protocol.hash]} predates it")
            del direct[name]
        return config
    for name in DIRECT_FIELDS_ADDED.get(protocol.hash, ()):
        if direct[name] != defaults[name]:
            raise ValueError(f"shape.{name}={direct[name]}: this protocol's runs predate it")
        del direct[name]
    from verl_ext.config import gdro_config_from_dict

    # every field of the controller's config, defaults included: what the run's GDROController reads
    resolved = asdict(gdro_config_from_dict(method_gdro(method, direct["n"], direct["gdro"])))
    defaults = asdict(gdro_config_from_dict({}))
    for name in METHOD_FIELDS_ADDED.get(protocol.hash, ()):
        section, key = name.split(".")
        if resolved[section][key] != defaults[section][key]:
            raise ValueError(f"gdro.{name}={resolved[section][key]}: this protocol's runs predate it")
        del resolved[section][key]
    config["method_config"] = resolved
    config["code"] = code
    return config


# Installed libraries whose version can change a run's numbers (recorded with the code; verl is also pinned
# by REQUIRED_VERL.txt).
RUN_LIBRARIES = ("torch", "transformers", "verl", "numpy")


def libraries() -> dict[str, str | None]:
    """The installed versions of :data:`RUN_LIBRARIES` (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in RUN_LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """A run's configuration without its code provenance: what names its file."""
    return {k: v for k, v in config.items() if k != "code"}


# A run's configuration (its key) names the shipped base by the path it had when the committed runs were
# made, before the lab moved under recipe/gdro/lab/ (issue 43): the committed runs keep their keys.
MOVED_PATHS = {"recipe/gdro/lab/tinylm/base": "recipe/gdro/tinylm/base"}


def portable_path(path: str | Path) -> str:
    """A path inside the repository as a repo-relative POSIX string: a run's configuration (its key in
    the run store) must not name the checkout, or a fresh clone elsewhere finds none of the committed runs."""
    resolved = Path(path).resolve()
    try:
        relative = resolved.relative_to(REPO).as_posix()
    except ValueError:
        return str(resolved)
    return MOVED_PATHS.get(relative, relative)


def local_path(path: str) -> str:
    """The inverse of :func:`portable_path` on this checkout."""
    path = {old: new for new, old in MOVED_PATHS.items()}.get(path, path)
    return str(path if Path(path).is_absolute() else REPO / path)


def _run(job: dict[str, Any]) -> dict[str, Any]:
    """One run: train, score the base and the trained model exactly (run_direct does); its summary."""
    from recipe.gdro.lab.experiments.direct import run_direct

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    config = job["config"]["direct"]
    if job["config"]["exact_temperature"] != config["temperature"]:
        raise ValueError("the exact metric is read at the run's temperature (run_direct)")
    result = run_direct({**config, "model_path": local_path(config["model_path"])}, log=lambda *_: None)
    final, base = result["after_exact"], result["before_exact"]
    history = result["history"]
    unseen = [h["train/unseen_share"] for h in history]
    return {
        "method": config["method"],
        "arm": job["arm"],
        "stage": job["stage"],
        "seed": config["seed"],
        "lr": config["lr"],
        "protocol_hash": job["protocol_hash"],
        "started_at": started,
        "base_exact": base["all"]["exact"],
        "final_exact": final["all"]["exact"],
        "base_sampled": result["before"]["all"]["pass1"],
        "final_sampled": result["after"]["all"]["pass1"],
        "tokens": int(result["curve"][-1]["tokens"]),
        "rollouts": int(result["curve"][-1]["rollouts"]),
        "base_exact_by_skill": {k: v["exact"] for k, v in base.items() if k != "all"},
        "final_exact_by_skill": {k: v["exact"] for k, v in final.items() if k != "all"},
        "final_sampled_by_skill": {k: v["pass1"] for k, v in result["after"].items() if k != "all"},
        # [step, tokens, rollouts, sampled mean, exact mean] at each evaluation
        "curve": [[p["step"], p["tokens"], p["rollouts"], p["mean"], p["exact"]] for p in result["curve"]],
        "warm_start": config["warm_start"],
        "steps_trained": len(history),
        # the cold start: training steps in which every prompt of the batch was unseen (GRPO's
        # behaviour under every method), and the mean unseen share of a batch
        "all_unseen_steps": int(sum(u == 1.0 for u in unseen)),
        "unseen_share": float(np.mean(unseen)) if unseen else float("nan"),
        "weighted_adv_token_mass": float(sum(h["train/weighted_adv_token_mass"] for h in history)),
        "seconds": result["train_seconds"],
        # per evaluation interval: prompts, rollouts, all-fail and all-pass groups per skill and bin, and
        # tokens (recipe.gdro.lab.experiments.direct.AllocationRecord); report's allocation tables
        "allocation": result["allocation"],
        # every evaluated prompt's exact p_i (recipe.gdro.lab.results.outcomes): the endpoints' only input
        "per_prompt": result["per_prompt"],
        **({"code": job["config"]["code"]} if "code" in job["config"] else {}),
    }


def read_run_file(path: Path) -> dict[str, Any]:
    """A run file's ``{"summary": ..., "config": ...}``; ValueError naming the file when it is unreadable,
    not JSON, or lacks either mapping."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(stored["summary"], dict) and isinstance(stored["config"], dict)):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: not a run summary of the study (unreadable)") from None
    return stored


# What a rerun may change: when it ran, how long it took, and the code that made it.
NOT_REPRODUCED = frozenset({"started_at", "seconds", "code"})


def reproduce(path: Path) -> tuple[list[str], int]:
    """Run a committed run file's configuration again with this checkout's code, one torch thread (as
    the study's workers run): (the summary fields whose stored JSON differs, the fields compared). A code
    change that keeps every number -- a faster sampler -- leaves the first list empty. ValueError naming
    the file when it is not a run file (:func:`read_run_file`) or lacks ``config.direct`` or summary keys."""
    import torch

    stored = read_run_file(Path(path))
    summary = stored["summary"]
    needed = ("arm", "stage", "protocol_hash")
    if "direct" not in stored["config"]:
        raise ValueError(f"{path}: the run file's config has no direct section (not a trained run)")
    missing = [k for k in needed if k not in summary]
    if missing:
        raise ValueError(f"{path}: the run file's summary has no {', '.join(missing)}")
    torch.set_num_threads(1)
    job = {**{k: summary[k] for k in needed}, "config": stored["config"]}
    again = json.loads(run_file_text({"summary": _run(job)}))["summary"]
    compared = [k for k in sorted(summary) if k not in NOT_REPRODUCED]
    differ = [k for k in compared if json.dumps(summary[k], sort_keys=True) != json.dumps(again.get(k), sort_keys=True)]
    return differ, len(compared)


def config_key(config: dict[str, Any]) -> str:
    """The SHA-256 of a run's :func:`identity` (its file name; a lookup also compares the code)."""
    return hashlib.sha256(canonical_json(identity(config)).encode("utf-8")).hexdigest()


def run_file_text(stored: dict[str, Any]) -> str:
    """A run file's JSON: keys sorted, one key a line, a list of numbers or strings on one line (the
    per-prompt outcomes stay a few lines, not one line per prompt)."""

    def dump(value: Any, depth: int) -> str:
        pad = " " * depth
        if isinstance(value, dict) and value:
            items = [f"{pad} {json.dumps(k)}: {dump(value[k], depth + 1)}" for k in sorted(value)]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            return "[\n" + ",\n".join(f"{pad} {dump(v, depth + 1)}" for v in value) + f"\n{pad}]"
        return json.dumps(value, allow_nan=True)

    return dump(stored, 0) + "\n"


# Summary fields that are NaN by design: the share of unseen prompts when a run has no step to average.
NAN_ALLOWED = frozenset({"unseen_share"})


def non_finite_field(value: Any, where: str = "") -> tuple[str, float] | None:
    """The first (dotted field, value) of a run summary that is NaN or infinite, outside
    :data:`NAN_ALLOWED`; None when every number is finite. A NaN result would reach the statistics
    (scipy's root finder stops at "function value is NaN") without naming the file or the field."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in NAN_ALLOWED:
                continue
            found = non_finite_field(item, f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = non_finite_field(item, f"{where}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, float) and not math.isfinite(value):
        return where, value
    return None


def shipped_protocols() -> dict[str, str]:
    """The protocol files the repository ships (recipe/gdro/lab/experiments/protocols/*.yaml): hash -> repo path."""
    from recipe.gdro.lab.experiments.protocol import PROTOCOL_DIR

    return {
        hashlib.sha256(path.read_bytes()).hexdigest(): str(path.relative_to(REPO))
        for path in sorted(PROTOCOL_DIR.glob("*.yaml"))
    }


class RunStore:
    """The per-run summaries under ``folder`` (one small JSON each), looked up by configuration.

    Refuses a folder holding runs of another protocol hash (a report never mixes protocols).
    """

    def __init__(self, folder: str | Path, protocol_hash: str):
        self.folder = Path(folder)
        self.protocol_hash = protocol_hash
        self.index: dict[str, tuple[Path, dict[str, Any]]] = {}
        foreign: dict[str, list[str]] = {}
        for path in sorted(self.folder.glob("*.json")):
            try:
                stored = read_run_file(path)
            except ValueError as e:
                raise ProtocolError(f"{e}; remove it") from None
            summary, config = stored["summary"], stored["config"]
            if summary.get("protocol_hash") != protocol_hash:
                foreign.setdefault(str(summary.get("protocol_hash")), []).append(path.name)
                continue
            bad = non_finite_field(summary)
            if bad is not None:
                raise ProtocolError(
                    f"{path}: summary field {bad[0]!r} is {bad[1]}, not a finite number: the run's result is "
                    "unusable; remove the file and run its stage again"
                )
            per = summary.get("per_prompt") or {}
            if "val" in per and "test" in per:  # the endpoints' split never held a validation prompt
                try:
                    check_disjoint({"validation": per["val"]["id"], "test": per["test"]["id"]})
                except ValueError as e:
                    raise ProtocolError(f"{path}: {e}") from None
            self.index[config_key(config)] = (path, stored)
        if foreign:
            known = shipped_protocols()
            others = "; ".join(
                f"{len(names)} of protocol {h[:16]}{f' ({known[h]})' if h in known else ''} "
                f"({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"
                for h, names in foreign.items()
            )
            if not self.index and len(foreign) == 1 and next(iter(foreign)) in known:
                # a folder of another shipped protocol's runs only: the protocol flag is the fix, nothing moves
                path = known[next(iter(foreign))]
                raise ProtocolError(
                    f"{self.folder}: its runs are of protocol {path}, not of this one ({protocol_hash[:16]}): "
                    f"{others}; pass --protocol {path} to work on them"
                )
            raise ProtocolError(
                f"{self.folder}: runs of another protocol than this one ({protocol_hash[:16]}): {others}; a report "
                "never mixes protocols: move the old runs to their own folder"
                + (
                    " (or pass --protocol with the file named above to work on its runs)"
                    if set(foreign) & set(known)
                    else ""
                )
            )

    def get(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The stored summary of ``config``, or None: a run of another identity, or (when ``config``
        names its code) one made by other code, is a miss, to run again (the new run replaces it)."""
        hit = self.index.get(config_key(config))
        if hit is None or canonical_json(identity(hit[1]["config"])) != canonical_json(identity(config)):
            return None
        if config.get("code") is not None and hit[1]["config"].get("code") != config["code"]:
            return None
        return hit[1]["summary"]

    def provenance(self) -> list[str]:
        """Report lines: the code commits the runs were made with, and the runs made from a tree
        whose run code had uncommitted changes, by file name (runs without provenance are left out)."""
        commits: dict[str, int] = {}
        dirty = []
        for path, stored in sorted(self.index.values()):
            code = stored["config"].get("code")
            if not isinstance(code, dict):
                continue
            commits[str(code.get("commit"))[:12]] = commits.get(str(code.get("commit"))[:12], 0) + 1
            if not code.get("clean"):
                dirty.append(path.name)
        if not commits:
            return []
        lines = ["Run code: " + ", ".join(f"commit {c} ({n} run{'s' * (n != 1)})" for c, n in commits.items()) + "."]
        if dirty:
            lines.append(
                f"Made from a tree with uncommitted changes to the run code ({len(dirty)}): " + ", ".join(dirty) + "."
            )
        return lines

    def put(self, config: dict[str, Any], summary: dict[str, Any]) -> Path:
        key = config_key(config)
        slug = re.sub(r"[^A-Za-z0-9]+", "_", summary["arm"]).strip("_")
        path = self.folder / f"{summary['stage']}-{slug}-seed{summary['seed']}-{key[:8]}.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        stored = {"summary": summary, "config": config}
        with atomic_replace(path, "w") as f:
            f.write(run_file_text(stored))
        self.index[key] = (path, stored)
        return path


class Study:
    """One protocol, its run store and ledger, and how many runs go at a time (0: run nothing)."""

    def __init__(self, protocol: Protocol, results: Path, jobs: int, device: str = "cpu", log=print):
        self.p = protocol
        self.results = Path(results)
        self.store = RunStore(self.results / "runs", protocol.hash)
        self.ledger = Ledger(self.results / "spent_seeds.yaml")
        self.jobs = jobs
        self.device = device
        self.log = log
        # the reference's tuned (prompts, n) when the protocol tunes it (tuning.reference_shapes): set by
        # tune(), and every later run of any method takes it (equal prompts per step and n̄)
        self.tuned_shape: dict[str, int] = {}
        # the run code's provenance when runs may be made; a report (jobs 0) reads runs of any code
        self.legacy = protocol.hash in PRE_PROVENANCE
        self.code = None if jobs == 0 or self.legacy else {**code_state(REPO, RUN_CODE), "libraries": libraries()}
        if jobs:  # a test split the data cannot hold is refused before any run, not in every worker
            from recipe.gdro.lab.experiments.direct import DataPrepError, DirectConfig, held_out_split

            shape = DirectConfig(**protocol.shape)
            try:
                held_out_split(shape.num_test, shape.data_seed, shape.num_val, shape.mix)
            except DataPrepError as e:
                raise ProtocolError(f"{protocol.path}: shape.num_test: {e}") from None
        if self.code is not None and not self.code["clean"]:
            log(
                "note: the run code has uncommitted changes: runs made now say so in their files, and report names them"
            )

    def config(self, method: str, lr: float, seed: int, shape: dict[str, Any] | None = None, **kw: Any):
        shape = {**self.tuned_shape, **(shape or {})} or None
        return run_config(self.p, method, lr, seed, device=self.device, code=self.code, shape=shape, **kw)

    def runs(self, stage: str, jobs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """Summaries of ``jobs`` ((arm label, config) pairs), running the missing ones."""
        full = [{"arm": arm, "stage": stage, "protocol_hash": self.p.hash, "config": c} for arm, c in jobs]
        cached = sum(self.store.get(j["config"]) is not None for j in full)
        if self.jobs:
            self.log(f"{stage}: {len(full)} runs, {cached} done, {len(full) - cached} to run ({self.jobs} at a time)")
        done = [0]

        def tick(job: dict[str, Any], r: dict[str, Any]) -> None:
            done[0] += 1
            self.log(
                f"[{done[0]}/{len(full) - cached}] {job['arm']} lr={r['lr']:g} seed={r['seed']}: "
                f"exact {r['final_exact']:.4f}, sampled {r['final_sampled']:.3f} ({r['seconds']:.0f} s)"
            )

        return run_all(
            full,
            _run,
            workers=self.jobs,
            cache=self.store,
            key=lambda j: j["config"],
            on_done=tick,
            describe=lambda j: (
                f"{j['stage']} {j['arm']} lr={j['config']['direct']['lr']:g} seed={j['config']['direct']['seed']}"
            ),
        )


# ------------------------------------------------------------------------------ the decoding baseline
# Decoding temperatures of the baseline (0: greedy), the grid of ``python -m recipe.gdro.lab.tinylm.exact``
# plus greedy; the base at its best one is what an RL gain must beat (issue 26 item 1).
BASELINE_TEMPERATURES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5)


def decoding_baseline(study: Study) -> dict[str, Any]:
    """The untrained base's exact metric on the validation prompts at each decoding temperature, and its
    best: one stored summary (stage ``baseline``), computed once and read back like a run."""
    from recipe.gdro.lab.experiments.direct import DirectConfig

    shape = DirectConfig(**study.p.shape)  # the runs' model and validation split, defaults included
    config = {
        "baseline": {
            "model_path": portable_path(shape.model_path),
            "num_val": int(shape.num_val),
            "data_seed": int(shape.data_seed),
            "temperatures": list(BASELINE_TEMPERATURES),
            **({"mix": shape.mix} if shape.mix is not None else {}),  # a protocol's task mix (v1, v2: none)
        }
    }
    if not study.legacy:
        config["code"] = study.code
    got = study.store.get(config)
    if got is not None:
        return got
    if not study.jobs:
        raise MissingRuns("the decoding baseline is not in the cache; run the tune stage, which makes it")
    from data_prep import arith
    from recipe.gdro.lab.tinylm import exact
    from recipe.gdro.lab.tinylm.model import load_model, load_tokenizer

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    b = config["baseline"]
    path = local_path(b["model_path"])
    model, tok = load_model(path), load_tokenizer(path)
    val = arith.build_split(b["num_val"], b["data_seed"], val=True, mix=b.get("mix"))
    sweep = exact.temperature_sweep(model, tok, val, temperatures=b["temperatures"])
    best = sweep["best_temperature"]
    summary = {
        "arm": "base decoding",
        "stage": "baseline",
        "seed": b["data_seed"],
        "protocol_hash": study.p.hash,
        "started_at": started,
        "exact_by_temperature": {f"{t:g}": v["all"]["exact"] for t, v in sweep["tables"].items()},
        "best_temperature": best,
        "best_exact": sweep["best_exact"],
        "best_exact_by_skill": {k: v["exact"] for k, v in sweep["tables"][best].items() if k != "all"},
        **({"code": config["code"]} if "code" in config else {}),
    }
    study.store.put(config, summary)
    study.log(f"baseline: base exact {summary['best_exact']:.4f} at its best decoding temperature {best:g}")
    return summary


def baseline_line(study: Study, grpo_runs: list[dict[str, Any]] | None = None) -> str:
    """One line beside a table: the base at the run temperature and at its best, and GRPO's gains over both."""
    b = decoding_baseline(study)
    t = study.p.eval_temperature
    at_t = b["exact_by_temperature"].get(f"{t:g}", float("nan"))
    best = "greedy" if b["best_temperature"] == 0 else f"T = {b['best_temperature']:g}"
    line = f"Decoding baseline (no training): base exact {at_t:.4f} at T = {t:g}, {b['best_exact']:.4f} at its best"
    line += f" ({best})"
    if grpo_runs:
        final = float(np.mean([r["final_exact"] for r in grpo_runs]))
        line += f"; GRPO here {final:.4f}: {final - at_t:+.4f} over the base"
        line += f", {final - b['best_exact']:+.4f} over its best"
    return line + "."


# --------------------------------------------------------------------------------- per-seed metrics
def solvable_skills(run: dict[str, Any], threshold: float) -> list[str]:
    """Skills the base answers exactly with probability >= threshold (fixed by the base, not by a method)."""
    return [k for k, v in run["base_exact_by_skill"].items() if v >= threshold]


def metric(run: dict[str, Any], name: str, threshold: float, endpoints: dict[str, Endpoint] | None = None) -> float:
    """``final_exact`` / ``final_sampled`` (means over validation prompts) and their ``_worst`` (the
    minimum over solvable skills), or a declared endpoint (``endpoints``; computed from the run's
    per-prompt outcomes, recipe.gdro.lab.results.outcomes.endpoint_value)."""
    if endpoints and name in endpoints:
        return endpoint_value(run, endpoints[name])
    if name in ("final_exact", "final_sampled"):
        return float(run[name])
    skills = solvable_skills(run, threshold)
    by = run["final_exact_by_skill"] if name == "final_exact_worst" else run["final_sampled_by_skill"]
    return float(min(by[k] for k in skills)) if skills else float("nan")


def tokens_to(run: dict[str, Any], target: float) -> float:
    """Tokens at which the run's exact-metric curve first reaches ``target`` (inf: never, censored)."""
    return budget_to_reach([p[1] for p in run["curve"]], [p[4] for p in run["curve"]], target)


def equal_budgets(stage: str, by_seed: dict[int, dict[str, dict[str, Any]]]) -> None:
    """Every stage: runs compared on one seed generated the same number of rollouts."""
    for seed, runs in by_seed.items():
        try:
            check_equal_budgets({name: r["rollouts"] for name, r in runs.items()}, "rollouts")
        except BudgetMismatch as e:
            raise BudgetMismatch(f"{stage}, seed {seed}: {e}") from None


def _fmt(x: float, spec: str = "+.4f") -> str:
    return "n/a" if not math.isfinite(x) else format(x, spec)


def _p(x: float) -> str:
    return "n/a (no variance)" if not math.isfinite(x) else f"{x:.3f}"


def family_table(
    diffs: dict[str, list[float]], alpha: float, better: str = "GDRO better"
) -> tuple[list[str], dict[str, Any]]:
    """A Holm family (results/stats.py paired_family): one row per comparison (mean diff, CI, seeds, p,
    Holm p, verdict)."""
    family = paired_family(diffs, alpha=alpha)
    rows = []
    for name, r in family.items():
        verdict = (better if r.mean > 0 else "GRPO better") if r.rejected else "not resolved"
        ci = f"[{r.lo:+.4f}, {r.hi:+.4f}]" if math.isfinite(r.lo) else "n/a"
        rows.append([name, _fmt(r.mean), ci, str(r.n), _p(r.p), _p(r.p_holm), verdict])
    head = ["comparison", "mean diff vs GRPO", "95% CI", "seeds", "p", "p (Holm)", "verdict"]
    return markdown_table(head, rows), family


PRIMARY_COLUMNS = ("comparison", "mean diff vs GRPO", "95% CI", "seeds", "p", "p (Holm)", "verdict")


# ------------------------------------------------------------------------------------------- stages
def shape_label(shape: dict[str, Any]) -> str:
    return f"{shape['prompts']} x {shape['n']}" if shape else ""


def tune_series(study: Study, series: list[tuple[str, dict[str, Any]]]) -> list[dict[float, list[float]]]:
    """Each (method, shape) series' ``final_exact`` per lr over the tuning seeds: the protocol's grid,
    then, while a series' best lr (ties: the smaller) lies on its grid's edge, one more lr beyond that
    edge at the grid's ratio (``tuning.extend`` times at most per side), so every choice is bracketed
    or the extension's limit is reported."""
    t = study.p.tuning
    grid = [float(lr) for lr in t["lr_grid"]]
    ratio = grid[1] / grid[0] if len(grid) > 1 else 1.0
    limit = int(t.get("extend", 0))
    seeds = t["seeds"]
    lrs = [list(grid) for _ in series]
    extended = [{"low": 0, "high": 0} for _ in series]
    scores: list[dict[float, list[float]]] = [{} for _ in series]
    todo = [(i, lr) for i in range(len(series)) for lr in grid]
    while todo:
        jobs = [(series[i][0], study.config(series[i][0], lr, s, shape=series[i][1])) for i, lr in todo for s in seeds]
        runs = iter(study.runs("tune", jobs))
        for i, lr in todo:
            scores[i][lr] = [next(runs)["final_exact"] for _ in seeds]
        todo = []
        for i in range(len(series)):
            best = choose_lr(scores[i], prefer="smaller")
            for side, edge, step in (("low", min(lrs[i]), 1 / ratio), ("high", max(lrs[i]), ratio)):
                if best == edge and extended[i][side] < limit:
                    extended[i][side] += 1
                    lrs[i].append(edge * step)
                    todo.append((i, edge * step))
    return scores


def tune(study: Study) -> tuple[dict[str, float], str]:
    """Each method's lr (best mean final_exact over the tuning seeds; ties: the smaller lr; grids
    extended at an edge, :func:`tune_series`) and its table. With ``tuning.reference_shapes`` the
    reference is tuned over (prompts, n) too, at equal rollouts per step, and every other method runs
    at the reference's tuned shape (``study.tuned_shape``). With ``tuning.power_seeds`` each method
    also runs at its tuned settings on those seeds (the power plan's extra seeds)."""
    t = study.p.tuning
    ref = study.p.primary.get("reference", "grpo")
    shapes = t.get("reference_shapes") or [{}]
    study.tuned_shape = {}
    ref_scores = tune_series(study, [(ref, shape) for shape in shapes])
    best = [choose_lr(sc, prefer="smaller") for sc in ref_scores]
    means = [float(np.mean(sc[lr])) for sc, lr in zip(ref_scores, best, strict=True)]
    pick = max(range(len(shapes)), key=lambda i: (means[i], -i))  # ties: the first declared shape
    study.tuned_shape = dict(shapes[pick])
    others = [m for m in t["methods"] if m != ref]
    other_scores = tune_series(study, [(m, {}) for m in others])
    tuned = {ref: best[pick]}
    tuned.update({m: choose_lr(sc, prefer="smaller") for m, sc in zip(others, other_scores, strict=True)})
    series = [(ref, shape, sc) for shape, sc in zip(shapes, ref_scores, strict=True)]
    series += [(m, study.tuned_shape, sc) for m, sc in zip(others, other_scores, strict=True)]
    all_lrs = sorted({lr for _, _, sc in series for lr in sc})
    rows = []
    for m, shape, sc in series:
        label = f"{m} ({shape_label(shape)})" if shape else m
        chosen = choose_lr(sc, prefer="smaller")
        mark = "" if m != ref or shape == study.tuned_shape or not study.tuned_shape else " (not chosen)"
        rows.append([label, *(f"{np.mean(sc[lr]):.4f}" if lr in sc else "–" for lr in all_lrs), f"{chosen:g}{mark}"])
    chosen_lrs = {ref: list(ref_scores[pick]), **{m: list(sc) for m, sc in zip(others, other_scores, strict=True)}}
    edge = [f"{m} at {tuned[m]:g}" for m in t["methods"] if tuned[m] in (min(chosen_lrs[m]), max(chosen_lrs[m]))]
    runs = _tuned_runs(study, tuned)
    base = float(np.mean([r["base_exact"] for r in runs.values()]))
    grpo = [runs[(ref, s)] for s in t["seeds"]]
    shape_line = (
        f"The reference's shape (prompts x n, {shapes[0]['prompts'] * shapes[0]['n']} rollouts a step) is tuned with "
        f"its lr: {shape_label(study.tuned_shape)} chosen; every other method runs at it."
        if study.tuned_shape
        else ""
    )
    rule = (
        f" on the validation prompts; a grid is extended by its ratio while the best lr is on its edge, at most "
        f"{t['extend']} extension{'s' * (t['extend'] != 1)} a side"
        if t.get("extend")
        else ""
    )
    lines = [
        f"Tuning (seeds {t['seeds']}; mean final exact probability{rule}; base {base:.4f}):",
        "",
        *markdown_table(["method", *(f"lr {lr:g}" for lr in all_lrs), "chosen"], rows),
        "",
        *([shape_line, ""] if shape_line else []),
        *(
            [f"On the edge of the extended grid (not bracketed): {', '.join(edge)}.", ""]
            if edge and t.get("extend")
            else []
        ),
        baseline_line(study, grpo),
    ]
    if t.get("power_seeds"):
        lines += ["", tuned_settings_text(study, tuned, runs)]
    return tuned, "\n".join(lines)


def tuning_seeds(study: Study) -> list[int]:
    """Every tuning seed: the grid's seeds, then ``tuning.power_seeds`` (run at the tuned settings only)."""
    t = study.p.tuning
    return [*t["seeds"], *t.get("power_seeds", [])]


def _tuned_runs(study: Study, tuned: dict[str, float]) -> dict[tuple[str, int], dict[str, Any]]:
    t = study.p.tuning
    jobs = [(m, study.config(m, tuned[m], s)) for m in t["methods"] for s in tuning_seeds(study)]
    return {(m, c["direct"]["seed"]): r for (m, c), r in zip(jobs, study.runs("tune", jobs), strict=True)}


def mass_ratio(study: Study, tuned: dict[str, float], method: str) -> float:
    """The reference's mean weighted-advantage token mass over ``method``'s, both at their tuned settings
    on every tuning seed: the lr multiplier of an arm at the reference's step size (protocol MASS_SCALE)."""
    runs = _tuned_runs(study, tuned)
    ref = study.p.primary.get("reference", "grpo")

    def mass(m: str) -> float:
        return float(np.mean([runs[(m, s)]["weighted_adv_token_mass"] for s in tuning_seeds(study)]))

    return mass(ref) / mass(method)


def arm_lr(study: Study, tuned: dict[str, float], arm) -> float:
    """An arm's lr: its method's tuned lr times ``lr_scale`` (a number, or the mass ratio)."""
    from recipe.gdro.lab.experiments.protocol import MASS_SCALE

    scale = mass_ratio(study, tuned, arm.method) if arm.lr_scale == MASS_SCALE else float(arm.lr_scale)
    return tuned[arm.method] * scale


def tuned_settings_text(study: Study, tuned: dict[str, float], runs) -> str:
    """Each method at its tuned settings over every tuning seed: the endpoints on the validation prompts
    and the weighted-advantage token mass (the step size the mass-normalised arms equalise)."""
    seeds = tuning_seeds(study)
    tail = next((e.tail for e in study.p.endpoints.values() if e.tail is not None), None)
    n = int(study.tuned_shape.get("n", study.p.shape["n"]))
    rows = []
    for m in study.p.tuning["methods"]:
        rs = [runs[(m, s)] for s in seeds]
        rows.append(
            [
                f"{m} (lr {tuned[m]:g})",
                f"{np.mean([r['final_exact'] for r in rs]):.4f}",
                *endpoint_cells(study, rs),
                *([all_fail_cell(rs, tail, n)] if tail is not None else []),
                f"{np.mean([r['weighted_adv_token_mass'] for r in rs]):,.0f}",
            ]
        )
    head = [
        "method",
        "final exact",
        *(f"{name} (val)" for name in study.p.endpoints),
        *([f"tail groups of {n} all failing (val, base -> final)"] if tail is not None else []),
        "weighted-advantage token mass",
    ]
    return "\n".join(
        [f"At the tuned settings, over every tuning seed ({seeds}; means):", "", *markdown_table(head, rows)]
    )


def all_fail_cell(runs: list[dict[str, Any]], tail, n: int) -> str:
    """The expected share of a tail's groups of ``n`` rollouts that all fail (no GRPO gradient),
    mean_i (1 - p_i)^n over the tail's validation prompts, at the base and at the end (mean over runs)."""
    from recipe.gdro.lab.results.outcomes import outcomes

    def share(run, at):
        base = outcomes(run, "val", "base")
        return float(np.mean((1 - outcomes(run, "val", at).p[tail.members(base)]) ** n))

    return f"{np.mean([share(r, 'base') for r in runs]):.3f} -> {np.mean([share(r, 'final') for r in runs]):.3f}"


def allocation_text(label_runs: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """Report lines: what each method's training allocation gave the tail, from the runs' ``allocation``
    records (issue 45; summed over every evaluation interval and run). The tail is the hardest bin when
    the count was scheduled (``bin_00``: windowed p̂ below the first bin edge); a group carries no
    gradient when its outcomes are all equal. None of this is printed unless every run holds the record
    (run files made before it keep their reports byte for byte)."""
    if not label_runs or not all("allocation" in r for _, rs in label_runs for r in rs):
        return []

    def total(runs: list[dict[str, Any]], key: str) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for r in runs:
            for interval in r["allocation"]:
                for name, row in interval[key].items():
                    out[name] = out.get(name, np.zeros(4)) + np.asarray(row, dtype=np.float64)
        return out

    def per_prompt(row: np.ndarray | None) -> str:
        return "–" if row is None or not row[0] else f"{row[1] / row[0]:.2f}"

    def share(row: np.ndarray | None, cols: slice) -> str:
        return "–" if row is None or not row[0] else f"{row[cols].sum() / row[0]:.3f}"

    rows, skill_rows = [], []
    skills = sorted({k for _, rs in label_runs for k in total(rs, "by_skill")})
    for label, rs in label_runs:
        bins, by_skill = total(rs, "by_bin"), total(rs, "by_skill")
        tail = bins.get("bin_00")
        rest = sum((v for k, v in bins.items() if k not in ("bin_00", "unseen")), np.zeros(4))
        steps = sum(i["steps"] for r in rs for i in r["allocation"])
        tokens = sum(i["tokens"] for r in rs for i in r["allocation"])
        rows.append(
            [
                label,
                per_prompt(tail),
                share(tail, slice(2, 4)),
                share(tail, slice(2, 3)),
                f"{100 * (tail[0] if tail is not None else 0) / max(1.0, sum(v[0] for v in bins.values())):.0f}%",
                per_prompt(rest),
                per_prompt(bins.get("unseen")),
                f"{tokens / max(1, steps):,.0f}",
            ]
        )
        skill_rows.append(
            [label, *(f"{per_prompt(by_skill.get(k))} / {share(by_skill.get(k), slice(2, 3))}" for k in skills)]
        )
    head = [
        "method", "tail rollouts / prompt", "tail groups with no gradient", "tail groups all failing",
        "tail share of prompts", "other seen prompts' rollouts / prompt", "unseen prompts' rollouts / prompt",
        "tokens / step",
    ]  # fmt: skip
    return [
        "",
        "The training allocation (every step of the runs above; the tail is the hardest bin, bin_00, when the "
        "count was scheduled; a group with all outcomes equal has no gradient):",
        "",
        *markdown_table(head, rows),
        "",
        "By skill (rollouts per prompt / share of groups all failing):",
        "",
        *markdown_table(["method", *skills], skill_rows),
    ]


def endpoints_on(study: Study, split: str | None) -> dict[str, Endpoint]:
    """The declared endpoints, read on ``split`` (None: as declared). The test split serves only the
    primary and confirmation comparisons; the power plan, the exploratory arms and the regimes read
    the same endpoints on the validation prompts."""
    ep = study.p.endpoints
    return ep if split is None else {n: dataclasses.replace(e, split=split) for n, e in ep.items()}


def family_diffs(
    study: Study, runs: dict[tuple[str, int], dict[str, Any]], seeds, split: str | None = None
) -> dict[str, list[float]]:
    """The primary family's per-seed paired differences (method minus reference), one list per
    comparison (endpoints on ``split``, :func:`endpoints_on`)."""
    pr, th, ep = study.p.primary, study.p.solvable, endpoints_on(study, split)
    return {
        f"{m} {name}": [
            metric(runs[(m, s)], name, th, ep) - metric(runs[(pr["reference"], s)], name, th, ep) for s in seeds
        ]
        for m in pr["methods"]
        for name in pr["metrics"]
    }


def pooled_sd(diffs: dict[str, list[float]]) -> float:
    """The per-seed SD of the paired differences, pooled over the family's comparisons (NaN below 2 seeds)."""
    variances = [float(np.var(d, ddof=1)) if len(d) > 1 else math.nan for d in diffs.values()]
    return float(np.sqrt(np.mean(variances)))


def endpoint_plan(study: Study, tuned: dict[str, float]):
    """The declared design when ``primary.power.mde`` names a target MDE per endpoint: from the tuning
    seeds only, Holm over methods x endpoints, each endpoint's SD at its upper confidence bound
    (results/stats.py plan_for_mdes; ``primary.power`` may set any field of PowerRule)."""
    pr = study.p.primary
    power = dict(pr.get("power", {}))
    mdes = power.pop("mde")
    rule = PowerRule(**{"alpha": float(pr.get("alpha", PowerRule.alpha)), **power})
    rule = PowerRule(**{**rule.__dict__, "max_seeds": min(rule.max_seeds, len(pr["seed_pool"]))})
    seeds = tuning_seeds(study)
    diffs = family_diffs(study, _tuned_runs(study, tuned), seeds, split="val")  # the test split is not read
    by_endpoint = {e: [diffs[f"{m} {e}"] for m in pr["methods"]] for e in pr["metrics"]}
    try:
        return plan_for_mdes(by_endpoint, {e: float(v) for e, v in mdes.items()}, len(pr["methods"]), rule)
    except ValueError as e:
        raise ProtocolError(f"{study.p.path}: tuning.seeds: {e}") from None


def _endpoint_plan_text(plan) -> str:
    r = plan.rule
    lines = [
        f"Power (declared before the primary run, from the tuning seeds): {plan.n_seeds} evaluation seeds; Holm over "
        f"{plan.family_size} comparisons (methods x endpoints) at alpha {r.alpha:g}, {100 * r.target_power:.0f}% "
        f"power, each endpoint's per-seed SD (tuning seeds, validation prompts) at the upper "
        f"{100 * r.sd_confidence:.0f}% confidence bound:",
        "",
    ]
    rows = [
        [
            e.endpoint,
            f"{e.sd.point:.4f}",
            f"{e.sd.upper:.4f}",
            f"{e.target_mde:.4f}",
            f"{e.seeds_needed}{' (capped)' if e.capped else ''}",
            f"{e.mde:.4f}",
        ]
        for e in plan.endpoints
    ]
    head = ["endpoint", "SD (tuning seeds)", "SD bound", "target MDE", "seeds it needs", f"MDE at {plan.n_seeds} seeds"]
    return "\n".join([*lines, *markdown_table(head, rows)])


def power_plan(study: Study, tuned: dict[str, float]):
    """The declared design, from the tuning seeds only (results/stats.py plan_seeds)."""
    pr = study.p.primary
    runs = _tuned_runs(study, tuned)
    seeds = study.p.tuning["seeds"]
    ref = pr["reference"]
    sd = pooled_sd(family_diffs(study, runs, seeds))
    if not math.isfinite(sd):
        raise ProtocolError(f"{study.p.path}: tuning.seeds: the power plan needs at least two tuning seeds")
    gain = float(np.mean([runs[(ref, s)]["final_exact"] - runs[(ref, s)]["base_exact"] for s in seeds]))
    power = pr.get("power", {})
    plan = plan_seeds(
        sd,
        gain,
        len(pr["methods"]) * len(pr["metrics"]),
        alpha=float(pr.get("alpha", 0.05)),
        target_power=float(power.get("target", 0.8)),
        floor=float(power.get("floor", 0.01)),
        fraction=float(power.get("fraction", 0.25)),
        max_seeds=len(pr["seed_pool"]),
    )
    return plan, gain


def _power_text(plan, gain: float) -> str:
    capped = " (the seed pool's size: the target power is not reached)" if plan.capped else ""
    return (
        f"Power (declared before the primary run, from the tuning seeds): GRPO's gain {gain:+.4f}; per-seed SD of "
        f"the paired differences {plan.sd:.4f} (pooled over the family); {plan.n_seeds} evaluation seeds{capped} "
        f"give {100 * plan.power:.0f}% power after Holm over {plan.family_size} at alpha {plan.alpha:g} for an "
        f"effect of {plan.effect:.4f}; minimum detectable effect (80% power) {plan.mde:.4f}."
    )


def declared_seeds(protocol: Protocol, stage: str) -> dict[str, list[int]]:
    """The evaluation seeds ``stage`` may spend, as the protocol declares them: the primary family's seed pool
    (its power plan takes the first n), the confirmation's seeds; none for the other stages."""
    if stage == "primary":
        return {"primary": [int(s) for s in protocol.primary["seed_pool"]]}
    if stage == "confirm":
        return {"confirm": [int(s) for s in protocol.confirm["seeds"]]}
    return {}


def primary_runs(study: Study, tuned: dict[str, float], n_seeds: int) -> tuple[list[int], list[str], dict]:
    """The primary family's runs: the first ``n_seeds`` of the seed pool (spent once run), the reference and
    each method at its tuned lr; returns (seeds, methods, {(method, seed): run}), budgets checked equal."""
    pr = study.p.primary
    seeds = [int(s) for s in pr["seed_pool"][:n_seeds]]
    methods = [pr["reference"], *pr["methods"]]
    if study.jobs:
        study.ledger.spend(study.p.hash, "primary", seeds)
    jobs = [(m, study.config(m, tuned[m], s)) for m in methods for s in seeds]
    runs = {(m, c["direct"]["seed"]): r for (m, c), r in zip(jobs, study.runs("primary", jobs), strict=True)}
    equal_budgets("primary", {s: {m: runs[(m, s)] for m in methods} for s in seeds})
    return seeds, methods, runs


def primary(study: Study, tuned: dict[str, float]) -> str:
    pr = study.p.primary
    if "mde" in pr.get("power", {}):
        return primary_endpoints(study, tuned)
    plan, gain = power_plan(study, tuned)
    seeds, methods, runs = primary_runs(study, tuned, plan.n_seeds)
    th, ref = study.p.solvable, pr["reference"]
    diffs = family_diffs(study, runs, seeds)
    table, _ = family_table(diffs, float(pr.get("alpha", 0.05)))
    # The plan's SD came from the tuning seeds; the same pooled SD on the evaluation seeds says what the
    # family could in fact detect (reported, never used to change the declared design).
    observed_sd = pooled_sd(diffs)
    level = float(pr.get("alpha", 0.05)) / len(diffs)
    observed_mde = minimum_detectable_effect(
        observed_sd, len(seeds), level, float(pr.get("power", {}).get("target", 0.8))
    )
    observed = (
        f"Observed on the evaluation seeds: per-seed SD of the paired differences {observed_sd:.4f} (planned "
        f"{plan.sd:.4f}); at {len(seeds)} seeds that SD gives a minimum detectable effect of {observed_mde:.4f}."
    )
    rows = []
    for m in methods:
        rs = [runs[(m, s)] for s in seeds]
        reach = censored_budgets(
            [tokens_to(runs[(m, s)], runs[(ref, s)]["final_exact"]) for s in seeds], [r["tokens"] for r in rs]
        )
        km = "beyond the budget" if not math.isfinite(reach.km_median) else f"{reach.km_median:,.0f}"
        rows.append(
            [
                f"{m} (lr {tuned[m]:g})",
                f"{np.mean([r['base_exact'] for r in rs]):.4f}",
                f"{np.mean([r['final_exact'] for r in rs]):.4f}",
                f"{np.mean([metric(r, 'final_exact_worst', th) for r in rs]):.4f}",
                f"{np.mean([r['final_sampled'] for r in rs]):.3f}",
                f"{km} ({reach.reached}/{reach.n} reached)",
                f"{np.mean([r['tokens'] for r in rs]):,.0f}",
            ]
        )
    head = ["method", "base exact", "final exact", "worst-skill exact", "final sampled", "tokens to GRPO's final"]
    return "\n".join(
        [
            _power_text(plan, gain),
            "",
            baseline_line(study, [runs[(ref, s)] for s in seeds]),
            "",
            f"Primary family (declared; Holm at {pr.get('alpha', 0.05)}; paired over seeds {seeds}):",
            "",
            *table,
            "",
            observed,
            "",
            "Per method (means over the evaluation seeds; tokens to GRPO's final exact mean: Kaplan-Meier median,",
            "runs that never reach it censored at their budget, not dropped):",
            "",
            *markdown_table([*head, "tokens"], rows),
        ]
    )


def primary_endpoints(study: Study, tuned: dict[str, float]) -> str:
    """The primary stage of a protocol with declared endpoints: the per-endpoint power plan, Holm over
    methods x endpoints, and per method every endpoint side by side (pass@1 beside pass@8), from the
    runs' per-prompt outcomes."""
    pr, ep = study.p.primary, study.p.endpoints
    plan = endpoint_plan(study, tuned)
    seeds, methods, runs = primary_runs(study, tuned, plan.n_seeds)
    alpha = plan.rule.alpha
    table, family = family_table(family_diffs(study, runs, seeds), alpha)
    names = list(ep)
    base = [runs[(pr["reference"], s)] for s in seeds]  # every run's base is the same untrained model
    base_values = [f"{np.mean([endpoint_value(r, ep[n], 'base') for r in base]):.4f}" for n in names]
    rows = [["base (no training)", *base_values, "–", "–"]]
    for m in methods:
        rs = [runs[(m, s)] for s in seeds]
        values = [f"{np.mean([metric(r, n, study.p.solvable, ep) for r in rs]):.4f}" for n in names]
        rows.append(
            [
                f"{m} (lr {tuned[m]:g})",
                *values,
                f"{np.mean([r['weighted_adv_token_mass'] for r in rs]):,.0f}",
                f"{np.mean([r['tokens'] for r in rs]):,.0f}",
            ]
        )
    described = "; ".join(f"{n}: {e.describe()}" for n, e in ep.items())
    diffs = family_diffs(study, runs, seeds)
    observed_sd = {e: pooled_sd({m: diffs[f"{m} {e}"] for m in pr["methods"]}) for e in pr["metrics"]}
    planned = {e.endpoint: e.sd.upper for e in plan.endpoints}
    observed_line = (
        "Observed per-seed SD of the paired differences on the evaluation seeds (test split; in brackets the "
        "planning bound from the tuning seeds): "
        + ", ".join(f"{e} {observed_sd[e]:.4f} ({planned[e]:.4f})" for e in pr["metrics"])
        + "."
    )
    return "\n".join(
        [
            _endpoint_plan_text(plan),
            "",
            baseline_line(study, [runs[(pr["reference"], s)] for s in seeds]),
            "",
            f"Primary family (declared; Holm at {alpha:g} over methods x endpoints; paired over seeds {seeds}):",
            "",
            *table,
            "",
            f"Per method (means over the evaluation seeds; endpoints from the per-prompt outcomes: {described}):",
            "",
            *markdown_table(["method", *names, "weighted-advantage token mass", "tokens"], rows),
            "",
            observed_line,
            *control_text(study, runs, seeds, family),
            *allocation_text([(m, [runs[(m, s)] for s in seeds]) for m in methods]),
            "",
            pass_at_k_text(study, tuned, seeds, methods, runs),
        ]
    )


# The positive control's allocator (a primary method whose config selects it is the control), and the
# token excess over the reference beyond which a comparison needs a token-matched arm (protocol tiny_lm_v3).
CONTROL_ALLOCATOR = "fixed_tail_share"
TOKEN_MATCH = 0.02


def control_text(study: Study, runs, seeds, family) -> list[str]:
    """Report lines for a primary family with a positive control (issue 45): each method's tokens against
    the reference's and those above :data:`TOKEN_MATCH`, and the control's verdict on the family's first
    metric (the primary endpoint): raised it (Holm) -> the other arms' verdicts stand; else the testbed
    cannot see tail-directed compute at this power and the verdict on the other allocators is void.
    None without a control (v1, v2: their reports unchanged)."""
    from recipe.gdro.lab.experiments.direct import method_gdro

    pr = study.p.primary
    n = int(study.tuned_shape.get("n", study.p.shape["n"]))
    controls = [m for m in pr["methods"] if method_gdro(m, n)["rollout"].get("allocator") == CONTROL_ALLOCATOR]
    if not controls:
        return []
    ref, first = pr["reference"], pr["metrics"][0]
    tokens = {m: float(np.mean([runs[(m, s)]["tokens"] for s in seeds])) for m in [ref, *pr["methods"]]}
    excess = {m: tokens[m] / tokens[ref] - 1 for m in pr["methods"]}
    over = [m for m in pr["methods"] if excess[m] > TOKEN_MATCH]
    lines = [
        "",
        f"Tokens against {ref}'s (means over the evaluation seeds): "
        + ", ".join(f"{m} {100 * excess[m]:+.1f}%" for m in pr["methods"])
        + f"; above +{100 * TOKEN_MATCH:g}% (a token-matched comparison needed): {', '.join(over) or 'none'}.",
    ]
    for c in controls:
        lines.append("")
        r = family[f"{c} {first}"]
        found = f"{r.mean:+.4f}, 95% CI [{r.lo:+.4f}, {r.hi:+.4f}], Holm p {_p(r.p_holm)}"
        if r.rejected and r.mean > 0:
            lines.append(
                f"Positive control: {c} raised {first} ({found}): the testbed sees tail-directed compute; "
                "the other arms' verdicts stand."
            )
        else:
            lines.append(
                f"Positive control: {c} did not raise {first} at the family's level ({found}): at this power the "
                "testbed cannot see tail-directed compute, and the verdict on the other allocators is void."
            )
    return lines


# pass@k over k = 1..32 on the test split: the figure (PASS_AT_K_FIGURE in the results folder) and its table
PASS_AT_K = tuple(range(1, 33))
PASS_AT_K_TABLE = (1, 2, 4, 8, 16, 32)
PASS_AT_K_FIGURE = "pass_at_k.svg"


def pass_at_k_panels(study: Study, seeds, methods, runs) -> dict[str, dict[str, np.ndarray]]:
    """pass@k (seeds x k) of each method on the test split: every prompt, and each declared tail."""
    from recipe.gdro.lab.results.outcomes import outcomes, pass_at_k

    sets = {"test split": None, **{n: e.tail for n, e in study.p.endpoints.items() if e.tail is not None}}
    panels: dict[str, dict[str, np.ndarray]] = {}
    for label, tail in sets.items():
        by_method = {}
        for m in methods:
            rows = []
            for s in seeds:
                final, base = outcomes(runs[(m, s)], "test", "final"), outcomes(runs[(m, s)], "test", "base")
                p = final.p if tail is None else final.p[tail.members(base)]
                rows.append([pass_at_k(p, k) for k in PASS_AT_K])
            by_method[m] = np.asarray(rows)
        name = label if tail is None else f"{label.replace(' pass@8', '')} ({tail.describe()})"
        panels[name] = by_method
    return panels


def pass_at_k_text(study: Study, tuned, seeds, methods, runs) -> str:
    """The table behind the figure: mean pass@k on the test split per method, and each method minus the
    reference with its paired 95% CI (unadjusted), at k = 1, 2, 4, ..., 32."""
    ref = study.p.primary["reference"]
    lines = [
        f"pass@k on the test split (figure: {PASS_AT_K_FIGURE}; differences unadjusted, paired over seeds {seeds}):",
        "",
    ]
    for name, by in pass_at_k_panels(study, seeds, methods, runs).items():
        rows = []
        for m, values in by.items():
            cells = []
            for k in PASS_AT_K_TABLE:
                j = PASS_AT_K.index(k)
                if m == ref:
                    cells.append(f"{values[:, j].mean():.4f}")
                else:
                    mean, lo, hi, _ = paired_ci(values[:, j], by[ref][:, j])
                    ci = f" [{lo:+.4f}, {hi:+.4f}]" if math.isfinite(lo) else ""
                    cells.append(f"{values[:, j].mean():.4f} ({mean:+.4f}{ci})")
            rows.append([f"{m} (lr {tuned[m]:g})", *cells])
        lines += [f"{name}:", "", *markdown_table(["method", *(f"pass@{k}" for k in PASS_AT_K_TABLE)], rows), ""]
    return "\n".join(lines).rstrip()


def pass_at_k_figure(study: Study, tuned: dict[str, float]) -> str | None:
    """The pass@k figure's SVG (plot.pass_at_k_svg) from the primary runs; None before they exist or
    for a protocol without endpoints on the test split."""
    from recipe.gdro.lab.results.plot import pass_at_k_svg

    if "mde" not in study.p.primary.get("power", {}) or not int(study.p.shape.get("num_test", 0)):
        return None
    try:
        plan = endpoint_plan(study, tuned)
        seeds, methods, runs = primary_runs(study, tuned, plan.n_seeds)
    except MissingRuns:
        return None
    title = (
        f"{study.p.data.get('name', '')}: exact pass@k on the held-out test split, {len(seeds)} evaluation seeds "
        f"({shape_label(study.tuned_shape) or study.p.shape['prompts']} prompts x rollouts a step, "
        f"{study.p.shape['steps']} steps)"
    )
    return pass_at_k_svg(PASS_AT_K, pass_at_k_panels(study, seeds, methods, runs), study.p.primary["reference"], title)


def _explore_runs(study: Study, tuned: dict[str, float]):
    ex = study.p.explore
    ref = ex.get("reference", "grpo")
    seeds = [int(s) for s in ex["seeds"]]
    jobs = [(f"{ref} (reference)", study.config(ref, tuned[ref], s)) for s in seeds]
    for arm in study.p.arms():
        lr = arm_lr(study, tuned, arm)
        jobs += [(arm.name, study.config(arm.method, lr, s, gdro=arm.gdro, warm_start=arm.warm_start)) for s in seeds]
    runs = {(a, c["direct"]["seed"]): r for (a, c), r in zip(jobs, study.runs("explore", jobs), strict=True)}
    ref_runs = {s: runs[(f"{ref} (reference)", s)] for s in seeds}
    arm_runs = {a.name: {s: runs[(a.name, s)] for s in seeds} for a in study.p.arms()}
    equal_budgets("explore", {s: {"reference": ref_runs[s], **{a: arm_runs[a][s] for a in arm_runs}} for s in seeds})
    return seeds, ref_runs, arm_runs


def explore_gains(study: Study, ref_runs, arm_runs) -> dict[str, list[float]]:
    """Each arm's per-seed gain over the reference on ``explore.criterion`` (default ``final_exact``;
    a declared endpoint may be named): what the confirmation rule ranks arms by."""
    name = study.p.explore.get("criterion", "final_exact")
    th, ep = study.p.solvable, endpoints_on(study, "val")

    def value(run):
        return metric(run, name, th, ep)

    return {a: [value(r[s]) - value(ref_runs[s]) for s in ref_runs] for a, r in arm_runs.items()}


def endpoint_cells(study: Study, runs: list[dict[str, Any]]) -> list[str]:
    """Each declared endpoint's mean over ``runs``, on the validation prompts (none for a protocol
    without endpoints)."""
    th, ep = study.p.solvable, endpoints_on(study, "val")
    return [f"{np.mean([metric(r, n, th, ep) for r in runs]):.4f}" for n in ep]


def explore(study: Study, tuned: dict[str, float]) -> str:
    seeds, ref_runs, arm_runs = _explore_runs(study, tuned)
    gains = explore_gains(study, ref_runs, arm_runs)
    th = study.p.solvable
    rows = []
    ref_tokens = np.mean([r["tokens"] for r in ref_runs.values()])
    for name, runs in [("grpo (reference)", ref_runs), *arm_runs.items()]:
        rs = list(runs.values())
        g = gains.get(name, [0.0] * len(seeds))
        mean, lo, hi, _ = paired_ci(g, [0.0] * len(g))
        rows.append(
            [
                name,
                f"{rs[0]['lr']:.3g}",
                f"{np.mean([r['final_exact'] for r in rs]):.4f}",
                "–" if name not in gains else _fmt(mean),
                "–" if name not in gains or not math.isfinite(lo) else f"[{lo:+.4f}, {hi:+.4f}]",
                f"{np.mean([metric(r, 'final_exact_worst', th) for r in rs]):.4f}",
                f"{np.mean([r['final_sampled'] for r in rs]):.3f}",
                f"{np.mean([r['tokens'] for r in rs]) / ref_tokens:.3f}",
                f"{np.mean([r['all_unseen_steps'] / max(1, r['steps_trained']) for r in rs]):.2f}",
                *endpoint_cells(study, rs),
                *([f"{np.mean([r['weighted_adv_token_mass'] for r in rs]):,.0f}"] if study.p.endpoints else []),
            ]
        )
    criterion = study.p.explore.get("criterion", "final_exact")
    versus = "vs GRPO" + ("" if criterion == "final_exact" else f" ({criterion}, val)")
    head = [
        "arm (exploratory)", "lr", "final exact", versus,
        "95% CI", "worst-skill exact", "final sampled", "tokens / GRPO's", "all-unseen steps",
        *(f"{n} (val)" for n in study.p.endpoints),
        *(["weighted-advantage token mass"] if study.p.endpoints else []),
    ]  # fmt: skip
    return "\n".join(
        [
            f"Exploratory arms (seeds {seeds}, which tuned nothing; each against GRPO at its tuned lr on the same "
            "seeds; unadjusted):",
            "",
            *markdown_table(head, rows),
            *allocation_text(
                [("grpo (reference)", list(ref_runs.values())), *((a, list(r.values())) for a, r in arm_runs.items())]
            ),
            "",
            baseline_line(study, list(ref_runs.values())),
        ]
    )


def chosen_arm(study: Study, gains: dict[str, list[float]]) -> str | None:
    """The confirmation rule: the non-control arm of largest mean gain, if that gain is > 0 (ties: first declared)."""
    candidates = [a.name for a in study.p.arms() if not a.control]
    if not candidates:
        return None
    best = max(candidates, key=lambda n: (float(np.mean(gains[n])), -candidates.index(n)))
    return best if float(np.mean(gains[best])) > 0 else None


def confirm(study: Study, tuned: dict[str, float]) -> str:
    _, ref_runs, arm_runs = _explore_runs(study, tuned)
    gains = explore_gains(study, ref_runs, arm_runs)
    name = chosen_arm(study, gains)
    if name is None:
        best = max(gains, key=lambda n: float(np.mean(gains[n]))) if gains else "none"
        return (
            f"Confirmation: no exploratory arm gained over GRPO on the explore seeds (best {best!r}, "
            f"{np.mean(gains.get(best, [float('nan')])):+.4f}): nothing to confirm, no seed spent."
        )
    arm = study.p.arm(name)
    cf = study.p.confirm
    seeds = [int(s) for s in cf["seeds"]]
    if study.jobs:
        study.ledger.spend(study.p.hash, "confirm", seeds)
    ref = study.p.explore.get("reference", "grpo")
    lr = arm_lr(study, tuned, arm)
    jobs = [(f"{ref} (reference)", study.config(ref, tuned[ref], s)) for s in seeds]
    jobs += [(arm.name, study.config(arm.method, lr, s, gdro=arm.gdro, warm_start=arm.warm_start)) for s in seeds]
    runs = {(a, c["direct"]["seed"]): r for (a, c), r in zip(jobs, study.runs("confirm", jobs), strict=True)}
    g = {s: runs[(f"{ref} (reference)", s)] for s in seeds}
    a = {s: runs[(arm.name, s)] for s in seeds}
    equal_budgets("confirm", {s: {"reference": g[s], arm.name: a[s]} for s in seeds})
    th = study.p.solvable
    ep = study.p.endpoints
    diffs = {m: [metric(a[s], m, th, ep) - metric(g[s], m, th, ep) for s in seeds] for m in cf["metrics"]}
    table, _ = family_table(diffs, float(cf.get("alpha", 0.05)), better="arm better")
    return "\n".join(
        [
            f"Confirmatory run: {name!r} (chosen on the explore seeds: {np.mean(gains[name]):+.4f}) against GRPO on "
            f"fresh seeds {seeds}; {len(diffs)} comparisons, Holm at {cf.get('alpha', 0.05)}:",
            "",
            *table,
            "",
            baseline_line(study, list(g.values())),
        ]
    )


def long_regimes(study: Study, tuned: dict[str, float]) -> str:
    lg = study.p.long
    if not lg.get("regimes"):
        return "None declared."
    seeds, methods = [int(s) for s in lg["seeds"]], lg["methods"]
    lines: list[str] = []
    for regime, shape in lg["regimes"].items():
        jobs = [(f"{regime}: {m}", study.config(m, tuned[m], s, shape=shape)) for m in methods for s in seeds]
        runs = {(a, c["direct"]["seed"]): r for (a, c), r in zip(jobs, study.runs("long", jobs), strict=True)}
        by = {m: {s: runs[(f"{regime}: {m}", s)] for s in seeds} for m in methods}
        equal_budgets(f"long ({regime})", {s: {m: by[m][s] for m in methods} for s in seeds})
        rows = []
        for m in methods:
            mean, lo, hi, _ = paired_ci(
                [by[m][s]["final_exact"] for s in seeds], [by[methods[0]][s]["final_exact"] for s in seeds]
            )
            ci = "–" if m == methods[0] else f"{_fmt(mean)} [{_fmt(lo)}, {_fmt(hi)}]"
            final = f"{np.mean([by[m][s]['final_exact'] for s in seeds]):.4f}"
            rows.append([f"{m} (lr {tuned[m]:g})", final, ci, *endpoint_cells(study, list(by[m].values()))])
        lines += [
            f"{regime} ({', '.join(f'{k}={v}' for k, v in shape.items())}), seeds {seeds}:",
            "",
            *markdown_table(
                ["method", "final exact", "vs GRPO (95% CI)", *(f"{n} (val)" for n in study.p.endpoints)], rows
            ),
            "",
            baseline_line(study, list(by[methods[0]].values())),
            "",
        ]
    return "\n".join(lines).rstrip()


def cold_start(study: Study, tuned: dict[str, float]) -> str:
    """How much of a run each method spends as GRPO: steps in which every batch prompt is unseen."""
    runs = _tuned_runs(study, tuned)
    rows = []
    for m in study.p.tuning["methods"]:
        rs = [runs[(m, s)] for s in tuning_seeds(study)]
        steps = np.mean([r["steps_trained"] for r in rs])
        cold = np.mean([r["all_unseen_steps"] for r in rs])
        rows.append(
            [
                m,
                f"{cold:.1f} of {steps:.0f}",
                f"{cold / max(steps, 1):.2f}",
                f"{np.mean([r['unseen_share'] for r in rs]):.2f}",
            ]
        )
    head = ["method (tuned lr, tuning seeds)", "all-unseen steps", "share of the run", "mean unseen share of a batch"]
    return "\n".join(
        ["Cold start (every method is GRPO while all its batch is unseen):", "", *markdown_table(head, rows)]
    )


# ------------------------------------------------------------------------------------------ the report
SECTIONS = (
    ("tune", "Tuning"),
    ("cold", "Cold start"),
    ("primary", "Primary"),
    ("explore", "Exploratory arms"),
    ("confirm", "Confirmation"),
    ("long", "Regimes"),
)


def regenerate_line(study: Study) -> str:
    """How to rebuild this report (v1's line is kept as committed: its report rebuilds byte for byte)."""
    if study.legacy:
        return "Regenerate: `python -m recipe.gdro.experiments.study report` (reads only results/tiny_lm_study/runs/)."
    folder = portable_path(study.results)
    protocol = portable_path(study.p.path)
    options = "" if Path(local_path(protocol)) == TINY_LM_PROTOCOL else f" --protocol {protocol} --results {folder}"
    return f"Regenerate: `python -m recipe.gdro.lab.experiments.study report{options}` (reads only {folder}/runs/)."


def report(study: Study) -> str:
    """Every section from the stored runs only (a stage not run yet says so); nothing runs."""
    quiet = Study(study.p, study.results, jobs=0, device=study.device, log=lambda *_: None)
    parts = [
        "# Tiny-LM study: report",
        "",
        f"Protocol `{Path(study.p.path).name}` ({study.p.data.get('name', '')}), SHA-256 `{study.p.hash}`. "
        + regenerate_line(study),
        "",
    ]
    provenance = quiet.store.provenance()
    if provenance:
        parts += [*provenance, ""]
    try:
        tuned, text = tune(quiet)
    except MissingRuns as e:
        return "\n".join([*parts, "## Tuning", "", f"Not run yet ({e}).", ""])
    parts += ["## Tuning", "", text, ""]
    stage_fns = {
        "cold": cold_start,
        "primary": primary,
        "explore": explore,
        "confirm": confirm,
        "long": long_regimes,
    }
    for key, title in SECTIONS[1:]:
        try:
            body = stage_fns[key](quiet, tuned)
        except MissingRuns as e:
            body = f"Not run yet ({str(e).split(';')[0]})."
        parts += [f"## {title}", "", body, ""]
    return "\n".join(parts)


def report_figure(study: Study) -> str | None:
    """The pass@k figure from the stored runs only (None: no primary runs yet, or a protocol without it)."""
    quiet = Study(study.p, study.results, jobs=0, device=study.device, log=lambda *_: None)
    try:
        tuned, _ = tune(quiet)
    except MissingRuns:
        return None
    return pass_at_k_figure(quiet, tuned)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_replace(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m recipe.gdro.lab.experiments.study",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--protocol", default=str(TINY_LM_PROTOCOL), help="the protocol file (YAML)")
    p.add_argument(
        "--results",
        default=None,
        help="runs/, spent_seeds.yaml, REPORT.md (default: the protocol's results: folder, else results/tiny_lm_study)",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto (recorded in each run's config)")
    p.add_argument("--run", default=None, help="reproduce: the run file to make again")
    args = p.parse_args(argv)
    if (args.stage == "reproduce") != (args.run is not None):
        print("error: --run FILE goes with the reproduce stage, and only with it", file=sys.stderr)
        return 2
    if args.stage == "reproduce":
        try:
            differ, compared = reproduce(Path(args.run))
        except ValueError as e:
            print(f"error: --run {e}", file=sys.stderr)
            return 2
        verdict = f"differs in {', '.join(differ)}" if differ else "the same numbers"
        print(f"{args.run}: {verdict} ({compared} summary fields compared; started_at, seconds, code are not)")
        return 1 if differ else 0
    if args.results is None:
        try:
            declared = load_protocol(args.protocol).results
        except ProtocolError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        args.results = str(REPO / declared) if declared else str(DEFAULT_RESULTS)
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    blocker = blocking_file(Path(args.results) / "runs")
    if blocker is not None:
        print(f"error: --results {args.results}: {blocker} is a file, not a folder", file=sys.stderr)
        return 2
    if args.stage == "report" and not (Path(args.results) / "runs").is_dir():  # report reads; it makes nothing
        print(f"error: no runs folder at {Path(args.results) / 'runs'}; run the tune stage first", file=sys.stderr)
        return 2
    try:
        from recipe.gdro.lab.experiments.direct import resolve_device

        resolve_device(args.device)
        protocol = load_protocol(args.protocol)
        study = Study(protocol, Path(args.results), 0 if args.stage == "report" else args.jobs, args.device)
        if study.jobs:  # a spent evaluation seed refuses the stage before any run (the tune stage's included)
            for stage, seeds in declared_seeds(protocol, args.stage).items():
                study.ledger.check_unspent(protocol.hash, stage, seeds)
        if args.stage != "report":
            tuned, text = tune(study)
            stage = {"tune": None, "primary": primary, "explore": explore, "confirm": confirm, "long": long_regimes}
            fn = stage[args.stage]
            print(text if fn is None else fn(study, tuned))
        text = report(study)
        _write(study.results / "REPORT.md", text)
        figure = report_figure(study)
        if figure is not None:
            _write(study.results / PASS_AT_K_FIGURE, figure)
        if args.stage == "report":
            print(text)
    except (ProtocolError, MissingRuns, BudgetMismatch, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.strerror or e}: {getattr(e, 'filename', '')}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from verl_ext.interrupt import run_main

    # stop the pool's workers at the signal: leaving its `with` otherwise waits for every queued run
    run_main("study", main, detail="finished runs are in --results/runs/", stop_children_at_signal=True)
