"""Fast tests of the GDRO recipe's config, start-up checks and metrics file (no Ray, no TransferQueue)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf
from recipe_helpers import standins as S
from recipe_helpers.paths import REPO

from recipe.gdro.results.metrics_io import (
    append_metrics_jsonl,
    read_metrics_jsonl,
    rewind_metrics_jsonl,
)
from recipe.gdro.startup import checks
from recipe.gdro.startup.checks import GDRORecipeError
from recipe.gdro.startup.cli import compose_config
from recipe.gdro.startup.recipe_config import (
    DryRun,
    recipe_config_from_dict,
)
from verl_ext import GDROConfigError, PromptIdError, gdro_config_from_dict, gdro_config_to_dict


@pytest.fixture(scope="module")
def default_config():
    return compose_config([])


def compose(*overrides: str):
    return compose_config(list(overrides))


def test_recipe_keys_are_typed_choices():
    """gdro.dry_run is a real three-way choice (a bool that also took the string "config" before), and
    gdro.backend a typed choice: anything else is refused naming the key, with a did-you-mean."""
    assert [recipe_config_from_dict({"dry_run": v}).dry_run for v in (False, True, "config")] == [
        DryRun.false,
        DryRun.true,
        DryRun.config,
    ]
    for value, hint in (("maybe", ""), ("confg", "did you mean config?"), (1, ""), ("yes", "")):
        with pytest.raises(GDROConfigError, match=r"gdro\.dry_run=") as e:
            recipe_config_from_dict({"dry_run": value})
        assert hint in str(e.value) and "('false', 'true', 'config')" in str(e.value)
    with pytest.raises(GDROConfigError, match=r"gdro\.backend='cuda' is invalid: must be one of \('verl', 'cpu'\)"):
        recipe_config_from_dict({"backend": "cuda"})
    assert recipe_config_from_dict({"backend": "cpu"}).backend == "cpu"  # a str Enum: compares as its value
    with pytest.raises(GDROConfigError, match="gdro.metrics_file"):
        recipe_config_from_dict({"metrics_file": "/tmp/m.jsonl"})


def test_controller_choices_are_typed_and_print_as_their_strings():
    """verl_ext's string options are typed choices (issue 24 item 4); they stay plain strings to read."""
    from verl_ext.config import Allocator, Budget

    cfg = gdro_config_from_dict({"rollout": {"allocator": "hedge", "budget": "tokens"}})
    assert cfg.rollout.allocator is Allocator.hedge and cfg.rollout.budget is Budget.tokens
    assert f"{cfg.rollout.allocator}" == "hedge" and cfg.rollout.allocator == "hedge"
    assert json.dumps(gdro_config_to_dict(cfg)["rollout"]["allocator"]) == '"hedge"'
    assert type(gdro_config_to_dict(cfg)["rollout"]["allocator"]) is str
    with pytest.raises(GDROConfigError, match=r"gdro\.prompt\.loss_signal='learnabilty'.*did you mean learnability\?"):
        gdro_config_from_dict({"prompt": {"loss_signal": "learnabilty"}})


def test_recipe_defaults_extend_verl(default_config):
    assert default_config.algorithm.adv_estimator == "grpo"
    assert default_config.trainer.use_v1 is True
    assert default_config.trainer.v1.trainer_mode == "gdro_sync"  # verl registry key of GDROTrainerSync
    # verl's own sections are all there (the recipe extends ppo_trainer, it does not replace it)
    for key in ("actor_rollout_ref.actor.optim.lr", "reward.reward_manager.name", "transfer_queue.backend"):
        assert OmegaConf.select(default_config, key) is not None


def test_n_mean_follows_rollout_n():
    config = compose("actor_rollout_ref.rollout.n=8")
    assert checks.build_gdro_config(config).rollout.n_mean == 8


