"""A study's protocol file (YAML, pre-registered by commit), its content hash, and the ledger of
spent evaluation seeds.

:func:`load_protocol` reads a protocol (the tiny-LM study's are ``protocols/tiny_lm.yaml``, v1,
``protocols/tiny_lm_v2.yaml``, the default, and ``protocols/tiny_lm_v3.yaml``; their keys are documented there;
``shape.mix`` is a task mix, skill -> share, ``data_prep.arith.mix_shares``) in two steps, as the GDRO config
and the simulator's scenario are read. First the typed parse: :class:`ProtocolSpec` and its sections are
dataclasses validated by ``pydantic.TypeAdapter`` (strict numbers, booleans and strings, unknown keys
refused, every bounded number a :class:`verl_ext.config.Range` in its field's metadata). ``shape:`` (and
each ``long.regimes`` entry) is checked against :class:`~recipe.gdro.lab.experiments.direct.DirectConfig`'s
own fields and types (:func:`shape_schema`), so a field added there is accepted here unedited; likewise
``primary.power`` against :class:`~recipe.gdro.lab.results.stats.PowerRule` and an endpoint against
:class:`~recipe.gdro.lab.results.outcomes.Endpoint`. Then the design rules (:func:`_check_design`): seeds of
different roles never overlap, every method is in the registry (``config/method/``), every arm names a
tuned method, the reference's shapes keep prompts x n equal. Every refusal is one :class:`ProtocolError`
line naming the file, the key (``tuning.lr_grid[1]``), the value and what it must be. A key added to a
section is a field added to its dataclass below (with a ``Range`` when it is a bounded number).
Its ``hash`` is the SHA-256 of the file's bytes: every run records it, and a report refuses runs of two hashes.

An optional ``endpoints:`` section declares named endpoints (:class:`recipe.gdro.lab.results.outcomes.Endpoint`:
``k``, ``split``, a ``tail`` by ``base_below`` or ``skills``, ``worst_skill`` with an optional
``min_base``); their names may be used as ``primary.metrics`` / ``confirm.metrics``, and
``primary.power.mde`` (a target MDE per primary metric, with any :class:`recipe.gdro.lab.results.stats.PowerRule`
field beside it) plans the primary seeds per endpoint; without ``mde``, ``primary.power`` holds v1's rule
(``target``, ``floor``, ``fraction``). An endpoint on the test split needs ``shape.num_test`` > 0.

The ledger (``results/tiny_lm_study/spent_seeds.yaml``) lists evaluation seeds already run, with the
protocol hash that ran them. :meth:`Ledger.spend` refuses a seed spent under another hash (a
changed protocol must take new seeds) and records the new ones before any of them runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import pydantic
import yaml
from annotated_types import MinLen
from pydantic import ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, with_config
from pydantic_core import PydanticCustomError

from data_prep.arith import mix_shares
from data_prep.common import DataPrepError
from recipe.gdro.config.registry import method_names
from recipe.gdro.lab.results.outcomes import Endpoint, Tail
from recipe.gdro.lab.results.stats import PowerRule
from verl_ext.atomic import atomic_replace
from verl_ext.config import TYPE_WANTED, Choice, Range, error_key, fields_at, range_violation, value_at

PROTOCOL_DIR = Path(__file__).resolve().parent / "protocols"
TINY_LM_V1 = PROTOCOL_DIR / "tiny_lm.yaml"  # issue 26's study; its runs and report stay as committed
TINY_LM_PROTOCOL = PROTOCOL_DIR / "tiny_lm_v2.yaml"  # the current one (issue 33): the CLI's default
TINY_LM_V3 = PROTOCOL_DIR / "tiny_lm_v3.yaml"  # issue 45: tail-directed allocation (pass --protocol)
# An arm's lr_scale may name this instead of a number: the reference's mean weighted-advantage token
# mass over the method's, both at their tuned settings on every tuning seed (equal step size).
MASS_SCALE = "reference_mass"
METRICS = ("final_exact", "final_exact_worst", "final_sampled", "final_sampled_worst")
# DirectConfig fields the study sets for each run (study.run_config): a shape may not set them
PER_RUN = ("method", "lr", "seed", "gdro", "warm_start", "temperature", "device")
LEGACY_POWER = ("target", "floor", "fraction")  # v1's rule (study.py power_plan), read when there is no mde


class ProtocolError(ValueError):
    """A protocol file or ledger that cannot be used; the message names the file and key."""


# ---------------------------------------------------------------------------------------- the schema
_FORBID_EXTRA = ConfigDict(extra="forbid")


def _range(**bounds: Any) -> dict[str, Any]:
    """Field metadata: the allowed values as verl_ext's :class:`~verl_ext.config.Range` (a list's or a
    mapping's items each)."""
    return {"range": Range(**bounds)}


