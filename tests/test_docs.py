"""The README's `gdro.*` reference is the dataclasses' truth: every key, and its default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from verl_ext.config import GDROConfig

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(gdro\.[a-z_.]+)` \| `([^`]*)` \|")


def dataclass_defaults() -> dict[str, object]:
    out: dict[str, object] = {}
    cfg = GDROConfig()
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            for sub in dataclasses.fields(value):
                out[f"gdro.{field.name}.{sub.name}"] = getattr(value, sub.name)
        else:
            out[f"gdro.{field.name}"] = value
    return out


def readme_table() -> dict[str, object]:
    rows = {}
    for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"README lists {m.group(1)} twice"
            rows[m.group(1)] = yaml.safe_load(m.group(2))
    return rows


def test_readme_gdro_reference_lists_every_key_with_its_default():
    expected = dataclass_defaults()
    documented = readme_table()
    assert sorted(documented) == sorted(expected), (
        f"missing from README: {sorted(set(expected) - set(documented))}; "
        f"not a config key: {sorted(set(documented) - set(expected))}"
    )
    wrong = {k: (documented[k], v) for k, v in expected.items() if documented[k] != v}
    assert not wrong, f"README default differs from verl_ext/config.py (README, code): {wrong}"


def test_readme_links_to_docs_that_exist():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 12_000, "the README is a user's manual: at most 12 KB"
    for target in re.findall(r"\]\(((?:docs/)?[A-Za-z_./-]+\.(?:md|txt|bib))(?:#[^)]*)?\)", text):
        assert (REPO / target).exists(), f"README links to {target}, which is not in the repository"
    for name in ("LICENSE",):
        assert (REPO / name).exists()


def _tables(lines: list[str]) -> list[list[str]]:
    """Every Markdown table in ``lines``: its header, separator and rows."""
    out, cur = [], []
    for ln in lines + [""]:
        if ln.startswith("|"):
            cur.append(ln)
        elif cur:
            out.append(cur)
            cur = []
    return [t for t in out if len(t) > 1 and t[1].startswith("|---")]


def test_readme_results_tables_are_the_ones_commands_write():
    """The README's only table is the config reference: results live in docs/ (issue 24 item 8). The
    tiny-LM study's tables in docs/tiny_lm.md are `study report`'s (results/tiny_lm_study/REPORT.md,
    which tests/test_study.py regenerates from the committed runs), except the previous study's, kept
    under its own heading; the simulator's headline table is sim_sweep's headline.md."""
    from recipe.gdro.experiments.sweep import COMPARE_HEADER

    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert [t[0] for t in _tables(lines)] == ["| key | default | meaning |"]
    doc = (REPO / "docs" / "tiny_lm.md").read_text(encoding="utf-8")
    study = doc[doc.index("## The study") :]
    current, _, previous = study.partition("## The previous study (before protocol files)")
    assert previous, "the pre-protocol study's tables sit under their own heading"
    report = (REPO / "results" / "tiny_lm_study" / "REPORT.md").read_text(encoding="utf-8")
    for table in _tables(current.splitlines()):
        assert "\n".join(table) in report, f"docs/tiny_lm.md table not in REPORT.md: {table[0]}"
    sim = (REPO / "docs" / "simulator.md").read_text(encoding="utf-8").splitlines()
    assert COMPARE_HEADER in sim, "docs/simulator.md's headline table is sim_sweep's headline.md"


def _headline_rows(path: Path) -> dict[tuple[str, str], str]:
    """(scenario, method) → row of the first COMPARE_HEADER table in a markdown file."""
    from recipe.gdro.experiments.sweep import COMPARE_HEADER

    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index(COMPARE_HEADER) + 2
    rows = {}
    for ln in lines[start:]:
        if not ln.startswith("| "):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[(cells[0], cells[1])] = ln
    return rows


def test_simulator_headline_numbers_are_what_the_code_produces():
    """Not only the header: every row's lr in docs/simulator.md's headline table is the shipped tuned lr,
    and two rows (dapo_like grpo and rollout_gdro, seeds 0-4 at tuned lr) are
    recomputed with the current code and must match cell for cell, so stale numbers fail."""
    from recipe.gdro.experiments.sweep import _compare_rows
    from recipe.gdro.sim.methods import lookup_tuned_lr
    from recipe.gdro.sim.scenario import load_scenario
    from recipe.gdro.sim.simulate import run_experiment

    headline = _headline_rows(REPO / "docs" / "simulator.md")
    for (scen, method), line in headline.items():
        lr = lookup_tuned_lr(scen, "shared", [method])[method]
        assert f"| {scen} | {method} | ×{lr:g} |" in line, (line, lr)
    methods = ["grpo", "rollout_gdro"]
    sc = load_scenario("dapo_like")
    res = run_experiment(
        sc,
        "unused",
        methods=methods,
        seeds=list(range(5)),
        lr_scales=lookup_tuned_lr("dapo_like", "shared", methods),
        workers=1,
        progress=False,
        plots=False,
        write_files=False,
    )
    got = _compare_rows("dapo_like", res, res["methods"]["grpo"], methods)
    # _compare_rows gives each row as its list of cells; the docs hold the rendered Markdown row
    pasted = [[c.strip() for c in headline[("dapo_like", m)].strip("|").split("|")] for m in methods]
    assert [[str(c) for c in row] for row in got] == pasted


def test_no_references_to_documents_outside_the_repository():
    """The design brief lives outside the repository: code and docs cite the paper and docs/ instead."""
    marker = "DESIGN" + " §"  # spelt in two parts so this file does not match itself
    offenders = []
    for pattern in ("**/*.py", "**/*.md", "**/*.sh", "**/*.yaml"):
        for path in REPO.glob(pattern):
            if ".venv" in path.parts or "outputs" in path.parts:
                continue
            if marker in path.read_text(encoding="utf-8", errors="replace"):
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_docs_links_name_files_and_headings_that_exist():
    """Every relative link of the README and docs/*.md names a file that exists and, after `#`, one of its
    headings: a figure has one home and the others link to it, so a renamed heading must not break a link."""
    broken = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (md.parent / file).resolve() if file else md
            if not path.exists():
                broken.append(f"{md.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{md.name}: {target} (no such heading)")
    assert not broken, broken


def test_docs_total_at_most_80_kb():
    sizes = {p.name: len(p.read_bytes()) for p in (REPO / "docs").glob("*.md")}
    assert sum(sizes.values()) <= 80_000, f"docs/ is {sum(sizes.values())} bytes (at most 80 KB): {sizes}"
