"""The dry run: ``python -m recipe.gdro.main_gdro gdro.dry_run=true ...``.

It composes the config, runs verl's validation and ours, prints the plan and the resolved keys and
exits 0, without Ray, without a GPU and with a model path that is not downloaded; a refused setting
exits non-zero with a message naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_helpers import standins as S
from recipe_helpers.overrides import paper_overrides

from recipe.gdro.main_gdro import cli
from recipe.gdro.startup.checks import GDRORecipeError, prepare
from recipe.gdro.startup.cli import compose_config


@pytest.fixture
def data(tmp_path) -> Path:
    """256 prompts: a full dry run needs at least data.train_batch_size (256) of them."""
    return Path(S.write_parquet(str(tmp_path / "dapo_train.parquet"), S.math_rows(list(range(10, 266)))))


def run_cli(capsys, argv):
    code = cli(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_prints_the_plan_and_resolved_values(capsys, data):
    import ray
    import torch

    code, out, err = run_cli(capsys, paper_overrides(data))
    assert code == 0, err
    assert "dry run OK" in out
    assert "model        Qwen/Qwen3-8B-Base" in out
    assert "256 prompts/step x n̄=4 -> 1024 responses/step" in out
    assert "padding rows/step: 0" in out
    assert "Rollout-GDRO ON   allocator=sqrt" in out
    assert "Prompt-GDRO  off" in out
    assert "256 training prompts, extra_info.index unique, ids < 256" in out
    assert "data files   256 training prompts in 1 file(s); 1 validation file(s) found" in out
    assert "acc probe: math_dapo: ['acc', 'pred', 'score']" in out
    for line in (
        "data.train_batch_size: 256",
        "actor_rollout_ref.rollout.n: 4",
        "actor_rollout_ref.actor.optim.lr: 1.0e-06",
        "actor_rollout_ref.actor.kl_loss_coef: 0.001",
        "actor_rollout_ref.actor.clip_ratio_low: 0.2",
        "actor_rollout_ref.actor.clip_ratio_high: 0.28",
        "actor_rollout_ref.rollout.val_kwargs.n: 8",
        "actor_rollout_ref.rollout.val_kwargs.temperature: 0.6",
        "actor_rollout_ref.rollout.val_kwargs.top_p: 0.8",
        "actor_rollout_ref.rollout.val_kwargs.top_k: 20",
        "gdro.rollout.enable: true",
        "gdro.prompt.enable: false",
        "trainer.n_gpus_per_node: 8",
    ):
        assert line in out.splitlines(), line
    # the resolved gdro section, block YAML
    assert "resolved gdro section:\ngdro:\n  binner:\n    num_bins: 10" in out
    assert "    n_mean: 4" in out
    # nothing was started
    assert not ray.is_initialized()
    assert not torch.cuda.is_initialized()


def test_dry_run_with_gdro_disabled_is_plain_verl(capsys, data):
    argv = [a for a in paper_overrides(data) if not a.startswith("gdro.rollout.enable")]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    assert "Rollout-GDRO off" in out and "Prompt-GDRO  off" in out
    assert "observe-only: metrics logged; advantages and rollout counts are verl's" in out
    assert "metrics      gdro/* via verl's logger" in out
    code, out, err = run_cli(capsys, argv + ["gdro.observe=false"])
    assert code == 0, err
    assert "unused: GDRO disabled -> plain verl GRPO" in out
    assert "metrics      gdro/* via verl's logger" not in out


@pytest.mark.parametrize(
    "extra, code, message",
    [
        (["+gdro.rollout.n_mn=2"], 2, "unknown key(s) gdro.rollout.n_mn"),
        (["gdro.rollout.n_mn=2"], 2, "unknown key gdro.rollout.n_mn; did you mean n_min?"),
        (["gdro.rollot.n_min=2"], 2, "unknown key gdro.rollot; did you mean rollout?"),
        (["trainer.nnodez=2"], 2, "unknown key trainer.nnodez; did you mean nnodes?"),
        (["gdro.dry_run=maybe"], 2, "gdro.dry_run='maybe' is invalid: must be one of ('false', 'true', 'config')"),
        (["gdro.dry_run=confg"], 2, "did you mean config?"),
        (["gdro.backend=gpu"], 2, "gdro.backend='gpu' is invalid: must be one of ('verl', 'cpu')"),
        (["gdro.rollout.allocator=sqr"], 2, "gdro.rollout.allocator='sqr' is invalid: must be one of"),
        (["gdro.rollout.n_min=abc"], 2, "rollout.n_min='abc' must be an integer"),
        (["gdro.rollout.n_max=3"], 2, "rollout.n_max=3 is invalid: must be >= rollout.n_mean=4"),
        (["gdro.rollout.n_mean=8"], 2, "gdro.rollout.n_mean=8 differs from actor_rollout_ref.rollout.n=4"),
        (["data.train_batch_size=200"], 2, "data.train_batch_size=200 is not a multiple of"),
        (["trainer.v1.trainer_mode=separate_async"], 2, "trainer_mode='separate_async' is verl's own trainer"),
        (["algorithm.filter_groups.enable=true"], 2, "algorithm.filter_groups.enable=true"),
        (
            ["actor_rollout_ref.rollout.name=???"],
            2,
            "required key(s) not set: actor_rollout_ref.rollout.name (no default)",
        ),
        (
            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
            2,
            "required key(s) not set: actor_rollout_ref.actor.ppo_micro",
        ),
        (["+trainer.v1.sync.parameter_sync_step=2"], 2, "trainer.v1.sync.parameter_sync_step=2 is not supported"),
        # the recipe always runs the v1 trainer: refused with the adversaries off too (issue 11, item 4)
        (["gdro.rollout.enable=false", "trainer.use_v1=false"], 2, "trainer.use_v1=false is not supported"),
        (
            ["gdro.rollout.enable=false", "gdro.observe=false", "trainer.use_v1=false"],
            2,
            "trainer.use_v1=false is not supported",
        ),
    ],
)
def test_dry_run_refusals_exit_nonzero_naming_the_setting(capsys, data, extra, code, message):
    got, out, err = run_cli(capsys, paper_overrides(data) + extra)
    assert got == code, (out, err)
    assert message in err
    assert "dry run OK" not in out


@pytest.mark.parametrize(
    "index, message",
    [
        ([0, 1, None, 3], "row 2 has no id"),
        ([0, 1, 1, 3], "id 1 appears at rows 1 and 2"),
    ],
)
def test_dry_run_refuses_bad_prompt_ids(capsys, tmp_path, index, message):
    bad = Path(S.write_parquet(str(tmp_path / "bad.parquet"), S.math_rows([1, 2, 3, 4], index=index)))
    code, out, err = run_cli(capsys, paper_overrides(bad))
    assert code == 2
    assert "bad.parquet extra_info.index" in err and message in err


def test_dry_run_refuses_a_reward_without_acc(capsys, data, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return {'score': 1.0}\n"
    )
    code, out, err = run_cli(capsys, paper_overrides(data) + [f"reward.custom_reward_function.path={reward}"])
    assert code == 2
    assert "without 'acc'" in err


def test_dry_run_without_local_data_fails_naming_the_file(capsys):
    code, out, err = run_cli(capsys, paper_overrides(Path("/nonexistent/dapo.parquet")))
    assert code == 2
    assert "missing data file(s): data.train_files: /nonexistent/dapo.parquet; data.val_files: /nonexistent" in err
    assert "gdro.dry_run=config" in err  # the way out is named
    assert "dry run OK" not in out


def test_config_only_dry_run_does_not_need_the_data(capsys):
    argv = [a for a in paper_overrides(Path("/nonexistent/dapo.parquet")) if a != "gdro.dry_run=true"]
    code, out, err = run_cli(capsys, argv + ["gdro.dry_run=config"])
    assert code == 0, err
    assert "dry run, configuration only" in out
    assert "not found (config-only dry run): data.train_files: /nonexistent/dapo.parquet" in out
    assert "NOT CHECKED" not in out  # listed once
    assert "dry run OK" in out


def test_dry_run_fails_on_a_missing_validation_file(capsys, data):
    code, out, err = run_cli(capsys, paper_overrides(data) + [f"data.val_files=[{data},/nonexistent/aime.parquet]"])
    assert code == 2
    assert "missing data file(s): data.val_files: /nonexistent/aime.parquet" in err


def test_dry_run_fails_with_fewer_prompts_than_the_batch(capsys, tmp_path):
    small = Path(S.write_parquet(str(tmp_path / "small.parquet"), S.math_rows(list(range(12)))))
    code, out, err = run_cli(capsys, paper_overrides(small))
    assert code == 2
    assert f"data.train_files hold 12 prompt(s) ({small}), fewer than data.train_batch_size=256" in err
    argv = [a for a in paper_overrides(small) if a != "gdro.dry_run=true"] + ["gdro.dry_run=config"]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    assert "data note    data.train_files hold 12 prompt(s)" in out


@pytest.mark.parametrize("gdro_on", [True, False], ids=["gdro", "plain_verl"])
@pytest.mark.parametrize("name, content", [("train.csv", "a,b\n1,2\n"), ("train.parquet", "not parquet")])
def test_dry_run_names_a_training_file_it_cannot_read(capsys, tmp_path, data, name, content, gdro_on):
    bad = tmp_path / name
    bad.write_text(content)
    argv = paper_overrides(data) + [f"data.train_files=[{bad}]"]
    if not gdro_on:  # the prompt-id check does not read the file then; the dry run's data check does
        argv += ["gdro.rollout.enable=false", "gdro.observe=false"]
    code, out, err = run_cli(capsys, argv)
    assert code == 2, err
    assert f"data.train_files: {bad} is not" in err


# --------------------------------------------------------------------------- the real command line
def _module_cli(args, cwd):
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-m", "recipe.gdro.main_gdro", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_dry_run_exits_zero_and_leaves_no_outputs_folder(data, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    proc = _module_cli(paper_overrides(data), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run OK" in proc.stdout
    assert "actor_rollout_ref.actor.clip_ratio_high: 0.28" in proc.stdout
    assert list(work.iterdir()) == []  # no Hydra outputs/<date>/<time>/


def test_cli_unknown_key_exits_2_naming_it(data, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    proc = _module_cli(paper_overrides(data) + ["gdro.rollout.n_mn=3"], cwd=work)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "unknown key gdro.rollout.n_mn; did you mean n_min?" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _module_cli(paper_overrides(data) + ["+gdro.rollout.n_mn=2"], cwd=work)
    assert proc.returncode == 2
    assert "unknown key(s) gdro.rollout.n_mn" in proc.stderr
    # a training run (no dry run) refuses it too, before Hydra's job starts
    proc = _module_cli(["gdro.rollout.n_mn=3"], cwd=work)
    assert proc.returncode == 2 and "did you mean n_min?" in proc.stderr
    assert list(work.iterdir()) == []


def test_cli_help_lists_the_gdro_keys(tmp_path):
    proc = _module_cli(["--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: python -m recipe.gdro.main_gdro")
    assert len(lines) < 250  # not Hydra's 1,100-line dump of every verl key (202 lines with gdro.restart_controller)
    text = " ".join(proc.stdout.split())
    assert "gdro.rollout.n_min 2 smallest count for any prompt; at least 2" in text
    for key in ("gdro.binner.num_bins", "gdro.prompt.eta", "gdro.rollout.allocator", "gdro.dry_run"):
        assert any(line.strip().startswith(key + " ") for line in lines), key
    assert "--help-all" in proc.stdout


# ------------------------------------------------------------------------ required keys, GPU layout
def test_dry_run_names_every_missing_required_key_at_once(capsys):
    """verl's bare defaults (no size group) lack three keys; all are named in one message, exit 2."""
    assert cli(["data.train_files=[/nowhere/train.parquet]", "gdro.rollout.enable=true", "gdro.dry_run=config"]) == 2
    err = capsys.readouterr().err
    assert "3 required key(s) not set" in err
    for key in (
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    ):
        assert key in err
    assert "size=" in err  # points at the groups
    # the reference policy's micro-batch is required only when a KL term needs the reference
    assert cli(["actor_rollout_ref.actor.use_kl_loss=true", "gdro.dry_run=config"]) == 2
    assert "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu" in capsys.readouterr().err


