"""A launch composes its config once and checks it once (``entry()``, no Hydra job runtime), and the
trainer takes the GDRO config it is handed instead of re-checking.

Each test runs a real launch through :func:`recipe.gdro.main_gdro.entry` up to verl's ``run_ppo``,
which is replaced by a recorder: everything before it is the recipe's code.
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
    assert calls == ["check_launch", "prepare"]  # once each, before Ray
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


def test_a_launch_composes_its_config_once(launch_argv, monkeypatch):
    """Hydra's config loader runs once per launch (before: entry's compose_config, then @hydra.main's)."""
    import verl.trainer.main_ppo as verl_main
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    calls: list[str] = []
    counting(monkeypatch, ConfigLoaderImpl, "load_configuration", calls)
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: None)
    assert main_gdro.entry(launch_argv) == 0
    assert calls == ["load_configuration"]
    assert not Path("outputs").exists()  # no Hydra job runtime: no outputs/<date>/<time>/ folder


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
    assert trainer.gdro_config.rollout.enable is True and trainer.gdro_runs
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


# ----------------------------------------------------------------------------------- verl's trainer registry
def test_the_trainer_is_verls_registry_entry_for_the_recipes_key():
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    from recipe.gdro import task_runner as TR
    from recipe.gdro.lab.backends.cpu import CPUBackendMixin, prepare_cpu_config
    from recipe.gdro.startup.cli import compose_config
    from recipe.gdro.trainer import GDROTrainerSync

    config = compose_config([])
    assert config.trainer.v1.trainer_mode == checks.GDRO_TRAINER_MODE == "gdro_sync"
    assert get_trainer_cls("gdro_sync") is GDROTrainerSync is TR.select_trainer_cls(config)
    assert get_trainer_cls("sync") is PPOTrainerSync  # verl's own key is untouched
    cpu = prepare_cpu_config(compose_config(["gdro.backend=cpu"]))
    assert cpu.trainer.v1.trainer_mode == "gdro_sync_cpu"
    cls = get_trainer_cls("gdro_sync_cpu")
    assert issubclass(cls, CPUBackendMixin) and issubclass(cls, GDROTrainerSync)
    assert prepare_cpu_config(cpu).trainer.v1.trainer_mode == "gdro_sync_cpu"  # idempotent, registered once
    assert get_trainer_cls("gdro_sync_cpu") is cls
    verl_cpu = get_trainer_cls(
        prepare_cpu_config(compose_config(["trainer.v1.trainer_mode=sync"])).trainer.v1.trainer_mode
    )
    assert issubclass(verl_cpu, PPOTrainerSync) and not issubclass(verl_cpu, GDROTrainerSync)


def test_the_gdro_trainer_runs_verls_sync_loop(launch_argv, monkeypatch):
    """verl's base class branches on ``self.trainer_mode == "sync"`` (replay buffer, refill, resume): the GDRO
    trainer reports verl's mode, reads ``trainer.v1.sync`` and keeps the registry key it was selected by."""
    import verl.trainer.main_ppo as verl_main
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from recipe.gdro.trainer import GDROTrainerSync

    launched = []
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: launched.append(config))
    assert main_gdro.entry(launch_argv) == 0
    trainer = GDROTrainerSync(launched[0])
    assert trainer.trainer_mode == "sync" and trainer.trainer_key == "gdro_sync"
    assert type(trainer.replay_buffer) is ReplayBuffer


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_verls_own_trainers_are_refused_with_an_adversary_on(mode):
    from recipe.gdro.startup.cli import compose_config

    config = compose_config(["gdro.rollout.enable=true", f"trainer.v1.trainer_mode={mode}"])
    with pytest.raises(checks.GDRORecipeError, match=rf"trainer\.v1\.trainer_mode='{mode}' .*gdro_sync"):
        checks.check_supported_modes(config, checks.build_gdro_config(config))
    off = compose_config([f"trainer.v1.trainer_mode={mode}"])
    checks.check_supported_modes(off, checks.build_gdro_config(off))  # GDRO off: verl's business
    assert not checks.observes_only(off, checks.build_gdro_config(off))  # verl's trainer: no binner


def test_the_cpu_backend_imports_nothing_above_it():
    import ast

    for path in (Path(main_gdro.__file__).parent / "backends").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("recipe.gdro."):
                    assert name.split(".")[2] in ("backends", "startup", "tinylm"), (path.name, name)
