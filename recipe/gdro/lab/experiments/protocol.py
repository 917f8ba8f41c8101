"""A study's protocol file (YAML, pre-registered by commit), its content hash, and the ledger of
spent evaluation seeds.

:func:`load_protocol` reads and checks a protocol (the tiny-LM study's are ``protocols/tiny_lm.yaml``,
v1, ``protocols/tiny_lm_v2.yaml``, the default, and ``protocols/tiny_lm_v3.yaml``; their keys are
documented there; ``shape.mix`` is a task mix, skill -> share, ``data_prep.arith.mix_shares``): seeds of
different roles never overlap, every method is in the registry (``config/method/``), every arm names
a tuned method, the reference's shapes keep prompts x n equal. Its ``hash`` is the SHA-256 of the
file's bytes: every run records it, and a report refuses runs of two hashes.

An optional ``endpoints:`` section declares named endpoints (:class:`recipe.gdro.lab.results.outcomes.Endpoint`:
``k``, ``split``, a ``tail`` by ``base_below`` or ``skills``, ``worst_skill`` with an optional
``min_base``); their names may be used as ``primary.metrics`` / ``confirm.metrics``, and
``primary.power.mde`` (a target MDE per primary metric, with any :class:`recipe.gdro.lab.results.stats.PowerRule`
field beside it) plans the primary seeds per endpoint. An endpoint on the test split needs
``shape.num_test`` > 0.

The ledger (``results/tiny_lm_study/spent_seeds.yaml``) lists evaluation seeds already run, with the
protocol hash that ran them. :meth:`Ledger.spend` refuses a seed spent under another hash (a
changed protocol must take new seeds) and records the new ones before any of them runs.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from data_prep.arith import mix_shares
from data_prep.common import DataPrepError
from recipe.gdro.config.registry import method_names
from recipe.gdro.lab.results.outcomes import Endpoint
from recipe.gdro.lab.results.stats import PowerRule
from verl_ext.atomic import atomic_replace

PROTOCOL_DIR = Path(__file__).resolve().parent / "protocols"
TINY_LM_V1 = PROTOCOL_DIR / "tiny_lm.yaml"  # issue 26's study; its runs and report stay as committed
TINY_LM_PROTOCOL = PROTOCOL_DIR / "tiny_lm_v2.yaml"  # the current one (issue 33): the CLI's default
TINY_LM_V3 = PROTOCOL_DIR / "tiny_lm_v3.yaml"  # issue 45: tail-directed allocation (pass --protocol)
# An arm's lr_scale may name this instead of a number: the reference's mean weighted-advantage token
# mass over the method's, both at their tuned settings on every tuning seed (equal step size).
MASS_SCALE = "reference_mass"
METRICS = ("final_exact", "final_exact_worst", "final_sampled", "final_sampled_worst")


class ProtocolError(ValueError):
    """A protocol file or ledger that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class Arm:
    name: str
    method: str
    gdro: dict[str, Any] = field(default_factory=dict)
    lr_scale: float | str = 1.0  # a multiplier of the method's tuned lr, or MASS_SCALE
    warm_start: int = 0
    control: bool = False


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