def _custom(check: typing.Callable[[Any], Any]) -> pydantic.PlainValidator:
    """A pydantic validator from ``check``, which returns the value or raises ValueError(why)."""

    def validate(value: Any) -> Any:
        try:
            return check(value)
        except ValueError as e:
            raise PydanticCustomError("protocol", str(e)) from None

    return pydantic.PlainValidator(validate)


def _yaml_number(value: Any) -> float:
    """A number, or a string YAML 1.1 left unread: PyYAML reads ``5e-5`` (no dot) as a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError("is not a number") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError("is not a number")


def _lr_scale(value: Any) -> float | str:
    """A multiplier of the tuned lr (a number >= 0) or :data:`MASS_SCALE`."""
    if value == MASS_SCALE:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and Range(lo=0).violation(value) is None:
        return float(value)
    raise ValueError(f"must be a number >= 0 or {MASS_SCALE}")


# a number, or a string PyYAML (YAML 1.1) left unread, as it does 5e-5
YamlNumber = Annotated[float, _custom(_yaml_number)]
Seeds = list[StrictInt]
SEED = _range(lo=0, integer=True)  # every seed role's metadata
PROBABILITY = _range(lo=0, hi=1, lo_open=True, hi_open=True)  # alpha, power, a confidence
_STRICT = {int: StrictInt, float: StrictFloat, str: StrictStr, bool: StrictBool}


def _strict(annotation: Any) -> Any:
    """``annotation`` (a field type of a plain dataclass) with pydantic's strict scalars: ``int`` ->
    ``StrictInt``, ``str | None`` -> ``StrictStr | None``, ``tuple[str, ...]`` -> ``list[StrictStr]`` (YAML
    has lists), ``dict`` -> a mapping."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _STRICT:
        return _STRICT[annotation]
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_strict(a) for a in args)]  # noqa: UP007 (a runtime-built union)
    if origin in (list, tuple):
        return list[_strict(args[0])] if args else list
    if annotation is dict or origin is dict:
        return dict[str, Any]
    return annotation


def typed_like(
    source: type,
    name: str,
    *,
    leave_out: tuple[str, ...] = (),
    ranges: dict[str, Range] | None = None,
    retyped: dict[str, Any] | None = None,
    more: tuple[tuple[str, Any, Any], ...] = (),
) -> type:
    """A schema dataclass with the fields of the plain dataclass ``source`` (its defaults; its types made
    strict, :func:`_strict`, or ``retyped``), less ``leave_out``, plus ``more`` (``make_dataclass`` fields),
    validated by pydantic with unknown keys refused; ``ranges`` bound fields by name. A field added to
    ``source`` is accepted here without an edit."""
    ranges, retyped = ranges or {}, retyped or {}
    hints = typing.get_type_hints(source)
    unknown = (set(ranges) | set(retyped)) - {f.name for f in dataclasses.fields(source)}
    assert not unknown, f"{name}: {sorted(unknown)} are not fields of {source.__name__}"
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(source):
        if f.name not in leave_out:
            meta = {"range": ranges[f.name]} if f.name in ranges else {}
            spec = field(default=f.default, default_factory=f.default_factory, metadata=meta)
            fields.append((f.name, retyped.get(f.name, _strict(hints[f.name])), spec))
    return with_config(_FORBID_EXTRA)(dataclasses.make_dataclass(name, [*fields, *more]))


@functools.cache
def shape_schema() -> type:
    """``shape:`` (and a ``long.regimes`` entry): DirectConfig's fields but :data:`PER_RUN`, strict types.
    DirectConfig is imported here, not at the top: direct.py imports torch and verl (seconds)."""
    from recipe.gdro.lab.experiments.direct import DirectConfig

    positive = Range(lo=1, integer=True)
    bounds = {name: positive for name in ("steps", "prompts", "n", "num_train", "num_val", "max_new_tokens")}
    at_least_0 = Range(lo=0, integer=True)
    bounds |= {"num_test": at_least_0, "data_seed": at_least_0, "eval_every": at_least_0, "eval_samples": positive}
    return typed_like(DirectConfig, "ShapeSpec", leave_out=PER_RUN, ranges=bounds)