def test_n_mean_different_from_rollout_n_is_refused():
    with pytest.raises(GDRORecipeError, match=r"gdro.rollout.n_mean=6 differs from actor_rollout_ref.rollout.n=4"):
        checks.build_gdro_config(compose("gdro.rollout.n_mean=6"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("+gdro.rollout.n_mn=2", r"unknown key\(s\) gdro\.rollout\.n_mn"),
        ("+gdro.prompt.etaa=1.0", r"unknown key\(s\) gdro\.prompt\.etaa"),
        ("+gdro.typo=1", r"unknown key\(s\) gdro\.typo"),
        ("gdro.rollout.n_min=abc", r"rollout\.n_min='abc' must be an integer"),
        ("gdro.prompt.enable=yes", r"prompt\.enable='yes' must be true or false"),
        ("gdro.rollout.n_min=1", r"rollout\.n_min=1 is invalid"),
        ("gdro.rollout.allocator=greedy", r"rollout\.allocator='greedy' is invalid"),
    ],
)
def test_bad_gdro_settings_name_the_key(override, message):
    with pytest.raises(GDROConfigError, match=message):
        checks.build_gdro_config(compose(override))


def test_unknown_key_without_plus_is_a_hydra_error():
    with pytest.raises(Exception, match=r"gdro\.rollout\.n_mn"):
        compose("gdro.rollout.n_mn=2")


# ----------------------------------------------------------------------------------- modes
ON = ("gdro.rollout.enable=true",)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("trainer.v1.trainer_mode=colocate_async",),
            r"trainer_mode='colocate_async' is verl's own .* use trainer.v1.trainer_mode=gdro_colocate_async",
        ),
        (
            ("trainer.v1.trainer_mode=separate_async",),
            r"trainer_mode='separate_async' is verl's own .* use trainer.v1.trainer_mode=gdro_separate_async",
        ),
        (
            ("mode=colocate_async", "gdro.prompt.enable=true", "gdro.prompt.loss_signal=mean_abs_advantage"),
            r"gdro\.prompt\.loss_signal=mean_abs_advantage is not supported with trainer\.v1\.trainer_mode=gdro_colo",
        ),
        (("mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4"), r"parameter_sync_step=4 is not"),
        (
            ("mode=separate_async", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16"),
            r"ppo_mini_batch_size=16: .* set ppo_mini_batch_size=64",
        ),
        (("algorithm.filter_groups.enable=true",), r"algorithm\.filter_groups\.enable=true \(DAPO dynamic sampling\)"),
        (("trainer.v1.sampler.sync_refill_failed_groups=true",), r"sync_refill_failed_groups=true is not supported"),
        (("algorithm.adv_estimator=gae",), r"algorithm\.adv_estimator='gae' is not supported"),
        (("trainer.use_v1=false",), r"trainer\.use_v1=false is not supported"),
    ],
)
def test_unsupported_modes_are_refused_with_gdro(overrides, message):
    config = compose(*ON, *overrides)
    with pytest.raises(GDRORecipeError, match=message):
        checks.check_supported_modes(config, checks.build_gdro_config(config))


def test_the_recipes_asynchronous_trainers_are_accepted_with_gdro():
    """Issue 46: ``mode=colocate_async`` / ``mode=separate_async`` select the recipe's trainers for verl's two
    asynchronous loops (refused with GDRO on before), and the run is named for its mode."""
    for mode in ("colocate_async", "separate_async"):
        config = compose(*ON, f"mode={mode}")
        assert config.trainer.v1.trainer_mode == f"gdro_{mode}"
        assert config.trainer.experiment_name.endswith(f"_{mode}")
        if mode == "separate_async":  # verl's train_batch_size = parameter_sync_step x ppo_mini_batch_size
            assert config.trainer.v1.separate_async.parameter_sync_step == 1
            assert config.actor_rollout_ref.actor.ppo_mini_batch_size == config.data.train_batch_size
        checks.check_supported_modes(config, checks.build_gdro_config(config))  # no error
    assert not compose(*ON).trainer.experiment_name.endswith("sync")  # the default keeps its name


