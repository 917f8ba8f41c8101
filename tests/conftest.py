"""In CI (``CI=true``) a skipped test fails the run, unless its skip reason is on ``ALLOWED_SKIPS``.

A module-level ``importorskip`` (ray, transfer_queue, psutil) or a ``skipif`` on a missing tool
(ruff) would otherwise let a broken install pass green. Skips are collected from collection reports
(module-level skips) and test reports; at the end of the session any skip whose reason is not
allowed is listed and the exit status becomes 1 (tests failed).

Several test files start a Ray of their own in this one process; :func:`ray_state_is_restored` fails a
test that leaves a ``RAY_*`` variable changed or Ray's cached authentication mode out of step with
``RAY_AUTH_MODE`` (tests/recipe_helpers/ray_env.py says why that breaks the next ``ray.init``).
"""

from __future__ import annotations

import os

import pytest
from recipe_helpers.ray_env import ray_auth_out_of_sync, ray_env_changes, ray_environ

# skip reason -> why it may be skipped in CI
ALLOWED_SKIPS = {
    "flash_attn is installed here": (
        "these tests check how a missing flash_attn is refused; where it is installed (a GPU runner) "
        "there is nothing to refuse"
    ),
    "a GPU is visible": "the preflight's CPU refusal path cannot be taken where CUDA is available",
}

_SKIPS: list[tuple[str, str]] = []


# The longest test files, longest first (measured with --durations): pytest-xdist's --dist loadfile
# (run_scripts/test.sh) hands files to its workers in collection order, so these start first and the
# short ones fill in around them, instead of one worker finishing a long file alone at the end.
LONGEST_FILES = (
    "tests/gdro/test_real_path.py",
    "tests/gdro/test_real_path_async.py",
    "tests/gdro/test_async_evictions.py",
    "tests/gdro/lab/backends/test_cpu_backend.py",
    "tests/gdro/test_weight_sync.py",
    "tests/gdro/test_real_path_separate_async.py",
    "tests/run_scripts/test_signals.py",
    "tests/gdro/backends/test_cpu_platform.py",
    "tests/run_scripts/test_run_scripts.py",
    "tests/test_docs.py",
    "tests/gdro/test_recipe_dry_run.py",
    "tests/gdro/test_recipe_e2e.py",
    "tests/test_packaging.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FILES)))  # stable: others keep order


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


@pytest.fixture(autouse=True)
def ray_state_is_restored():
    """After each test (and its function-scoped fixtures, monkeypatch included): the ``RAY_*`` variables
    are as before it, but for the one Ray sets itself, and Ray's cached auth mode agrees with them."""
    before = ray_environ()
    yield
    changes = ray_env_changes(before, ray_environ())
    problems = [f"{k} was {old!r}, left {new!r}" for k, (old, new) in sorted(changes.items())]
    out_of_sync = ray_auth_out_of_sync()
    if out_of_sync:
        problems.append(out_of_sync)
    if problems:
        pytest.fail("Ray state leaked out of this test: " + "; ".join(problems), pytrace=False)