class Split(Choice):
    test = "test"
    val = "val"


TailSpec = typed_like(Tail, "TailSpec", ranges={"base_below": Range(0, 1)})
EndpointSpec = typed_like(
    Endpoint,
    "EndpointSpec",
    leave_out=("name",),  # the endpoint's key in ``endpoints:``
    ranges={"k": Range(lo=1, integer=True), "min_base": Range(0, 1)},
    retyped={"tail": Optional[TailSpec], "split": Split},
)
PowerSpec = typed_like(
    PowerRule,
    "PowerSpec",
    ranges={
        "alpha": PROBABILITY["range"],
        "target_power": PROBABILITY["range"],
        "sd_confidence": PROBABILITY["range"],
        "min_tuning_seeds": Range(lo=2, integer=True),
        "max_seeds": Range(lo=1, integer=True),
    },
    more=(
        ("mde", Optional[dict[str, StrictFloat]], field(default=None, metadata=_range(lo=0, hi=1, lo_open=True))),
        ("target", Optional[StrictFloat], field(default=None, metadata=PROBABILITY)),
        ("floor", Optional[StrictFloat], field(default=None, metadata=_range(lo=0, hi=1))),
        ("fraction", Optional[StrictFloat], field(default=None, metadata=_range(lo=0))),
    ),
)


@with_config(_FORBID_EXTRA)
@dataclass(frozen=True)
class Arm:
    """An exploratory arm (``explore.arms``): a registry method, gdro overrides, an lr multiplier of the
    method's tuned lr (or :data:`MASS_SCALE`), the binner warm start, and whether it is a control."""

    name: StrictStr
    method: StrictStr
    gdro: dict[str, Any] = field(default_factory=dict)
    lr_scale: Annotated[Any, _custom(_lr_scale)] = 1.0  # float | MASS_SCALE
    warm_start: StrictInt = field(default=0, metadata=_range(lo=0, integer=True))
    control: StrictBool = False


@with_config(_FORBID_EXTRA)
@dataclass
class ReferenceShape:
    prompts: StrictInt = field(metadata=_range(lo=1, integer=True))
    n: StrictInt = field(metadata=_range(lo=1, integer=True))


@with_config(_FORBID_EXTRA)
@dataclass
class TuningSpec:
    seeds: Annotated[Seeds, MinLen(1)] = field(metadata=SEED)
    lr_grid: Annotated[list[YamlNumber], MinLen(1)] = field(metadata=_range(lo=0, lo_open=True))
    methods: Annotated[list[StrictStr], MinLen(1)]
    power_seeds: Seeds = field(default_factory=list, metadata=SEED)
    extend: StrictInt = field(default=0, metadata=_range(lo=0, integer=True))  # grid extensions per side
    reference_shapes: Optional[Annotated[list[ReferenceShape], MinLen(1)]] = None


@with_config(_FORBID_EXTRA)
@dataclass
class PrimarySpec:
    reference: StrictStr
    methods: Annotated[list[StrictStr], MinLen(1)]
    metrics: Annotated[list[StrictStr], MinLen(1)]
    seed_pool: Annotated[Seeds, MinLen(1)] = field(metadata=SEED)
    alpha: StrictFloat = field(default=0.05, metadata=PROBABILITY)
    power: PowerSpec = field(default_factory=PowerSpec)  # type: ignore[valid-type]


@with_config(_FORBID_EXTRA)
@dataclass
class ExploreSpec:
    seeds: Seeds = field(metadata=SEED)
    reference: StrictStr = "grpo"
    criterion: StrictStr = "final_exact"
    arms: list[Arm] = field(default_factory=list)


@with_config(_FORBID_EXTRA)
@dataclass
class ConfirmSpec:
    seeds: Seeds = field(metadata=SEED)
    metrics: Annotated[list[StrictStr], MinLen(1)]
    alpha: StrictFloat = field(default=0.05, metadata=PROBABILITY)


