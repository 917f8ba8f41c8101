"""A launch checks its config once: ``entry()`` checks before Hydra's job runtime, Hydra's ``main()`` runs
that checked config, and the trainer takes the GDRO config it is handed instead of re-checking.

Each test runs a real launch through :func:`recipe.gdro.main_gdro.entry` (Hydra's job runtime included)
up to verl's ``run_ppo``, which is replaced by a recorder: everything before it is the recipe's code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import open_dict
from recipe_helpers import standins as S
from recipe_helpers.overrides import paper_overrides

from recipe.gdro import main_gdro
from recipe.gdro.startup import checks
from verl_ext import gdro_config_to_dict


@pytest.fixture
def launch_argv(tmp_path, monkeypatch) -> list[str]:
    """A real launch's overrides (paper settings, Rollout-GDRO on): data, a local model folder, checkpoints."""
    data = Path(S.write_parquet(str(tmp_path / "dapo_train.parquet"), S.math_rows(list(range(10, 266)))))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # Hydra's outputs/ folder goes here
    argv = [a for a in paper_overrides(data) if a != "gdro.dry_run=true"]
    return [
        *argv,
        f"actor_rollout_ref.model.path={model}",
        f"launch.ckpt_root={tmp_path}/ckpt",
        "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash_attn on CPU
    ]


def counting(monkeypatch, module, name: str, calls: list[str]):
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def test_a_launch_runs_its_checks_once_and_hands_them_to_the_trainer(launch_argv, monkeypatch):
    import verl.trainer.main_ppo as verl_main

    calls: list[str] = []
    counting(monkeypatch, main_gdro, "check_launch", calls)
    counting(monkeypatch, main_gdro, "prepare", calls)
    launched = []
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: launched.append(config))
    assert main_gdro.entry(launch_argv) == 0
    assert calls == ["check_launch", "prepare"]  # once each, before Hydra's job runtime
    assert len(launched) == 1
    config = launched[0]
    expected = checks.prepare(config, data_files=checks.DATA_REQUIRED, launch=True)
    handed = checks.handed_over(config)
    assert handed is not None and handed.runs is True
    assert gdro_config_to_dict(handed.gdro) == gdro_config_to_dict(expected.gdro)
    assert handed.gdro.rollout.enable is True
    assert handed.metrics_file == expected.recipe.metrics_file == "gdro_metrics.jsonl"
    # what crosses to the Ray TaskRunner is plain data in the config (run_ppo pickles nothing else)
    assert isinstance(config[checks.CHECKED_KEY]["gdro"]["rollout"]["n_max"], int)


def test_the_trainer_uses_what_it_is_handed_and_checks_nothing(launch_argv, monkeypatch):
    """The trainer built from the launched config calls none of the build / check functions."""
    import verl.trainer.main_ppo as verl_main

    from recipe.gdro import trainer as T

    launched = []
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: launched.append(config))
    assert main_gdro.entry([*launch_argv, "gdro.metrics_file=handed.jsonl"]) == 0
    config = launched[0]
    calls: list[str] = []
    for name in ("build_gdro_config", "build_recipe_config", "check_budget", "check_supported_modes"):
        counting(monkeypatch, T, name, calls)
    trainer = T.GDROTrainerSync(config)
    assert calls == []
    assert trainer.gdro_config.rollout.enable is True and trainer.gdro_enabled
    assert trainer.gdro_metrics_path().endswith("/handed.jsonl")
    # built outside a launch (no handed-over key), the trainer checks the section itself, once
    with open_dict(config):
        del config[checks.CHECKED_KEY]
    T.GDROTrainerSync(config)
    assert sorted(calls) == ["build_gdro_config", "build_recipe_config", "check_budget", "check_supported_modes"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["+gdro.rollout.n_mn=2"], "unknown key(s) gdro.rollout.n_mn"),
        (["data.train_batch_size=250"], "Rollout-GDRO budget: data.train_batch_size=250"),
    ],
)
def test_a_refused_launch_exits_2_naming_it_before_run_ppo(launch_argv, monkeypatch, capsys, extra, message):
    import verl.trainer.main_ppo as verl_main

    launched = []
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: launched.append(config))
    assert main_gdro.entry([*launch_argv, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert launched == [] and not Path("outputs").exists()
