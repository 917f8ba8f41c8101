"""Write the two copies of the ``gdro.*`` defaults from the dataclasses, their one source.

``verl_ext/config.py`` (the controllers' keys) and ``startup/recipe_config.py`` (the recipe's) hold
each key's default, type, range (``Range``) and one-line ``brief`` in field metadata. This writes

* the ``gdro:`` block of ``recipe/gdro/config/gdro_trainer.yaml`` and
* the ``gdro.*`` table of ``README.md``,

each between its ``BEGIN``/``END`` marker lines, leaving the rest of the file alone::

    python -m recipe.gdro.startup.gen_config           # rewrite both
    python -m recipe.gdro.startup.gen_config --check   # exit 1 naming a stale file (the suite runs this)
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import stat
import sys
import tempfile
import typing
from dataclasses import MISSING, Field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from recipe.gdro.startup.recipe_config import RecipeConfig
from verl_ext.config import Choice, GDROConfig

ROOT = Path(__file__).resolve().parents[3]
YAML_FILE = ROOT / "recipe" / "gdro" / "config" / "gdro_trainer.yaml"
README = ROOT / "README.md"
COMMAND = "python -m recipe.gdro.startup.gen_config"
BEGIN = "BEGIN gdro keys: gen_config writes these"  # from the dataclasses: edit those, then run COMMAND
END = "END gdro keys"
# The recipe's YAML ties n̄ to verl's rollout.n; everything else is the dataclass default.
YAML_VALUES = {"gdro.rollout.n_mean": "${actor_rollout_ref.rollout.n}"}


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _plain(value: Any) -> Any:
    """A default as YAML reads it: a choice is its string, except DryRun's ``false``, a YAML boolean."""
    return yaml.safe_load(value.value) if isinstance(value, Choice) else value


def walk(cls: type = GDROConfig, prefix: str = "gdro") -> Iterator[tuple[str, Field, Any, bool]]:
    """``(key, field, default, is_section)`` for every section (a dataclass) and leaf below ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}.{f.name}"
        if is_dataclass(hints[f.name]):
            yield key, f, None, True
            yield from walk(hints[f.name], key)
        else:
            yield key, f, _plain(_default(f)), False


def all_keys() -> Iterator[tuple[str, Field, Any, bool]]:
    yield from walk(GDROConfig)
    yield from walk(RecipeConfig)


def _text(s: str) -> str:
    """reST (``x``, :mod:`x`) as plain text for a YAML comment."""
    return re.sub(r":\w+:`([^`]*)`", r"\1", s).replace("``", "")


def scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip().removesuffix("...").strip()


def yaml_block() -> str:
    """The ``gdro:`` section: every key at its default, a comment of its brief (and range) above it."""
    out = ["gdro:"]
    for key, f, default, section in all_keys():
        pad = "  " * key.count(".")
        if section:
            out += ["", f"{pad}# {_text(f.metadata['help'])}", f"{pad}{f.name}:"]
            continue
        note = _text(f.metadata["brief"])
        if "range" in f.metadata:
            note += f"; range {f.metadata['range'].text()}"
        value = YAML_VALUES.get(key, scalar(default))
        out += [f"{pad}# {note}", f"{pad}{f.name}: {value}"]
    return "\n".join(out)


def _cell(s: str) -> str:
    return re.sub(r"``([^`]*)``", r"`\1`", s).replace("|", "\\|")


def readme_table() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, f, default, section in all_keys():
        if not section:
            rows.append(f"| `{key}` | `{scalar(default)}` | {_cell(f.metadata['brief'])} |")
    return "\n".join(rows)


def _splice(path: Path, body: str, opening: str, closing: str = "") -> str:
    """``path``'s text with the lines between its two marker comments replaced by ``body``."""
    text = path.read_text(encoding="utf-8")
    begin, end = f"{opening} {BEGIN}{closing}\n", f"\n{opening} {END}{closing}"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"gen_config: {path}: needs one line `{begin.strip()}` and one `{end.strip()}`")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}{body}{end}{tail}"


def generated() -> dict[Path, str]:
    """Each file as the generator writes it."""
    return {YAML_FILE: _splice(YAML_FILE, yaml_block(), "#"), README: _splice(README, readme_table(), "<!--", " -->")}


def stale() -> list[Path]:
    return [p for p, text in generated().items() if p.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for p in bad:
            print(f"{p.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if bad else 0
    changed = {p: text for p, text in generated().items() if p.read_text(encoding="utf-8") != text}
    try:
        staged = stage_all(changed)
    except OSError as e:
        print(f"gen_config: error: {e}; nothing written (the files stay in step)", file=sys.stderr)
        return 2
    for p, tmp in staged.items():
        os.replace(tmp, p)
        print(f"wrote {_shown(p)}")
    return 0


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def stage_all(texts: dict[Path, str]) -> dict[Path, str]:
    """Every file's new text written in full to a temporary file beside it (its mode kept), before any file
    is replaced: the caller renames them all, so a file that cannot be written (read-only, a full disk, a
    file-size limit) leaves every file as it was, never one rewritten and the other stale. Raises
    :class:`OSError` naming the file after removing the temporary files already written."""
    staged: dict[Path, str] = {}
    try:
        for path, text in texts.items():
            if not os.access(path, os.W_OK):
                raise OSError(errno.EACCES, f"{_shown(path)} is not writable by this user")
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged[path] = tmp
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise OSError(e.errno, f"cannot write {_shown(path)} ({e.strerror})") from None
    except OSError:
        for tmp in staged.values():
            os.unlink(tmp)
        raise
    return staged


if __name__ == "__main__":
    sys.exit(main())