@with_config(_FORBID_EXTRA)
@dataclass
class LongSpec:
    seeds: Seeds = field(default_factory=list, metadata=SEED)
    methods: list[StrictStr] = field(default_factory=list)
    regimes: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> shape overrides (shape_schema)


@with_config(_FORBID_EXTRA)
@dataclass
class ProtocolSpec:
    """The protocol file as written (``protocols/tiny_lm_v2.yaml`` says what each key is)."""

    shape: dict[str, Any]  # DirectConfig's fields (shape_schema)
    tuning: TuningSpec
    primary: PrimarySpec
    explore: ExploreSpec
    confirm: ConfirmSpec
    long: LongSpec
    name: Optional[StrictStr] = None
    results: Optional[Annotated[StrictStr, MinLen(1)]] = None  # a folder, relative to the repository
    eval_temperature: StrictFloat = field(default=1.0, metadata=_range(lo=0, lo_open=True))
    endpoints: Optional[dict[str, Optional[EndpointSpec]]] = None  # type: ignore[valid-type]
    solvable: StrictFloat = field(default=0.1, metadata=_range(lo=0, hi=1))


@dataclass(frozen=True)
class Protocol:
    path: str
    hash: str
    data: dict[str, Any]

    # the sections, as read (see protocols/tiny_lm.yaml)
    @property
    def shape(self) -> dict[str, Any]:
        return dict(self.data["shape"])

    @property
    def eval_temperature(self) -> float:
        return float(self.data.get("eval_temperature", 1.0))

    @property
    def tuning(self) -> dict[str, Any]:
        return self.data["tuning"]

    @property
    def primary(self) -> dict[str, Any]:
        return self.data["primary"]

    @property
    def explore(self) -> dict[str, Any]:
        return self.data["explore"]

    @property
    def confirm(self) -> dict[str, Any]:
        return self.data["confirm"]

    @property
    def long(self) -> dict[str, Any]:
        return self.data["long"]

    @property
    def endpoints(self) -> dict[str, Endpoint]:
        """The declared endpoints (``endpoints:``, name -> spec of :class:`Endpoint`), usable as metrics."""
        return {name: Endpoint.from_dict(name, spec or {}) for name, spec in (self.data.get("endpoints") or {}).items()}

    @property
    def results(self) -> str | None:
        """The results folder the protocol declares (repo-relative), or None (the CLI's default)."""
        return self.data.get("results")

    @property
    def solvable(self) -> float:
        return float(self.data.get("solvable", 0.1))

    def arms(self) -> list[Arm]:
        return [Arm(**a) for a in self.explore.get("arms", [])]

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms() if a.name == name)


def _fail(path: Path | str, key: str, msg: str) -> None:
    raise ProtocolError(f"{path}: {key}: {msg}")