def load_protocol(path: str | Path = TINY_LM_PROTOCOL) -> Protocol:
    """Read and check the protocol at ``path`` (ProtocolError naming the key at fault)."""
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
    for key in ("shape", "tuning", "primary", "explore", "confirm", "long"):
        if not isinstance(data.get(key), dict):
            _fail(path, key, "missing section (a mapping)")
    if "results" in data and not (isinstance(data["results"], str) and data["results"]):
        _fail(path, "results", f"{data['results']!r}: a folder (relative to the repository)")
    mix = data["shape"].get("mix")
    if mix is not None:
        if not isinstance(mix, dict):
            _fail(path, "shape.mix", f"{mix!r}: a mapping of skill name to its share of the rows")
        try:
            mix_shares(mix)
        except DataPrepError as e:
            _fail(path, "shape.mix", str(e))
    known = set(method_names())
    tuning = data["tuning"]
    for key in ("seeds", "lr_grid", "methods"):
        if not isinstance(tuning.get(key), list) or not tuning[key]:
            _fail(path, f"tuning.{key}", "must be a non-empty list")
    # YAML 1.1 (PyYAML) reads 5e-5 (no dot) as a string: every lr is read as a number, or refused.
    for i, lr in enumerate(tuning["lr_grid"]):
        try:
            tuning["lr_grid"][i] = float(lr)
        except (TypeError, ValueError):
            _fail(path, f"tuning.lr_grid[{i}]", f"{lr!r} is not a number")
        if not (math.isfinite(tuning["lr_grid"][i]) and tuning["lr_grid"][i] > 0):
            _fail(path, f"tuning.lr_grid[{i}]", f"{lr!r}: an lr must be a finite number > 0")
    if not isinstance(tuning.get("extend", 0), int) or tuning.get("extend", 0) < 0:
        _fail(path, "tuning.extend", f"{tuning.get('extend')!r}: extensions of the lr grid per side, an integer >= 0")
    if tuning.get("extend") and len(tuning["lr_grid"]) < 2:
        _fail(path, "tuning.extend", "extending the grid needs at least two lrs (their ratio is the step)")
    shapes = tuning.get("reference_shapes")
    if shapes is not None:
        if not isinstance(shapes, list) or not shapes:
            _fail(path, "tuning.reference_shapes", "a non-empty list of {prompts, n}")
        sizes = set()
        for i, shape in enumerate(shapes):
            if not isinstance(shape, dict) or set(shape) != {"prompts", "n"}:
                _fail(path, f"tuning.reference_shapes[{i}]", f"{shape!r}: a mapping of exactly prompts and n")
            if not all(isinstance(v, int) and v > 0 for v in shape.values()):
                _fail(path, f"tuning.reference_shapes[{i}]", f"{shape!r}: prompts and n are integers > 0")
            sizes.add(shape["prompts"] * shape["n"])
        if len(sizes) > 1:  # the reference is tuned at equal rollouts per step
            _fail(path, "tuning.reference_shapes", f"prompts x n differ: {sorted(sizes)}; keep it equal")
    for m in [*tuning["methods"], data["primary"].get("reference"), *data["primary"].get("methods", [])]:
        if m not in known:
            _fail(path, "methods", f"{m!r} is not in config/method/ ({', '.join(sorted(known))})")
    tuned = set(tuning["methods"])
    if data["primary"]["reference"] not in tuned or not set(data["primary"]["methods"]) <= tuned:
        _fail(path, "primary", "every primary method and the reference must be tuned (tuning.methods)")
    endpoints = data.get("endpoints") or {}
    if not isinstance(endpoints, dict):
        _fail(path, "endpoints", "a mapping of endpoint name to its spec (k, split, tail, worst_skill, min_base)")
    for name, spec in endpoints.items():
        try:
            ep = Endpoint.from_dict(str(name), spec or {})
        except (TypeError, ValueError, AttributeError) as e:
            _fail(path, f"endpoints.{name}", str(e))
        if ep.split == "test" and not int(data["shape"].get("num_test", 0)) > 0:
            _fail(path, f"endpoints.{name}", "reads the test split: set shape.num_test > 0")
        if ep.split not in ("test", "val"):
            _fail(path, f"endpoints.{name}", f"split {ep.split!r}: use test or val")
    for m in data["primary"].get("metrics", []) + data["confirm"].get("metrics", []):
        if m not in METRICS and m not in endpoints:
            _fail(path, "metrics", f"{m!r}: use one of {', '.join([*METRICS, *endpoints])}")
    criterion = data["explore"].get("criterion", "final_exact")
    if criterion not in METRICS and criterion not in endpoints:
        _fail(path, "explore.criterion", f"{criterion!r}: use one of {', '.join([*METRICS, *endpoints])}")
    power = dict(data["primary"].get("power", {}))
    mdes = power.pop("mde", None)
    if mdes is not None:
        if not isinstance(mdes, dict) or set(mdes) != set(data["primary"].get("metrics", [])):
            _fail(path, "primary.power.mde", "a target minimum detectable effect for each of primary.metrics")
        try:
            PowerRule(**power)
        except TypeError as e:
            _fail(path, "primary.power", f"{e} (beside mde: the fields of results/stats.py PowerRule)")
    if not data["primary"].get("seed_pool"):
        _fail(path, "primary.seed_pool", "must list the evaluation seeds")
    names = set()
    for i, a in enumerate(data["explore"].get("arms", [])):
        try:
            arm = Arm(**a)
        except TypeError as e:
            _fail(path, f"explore.arms[{i}]", f"{e}")
        if arm.method not in tuned:
            _fail(path, f"explore.arms[{i}].method", f"{arm.method!r} is not a tuned method")
        if isinstance(arm.lr_scale, str) and arm.lr_scale != MASS_SCALE:
            _fail(path, f"explore.arms[{i}].lr_scale", f"{arm.lr_scale!r}: a number or {MASS_SCALE}")
        if arm.name in names:
            _fail(path, f"explore.arms[{i}].name", f"{arm.name!r} appears twice")
        names.add(arm.name)
    for m in data["long"].get("methods", []):
        if m not in tuned:
            _fail(path, "long.methods", f"{m!r} is not a tuned method")
    roles = {
        "tuning.seeds": tuning["seeds"],
        "tuning.power_seeds": tuning.get("power_seeds", []),
        "primary.seed_pool": data["primary"]["seed_pool"],
        "explore.seeds": data["explore"].get("seeds", []),
        "confirm.seeds": data["confirm"].get("seeds", []),
        "long.seeds": data["long"].get("seeds", []),
    }
    seen: dict[int, str] = {}
    for role, seeds in roles.items():
        for s in seeds:
            if not isinstance(s, int):
                _fail(path, role, f"seed {s!r} is not an integer")
            if s in seen and seen[s] != role:
                _fail(path, role, f"seed {s} is also in {seen[s]}: each seed has one role")
            seen[s] = role
    return Protocol(str(path), hashlib.sha256(raw).hexdigest(), data)


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
