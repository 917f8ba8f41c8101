"""In CI (``CI=true``) a skipped test fails the run, unless its skip reason is on ``ALLOWED_SKIPS``.

A module-level ``importorskip`` (ray, transfer_queue, psutil) or a ``skipif`` on a missing tool
(ruff) would otherwise let a broken install pass green. Skips are collected from collection reports
(module-level skips) and test reports; at the end of the session any skip whose reason is not
allowed is listed and the exit status becomes 1 (tests failed).
"""

from __future__ import annotations

import os

import pytest

# skip reason -> why it may be skipped in CI
ALLOWED_SKIPS = {
    "flash_attn is installed here": (
        "these tests check how a missing flash_attn is refused; where it is installed (a GPU runner) "
        "there is nothing to refuse"
    ),
    "a GPU is visible": "the preflight's CPU refusal path cannot be taken where CUDA is available",
}

_SKIPS: list[tuple[str, str]] = []


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text.removeprefix("Skipped: ").strip()


def pytest_collectreport(report):
    if report.skipped:
        _SKIPS.append((report.nodeid, _reason(report)))


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, _reason(report)))


def unexpected_skips() -> list[tuple[str, str]]:
    return [(node, reason) for node, reason in _SKIPS if reason not in ALLOWED_SKIPS]


def pytest_terminal_summary(terminalreporter):
    if in_ci() and unexpected_skips():
        terminalreporter.section("unexpected skips (CI=true: a skip fails the run)", red=True)
        for node, reason in unexpected_skips():
            terminalreporter.line(f"{node}: {reason}")
        terminalreporter.line("allowed skip reasons: tests/conftest.py ALLOWED_SKIPS")


def pytest_sessionfinish(session, exitstatus):
    if in_ci() and unexpected_skips() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    """test_cpu_backend.py, then test_multinode.py, run last. Each starts and stops a Ray of its own, and
    after them an in-process ``ray.init`` in the same pytest process failed to start its GCS: every
    test_recipe_e2e.py test errored ("InvalidAuthToken") in two clean-clone runs of the whole suite,
    where both files ran before it. Alone each file passes; e2e then cpu_backend, and cpu_backend then
    multinode, passed in those orders. Which of the two leaves the state behind is not found yet."""
    last = {"test_cpu_backend.py": 1, "test_multinode.py": 2}
    items.sort(key=lambda item: last.get(item.path.name, 0))