@functools.cache
def _adapter(schema: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(schema)


def typed_parse(path: Path, schema: type, data: Any, at: tuple[Any, ...] = ()) -> Any:
    """``data`` validated as ``schema`` (one of the dataclasses above), or pydantic's first error as one
    :class:`ProtocolError` line (``at``: where ``data`` sits in the file); then every field's range."""
    try:
        spec = _adapter(schema).validate_python(data)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        kind, loc = error["type"], tuple(error["loc"])
        if kind == "invalid_key" or loc[-1:] == ("[key]",):  # a mapping's key that is not a string
            where = error_key(at + loc[: -1 if kind == "invalid_key" else -2]) or "the top level"
            _fail(path, where, f"key {error['input']!r} must be a string")
        key, value = error_key(at + loc), value_at(data, loc)
        if kind in ("missing", "missing_argument"):
            _fail(path, key, "missing (a required key)")
        if kind == "unexpected_keyword_argument":
            names = fields_at(schema, loc)
            close = difflib.get_close_matches(str(loc[-1]), names, n=1)
            where = error_key(at + loc[:-1]) or "the top level"
            hint = f" (did you mean {close[0]}?)" if close else ""
            _fail(path, key, f"unknown key{hint}; the keys under {where}: {', '.join(names)}")
        if kind in ("dataclass_type", "dataclass_exact_type", "dict_type"):
            _fail(path, key or "the file", f"{value!r} must be a mapping")
        if kind in ("too_short", "too_long") and error["ctx"].get("min_length", 0) != 1:
            bound = (
                f"at least {error['ctx']['min_length']}"
                if kind == "too_short"
                else f"at most {error['ctx']['max_length']}"
            )
            _fail(path, key, f"{value!r} must hold {bound} items")
        if kind in TYPE_WANTED:
            _fail(path, key, f"{value!r} must be {TYPE_WANTED[kind]}")
        _fail(
            path, key, f"{value!r} {error['msg']}" if kind in ("protocol", "choice") else f"{value!r}: {error['msg']}"
        )
    bad = range_violation(spec, error_key(at))
    if bad:
        _fail(path, bad[0], f"{bad[1]!r} {bad[2]}")
    return spec


def load_protocol(path: str | Path = TINY_LM_PROTOCOL) -> Protocol:
    """Read and check the protocol at ``path`` (ProtocolError naming the key at fault; module docstring)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = yaml.safe_load(raw)
    except OSError as e:
        raise ProtocolError(f"{path}: cannot read the protocol: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ProtocolError(f"{path}: not YAML: {e}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{path}: a protocol is a mapping of sections")
    spec: ProtocolSpec = typed_parse(path, ProtocolSpec, data)
    shape = typed_parse(path, shape_schema(), data["shape"], ("shape",))
    for name, regime in spec.long.regimes.items():
        typed_parse(path, shape_schema(), regime, ("long", "regimes", name))
    _check_design(path, spec, shape, set(data["primary"].get("power") or {}))
    data["tuning"]["lr_grid"] = list(spec.tuning.lr_grid)  # as numbers (YAML 1.1 reads 5e-5 as a string)
    return Protocol(str(path), hashlib.sha256(raw).hexdigest(), data)


def _check_design(path: Path, spec: ProtocolSpec, shape: Any, power_keys: set[str]) -> None:
    """The rules between fields (module docstring), on the typed parse; ``power_keys``: those written
    under ``primary.power``."""
    tuning, primary = spec.tuning, spec.primary
    mix = getattr(shape, "mix", None)
    if mix is not None:  # its keys are skills, its values shares: data_prep's own check names the one at fault
        try:
            mix_shares(mix)
        except DataPrepError as e:
            _fail(path, "shape.mix", str(e))
    if tuning.extend and len(tuning.lr_grid) < 2:
        _fail(path, "tuning.extend", "extending the grid needs at least two lrs (their ratio is the step)")
    sizes = sorted({s.prompts * s.n for s in tuning.reference_shapes or []})
    if len(sizes) > 1:  # the reference is tuned at equal rollouts per step
        _fail(path, "tuning.reference_shapes", f"prompts x n differ: {sizes}; keep it equal")
    known = set(method_names())
    named = {"tuning.methods": tuning.methods, "primary.methods": primary.methods}
    for key, m in [(f"{k}[{i}]", m) for k, ms in named.items() for i, m in enumerate(ms)]:
        if m not in known:
            _fail(path, key, f"{m!r} is not in config/method/ ({', '.join(sorted(known))})")
    tuned = set(tuning.methods)
    used = {
        "primary.reference": [primary.reference],
        "primary.methods": primary.methods,
        "explore.reference": [spec.explore.reference],
        **{f"explore.arms[{i}].method": [a.method] for i, a in enumerate(spec.explore.arms)},
        "long.methods": spec.long.methods,
    }
    for key, methods in used.items():
        for m in methods:
            if m not in tuned:
                _fail(path, key, f"{m!r} is not a tuned method (tuning.methods: {', '.join(tuning.methods)})")
    endpoints = spec.endpoints or {}
    for name, ep in endpoints.items():
        try:
            Endpoint.from_dict(name, dataclasses.asdict(ep) if ep else {})
        except ValueError as e:
            _fail(path, f"endpoints.{name}", str(e))
        if (ep is None or ep.split == Split.test) and not shape.num_test > 0:
            _fail(path, f"endpoints.{name}", "reads the test split: set shape.num_test > 0")
    allowed = [*METRICS, *endpoints]
    metrics = {"primary.metrics": primary.metrics, "confirm.metrics": spec.confirm.metrics}
    listed = [(f"{k}[{i}]", m) for k, ms in metrics.items() for i, m in enumerate(ms)]
    for key, m in [*listed, ("explore.criterion", spec.explore.criterion)]:
        if m not in allowed:
            _fail(path, key, f"{m!r}: use one of {', '.join(allowed)}")
    _check_power(path, primary, power_keys)
    names: set[str] = set()
    for i, arm in enumerate(spec.explore.arms):
        if arm.name in names:
            _fail(path, f"explore.arms[{i}].name", f"{arm.name!r} appears twice")
        names.add(arm.name)
    roles = {
        "tuning.seeds": tuning.seeds,
        "tuning.power_seeds": tuning.power_seeds,
        "primary.seed_pool": primary.seed_pool,
        "explore.seeds": spec.explore.seeds,
        "confirm.seeds": spec.confirm.seeds,
        "long.seeds": spec.long.seeds,
    }
    seen: dict[int, str] = {}
    for role, seeds in roles.items():
        for s in seeds:
            if s in seen and seen[s] != role:
                _fail(path, role, f"seed {s} is also in {seen[s]}: each seed has one role")
            seen[s] = role


def _check_power(path: Path, primary: PrimarySpec, given: set[str]) -> None:
    """``primary.power``: an MDE per primary metric with PowerRule's fields beside it, or v1's rule."""
    power, rule = primary.power, [f.name for f in dataclasses.fields(PowerRule)]
    if power.mde is not None:
        if set(power.mde) != set(primary.metrics):
            _fail(
                path,
                "primary.power.mde",
                f"{sorted(power.mde)}: a target minimum detectable effect for each of primary.metrics "
                f"({', '.join(primary.metrics)})",
            )
        for key in sorted(given & set(LEGACY_POWER)):
            _fail(
                path,
                "primary.power",
                f"{key!r} is v1's rule ({', '.join(LEGACY_POWER)}); beside mde give the fields of "
                f"results/stats.py PowerRule ({', '.join(rule)})",
            )
    for key in sorted(given & set(rule) if power.mde is None else ()):
        _fail(
            path, f"primary.power.{key}", f"a setting of the mde plan: give primary.power.mde, or v1's {LEGACY_POWER}"
        )


# ------------------------------------------------------------------------------------- the ledger
class Ledger:
    """The spent evaluation seeds (module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            data = yaml.safe_load(self.path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ProtocolError(f"{self.path}: not YAML: {e}") from None
        spent = data.get("spent", [])
        for i, e in enumerate(spent):
            if not (isinstance(e, dict) and {"protocol", "stage", "seeds"} <= set(e)):
                raise ProtocolError(f"{self.path}: spent[{i}]: needs protocol, stage and seeds")
        return spent

    def conflicts(self, protocol_hash: str, seeds: list[int]) -> dict[int, str]:
        """Seeds among ``seeds`` already spent under another protocol: seed -> that protocol."""
        out: dict[int, str] = {}
        for e in self.entries():
            if e["protocol"] != protocol_hash:
                for s in e["seeds"]:
                    if s in seeds:
                        out.setdefault(int(s), str(e["protocol"]))
        return out

    def check_unspent(self, protocol_hash: str, stage: str, seeds: list[int]) -> None:
        """Refuse seeds spent by another protocol (:class:`ProtocolError` naming the first and the count)."""
        bad = self.conflicts(protocol_hash, seeds)
        if bad:
            s, other = next(iter(bad.items()))
            raise ProtocolError(
                f"{self.path}: evaluation seed {s} was spent by protocol {other[:16]}; a changed protocol must take "
                f"new seeds ({len(bad)} of {stage}'s {len(seeds)} seeds are spent)"
            )

    def spend(self, protocol_hash: str, stage: str, seeds: list[int]) -> None:
        """Refuse seeds spent by another protocol; record ``seeds`` for this one (before they run)."""
        self.check_unspent(protocol_hash, stage, seeds)
        entries = self.entries()
        done = {int(s) for e in entries if e["protocol"] == protocol_hash and e["stage"] == stage for s in e["seeds"]}
        new = [int(s) for s in seeds if int(s) not in done]
        if not new:
            return
        head = ""
        if self.path.exists():
            text = self.path.read_text(encoding="utf-8")
            head = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
        entries.append({"protocol": protocol_hash, "stage": stage, "seeds": new})
        body = yaml.safe_dump({"spent": entries}, sort_keys=False, default_flow_style=None, width=120)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_replace(self.path, "w") as f:
            f.write(head + body)