@pytest.mark.parametrize(
    "size,method,args,needle",
    [
        ("8b", "rollout_gdro", ["trainer.nnodes=3"], "not a multiple of lcm"),  # 1024 rows / 24 GPUs
        ("1.7b", "rollout_gdro", ["trainer.n_gpus_per_node=6"], "not a multiple of lcm"),
        ("8b", "grpo", ["trainer.n_gpus_per_node=1"], "not divisible by the rollout tensor-parallel size"),
        ("1.7b", "grpo", ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], "tensor-parallel size"),
        ("4b", "grpo", ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"], "must hold one full sequence"),
    ],
    ids=["nnodes3", "gpus6", "8b_on_1_gpu", "tp3", "token_budget"],
)
def test_recipe_refuses_layouts_that_do_not_divide(size, method, args, needle):
    """The layout checks the bash launcher did now run on the final config (any launch)."""
    config = compose_config([f"size={size}", f"method={method}", *args])
    with pytest.raises(GDRORecipeError, match=needle):
        prepare(config, run_verl_checks=False)


def test_layout_checks_see_the_final_config():
    """3 nodes x 8 GPUs do not divide 256 x 4, but they divide the batch given as arguments."""
    args = ["trainer.nnodes=3", "data.train_batch_size=384", "actor_rollout_ref.actor.ppo_mini_batch_size=192"]
    prepared = prepare(compose_config(["size=4b", "method=rollout_gdro", *args]), run_verl_checks=False)
    assert prepared.budget.padding_rows == 0


