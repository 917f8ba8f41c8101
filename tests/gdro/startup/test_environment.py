"""recipe.gdro.startup.environment: every environment variable the recipe reads is checked by the dry run,
and the data check names a symbolic link loop instead of asking for the data to be prepared."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from recipe_helpers.paths import REPO

from recipe.gdro.main_gdro import cli
from recipe.gdro.startup.checks import GDRORecipeError, check_dry_run_data
from recipe.gdro.startup.cli import compose_config
from recipe.gdro.startup.environment import check_environment, cpu_threads, weight_sync_timeout

BAD = {
    "GDRO_WEIGHT_SYNC_TIMEOUT": ["abc", "-1", "0", "inf", "nan"],
    "GDRO_CPU_THREADS": ["0", "two", "-3", "1.5"],
    "GDRO_CPU_PLATFORM": ["yes", "2", "false"],
    "GDRO_CPU_PLATFORM_SKIP_SHIMS": ["shim_nope", "shim_process_group_backend,typo"],
    "VERL_LOGGING_LEVEL": ["abc", "debug"],
    "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": ["abc", "0", "1.5", "-2"],
}


def test_a_bad_weight_sync_timeout_stops_the_dry_run(monkeypatch, capsys):
    """Before, it passed the dry run and was refused only after Ray, the workers and vLLM were up."""
    monkeypatch.setenv("GDRO_WEIGHT_SYNC_TIMEOUT", "abc")
    assert cli(["gdro.dry_run=config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "gdro dry run: error: GDRO_WEIGHT_SYNC_TIMEOUT='abc': expected a positive number of seconds"


@pytest.mark.parametrize("name", sorted(BAD))
def test_every_variable_the_recipe_reads_is_refused_naming_it(name):
    for value in BAD[name]:
        with pytest.raises(GDRORecipeError, match=rf"^{name}={re.escape(repr(value))}"):
            check_environment({name: value})
    check_environment({})  # unset: the defaults
    assert weight_sync_timeout({}) == 900 and weight_sync_timeout({"GDRO_WEIGHT_SYNC_TIMEOUT": "30"}) == 30
    assert cpu_threads({}) == 1 and cpu_threads({"GDRO_CPU_THREADS": "2"}, cpus=2) == 2
    check_environment({"GDRO_CPU_PLATFORM": "0", "GDRO_CPU_PLATFORM_SKIP_SHIMS": "shim_process_group_backend"})


def test_more_cpu_threads_than_cpus_is_refused_before_ray(monkeypatch, capsys):
    """Issue 44 item 5: GDRO_CPU_THREADS=100000 on 2 cores passed, Ray's GCS timed out and the run segfaulted.
    Refused (not clamped) naming the variable and the CPU count."""
    with pytest.raises(
        GDRORecipeError, match=r"^GDRO_CPU_THREADS='3': this machine gives the run 2 CPU\(s\); set at most"
    ):
        cpu_threads({"GDRO_CPU_THREADS": "3"}, cpus=2)
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("GDRO_CPU_THREADS", "100000")
    assert cli(["gdro.dry_run=config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"gdro dry run: error: GDRO_CPU_THREADS='100000': this machine gives the run {cpus} CPU(s); set at most "
        f"GDRO_CPU_THREADS={cpus} (or unset it: 1 thread, the CPU backend's default)"
    )


def test_no_variable_read_by_the_recipe_goes_unchecked():
    """Every variable read in recipe/ and verl_ext/ is one this module checks, or one the docstring of
    check_environment names as parsed where it acts."""
    read = set()
    for path in [*(REPO / "recipe").rglob("*.py"), *(REPO / "verl_ext").rglob("*.py")]:
        text = path.read_text()
        read |= set(re.findall(r"(?:environ\.get|getenv|environ\.setdefault)\(\s*\"([A-Z_]+)\"", text))
        read |= set(re.findall(r"^[A-Z_]+_ENV = \"([A-Z_]+)\"", text, flags=re.M))
    from recipe.gdro.startup import environment

    source = Path(environment.__file__).read_text()
    named = set(re.findall(r"\"((?:GDRO|VERL|TQ)_[A-Z_]+)\"", source))
    named |= set(re.findall(r"``([A-Z_]+)``", environment.check_environment.__doc__))  # parsed where they act
    named.add("VERL_ENGINE_DEVICE")  # set by the cpu platform for verl (setdefault), not read from the user
    assert read <= named, f"read but not checked: {sorted(read - named)}"
    assert set(BAD) <= read  # and the check list is not stale


def test_a_symlink_loop_in_the_data_path_is_named(tmp_path):
    """Before: "missing data file(s) ... Prepare the data"."""
    loop = tmp_path / "data"
    os.symlink(loop, loop)
    config = compose_config([f"data.train_files=['{loop}/train.parquet']", "data.val_files=[]"])
    with pytest.raises(GDRORecipeError, match=rf"{loop} is a symbolic link loop"):
        check_dry_run_data(config, config_only=True)
    config = compose_config([f"data.train_files=['{tmp_path}/absent/train.parquet']", "data.val_files=[]"])
    with pytest.raises(GDRORecipeError, match="missing data file"):
        check_dry_run_data(config, config_only=False)


def test_the_shim_names_checked_before_ray_are_the_cpu_platform_plugins_shims():
    """environment.py names the shims (it may not import the plugin module above it): the two lists agree."""
    from recipe.gdro.backends import cpu_platform
    from recipe.gdro.startup import environment

    assert tuple(shim.__name__ for shim in cpu_platform.SHIMS) == environment.CPU_PLATFORM_SHIMS
