"""Per-prompt outcomes of a run and the endpoints computed from them: exact pass@k, a declared hard
tail, the worst skill.

A run file of the tiny-LM study (``recipe.gdro.lab.experiments.study``) holds, per evaluated split
(``val``, ``test``), each prompt's id (its text), skill, and exact success probability p_i at each
evaluation (:func:`per_prompt_record`)::

    "per_prompt": {"test": {"id": ["12+34=", ...], "skill": ["add2", ...], "step": [0, 150],
                            "p": [[0.91, ...], [0.97, ...]]}, "val": {...}}

From these alone any endpoint is recomputed, with no rerun:

* **exact pass@k** (:func:`pass_at_k`): a prompt answered with probability p is solved by at least
  one of k independent samples with probability 1 - (1 - p)^k; over a set of prompts the mean
  (1/N) Σ_i [1 - (1 - p_i)^k]. This is the quantity the unbiased estimator of Chen et al. (2021)
  estimates from n ≥ k samples; here it is exact, as p_i is. Its complement 1 - pass@n is the
  expected share of a prompt set's GRPO groups of n rollouts that all fail (no gradient).
* **a hard tail** (:class:`Tail`): a set of prompts declared before any run, by the base's p_i
  (``base_below``: the prompts the untrained model solves with probability below a threshold) or by
  skill (``skills``); the endpoint is pass@k over that set.
* **the worst skill** (:class:`Endpoint` ``worst_skill``): the minimum over skills of the skill's
  pass@k, over every skill unless ``min_base`` keeps only skills whose base pass@k reaches it.

Imports only numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "SIGNIFICANT_DIGITS",
    "Endpoint",
    "MissingOutcomes",
    "Outcomes",
    "Tail",
    "add_evaluation",
    "check_disjoint",
    "endpoint_value",
    "outcomes",
    "pass_at_k",
    "per_prompt_record",
    "round_probabilities",
]

# Digits kept of each p_i in a run file: pass@k from the rounded values differs by < 1e-5 relative.
SIGNIFICANT_DIGITS = 6


def pass_at_k(p: Sequence[float] | np.ndarray, k: int) -> float:
    """Exact pass@k of a set of prompts: mean_i 1 - (1 - p_i)^k (module docstring); NaN for no prompt.

    Computed as -expm1(k log1p(-p_i)), accurate for the small p_i of a hard tail."""
    if int(k) != k or k < 1:
        raise ValueError(f"k={k}: pass@k needs a whole number k >= 1")
    p = np.asarray(p, dtype=np.float64)
    if p.size == 0:
        return float("nan")
    if np.any((p < 0) | (p > 1)) or np.any(np.isnan(p)):
        raise ValueError("pass_at_k: every p_i must be a probability in [0, 1]")
    with np.errstate(divide="ignore"):
        return float(np.mean(-np.expm1(k * np.log1p(-p))))


def round_probabilities(p: Sequence[float] | np.ndarray) -> list[float]:
    """``p`` as a list of floats of :data:`SIGNIFICANT_DIGITS` significant digits (what a run file keeps)."""
    return [float(f"{float(x):.{SIGNIFICANT_DIGITS}g}") for x in np.asarray(p, dtype=np.float64)]


def per_prompt_record(ids: Sequence[str], skills: Sequence[str]) -> dict[str, list]:
    """A split's entry of a run file's ``per_prompt``, before any evaluation (add them with ``add_evaluation``)."""
    if len(ids) != len(skills):
        raise ValueError(f"{len(ids)} prompt ids but {len(skills)} skills")
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if list(ids).count(i) > 1)
        raise ValueError(f"prompt {dup!r} appears twice in one split")
    return {"id": list(ids), "skill": list(skills), "step": [], "p": []}


def add_evaluation(record: dict[str, list], step: int, p: Sequence[float] | np.ndarray) -> None:
    """Append one evaluation (its step and the rounded p_i, in the record's prompt order)."""
    if len(p) != len(record["id"]):
        raise ValueError(f"{len(p)} probabilities for {len(record['id'])} prompts")
    record["step"].append(int(step))
    record["p"].append(round_probabilities(p))


def check_disjoint(splits: Mapping[str, Sequence[str]]) -> None:
    """Refuse two splits sharing a prompt: ValueError naming the prompt and both splits."""
    seen: dict[str, str] = {}
    for name, ids in splits.items():
        for prompt in dict.fromkeys(ids):
            if prompt in seen:
                raise ValueError(
                    f"prompt {prompt!r} is in both the {seen[prompt]} and the {name} split: the splits must be disjoint"
                )
            seen[prompt] = name


class MissingOutcomes(ValueError):
    """A run summary without the per-prompt outcomes an endpoint needs."""


@dataclass(frozen=True)
class Outcomes:
    """One split of one run at one evaluation: prompt ids, skills, p_i (aligned)."""

    ids: tuple[str, ...]
    skills: tuple[str, ...]
    p: np.ndarray
    step: int


def outcomes(run: Mapping[str, Any], split: str = "test", at: str | int = "final") -> Outcomes:
    """A run summary's per-prompt outcomes on ``split`` at ``at``: ``"base"`` (the first evaluation,
    before training), ``"final"`` (the last) or a step. KeyError naming what is missing (e.g. a run
    file written before per-prompt outcomes were recorded)."""
    per = run.get("per_prompt")
    if not isinstance(per, Mapping) or split not in per:
        have = f"it has {sorted(per)}" if isinstance(per, Mapping) else "a run file from before per-prompt outcomes"
        who = f"{run.get('arm', run.get('method', '?'))!r} seed {run.get('seed')}"
        raise MissingOutcomes(f"run {who}: no per-prompt outcomes on the {split!r} split ({have})")
    rec = per[split]
    if not rec["step"]:
        raise MissingOutcomes(f"split {split!r} was never evaluated")
    i = {"base": 0, "final": len(rec["step"]) - 1}.get(at) if isinstance(at, str) else rec["step"].index(int(at))
    if i is None:
        raise ValueError(f"at={at!r}: use 'base', 'final' or a step")
    return Outcomes(tuple(rec["id"]), tuple(rec["skill"]), np.asarray(rec["p"][i], dtype=np.float64), rec["step"][i])


@dataclass(frozen=True)
class Tail:
    """A hard tail, declared before any run: the prompts whose base p_i is below ``base_below``, the
    prompts of ``skills``, or with both the prompts of ``skills`` whose base p_i is below
    ``base_below`` (a tail split into its skills)."""

    base_below: float | None = None
    skills: tuple[str, ...] = ()

    def __post_init__(self):
        if self.base_below is None and not self.skills:
            raise ValueError("a tail is declared by base_below (a threshold), skills (a list), or both")

    def members(self, base: Outcomes) -> np.ndarray:
        """Boolean mask over ``base``'s prompts."""
        mask = np.ones(len(base.p), dtype=bool) if self.base_below is None else base.p < self.base_below
        if not self.skills:
            return mask
        unknown = set(self.skills) - set(base.skills)
        if unknown:
            have = sorted(set(base.skills))
            raise ValueError(f"tail skills {sorted(unknown)} are not among the split's skills {have}")
        return mask & np.isin(np.asarray(base.skills), list(self.skills))

    def describe(self) -> str:
        below = f"prompts with base p < {self.base_below:g}" if self.base_below is not None else ""
        skills = "skill " + ", ".join(self.skills) if self.skills else ""
        return f"{skills}, {below}" if skills and below else skills or below


@dataclass(frozen=True)
class Endpoint:
    """One declared endpoint: pass@``k`` on ``split`` at the run's final evaluation, over every
    prompt, over a ``tail``, or the ``worst_skill`` (every skill, or those whose base pass@k is at
    least ``min_base``)."""

    name: str
    k: int = 1
    split: str = "test"
    tail: Tail | None = None
    worst_skill: bool = False
    min_base: float | None = None

    def __post_init__(self):
        if int(self.k) != self.k or self.k < 1:
            raise ValueError(f"endpoint {self.name!r}: k={self.k} must be a whole number >= 1")
        if self.tail is not None and self.worst_skill:
            raise ValueError(f"endpoint {self.name!r}: a tail or the worst skill, not both")
        if self.min_base is not None and not self.worst_skill:
            raise ValueError(f"endpoint {self.name!r}: min_base applies to worst_skill only")

    def describe(self) -> str:
        """E.g. ``pass@8 on test, prompts with base p < 0.05``."""
        text = f"pass@{self.k} on {self.split}"
        if self.tail is not None:
            text += f", {self.tail.describe()}"
        if self.worst_skill:
            text += ", worst skill" + (
                f" of base pass@{self.k} >= {self.min_base:g}" if self.min_base is not None else ""
            )
        return text

    @classmethod
    def from_dict(cls, name: str, spec: Mapping[str, Any]) -> Endpoint:
        spec = dict(spec)
        tail = spec.pop("tail", None)
        if tail is not None:
            tail = Tail(**{**tail, "skills": tuple(tail.get("skills", ()))})
        return cls(name=name, tail=tail, **spec)


def endpoint_value(run: Mapping[str, Any], endpoint: Endpoint, at: str | int = "final") -> float:
    """The endpoint of one run, from its per-prompt outcomes alone (module docstring), at its final
    evaluation (or ``at``: ``"base"``, a step); a tail's prompts are always chosen by the base's p_i."""
    final = outcomes(run, endpoint.split, at)
    base = outcomes(run, endpoint.split, "base")
    if base.ids != final.ids:
        raise ValueError(f"{endpoint.name}: the base and final evaluations list different prompts")
    if endpoint.tail is not None:
        mask = endpoint.tail.members(base)
        if not mask.any():
            raise ValueError(f"{endpoint.name}: the tail ({endpoint.tail.describe()}) holds no prompt")
        return pass_at_k(final.p[mask], endpoint.k)
    if endpoint.worst_skill:
        skills = np.asarray(final.skills)
        values = []
        for s in dict.fromkeys(final.skills):
            mask = skills == s
            if endpoint.min_base is None or pass_at_k(base.p[mask], endpoint.k) >= endpoint.min_base:
                values.append(pass_at_k(final.p[mask], endpoint.k))
        return float(min(values)) if values else math.nan
    return pass_at_k(final.p, endpoint.k)