@pytest.mark.parametrize(
    "overrides",
    [
        ("trainer.v1.trainer_mode=colocate_async",),
        ("algorithm.filter_groups.enable=true",),
        ("algorithm.adv_estimator=gae",),
    ],
)
def test_modes_are_verls_business_when_gdro_is_off(overrides):
    config = compose(*overrides)
    checks.check_supported_modes(config, checks.build_gdro_config(config))  # no error


@pytest.mark.parametrize(
    "mode",
    [(), ("gdro.observe=false",), ("gdro.prompt.enable=true",)],
    ids=["grpo_observe_only", "grpo_plain_verl", "prompt_gdro"],
)
def test_use_v1_false_is_refused_in_every_mode(mode):
    """The recipe always runs the v1 trainer: use_v1=false would be silently ignored (issue 11, item 4)."""
    config = compose(*mode, "trainer.use_v1=false")
    with pytest.raises(GDRORecipeError, match=r"trainer\.use_v1=false is not supported.*Set trainer\.use_v1=true"):
        checks.check_supported_modes(config, checks.build_gdro_config(config))


@pytest.mark.parametrize(
    "mode",
    [(), ("gdro.prompt.enable=true",), ("gdro.rollout.enable=true",)],
    ids=["grpo_observe_only", "prompt_gdro", "rollout_gdro"],
)
def test_parameter_sync_step_above_one_is_refused_when_gdro_runs(mode):
    """k > 1 makes verl call _compute_advantage k times per step on B/k groups (issue 18 item 2)."""
    config = compose(*mode, "+trainer.v1.sync.parameter_sync_step=2")
    with pytest.raises(GDRORecipeError, match=r"trainer\.v1\.sync\.parameter_sync_step=2 is not supported"):
        checks.check_supported_modes(config, checks.build_gdro_config(config))
    plain = compose("gdro.observe=false", "+trainer.v1.sync.parameter_sync_step=2")
    checks.check_supported_modes(plain, checks.build_gdro_config(plain))  # plain verl: its business
    one = compose(*mode, "+trainer.v1.sync.parameter_sync_step=1")
    checks.check_supported_modes(one, checks.build_gdro_config(one))


def test_prompt_only_allows_failed_group_refill():
    config = compose("gdro.prompt.enable=true", "trainer.v1.sampler.sync_refill_failed_groups=true")
    checks.check_supported_modes(config, checks.build_gdro_config(config))


# ----------------------------------------------------------------------------------- budget
def budget(*overrides):
    config = compose(*overrides)
    return checks.check_budget(config, checks.build_gdro_config(config))


def test_paper_budget_has_no_padding():
    plan = budget(*ON, "data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=128")
    assert (plan.rows_per_step, plan.mini_batch_rows, plan.updates_per_step, plan.padding_rows) == (1024, 512, 2, 0)


def test_batch_not_multiple_of_mini_batch_is_refused():
    with pytest.raises(
        GDRORecipeError, match=r"data\.train_batch_size=200 is not a multiple of .*ppo_mini_batch_size=128"
    ):
        budget(*ON, "data.train_batch_size=200", "actor_rollout_ref.actor.ppo_mini_batch_size=128")


def test_rows_not_multiple_of_dp_is_refused():
    with pytest.raises(GDRORecipeError, match=r"verl would pad 4 dummy rows"):
        budget(
            *ON,
            "data.train_batch_size=3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.rollout.n=4",
            "trainer.n_gpus_per_node=8",
        )


def test_gen_batch_size_must_divide_the_batch():
    with pytest.raises(GDRORecipeError, match=r"data\.gen_batch_size=3 does not divide data\.train_batch_size=16"):
        budget(
            *ON, "data.train_batch_size=16", "+data.gen_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=8"
        )