# --------------------------------------------------------------------------- issue 27: what cannot work
def _refusal(capsys, argv, work: Path) -> str:
    """Run a dry run that must be refused; return its one error line (checking nothing was written)."""
    before = sorted(p.name for p in work.iterdir())
    code, out, err = run_cli(capsys, argv)
    assert code == 2, (argv[-3:], out[-500:], err[-2000:])
    assert "dry run OK" not in out
    lines = [line for line in err.splitlines() if line.startswith("gdro")]
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in work.iterdir()) == before  # no outputs/, no checkpoint folder, no metrics
    return lines[0]


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """An empty working folder (the cwd), checkpoints under it: anything written would show."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def test_verl_keys_users_set_are_refused_by_type_and_range(capsys, data, work):
    """verl's keys as users set them (through the scripts or by hand) are typed and ranged, named, exit 2.
    Before: lr -1e-6, steps -5, memory 2.0 ("fits") and use_dynamic_bsz=maybe (true) passed; lr=fast and
    train_batch_size=lots were a bare ValueError (exit 1); rollout.n=0 was blamed on gdro.rollout.n_min."""
    base = paper_overrides(data) + [f"launch.ckpt_root={work}/ckpt"]
    cases = {
        "actor_rollout_ref.actor.optim.lr=-1e-6": "actor_rollout_ref.actor.optim.lr=-1e-06 must be a number >= 0",
        "actor_rollout_ref.actor.optim.lr=fast": "actor_rollout_ref.actor.optim.lr='fast' must be a number >= 0",
        "trainer.total_training_steps=-5": "trainer.total_training_steps=-5 must be an integer >= 1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=2.0": "gpu_memory_utilization=2.0 must be a number in (0, 1]",
        "actor_rollout_ref.actor.use_dynamic_bsz=maybe": "use_dynamic_bsz='maybe' must be true or false",
        "data.train_batch_size=lots": "data.train_batch_size='lots' must be an integer >= 1",
        "actor_rollout_ref.rollout.n=0": "actor_rollout_ref.rollout.n=0 must be an integer >= 1",
        "trainer.logger=',,'": "trainer.logger=',,' must be a list of",
        "trainer.logger=[console,nope]": "trainer.logger=['console', 'nope'] must be a list of",
        "trainer.experiment_name=a/b": "trainer.experiment_name='a/b' may use letters",
    }
    for override, message in cases.items():
        line = _refusal(capsys, base + [override], work)
        assert message in line, (override, line)
        assert "n_min" not in line, line
    # lr 0 is a run that only evaluates or resaves (the real-path resume test, the study's lr-0 control)
    code, out, err = run_cli(capsys, base + ["actor_rollout_ref.actor.optim.lr=0"])
    assert code == 0 and "dry run OK" in out, err[-2000:]
    # verl's own refusal (validate_config) follows the recipe's message and exit code (before: exit 1)
    line = _refusal(capsys, base + ["gdro.rollout.enable=false", "data.train_batch_size=64"], work)
    assert line.startswith("gdro dry run: error: verl refuses the config") and "train_batch_size (64)" in line


def test_data_files_that_cannot_train_are_refused_naming_file_row_or_column(capsys, tmp_path, work):
    """Before: no `prompt` column and an extra_info.index of 10**12 (the binner sizes its arrays by it)
    passed, a parquet named .jsonl and a non-UTF-8 jsonl were a bare UnicodeDecodeError, and a batch of
    1000 against 300 prompts was reported as a mini-batch problem."""
    files = tmp_path / "files"
    rows = S.math_rows(list(range(256)))
    no_prompt = S.write_parquet(
        str(files / "no_prompt.parquet"), [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    )
    huge = S.write_parquet(str(files / "huge.parquet"), S.math_rows(list(range(256)), index=[*range(255), 10**12]))
    good = S.write_parquet(str(files / "good.parquet"), rows)
    misnamed = files / "parquet.jsonl"
    misnamed.write_bytes(Path(good).read_bytes())
    latin1 = files / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "caf\xe9", "extra_info": {"index": 0}}\n')
    small = S.write_parquet(str(files / "small.parquet"), S.math_rows(list(range(300))))
    snapshot = {p: p.read_bytes() for p in files.iterdir()}
    cases = [
        ([f"data.train_files=[{no_prompt}]"], [no_prompt, "no column 'prompt'"]),
        ([f"data.train_files=[{huge}]"], [str(huge), "row 255", "extra_info.index 1000000000000"]),
        ([f"data.train_files=[{misnamed}]"], [str(misnamed), "not a readable JSON-lines file"]),
        ([f"data.train_files=[{latin1}]"], [str(latin1), "UnicodeDecodeError"]),
        ([f"data.val_files=[{no_prompt}]"], ["data.val_files", no_prompt, "no column 'prompt'"]),
        (
            [f"data.train_files=[{small}]", "data.train_batch_size=1000"],
            ["hold 300 prompt(s)", "fewer than data.train_batch_size=1000"],
        ),
    ]
    base = paper_overrides(Path(good)) + [f"launch.ckpt_root={work}/ckpt"]
    for extra, needles in cases:
        line = _refusal(capsys, base + extra, work)
        assert all(n in line for n in needles), (extra, line)
        assert "mini-batch" not in line and "ppo_mini_batch_size" not in line, line
    assert {p: p.read_bytes() for p in files.iterdir()} == snapshot


def test_output_paths_that_cannot_be_created_are_refused(capsys, data, tmp_path, work):
    """Before: a checkpoint folder or metrics file under a plain file, or a metrics file naming a folder,
    passed the dry run (and failed hours later, at the first save)."""
    plain = tmp_path / "plain_file"
    plain.write_text("keep me\n")
    run_dir = tmp_path / "run"
    (run_dir / "a_folder").mkdir(parents=True)
    (run_dir / "sub").write_text("a file\n")
    base = paper_overrides(data)
    cases = [
        ([f"launch.ckpt_root={plain}/ckpt"], ["trainer.default_local_dir", str(plain), "is a file"]),
        ([f"trainer.default_local_dir={plain}/x/y"], ["trainer.default_local_dir", str(plain), "is a file"]),
        (
            [f"trainer.default_local_dir={run_dir}", "gdro.metrics_file=a_folder"],
            ["gdro.metrics_file", "is a directory"],
        ),
        (
            [f"trainer.default_local_dir={run_dir}", "gdro.metrics_file=sub/m.jsonl"],
            ["gdro.metrics_file", "sub is a file"],
        ),
        ([f"trainer.default_local_dir={run_dir}", "gdro.metrics_file=/abs/m.jsonl"], ["gdro.metrics_file", "relative"]),
    ]
    for extra, needles in cases:
        line = _refusal(capsys, base + extra, work)
        assert all(n in line for n in needles), (extra, line)
    assert plain.read_text() == "keep me\n" and sorted(p.name for p in run_dir.iterdir()) == ["a_folder", "sub"]
    assert list((run_dir / "a_folder").iterdir()) == []


def test_a_real_launch_also_checks_what_only_the_training_machine_can(data, tmp_path, work, capsys):
    """A local model folder must hold config.json on a launch (the bash launcher's check, now the recipe's);
    a dry run, possibly on another machine, does not ask it."""
    from recipe.gdro.main_gdro import check_launch

    model = tmp_path / "models" / "qwen3"
    model.mkdir(parents=True)
    argv = [a for a in paper_overrides(data) if a != "gdro.dry_run=true"]
    argv += [f"actor_rollout_ref.model.path={model}", f"launch.ckpt_root={work}/ckpt"]
    assert check_launch(compose_config(argv)) == 2
    err = capsys.readouterr().err
    assert f"actor_rollout_ref.model.path={model}: no config.json in {model}" in err
    assert cli([*argv, "gdro.dry_run=true"]) == 0, capsys.readouterr().err
    assert list(work.iterdir()) == []


def test_refused_real_launch_leaves_no_outputs_folder(data, tmp_path):
    """A training launch is checked before Hydra's job runtime starts (before: Hydra's outputs/<date>/
    folder was created, then the recipe refused the config inside it)."""
    work = tmp_path / "work"
    work.mkdir()
    argv = [a for a in paper_overrides(data) if a != "gdro.dry_run=true"]
    proc = _module_cli([*argv, "gdro.rollout.n_max=3", f"launch.ckpt_root={work}/ckpt"], cwd=work)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "gdro.rollout.n_max=3 is invalid" in proc.stderr and "Traceback" not in proc.stderr
    assert list(work.iterdir()) == []


def test_preflight_help_prints_its_usage(capsys):
    """Before: `python -m recipe.gdro.preflight --help` was a Hydra LexerNoViableAltException (exit 1)."""
    from recipe.gdro import preflight

    assert preflight.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m recipe.gdro.preflight") and "python -m recipe.gdro.main_gdro" in out
    assert preflight.main(["trainer.nnodez=2"]) == 2
    assert "unknown key trainer.nnodez; did you mean nnodes?" in capsys.readouterr().err
