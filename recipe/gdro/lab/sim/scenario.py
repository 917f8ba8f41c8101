"""Scenario files for the GDRO simulator (a SYNTHETIC learner; see docs/simulator.md).

A scenario is a YAML mapping describing a synthetic dataset of "skills" (sub-domains) and the
training budget. Its schema is :class:`ScenarioSpec` (dataclasses validated by ``pydantic.TypeAdapter``
with strict scalars and no unknown keys, as the GDRO config is; ranges are verl_ext's ``Range`` in each field's
``metadata``); every error names the file and the offending key, e.g.
``scenario 'x.yaml': skills[2].difficulty.std=-1.0 must lie in [0, 30]``.

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
        length?:                  this skill's response-length model (fields default to the top level's)
    length?:                      response-length model of every skill (tokens per response):
      correct?: float > 0         1000   mean length of a correct response
      wrong?: float > 0           1000   mean length of a wrong one (failures run longer: wrong > correct)
      spread?: float >= 0         0.0    σ of a lognormal spread around the mean (mean-preserving)
    max_response_length?: int     4096   responses are cut here (a cut response counts as truncated)
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
import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

import yaml
from annotated_types import MinLen
from pydantic import (
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    with_config,
)

from verl_ext.config import TYPE_WANTED, Range, error_key, fields_at, set_fields, value_at

SCENARIO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")
DEFAULT_SCENARIO = "dapo_like"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class ScenarioError(ValueError):
    """A malformed scenario file. The message names the file and the key at fault."""


def _range(**bounds: Any) -> dict[str, Any]:
    """Field metadata: the allowed values as verl_ext's :class:`~verl_ext.config.Range` (the GDRO config's too)."""
    return {"range": Range(**bounds)}


def _pattern(regex: re.Pattern[str], why: str) -> dict[str, Any]:
    """Field metadata: a string must match ``regex``; ``why`` is what the error says it must match."""
    return {"name_pattern": regex, "why": why}  # not "pattern": pydantic would read that key itself


# ---------------------------------------------------------------------------------- schema
@with_config(ConfigDict(extra="forbid"))
@dataclass
class ComponentSpec:
    weight: StrictFloat = field(metadata=_range(lo=0.0, lo_open=True))
    mean: StrictFloat = field(metadata=_range(lo=-30.0, hi=30.0))
    std: StrictFloat = field(metadata=_range(lo=0.0, hi=30.0))


@with_config(ConfigDict(extra="forbid"))
@dataclass
class DifficultySpec:
    """Either ``mean`` and ``std`` (a normal) or ``mixture`` (a list of normal components)."""

    mean: Optional[StrictFloat] = field(default=None, metadata=_range(lo=-30.0, hi=30.0))
    std: Optional[StrictFloat] = field(default=None, metadata=_range(lo=0.0, hi=30.0))
    mixture: Optional[Annotated[list[ComponentSpec], MinLen(1)]] = None


@with_config(ConfigDict(extra="forbid"))
@dataclass
class LengthSpec:
    """Response-length model (tokens): failures run longer when ``wrong`` > ``correct``."""

    correct: Optional[StrictFloat] = field(default=None, metadata=_range(lo=0.0, lo_open=True))
    wrong: Optional[StrictFloat] = field(default=None, metadata=_range(lo=0.0, lo_open=True))
    spread: Optional[StrictFloat] = field(default=None, metadata=_range(lo=0.0, hi=3.0))


@with_config(ConfigDict(extra="forbid"))
@dataclass
class SkillSpec:
    name: StrictStr = field(metadata=_pattern(_NAME_RE, "[A-Za-z0-9_.-]+ (it becomes a metric key)"))
    frequency: StrictFloat = field(metadata=_range(lo=0.0, lo_open=True))
    difficulty: DifficultySpec
    unsolvable: StrictFloat = field(default=0.0, metadata=_range(lo=0.0, hi=1.0, hi_open=True))
    transfer: Optional[StrictFloat] = field(default=None, metadata=_range(lo=0.0, hi=1.0))
    length: LengthSpec = field(default_factory=LengthSpec)


@with_config(ConfigDict(extra="forbid"))
@dataclass
class LearnerParams:
    """Parameters of the shared learner (see recipe/gdro/lab/sim/learner.py)."""

    rep_dim: Optional[StrictInt] = field(default=None, metadata=_range(lo=1, hi=32, integer=True))
    feature_overlap: StrictFloat = field(default=0.6, metadata=_range(lo=0.0, hi=1.0))
    forgetting: StrictFloat = field(default=0.003, metadata=_range(lo=0.0, hi=1.0, hi_open=True))
    capacity: StrictFloat = field(default=6.0, metadata=_range(lo=0.0, lo_open=True))
    curvature: StrictFloat = field(default=2.0, metadata=_range(lo=0.0))
    recovery: StrictFloat = field(default=0.05, metadata=_range(lo=0.0, hi=1.0, lo_open=True))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@with_config(ConfigDict(extra="forbid"))
@dataclass
class ScenarioSpec:
    """The scenario file as written (the module docstring lists every key)."""

    num_prompts: StrictInt = field(metadata=_range(lo=1, integer=True))
    batch_size: StrictInt = field(metadata=_range(lo=1, integer=True))
    lr: StrictFloat = field(metadata=_range(lo=0.0, lo_open=True))
    steps: StrictInt = field(metadata=_range(lo=1, integer=True))
    skills: Annotated[list[SkillSpec], MinLen(1)]
    name: Optional[StrictStr] = field(default=None, metadata=_pattern(_NAME_RE, "[A-Za-z0-9_.-]+"))
    description: StrictStr = ""
    num_eval_prompts: StrictInt = field(default=2000, metadata=_range(lo=1, integer=True))
    n_mean: StrictInt = field(default=4, metadata=_range(lo=2, integer=True))
    transfer: StrictFloat = field(default=0.5, metadata=_range(lo=0.0, hi=1.0))
    grad_noise: StrictFloat = field(default=0.0, metadata=_range(lo=0.0))
    norm_adv_by_std: StrictBool = True
    seeds: StrictInt = field(default=3, metadata=_range(lo=1, integer=True))
    gdro: dict[str, Any] = field(default_factory=dict)
    learner: LearnerParams = field(default_factory=LearnerParams)
    length: LengthSpec = field(default_factory=lambda: LengthSpec(correct=1000.0, wrong=1000.0, spread=0.0))
    max_response_length: StrictInt = field(default=4096, metadata=_range(lo=1, integer=True))


# ---------------------------------------------------------------------------------- runtime form
@dataclass
class NormalComponent:
    weight: float
    mean: float
    std: float


@dataclass
class LengthModel:
    """Tokens of a response: mean ``correct`` or ``wrong``, lognormal spread σ (mean-preserving)."""

    correct: float = 1000.0
    wrong: float = 1000.0
    spread: float = 0.0


@dataclass
class Skill:
    name: str
    frequency: float
    components: list[NormalComponent]
    unsolvable: float = 0.0
    transfer: Optional[float] = None
    length: LengthModel = field(default_factory=LengthModel)


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
    max_response_length: int = 4096
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
                "length": dataclasses.asdict(s.length),
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
            "max_response_length": self.max_response_length,
            "gdro": copy.deepcopy(self.gdro),
        }


# ---------------------------------------------------------------------------------- validation
_GDRO_ENABLE_KEYS = {("prompt", "enable"), ("rollout", "enable")}
_SPEC = TypeAdapter(ScenarioSpec)  # numbers, booleans, strings strict; unknown keys forbidden (with_config)


def _shape_error(src: str, error: Any, data: Any) -> ScenarioError:
    """pydantic's first error as one line naming the file, the key (full path) and the value."""
    kind, loc = error["type"], tuple(error["loc"])
    key, value = error_key(loc), value_at(data, loc)
    if kind == "missing":
        return ScenarioError(f"scenario {src!r}: missing required key(s) {key}")
    if kind == "unexpected_keyword_argument":
        names = fields_at(ScenarioSpec, loc)
        where = error_key(loc[:-1])
        pre = f"{where}." if where else ""
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = f" (did you mean {pre}{close[0]}?)" if close else ""
        return ScenarioError(
            f"scenario {src!r}: unknown key(s) {key}{hint}; "
            f"valid keys{' under ' + where if where else ''}: {', '.join(sorted(names))}"
        )
    if kind in ("dataclass_type", "dataclass_exact_type"):
        return ScenarioError(f"scenario {src!r}: {key or 'top level'} must be a mapping, got {type(value).__name__}")
    return ScenarioError(f"scenario {src!r}: {key}={value!r} must be {TYPE_WANTED.get(kind, error['msg'])}")


