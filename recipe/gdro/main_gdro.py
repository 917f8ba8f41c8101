"""Entry point of the GDRO recipe for verl 0.9.1.

    python -m recipe.gdro.main_gdro [hydra overrides]                    # train
    python -m recipe.gdro.main_gdro gdro.dry_run=true [hydra overrides]  # check + print the plan, exit
    python -m recipe.gdro.main_gdro gdro.dry_run=config [overrides]      # the same, data files not required
    python -m recipe.gdro.main_gdro --help                               # usage and the gdro.* keys
    python -m recipe.gdro.main_gdro --help-all                           # Hydra's help: every verl key

The Hydra config is ``recipe/gdro/config/gdro_trainer.yaml``: verl's ``ppo_trainer`` plus a
``gdro:`` section. Before Ray starts, :func:`recipe.gdro.checks.prepare` validates the ``gdro``
section, refuses unsupported verl modes, checks the rollout budget against the batch and
mini-batch sizes, the training data's ``extra_info.index`` and that the reward reports ``acc``, and
runs verl's own config validation. A dry run stops there and prints the resolved ``gdro``
section, the relevant resolved verl keys and a one-screen plan; it needs no GPU, no Ray and no
downloaded model. A dry run (``gdro.dry_run=true``) also requires the data: every local training
and validation file must exist and be readable, and the training files must hold at least
``data.train_batch_size`` prompts; ``gdro.dry_run=config`` checks the configuration alone (files
that exist are still checked, missing ones are listed). A dry run composes the config without
Hydra's job runtime, so it leaves no ``outputs/<date>/<time>/`` folder behind.

Exit status: 0 on success; 2 for a setting the start-up checks refuse (unknown / mistyped ``gdro``
key, impossible budget, unsupported verl mode, bad prompt ids, reward without ``acc``, a verl
section its dataclass rejects, missing or too-small data in a dry run); 1 when verl's
``validate_config`` (or Hydra, e.g. an override of a verl key that does not exist) fails.
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Optional, Sequence

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from recipe.gdro.checks import (
    GDRO_STATE_FILE,
    GDRORecipeError,
    Prepared,
    check_dry_run_data,
    gdro_runs,
    observes_only,
    prepare,
)
from verl_ext import GDROConfig, GDROConfigError, PromptIdError, gdro_config_to_dict

CONFIG_MODULE = "recipe.gdro.config"
CONFIG_NAME = "gdro_trainer"

# Resolved verl keys the dry run prints (one "key: value" line each, greppable by launch-script tests).
RESOLVED_KEYS = (
    "actor_rollout_ref.model.path",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.device",
    "trainer.use_v1",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.v1.trainer_mode",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.default_local_dir",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.logger",
    "data.train_files",
    "data.val_files",
    "data.train_batch_size",
    "data.gen_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.shuffle",
    "data.seed",
    "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_ctrl.kl_coef",
    "algorithm.filter_groups.enable",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.val_kwargs.do_sample",
    "actor_rollout_ref.rollout.val_kwargs.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p",
    "actor_rollout_ref.rollout.val_kwargs.top_k",
    "reward.reward_manager.name",
    "reward.custom_reward_function.path",
    "reward.custom_reward_function.name",
    "actor_rollout_ref.model.override_config.attn_implementation",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units",
    "ray_kwargs.ray_init.runtime_env.py_modules",
    "gdro.prompt.enable",
    "gdro.rollout.enable",
)


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the recipe config with Hydra overrides (the same config ``main`` receives)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides))


def _select(config: DictConfig, key: str) -> Any:
    try:
        value = OmegaConf.select(config, key, throw_on_missing=True, default="<absent>")
    except MissingMandatoryValue:
        return "???"
    except Exception as e:  # noqa: BLE001 - an interpolation that does not resolve
        return f"<unresolved: {e}>"
    if isinstance(value, DictConfig) or OmegaConf.is_list(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def resolved_keys_yaml(config: DictConfig, keys: Sequence[str] = RESOLVED_KEYS) -> str:
    """``key: value`` lines (YAML) for the given dotted keys, resolved."""
    lines = []
    for key in keys:
        flow = yaml.safe_dump([_select(config, key)], default_flow_style=True, width=10_000).strip()
        lines.append(f"{key}: {flow[1:-1]}")  # strip the enclosing [ ] of the one-element list
    return "\n".join(lines)


def format_plan(config: DictConfig, prepared: Prepared) -> str:
    """The one-screen plan a dry run prints (followed by the resolved keys and the gdro section)."""
    g, b = prepared.gdro, prepared.budget
    model = _select(config, "actor_rollout_ref.model.path")
    mode = _select(config, "trainer.v1.trainer_mode")
    trainer_cls = "recipe.gdro.trainer.GDROTrainerSync" if mode == "sync" else f"verl's {mode} trainer (GDRO off)"
    steps = _select(config, "trainer.total_training_steps")
    epochs = _select(config, "trainer.total_epochs")
    title = "dry run (no Ray, no GPU, model not loaded)" if g.dry_run else "start-up checks passed"
    if g.dry_run and prepared.files is not None and prepared.files.notes:
        title = "dry run, configuration only (no Ray, no GPU, model not loaded; data not required)"
    out = ["=" * 78, f"GDRO recipe - {title}", "=" * 78]
    out.append(f"model        {model}")
    out.append(
        f"hardware     {b.n_gpus} GPU(s) = {_select(config, 'trainer.nnodes')} node(s) x "
        f"{_select(config, 'trainer.n_gpus_per_node')}; actor data-parallel size {b.dp_size}; "
        f"rollout engine {_select(config, 'actor_rollout_ref.rollout.name')} "
        f"(TP {_select(config, 'actor_rollout_ref.rollout.tensor_model_parallel_size')})"
    )
    out.append(
        f"trainer      {trainer_cls}; total_training_steps={steps}, total_epochs={epochs} (whichever ends first)"
    )
    out.append(
        f"batch        {b.train_batch_size} prompts/step x n̄={b.n_mean} -> {b.rows_per_step} responses/step "
        f"(exactly; Rollout-GDRO only redistributes them)"
    )
    out.append(
        f"actor        PPO mini-batch {b.mini_batch_prompts} prompts = {b.mini_batch_rows} rows -> "
        f"{b.updates_per_step} update(s)/step; padding rows/step: {b.padding_rows}; "
        f"lr {_select(config, 'actor_rollout_ref.actor.optim.lr')}, "
        f"clip [{_select(config, 'actor_rollout_ref.actor.clip_ratio_low')}, "
        f"{_select(config, 'actor_rollout_ref.actor.clip_ratio_high')}], "
        f"kl_loss {_select(config, 'actor_rollout_ref.actor.use_kl_loss')} "
        f"(coef {_select(config, 'actor_rollout_ref.actor.kl_loss_coef')})"
    )
    if g.rollout.enable:
        out.append(
            f"Rollout-GDRO ON   allocator={g.rollout.allocator}, n(x) in [{g.rollout.n_min}, {g.rollout.n_max}] per "
            f"prompt, sum = {b.rows_per_step} every step, mu_lr={g.rollout.mu_lr}"
        )
    else:
        out.append(f"Rollout-GDRO off  every prompt gets rollout.n = {b.n_mean} rollouts")
    if g.prompt.enable:
        out.append(
            f"Prompt-GDRO  ON   loss_signal={g.prompt.loss_signal}, eta={g.prompt.eta}, gamma={g.prompt.gamma}, "
            f"beta={g.prompt.beta}, weight_cap={g.prompt.weight_cap}, rollout_coupling={g.prompt.rollout_coupling}"
        )
    else:
        out.append("Prompt-GDRO  off  GRPO advantages are not reweighted")
    edges = g.binner.bin_edges if g.binner.bin_edges is not None else f"{g.binner.num_bins} equal-width bins"
    out.append(
        f"binner       {edges}, window {g.binner.window}, hysteresis {g.binner.hysteresis}, unseen={g.binner.unseen}"
        + (
            ""
            if g.enabled
            else "  (observe-only: metrics logged; advantages and rollout counts are verl's)"
            if observes_only(config, g)
            else "  (unused: GDRO disabled -> plain verl GRPO)"
        )
    )
    if prepared.data is not None:
        d = prepared.data
        if d.checked:
            out.append(
                f"data         {d.num_rows} training prompts, extra_info.index unique, ids < {d.num_prompts} "
                f"({', '.join(d.checked)})"
            )
        listed = {p for _, p in prepared.files.missing} if prepared.files is not None else set()
        for path in d.not_checked:
            if path not in listed:
                out.append(f"data         NOT CHECKED (not found locally / remote): {path}; checked again at start-up")
    if prepared.files is not None:
        f = prepared.files
        out.append(
            f"data files   {f.train_rows} training prompts in {len(f.train_found)} file(s); "
            f"{len(f.val_found)} validation file(s) found"
            + (f"; remote, not read: {', '.join(f.remote)}" if f.remote else "")
        )
        for note in f.notes:
            out.append(f"data note    {note}")
    if prepared.reward is not None:
        r = prepared.reward
        probed = "; ".join(f"{src}: {keys}" for src, keys in r.results.items()) or "not probed"
        out.append(f"reward       manager {r.manager}, {r.function}; acc probe: {probed}")
        for note in r.notes:
            out.append(f"             note: {note}")
    for note in b.notes:
        out.append(f"note         {note}")
    local_dir = _select(config, "trainer.default_local_dir")
    if gdro_runs(config, g):
        metrics_file = f"{local_dir}/{g.metrics_file}" if g.metrics_file else "(disabled: gdro.metrics_file='')"
        out.append(f"checkpoints  {local_dir}/global_step_N/{GDRO_STATE_FILE} with verl's checkpoint")
        out.append(f"metrics      gdro/* via verl's logger {_select(config, 'trainer.logger')}; JSONL {metrics_file}")
    out.append(f"verl checks  {', '.join(prepared.verl_checks) or 'skipped'}: passed")
    return "\n".join(out)


def print_dry_run(config: DictConfig, prepared: Prepared, stream=None, cluster_lines: Sequence[str] = ()) -> None:
    stream = stream or sys.stdout
    print(format_plan(config, prepared), file=stream)
    for line in cluster_lines:
        print(line, file=stream)
    print("-" * 78, file=stream)
    print("resolved config (relevant keys):", file=stream)
    print(resolved_keys_yaml(config), file=stream)
    print("-" * 78, file=stream)
    print("resolved gdro section:", file=stream)
    section = yaml.safe_dump({"gdro": gdro_config_to_dict(prepared.gdro)}, sort_keys=False, default_flow_style=False)
    print(section, file=stream, end="")
    print("=" * 78, file=stream)
    print("dry run OK: configuration valid; exiting without starting Ray.", file=stream)


def run_from_config(config: DictConfig, *, stdout=None, stderr=None) -> int:
    """Check ``config``; on a dry run print the plan, otherwise train. Returns the exit status."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        mode = dry_run_mode(config)
    except GDRORecipeError as e:
        print(f"gdro: error: {e}", file=stderr)
        return 2
    dry = mode is not None
    what = "gdro dry run" if dry else "gdro"
    try:
        prepared = prepare(config)
        if dry:
            prepared.files = check_dry_run_data(config, config_only=mode == DRY_RUN_CONFIG_ONLY)
    except (GDROConfigError, GDRORecipeError, PromptIdError) as e:
        print(f"{what}: error: {e}", file=stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - verl's validation raises assertions, ValueErrors, Hydra errors...
        print(f"{what}: verl config validation failed: {type(e).__name__}: {e}", file=stderr)
        return 1
    # Cluster readiness (recipe.gdro.cluster): attention kernel importable, code shipped to Ray workers.
    from recipe.gdro.cluster import cluster_checks

    try:
        cluster_lines = cluster_checks(config, dry_run=dry).lines()
    except GDRORecipeError as e:
        print(f"{what}: error: {e}", file=stderr)
        return 2
    if dry:
        print_dry_run(config, prepared, stream=stdout, cluster_lines=cluster_lines)
        return 0

    print(format_plan(config, prepared), file=stdout)
    print("\n".join(cluster_lines), file=stdout, flush=True)

    from verl.trainer.main_ppo import run_ppo

    from recipe.gdro.task_runner import GDROTaskRunnerActor

    run_ppo(config, task_runner_class=GDROTaskRunnerActor)
    return 0


@hydra.main(config_path="config", config_name=CONFIG_NAME, version_base=None)
def main(config: DictConfig) -> None:
    status = run_from_config(config)
    if status:
        sys.exit(status)


def cli(argv: Optional[Sequence[str]] = None) -> int:
    """Programmatic equivalent of ``python -m recipe.gdro.main_gdro ARGV`` for a dry run (or a run
    started without Hydra's job runtime); returns the exit status."""
    argv = list(argv or ())
    try:
        config = compose_config(argv)
    except Exception as e:  # noqa: BLE001 - Hydra's own override errors (e.g. an unknown key)
        return report_compose_error(e, argv)
    return run_from_config(config)


# ----------------------------------------------------------------------------------- dry-run modes
DRY_RUN_CONFIG_ONLY = "config"
_FALSE = ("false", "0", "no", "off", "null", "none", "")
_TRUE = ("true", "1", "yes", "on")


def dry_run_mode(config: DictConfig) -> Optional[str]:
    """``None`` (no dry run), ``"full"`` (``gdro.dry_run=true``: config and data) or ``"config"``
    (``gdro.dry_run=config``: the configuration alone). ``config`` is normalised to
    ``gdro.dry_run=true`` so the gdro section still validates as a boolean."""
    value = OmegaConf.select(config, "gdro.dry_run", default=False)
    if isinstance(value, str) and value.strip().lower() == DRY_RUN_CONFIG_ONLY:
        with open_dict(config):
            config.gdro.dry_run = True
        return DRY_RUN_CONFIG_ONLY
    if isinstance(value, str) and value.strip().lower() not in _TRUE + _FALSE:
        raise GDRORecipeError(
            f"gdro.dry_run={value!r}: use true (check config and data), config (the configuration alone) or false"
        )
    return "full" if value is True or (isinstance(value, str) and value.strip().lower() in _TRUE) else None


def argv_dry_run(argv: Sequence[str]) -> bool:
    """Whether the command line asks for a dry run (the last ``gdro.dry_run=`` override wins)."""
    found = False
    for arg in argv:
        m = re.fullmatch(r"\+{0,2}gdro\.dry_run=(.*)", arg)
        if m:
            found = m.group(1).strip().strip("'\"").lower() not in _FALSE
    return found


# ----------------------------------------------------------------------------------- Hydra errors
def _unknown_key(error: BaseException) -> Optional[str]:
    """The full key of an override Hydra refused because the key does not exist, if that is why."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = error
    while cause is not None:
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and getattr(cause, "full_key", None):
            return str(cause.full_key)
        cause = cause.__cause__ or cause.__context__
    return None


def did_you_mean(full_key: str, base: Optional[DictConfig] = None) -> str:
    """``"; did you mean n_min?"`` for the closest existing sibling of ``full_key`` ("" if none)."""
    parent, _, name = full_key.rpartition(".")
    base = compose_config([]) if base is None else base
    node = OmegaConf.select(base, parent, default=None) if parent else base
    if not isinstance(node, DictConfig):
        return ""
    close = difflib.get_close_matches(name, [str(k) for k in node.keys()], n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def report_compose_error(error: BaseException, argv: Sequence[str], stream=None) -> int:
    """Print a Hydra composition error; an unknown ``gdro.*`` key exits 2 naming it, others 1."""
    stream = stream or sys.stderr
    key = _unknown_key(error)
    if key is not None:
        try:
            hint = did_you_mean(key)
        except Exception:  # noqa: BLE001 - the hint is a courtesy; never hide the real error
            hint = ""
        if key.startswith("gdro."):
            print(
                f"gdro: error: unknown key {key}{hint} (python -m recipe.gdro.main_gdro --help lists them)", file=stream
            )
            return 2
        print(f"gdro: error: unknown key {key}{hint} (Hydra: {error}; `+{key}=...` adds a new key)", file=stream)
        return 1
    print(f"gdro: error: {type(error).__name__}: {error}", file=stream)
    return 1


# ----------------------------------------------------------------------------------- --help
USAGE = """usage: python -m recipe.gdro.main_gdro [KEY=VALUE ...]

Trains with verl 0.9.1's v1 trainer plus GDRO (config: recipe/gdro/config/gdro_trainer.yaml, verl's
ppo_trainer with a gdro: section). Every argument is a Hydra override, e.g.
  gdro.rollout.enable=true data.train_files=~/data/dapo/train.parquet trainer.n_gpus_per_node=8

  gdro.dry_run=true     check config and data (files exist, >= data.train_batch_size prompts, prompt
                        ids, reward reports acc), print the plan and the resolved keys, exit;
                        no Ray, no GPU, no model download
  gdro.dry_run=config   the same, without requiring the data files
  --help-all            Hydra's help with every verl key (~1,100 lines)
  --hydra-help          Hydra's own options (--cfg, --multirun, ...)

