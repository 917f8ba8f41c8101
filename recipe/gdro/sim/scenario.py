"""Scenario files for the GDRO simulator (a SYNTHETIC learner; see docs/simulator.md).

A scenario is a YAML mapping describing a synthetic dataset of "skills" (sub-domains) and the
training budget. It is validated here; every error names the offending key, e.g.
``scenario 'x.yaml': skills[2].difficulty.std=-1 must be a number > 0``.

Schema (all keys; ``?`` = optional, with its default)::

    name?: str                    file stem
    description?: str             ""
    num_prompts: int              training prompts (stable ids 0..num_prompts-1)
    num_eval_prompts?: int        2000   held-out prompts drawn from the same skills
    batch_size: int               B, prompts per step (<= num_prompts)
    n_mean?: int                  4      n̄, mean rollouts per prompt (the budget; >= 2)
    lr: float                     policy-gradient step size (see sim_learner)
    transfer?: float              0.5    share of a prompt's update that flows to its skill
    grad_noise?: float            0.0    zero-mean gradient noise per unit of advantage mass
    norm_adv_by_std?: bool        true   GRPO std normalisation (verl's norm_adv_by_std_in_grpo)
    steps: int                    training steps
    seeds?: int                   3      default number of seeds
    skills: list                  at least one
      - name: str                 [A-Za-z0-9_.-]+, unique
        frequency: float > 0      relative share of prompts (normalised over skills)
        difficulty:               initial logit offset d_x of each prompt, either
          mean: float             ... a normal N(mean, std²)
          std: float >= 0
        # or
          mixture:                ... a mixture of normals
            - {weight: float > 0, mean: float, std: float >= 0}
        unsolvable?: float        0.0    fraction of the skill's prompts no policy can solve (p ≡ 0)
        transfer?: float          top-level transfer, for this skill only
    learner?: mapping             parameters of the shared learner (``--learner shared``; the
                                  logistic learner ignores them; see sim_learner):
      rep_dim?: int               ceil(S/2)  D, dimensions of the shared representation
      feature_overlap?: float     0.6    ρ in [0, 1], common part of the skills' feature vectors
      forgetting?: float          0.003  λ in [0, 1), per-step decay of w
      capacity?: float            6.0    C > 0, bound on ‖w‖
      curvature?: float           2.0    κ >= 0, general-competence loss per unit ‖Δw‖²
      recovery?: float            0.05   ρ_b in (0, 1], per-step recovery of that loss
    gdro?: mapping                overrides of the verl_ext ``gdro:`` config for every method
                                  (binner.*, prompt.*, rollout.* except the enable flags)
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

SCENARIO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")
DEFAULT_SCENARIO = "dapo_like"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class ScenarioError(ValueError):
    """A malformed scenario file. The message names the file and the key at fault."""


@dataclass
class NormalComponent:
    weight: float
    mean: float
    std: float


@dataclass
class Skill:
    name: str
    frequency: float
    components: list[NormalComponent]
    unsolvable: float = 0.0
    transfer: Optional[float] = None


@dataclass
class LearnerParams:
    """Parameters of the shared learner (see recipe/gdro/sim/learner.py)."""

    rep_dim: Optional[int] = None
    feature_overlap: float = 0.6
    forgetting: float = 0.003
    capacity: float = 6.0
    curvature: float = 2.0
    recovery: float = 0.05

    def to_dict(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in ("rep_dim", "feature_overlap", "forgetting", "capacity", "curvature", "recovery")
        }


@dataclass
class Scenario:
    name: str
    num_prompts: int
    batch_size: int
    lr: float
    steps: int
    skills: list[Skill]
    description: str = ""
    num_eval_prompts: int = 2000
    n_mean: int = 4
    transfer: float = 0.5
    grad_noise: float = 0.0
    norm_adv_by_std: bool = True
    seeds: int = 3
    gdro: dict[str, Any] = field(default_factory=dict)
    learner: LearnerParams = field(default_factory=LearnerParams)
    source: str = ""  # file it was loaded from

    def skill_transfer(self) -> list[float]:
        return [self.transfer if s.transfer is None else s.transfer for s in self.skills]

    def to_dict(self) -> dict[str, Any]:
        """Plain form (as it would be written in YAML), for results.json."""
        skills = []
        for s in self.skills:
            if len(s.components) == 1 and s.components[0].weight == 1.0:
                diff: dict[str, Any] = {"mean": s.components[0].mean, "std": s.components[0].std}
            else:
                diff = {"mixture": [{"weight": c.weight, "mean": c.mean, "std": c.std} for c in s.components]}
            d: dict[str, Any] = {
                "name": s.name,
                "frequency": s.frequency,
                "difficulty": diff,
                "unsolvable": s.unsolvable,
            }
            if s.transfer is not None:
                d["transfer"] = s.transfer
            skills.append(d)
        return {
            "name": self.name,
            "description": self.description,
            "num_prompts": self.num_prompts,
            "num_eval_prompts": self.num_eval_prompts,
            "batch_size": self.batch_size,
            "n_mean": self.n_mean,
            "lr": self.lr,
            "transfer": self.transfer,
            "grad_noise": self.grad_noise,
            "norm_adv_by_std": self.norm_adv_by_std,
            "steps": self.steps,
            "seeds": self.seeds,
            "skills": skills,
            "learner": self.learner.to_dict(),
            "gdro": copy.deepcopy(self.gdro),
        }


# ---------------------------------------------------------------------------------- validation
class _V:
    """Typed accessors that raise ScenarioError naming ``where`` and the key."""

    def __init__(self, src: str):
        self.src = src

    def fail(self, key: str, value: Any, why: str) -> None:
        raise ScenarioError(f"scenario {self.src!r}: {key}={value!r} {why}")

    def keys(self, data: Any, where: str, required: set[str], optional: set[str]) -> dict:
        label = where or "top level"
        if not isinstance(data, dict):
            raise ScenarioError(f"scenario {self.src!r}: {label} must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(map(str, data)) - required - optional)
        if unknown:
            pre = f"{where}." if where else ""
            raise ScenarioError(
                f"scenario {self.src!r}: unknown key(s) {', '.join(pre + k for k in unknown)}; "
                f"valid keys{' under ' + where if where else ''}: {', '.join(sorted(required | optional))}"
            )
        missing = sorted(required - set(data))
        if missing:
            pre = f"{where}." if where else ""
            raise ScenarioError(f"scenario {self.src!r}: missing required key(s) {', '.join(pre + k for k in missing)}")
        return data

    def int_(self, key: str, value: Any, lo: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(key, value, "must be an integer")
        if value < lo:
            self.fail(key, value, f"must be >= {lo}")
        return int(value)

    def float_(
        self,
        key: str,
        value: Any,
        *,
        lo: float = -math.inf,
        hi: float = math.inf,
        lo_open: bool = False,
        hi_open: bool = False,
    ) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            self.fail(key, value, "must be a finite number")
        v = float(value)
        if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
            lb = "(" if lo_open else "["
            rb = ")" if hi_open else "]"
            self.fail(key, value, f"must lie in {lb}{lo}, {hi}{rb}")
        return v

    def bool_(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(key, value, "must be true or false")
        return value

    def str_(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            self.fail(key, value, "must be a string")
        return value


_TOP_REQUIRED = {"num_prompts", "batch_size", "lr", "steps", "skills"}
_TOP_OPTIONAL = {
    "name",
    "description",
    "num_eval_prompts",
    "n_mean",
    "transfer",
    "grad_noise",
    "norm_adv_by_std",
    "seeds",
    "gdro",
    "learner",
}
_GDRO_ENABLE_KEYS = {("prompt", "enable"), ("rollout", "enable")}


def _parse_components(v: _V, where: str, diff: Any) -> list[NormalComponent]:
    if isinstance(diff, dict) and "mixture" in diff:
        v.keys(diff, where, {"mixture"}, set())
        mix = diff["mixture"]
        if not isinstance(mix, list) or not mix:
            v.fail(f"{where}.mixture", mix, "must be a non-empty list of {weight, mean, std}")
        comps = []
        for j, c in enumerate(mix):
            w = f"{where}.mixture[{j}]"
            v.keys(c, w, {"weight", "mean", "std"}, set())
            comps.append(
                NormalComponent(
                    weight=v.float_(f"{w}.weight", c["weight"], lo=0.0, lo_open=True),
                    mean=v.float_(f"{w}.mean", c["mean"], lo=-30, hi=30),
                    std=v.float_(f"{w}.std", c["std"], lo=0.0, hi=30),
                )
            )
        total = sum(c.weight for c in comps)
        for c in comps:
            c.weight /= total
        return comps
    v.keys(diff, where, {"mean", "std"}, set())
    return [
        NormalComponent(
            1.0,
            v.float_(f"{where}.mean", diff["mean"], lo=-30, hi=30),
            v.float_(f"{where}.std", diff["std"], lo=0.0, hi=30),
        )
    ]


def scenario_from_dict(data: Any, source: str = "<dict>") -> Scenario:
    """Validate a scenario mapping; raise :class:`ScenarioError` naming the bad key."""
    v = _V(source)
    d = v.keys(data, "", _TOP_REQUIRED, _TOP_OPTIONAL)
    name = v.str_("name", d.get("name", os.path.splitext(os.path.basename(source))[0] or "scenario"))
    if not _NAME_RE.match(name):
        v.fail("name", name, "must match [A-Za-z0-9_.-]+")
    num_prompts = v.int_("num_prompts", d["num_prompts"], 1)
    batch_size = v.int_("batch_size", d["batch_size"], 1)
    if batch_size > num_prompts:
        v.fail("batch_size", batch_size, f"must be <= num_prompts={num_prompts}")
    n_mean = v.int_("n_mean", d.get("n_mean", 4), 2)
    raw_skills = d["skills"]
    if not isinstance(raw_skills, list) or not raw_skills:
        v.fail("skills", raw_skills, "must be a non-empty list")
    skills: list[Skill] = []
    seen: set[str] = set()
    for i, s in enumerate(raw_skills):
        w = f"skills[{i}]"
        v.keys(s, w, {"name", "frequency", "difficulty"}, {"unsolvable", "transfer"})
        sname = v.str_(f"{w}.name", s["name"])
        if not _NAME_RE.match(sname):
            v.fail(f"{w}.name", sname, "must match [A-Za-z0-9_.-]+ (it becomes a metric key)")
        if sname in seen:
            v.fail(f"{w}.name", sname, "is a duplicate skill name")
        seen.add(sname)
        skills.append(
            Skill(
                name=sname,
                frequency=v.float_(f"{w}.frequency", s["frequency"], lo=0.0, lo_open=True),
                components=_parse_components(v, f"{w}.difficulty", s["difficulty"]),
                unsolvable=v.float_(f"{w}.unsolvable", s.get("unsolvable", 0.0), lo=0.0, hi=1.0, hi_open=True),
                transfer=None
                if s.get("transfer") is None
                else v.float_(f"{w}.transfer", s["transfer"], lo=0.0, hi=1.0),
            )
        )
    if num_prompts < len(skills):
        v.fail("num_prompts", num_prompts, f"must be >= the number of skills ({len(skills)})")
    num_eval = v.int_("num_eval_prompts", d.get("num_eval_prompts", 2000), len(skills))
    gdro = d.get("gdro", {}) or {}
    if not isinstance(gdro, dict):
        v.fail("gdro", gdro, "must be a mapping of verl_ext gdro overrides")
    for section, key in _GDRO_ENABLE_KEYS:
        if isinstance(gdro.get(section), dict) and key in gdro[section]:
            v.fail(f"gdro.{section}.{key}", gdro[section][key], "is set by the method, not the scenario")
    if isinstance(gdro.get("rollout"), dict) and "n_mean" in gdro["rollout"]:
        v.fail(
            "gdro.rollout.n_mean",
            gdro["rollout"]["n_mean"],
            "use the top-level n_mean (it is the budget of every method)",
        )
    lraw = d.get("learner", {}) or {}
    v.keys(lraw, "learner", set(), set(LearnerParams().to_dict()))
    lp = LearnerParams(
        rep_dim=None if lraw.get("rep_dim") is None else v.int_("learner.rep_dim", lraw["rep_dim"], 1),
        feature_overlap=v.float_("learner.feature_overlap", lraw.get("feature_overlap", 0.6), lo=0.0, hi=1.0),
        forgetting=v.float_("learner.forgetting", lraw.get("forgetting", 0.003), lo=0.0, hi=1.0, hi_open=True),
        capacity=v.float_("learner.capacity", lraw.get("capacity", 6.0), lo=0.0, lo_open=True),
        curvature=v.float_("learner.curvature", lraw.get("curvature", 2.0), lo=0.0),
        recovery=v.float_("learner.recovery", lraw.get("recovery", 0.05), lo=0.0, hi=1.0, lo_open=True),
    )
    if lp.rep_dim is not None and lp.rep_dim > 32:
        v.fail("learner.rep_dim", lp.rep_dim, "must be <= 32")
    sc = Scenario(
        name=name,
        description=v.str_("description", d.get("description", "")),
        num_prompts=num_prompts,
        num_eval_prompts=num_eval,
        batch_size=batch_size,
        n_mean=n_mean,
        lr=v.float_("lr", d["lr"], lo=0.0, lo_open=True),
        transfer=v.float_("transfer", d.get("transfer", 0.5), lo=0.0, hi=1.0),
        grad_noise=v.float_("grad_noise", d.get("grad_noise", 0.0), lo=0.0),
        norm_adv_by_std=v.bool_("norm_adv_by_std", d.get("norm_adv_by_std", True)),
        steps=v.int_("steps", d["steps"], 1),
        seeds=v.int_("seeds", d.get("seeds", 3), 1),
        skills=skills,
        gdro=copy.deepcopy(gdro),
        learner=lp,
        source=source,
    )
    # Validate the gdro overrides now (with every adversary on), so a typo fails before any step runs.
    from recipe.gdro.sim.methods import build_gdro_dict  # local import: avoids a cycle
    from verl_ext import GDROConfigError, gdro_config_from_dict

    try:
        gdro_config_from_dict(build_gdro_dict(sc, "joint", {}, seed=0))
    except GDROConfigError as exc:
        raise ScenarioError(f"scenario {source!r}: {exc}") from None
    return sc


def shipped_scenarios() -> list[str]:
    """Names of the scenarios shipped in recipe/gdro/sim/scenarios/."""
    if not os.path.isdir(SCENARIO_DIR):
        return []
    return sorted(os.path.splitext(f)[0] for f in os.listdir(SCENARIO_DIR) if f.endswith((".yaml", ".yml")))


def resolve_scenario_path(name_or_path: Optional[str]) -> str:
    """A file path, or the name of a shipped scenario (``dapo_like``); ``None`` = the default."""
    target = name_or_path or DEFAULT_SCENARIO
    if os.path.isfile(target):
        return target
    for ext in (".yaml", ".yml", ""):
        cand = os.path.join(SCENARIO_DIR, target + ext)
        if os.path.isfile(cand):
            return cand
    raise ScenarioError(
        f"scenario {target!r}: no such file, and not a shipped scenario (shipped: {', '.join(shipped_scenarios())})"
    )


def load_scenario(name_or_path: Optional[str] = None, overrides: Optional[dict[str, Any]] = None) -> Scenario:
    """Load and validate a scenario file or shipped scenario name; ``overrides`` replace top-level keys."""
    path = resolve_scenario_path(name_or_path)
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ScenarioError(f"scenario {path!r}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if isinstance(data, dict) and overrides:
        data = {**data, **overrides}
    return scenario_from_dict(data, source=path)