def _check_ranges(src: str, spec: ScenarioSpec) -> None:
    """Every field's ``range`` (:class:`~verl_ext.config.Range`) and ``pattern`` metadata, recursively."""
    for key, metadata, value in set_fields(spec):
        if "name_pattern" in metadata and not metadata["name_pattern"].match(value):
            raise ScenarioError(f"scenario {src!r}: {key}={value!r} must match {metadata['why']}")
        why = metadata["range"].violation(value) if "range" in metadata else None
        if why:
            raise ScenarioError(f"scenario {src!r}: {key}={value!r} {why}")


def _fail(src: str, key: str, value: Any, why: str) -> None:
    raise ScenarioError(f"scenario {src!r}: {key}={value!r} {why}")


def _components(src: str, where: str, diff: DifficultySpec) -> list[NormalComponent]:
    if diff.mixture is not None:
        if diff.mean is not None or diff.std is not None:
            _fail(src, where, "mean/std with mixture", "must give either mean and std, or mixture")
        total = sum(c.weight for c in diff.mixture)
        return [NormalComponent(c.weight / total, c.mean, c.std) for c in diff.mixture]
    for k in ("mean", "std"):
        if getattr(diff, k) is None:
            raise ScenarioError(f"scenario {src!r}: missing required key(s) {where}.{k} (or give {where}.mixture)")
    return [NormalComponent(1.0, float(diff.mean), float(diff.std))]