Exit status: 0 ok; 2 a setting or data file the checks refuse (named in the message);
1 verl's validation or Hydra fails.
"""


def _attribute_docs(cls) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of a (Google-style) class docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    current = None
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break  # the next section
        m = re.match(r"^ {4}(\w+)(?: \([^)]*\))?:\s*(.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.strip():
            out[current] += " " + line.strip()
    # reST markup -> plain text: :mod:`x` -> x, ``x`` -> x
    return {k: re.sub(r":\w+:`([^`]*)`", r"\1", v).replace("``", "") for k, v in out.items()}


def _default(f) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "???"


def gdro_keys_help(cls=GDROConfig, prefix: str = "gdro") -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` for every leaf of the gdro section, from the dataclasses."""
    docs = _attribute_docs(cls)
    rows = []
    for f in fields(cls):
        key = f"{prefix}.{f.name}"
        default = _default(f)
        if is_dataclass(default):
            rows.extend(gdro_keys_help(type(default), key))
            continue
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        rows.append((key, shown, docs.get(f.name, "")))
    return rows


def format_help(width: int = 100) -> str:
    import textwrap

    rows = gdro_keys_help()
    key_w = max(len(k) for k, _, _ in rows)
    def_w = min(max(len(d) for _, d, _ in rows), 14)
    out = [USAGE, "gdro: keys (default, meaning):"]
    indent = " " * (2 + key_w + 2 + def_w + 2)
    for key, default, meaning in rows:
        head = f"  {key:<{key_w}}  {default:<{def_w}}  "
        text = textwrap.fill(meaning or "-", width=width, initial_indent=head, subsequent_indent=indent)
        out.append(text)
    out.append("")
    out.append("The recipe's YAML: recipe/gdro/config/gdro_trainer.yaml; every verl key: --help-all")
    return "\n".join(out)


def entry(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: ``--help`` is ours; dry runs compose the config without Hydra's job runtime
    (no ``outputs/`` folder); a training run goes through ``@hydra.main`` as in verl. Unknown keys
    are reported before Hydra starts (exit 2 for ``gdro.*``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--help", "-h") for a in argv):
        try:
            print(format_help())
        except BrokenPipeError:  # `--help | head`
            pass
        return 0
    if "--help-all" in argv:
        sys.argv = [sys.argv[0], *["--help" if a == "--help-all" else a for a in argv]]
        main()
        return 0
    if any(a.startswith("-") for a in argv):  # Hydra's own flags (--cfg, --multirun, ...): Hydra's job
        sys.argv = [sys.argv[0], *argv]
        main()
        return 0
    if argv_dry_run(argv):
        return cli(argv)
    try:
        compose_config(argv)  # fail fast, with our message, on an unknown key
    except Exception as e:  # noqa: BLE001
        return report_compose_error(e, argv)
    sys.argv = [sys.argv[0], *argv]
    main()
    return 0


if __name__ == "__main__":
    sys.exit(entry())
