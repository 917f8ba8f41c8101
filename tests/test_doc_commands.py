"""Every launch command a script header, README.md or docs/*.md shows runs: as a configuration dry run
(``gdro.dry_run=config``: no data, GPU or Ray), in-process through ``recipe.gdro.main_gdro.cli``, plus
the bash-level checks of the launcher (the script exists and parses, no variable ``gdro_common.sh``
refuses as removed, flags it accepts)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from recipe_helpers.paths import REPO

from recipe.gdro.main_gdro import cli

COMMAND = re.compile(
    r"((?:[A-Z_]+=\S*\s+)*(?:bash run_scripts/[\w.]+\.sh|python -m recipe\.gdro\.main_gdro)\b[^`#\n]*)"
)
COMMON = REPO / "run_scripts" / "common" / "gdro_common.sh"
# The launchers' own flags (gdro_common.sh, tiny_real_path_env.sh, cpu_backend_tiny.sh, quickstart.sh)
FLAGS = {"DRY_RUN": {"0", "1", "true", "false", "config"}, "PREFLIGHT": {"0", "1", "true", "false"}}


@dataclass(frozen=True)
class Shown:
    where: str  # file:line
    env: tuple[tuple[str, str], ...]
    script: str | None  # run_scripts/<name>.sh, or None for python -m recipe.gdro.main_gdro
    args: tuple[str, ...]


def _lines(path: Path) -> list[tuple[int, str]]:
    """Where commands are shown: a script's header comments; a Markdown file's code blocks, fenced or
    indented (lines joined at a trailing backslash), and its inline code spans of five words or more."""
    text = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".sh":
        return [(i, ln[1:]) for i, ln in enumerate(text, 1) if ln.startswith("#")]
    out, fenced, i = [], False, 0
    while i < len(text):
        ln, start = text[i], i + 1
        if ln.startswith("```"):
            fenced = not fenced
        elif fenced or ln.startswith("    "):  # a fenced or an indented code block
            while ln.endswith("\\") and i + 1 < len(text):
                i += 1
                ln = ln[:-1] + " " + text[i].strip()
            out.append((start, ln))
        else:
            out += [(start, span) for span in re.findall(r"`([^`]+)`", ln) if len(span.split()) > 4]
        i += 1
    return out


def _parse(where: str, text: str) -> list[Shown]:
    text = re.sub(r"\s\[[^\]=]*\]", " ", text)  # [hydra overrides], [--steps 30]: placeholders
    tokens = [t for t in shlex.split(os.path.expandvars(text)) if t != "..."]
    env = []
    while "=" in tokens[0] and tokens[0].split("=")[0].isupper():
        env.append(tuple(tokens.pop(0).split("=", 1)))
    script = tokens[1] if tokens[0] == "bash" else None
    args = tokens[2:] if script else tokens[3:]
    # METHOD=grpo|prompt_gdro: one command per alternative
    alternatives = [[(k, v) for v in val.split("|")] for k, val in env]
    combos = [[]]
    for alt in alternatives:
        combos = [c + [a] for c in combos for a in alt]
    return [Shown(where, tuple(c), script, tuple(args)) for c in combos]


def shown_commands() -> list[Shown]:
    files = sorted((REPO / "run_scripts").glob("*.sh")) + [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
    out = []
    for path in files:
        for line, text in _lines(path):
            for m in COMMAND.finditer(text):
                out += _parse(f"{path.relative_to(REPO)}:{line}", m.group(1).strip())
    return out


SHOWN = shown_commands()
_GROUPED = re.compile(r"run_scripts/(?:qwen3_(1\.7b|4b|8b)|(tiny))_(grpo|prompt_gdro|rollout_gdro|joint_gdro)\.sh")


def argv_of(cmd: Shown) -> list[str] | None:
    """The recipe's arguments the command launches with (gdro_common.sh: groups, data, then the
    user's), or None for a script that does not launch the recipe through gdro_launch."""
    if cmd.script is None:
        return list(cmd.args)
    m = _GROUPED.fullmatch(cmd.script)
    if not m:
        return None
    size = m.group(1) or m.group(2)
    data = os.path.expanduser("~/data/dapo")
    return [f"size={size}", f"method={m.group(3)}", f"data.train_files={data}/train.parquet", *cmd.args]


def test_the_docs_show_the_launches_this_test_runs():
    where = {c.where.split(":")[0] for c in SHOWN}
    assert len([c for c in SHOWN if c.script and c.script.startswith("run_scripts/qwen3_")]) >= 12 * 5
    assert {"README.md", "docs/cluster.md", "docs/reproducing.md", "docs/recipe.md"} <= where
    assert any(c.script is None for c in SHOWN), "README's direct python -m recipe.gdro.main_gdro line"


REMOVED = re.findall(r'^  "([A-Z_]+)=', COMMON.read_text(encoding="utf-8"), re.M)


def test_shown_commands_pass_the_launchers_bash_checks():
    """No header or doc tells a user to set a variable the launcher refuses (exit 2)."""
    assert "NNODES" in REMOVED and "PAPER_EXACT" in REMOVED
    bad = []
    for cmd in SHOWN:
        script = REPO / cmd.script if cmd.script else None
        if script is not None and not script.is_file():
            bad.append(f"{cmd.where}: no such script {cmd.script}")
        for name, value in cmd.env:
            if name in REMOVED:
                bad.append(f"{cmd.where}: {name} is refused by gdro_common.sh (GDRO_REMOVED_VARS)")
            if name in FLAGS and value.lower() not in FLAGS[name]:
                bad.append(f"{cmd.where}: {name}={value} is not a value the launcher accepts")
            if name == "METHOD" and not (REPO / "recipe/gdro/config/method" / f"{value}.yaml").is_file():
                bad.append(f"{cmd.where}: METHOD={value} is not a method")
    assert not bad, "\n".join(bad)


def test_shown_scripts_parse():
    scripts = sorted({c.script for c in SHOWN if c.script})
    proc = subprocess.run(
        ["bash", "-c", 'for f in "$@"; do bash -n "$f" || exit 1; done', "_", *scripts], cwd=REPO, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr.decode()


RUNS = sorted({tuple(a) for a in map(argv_of, SHOWN) if a is not None})


@pytest.mark.parametrize("argv", RUNS, ids=[" ".join(a)[:80] for a in RUNS])
def test_shown_launch_dry_runs(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli([*argv, "gdro.dry_run=config"])
    shown = [c.where for c in SHOWN if argv_of(c) == list(argv)]
    assert status == 0, f"{shown}: exit {status}: {err.getvalue()[-600:]}"