def _length(top: LengthSpec, own: LengthSpec) -> LengthModel:
    pick = {
        k: getattr(own, k) if getattr(own, k) is not None else getattr(top, k) for k in ("correct", "wrong", "spread")
    }
    default = LengthModel()
    return LengthModel(**{k: float(v if v is not None else getattr(default, k)) for k, v in pick.items()})


def scenario_from_dict(data: Any, source: str = "<dict>") -> Scenario:
    """Validate a scenario mapping against :class:`ScenarioSpec`; raise :class:`ScenarioError` naming the bad key."""
    src = source
    if isinstance(data, dict):  # an empty section (``gdro:`` with nothing under it) means its defaults
        data = {k: v for k, v in data.items() if not (v is None and k in ("gdro", "learner", "length"))}
    try:
        spec: ScenarioSpec = _SPEC.validate_python(data)
    except ValidationError as exc:
        raise _shape_error(src, exc.errors()[0], data) from None
    _check_ranges(src, spec)
    name = spec.name or os.path.splitext(os.path.basename(source))[0] or "scenario"
    if not _NAME_RE.match(name):
        _fail(src, "name", name, "must match [A-Za-z0-9_.-]+")
    if spec.batch_size > spec.num_prompts:
        _fail(src, "batch_size", spec.batch_size, f"must be <= num_prompts={spec.num_prompts}")
    seen: set[str] = set()
    skills: list[Skill] = []
    for i, s in enumerate(spec.skills):
        w = f"skills[{i}]"
        if s.name in seen:
            _fail(src, f"{w}.name", s.name, "is a duplicate skill name")
        seen.add(s.name)
        skills.append(
            Skill(
                name=s.name,
                frequency=float(s.frequency),
                components=_components(src, f"{w}.difficulty", s.difficulty),
                unsolvable=float(s.unsolvable),
                transfer=None if s.transfer is None else float(s.transfer),
                length=_length(spec.length, s.length),
            )
        )
    if spec.num_prompts < len(skills):
        _fail(src, "num_prompts", spec.num_prompts, f"must be >= the number of skills ({len(skills)})")
    if spec.num_eval_prompts < len(skills):
        _fail(src, "num_eval_prompts", spec.num_eval_prompts, f"must be >= the number of skills ({len(skills)})")
    gdro = dict(spec.gdro or {})
    for section, key in _GDRO_ENABLE_KEYS:
        if isinstance(gdro.get(section), dict) and key in gdro[section]:
            _fail(src, f"gdro.{section}.{key}", gdro[section][key], "is set by the method, not the scenario")
    if isinstance(gdro.get("rollout"), dict) and "n_mean" in gdro["rollout"]:
        _fail(
            src,
            "gdro.rollout.n_mean",
            gdro["rollout"]["n_mean"],
            "use the top-level n_mean (it is the budget of every method)",
        )
    sc = Scenario(
        name=name,
        description=spec.description,
        num_prompts=spec.num_prompts,
        num_eval_prompts=spec.num_eval_prompts,
        batch_size=spec.batch_size,
        n_mean=spec.n_mean,
        lr=float(spec.lr),
        transfer=float(spec.transfer),
        grad_noise=float(spec.grad_noise),
        norm_adv_by_std=spec.norm_adv_by_std,
        steps=spec.steps,
        seeds=spec.seeds,
        skills=skills,
        gdro=copy.deepcopy(gdro),
        learner=spec.learner,
        max_response_length=spec.max_response_length,
        source=source,
    )
    # Validate the gdro overrides now (with every adversary on), so a typo fails before any step runs.
    from recipe.gdro.lab.sim.methods import build_gdro_dict  # local import: avoids a cycle
    from verl_ext import GDROConfigError, gdro_config_from_dict

    try:
        gdro_config_from_dict(build_gdro_dict(sc, "joint_gdro", {}, seed=0))
    except GDROConfigError as exc:
        raise ScenarioError(f"scenario {source!r}: {exc}") from None
    return sc


def shipped_scenarios() -> list[str]:
    """Names of the scenarios shipped in recipe/gdro/lab/sim/scenarios/."""
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