def test_padding_is_only_a_note_without_rollout_gdro():
    plan = budget("gdro.prompt.enable=true", "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    assert plan.padding_rows == 4 and any("pads" in n for n in plan.notes)


# ----------------------------------------------------------------------------------- data
def data_config(tmp_path, *files):
    paths = ",".join(str(tmp_path / f) for f in files)
    return compose(*ON, f"data.train_files=[{paths}]")


def test_prompt_ids_ok(tmp_path):
    S.write_parquet(str(tmp_path / "a.parquet"), S.math_rows([1, 2, 3], index=[0, 5, 2]))
    data = checks.check_train_prompt_ids(data_config(tmp_path, "a.parquet"))
    assert (data.num_prompts, data.num_rows, data.not_checked) == (6, 3, [])
    assert set(data.data_sources) == {"math_dapo"}


def test_missing_index_names_the_row(tmp_path):
    S.write_parquet(str(tmp_path / "a.parquet"), S.math_rows([1, 2, 3], index=[0, None, 2]))
    with pytest.raises(PromptIdError, match=r"a\.parquet extra_info\.index: row 1 has no id"):
        checks.check_train_prompt_ids(data_config(tmp_path, "a.parquet"))


def test_duplicate_index_names_both_rows(tmp_path):
    S.write_parquet(str(tmp_path / "a.parquet"), S.math_rows([1, 2, 3, 4], index=[0, 7, 2, 7]))
    with pytest.raises(PromptIdError, match=r"id 7 appears at rows 1 and 3"):
        checks.check_train_prompt_ids(data_config(tmp_path, "a.parquet"))


def test_duplicate_index_across_files(tmp_path):
    S.write_parquet(str(tmp_path / "a.parquet"), S.math_rows([1, 2], index=[0, 1]))
    S.write_parquet(str(tmp_path / "b.parquet"), S.math_rows([3, 4], index=[2, 1]))
    with pytest.raises(PromptIdError, match=r"concatenated.*id 1 appears at rows 1 and 3"):
        checks.check_train_prompt_ids(data_config(tmp_path, "a.parquet", "b.parquet"))


def test_no_extra_info_column(tmp_path):
    rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": "x"}]}]
    S.write_parquet(str(tmp_path / "a.parquet"), rows)
    with pytest.raises(PromptIdError, match=r"no `extra_info` column"):
        checks.check_train_prompt_ids(data_config(tmp_path, "a.parquet"))


def test_missing_files_are_reported_not_checked(tmp_path):
    config = compose(*ON, f"data.train_files=[{tmp_path / 'absent.parquet'},hdfs://cluster/x.parquet]")
    data = checks.check_train_prompt_ids(config)
    assert data.num_prompts is None and len(data.not_checked) == 2
    with pytest.raises(GDRORecipeError, match="does not exist"):
        checks.check_train_prompt_ids(config, require_files=True)


def test_trainer_reads_ids_of_the_filtered_dataset():
    """The trainer keys the binner on the rows verl kept (an HF dataset with an indices mapping)."""
    import datasets

    from recipe.gdro.trainer import GDROTrainerSync

    frame = datasets.Dataset.from_list(S.math_rows([1, 2, 3, 4], index=[3, 1, 9, 4])).select([0, 1, 3])
    fake = SimpleNamespace(train_dataset=SimpleNamespace(dataframe=frame))
    assert GDROTrainerSync._dataset_prompt_ids(fake).tolist() == [3, 1, 4]
    bad = datasets.Dataset.from_list(S.math_rows([1, 2, 3], index=[3, 1, 3]))
    with pytest.raises(PromptIdError, match="id 3 appears at rows 0 and 2"):
        GDROTrainerSync._dataset_prompt_ids(SimpleNamespace(train_dataset=SimpleNamespace(dataframe=bad)))


# ----------------------------------------------------------------------------------- reward probe
def probe(tmp_path, *overrides):
    S.write_parquet(str(tmp_path / "a.parquet"), S.math_rows([5, 6]))
    config = compose(*ON, f"data.train_files=[{tmp_path / 'a.parquet'}]", *overrides)
    return checks.probe_reward_acc(config, checks.check_train_prompt_ids(config))


def test_math_dapo_reports_acc(tmp_path):
    result = probe(tmp_path)
    assert "acc" in result.results["math_dapo"]


def _reward_file(tmp_path, body: str) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_reward_without_acc_is_refused(tmp_path):
    path = _reward_file(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            return {"score": 1.0, "pred": "x"}
        """,
    )
    with pytest.raises(GDRORecipeError, match=r"returns keys \['pred', 'score'\] .* without 'acc'"):
        probe(tmp_path, f"reward.custom_reward_function.path={path}")


def test_float_reward_is_accepted_with_the_naive_manager(tmp_path):
    path = _reward_file(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            return 1.0
        """,
    )
    result = probe(tmp_path, f"reward.custom_reward_function.path={path}")
    assert result.results["math_dapo"].startswith("float")


def test_failing_reward_names_the_data_source(tmp_path):
    path = _reward_file(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            raise NotImplementedError(data_source)
        """,
    )
    with pytest.raises(GDRORecipeError, match=r"fails for data_source='math_dapo'"):
        probe(tmp_path, f"reward.custom_reward_function.path={path}")


def test_unloadable_reward_function_is_refused(tmp_path):
    with pytest.raises(GDRORecipeError, match=r"reward\.custom_reward_function\.path="):
        probe(tmp_path, f"reward.custom_reward_function.path={tmp_path / 'nope.py'}")


def test_project_reward_fn_reports_acc(tmp_path):
    path = REPO / "data_prep" / "reward_fn.py"
    result = probe(tmp_path, f"reward.custom_reward_function.path={path}")
    assert "acc" in result.results["math_dapo"]


# ----------------------------------------------------------------------------------- trainer helpers
def test_trajectory_key_and_acc_parsing():
    from recipe.gdro.trainer_step import _MISSING, _acc_value, split_trajectory_key

    assert split_trajectory_key("3f2a-9c_12_0") == ("3f2a-9c", "12", 0)
    with pytest.raises(ValueError):
        split_trajectory_key("nounderscore")
    assert _acc_value({"reward_extra_info": {"acc": True, "score": 1.0}}) == (True, ["acc", "score"])
    assert _acc_value({"reward_extra_info": {"score": 1.0}})[0] is _MISSING
    assert _acc_value(SimpleNamespace(data={"reward_extra_info": {"acc": 0.0}}))[0] == 0.0
    assert _acc_value(None)[0] is _MISSING


# ----------------------------------------------------------------------------------- metrics file
def test_metrics_jsonl_round_trip(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    append_metrics_jsonl(
        path, 1, {"gdro/mu": 0.5, "gdro/x": float("nan"), "gdro/y": np.float64(2.0), "gdro/z": float("inf")}
    )
    append_metrics_jsonl(path, 2, {"gdro/mu": np.float32(0.25)})
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "gdro/mu": 0.5, "gdro/x": None, "gdro/y": 2.0, "gdro/z": None}
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]
    records = read_metrics_jsonl(path)
    assert [r["step"] for r in records] == [1, 2]
    assert math.isnan(records[0]["gdro/x"]) and records[1]["gdro/mu"] == 0.25


def test_metrics_jsonl_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        append_metrics_jsonl(tmp_path / "m.jsonl", 1, {"step": 3})
    with pytest.raises(TypeError, match="non-numeric"):
        append_metrics_jsonl(tmp_path / "m.jsonl", 1, {"gdro/name": "text"})


def test_metrics_jsonl_rewind_and_partial_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    for step in (1, 2, 3, 4):
        append_metrics_jsonl(path, step, {"gdro/mu": float(step)})
    with open(path, "a") as f:
        f.write('{"step": 5, "gdro/m')  # a run killed mid-line
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2, 3, 4]
    assert rewind_metrics_jsonl(path, 2) == 3
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2]
    assert rewind_metrics_jsonl(path, 2) == 0
    assert rewind_metrics_jsonl(tmp_path / "absent.jsonl", 2) == 0
    # a step written twice (a copied file) reads as its last line
    append_metrics_jsonl(path, 2, {"gdro/mu": 20.0})
    assert read_metrics_jsonl(path)[-1]["gdro/mu"] == 20.0
