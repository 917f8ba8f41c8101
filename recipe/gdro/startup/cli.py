"""Composing the recipe's Hydra config and the command line around it: dry-run modes, Hydra's
errors turned into messages that name the key, and ``--help`` for the ``gdro.*`` keys."""

from __future__ import annotations

import difflib
import re
import sys
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from recipe.gdro.startup.checks import GDRORecipeError
from recipe.gdro.startup.recipe_config import DryRun, RecipeConfig, recipe_config_from_dict
from verl_ext import GDROConfig, GDROConfigError

CONFIG_MODULE = "recipe.gdro.config"
CONFIG_NAME = "gdro_trainer"


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the recipe config with Hydra overrides (the same config ``main`` receives)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides))


# ----------------------------------------------------------------------------------- dry-run modes
DRY_RUN_CONFIG_ONLY = DryRun.config.value


def dry_run_mode(config: DictConfig) -> Optional[str]:
    """``None`` (no dry run), ``"full"`` (``gdro.dry_run=true``: config and data) or ``"config"``
    (``gdro.dry_run=config``: the configuration alone). Anything else is a :class:`GDRORecipeError`
    naming the key (:class:`recipe.gdro.startup.recipe_config.DryRun` lists the choices)."""
    value = OmegaConf.select(config, "gdro.dry_run", default=False)
    try:
        mode = recipe_config_from_dict({"dry_run": value}).dry_run
    except GDROConfigError as e:
        raise GDRORecipeError(str(e).removeprefix("gdro config: ")) from None
    return {DryRun.false: None, DryRun.true: "full", DryRun.config: DRY_RUN_CONFIG_ONLY}[mode]


def argv_dry_run(argv: Sequence[str]) -> bool:
    """Whether the command line asks for anything but ``gdro.dry_run=false`` (the last override wins);
    a value that is not a choice counts as a dry run, so it is refused without Hydra's job runtime."""
    found = False
    for arg in argv:
        m = re.fullmatch(r"\+{0,2}gdro\.dry_run=(.*)", arg)
        if m:
            found = m.group(1).strip().strip("'\"").lower() != "false"
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
    """Print a Hydra composition error on one line and return 2: an unknown key (with a did-you-mean)
    or config-group choice (``size=9b``) is named; verl's keys are refused like the recipe's."""
    from hydra.errors import MissingConfigException

    stream = stream or sys.stderr
    missing = getattr(error, "missing_cfg_file", None)
    if isinstance(error, MissingConfigException) and missing and "/" in missing and error.options:
        group, _, choice = missing.rpartition("/")
        print(
            f"gdro: error: {group}={choice}: no such choice in recipe/gdro/config/{group}/; "
            f"choose one of: {', '.join(error.options)}",
            file=stream,
        )
        return 2
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
        print(
            f"gdro: error: unknown key {key}{hint} (`+{key}=...` adds a new key; --help-all lists verl's)", file=stream
        )
        return 2
    message = " ".join(str(error).split())
    print(f"gdro: error: {type(error).__name__}: {message[:500]}", file=stream)
    return 2


# ----------------------------------------------------------------------------------- --help
USAGE = """usage: python -m recipe.gdro.main_gdro [KEY=VALUE ...]

Trains with verl 0.9.1's v1 trainer plus GDRO (config: recipe/gdro/config/gdro_trainer.yaml, verl's
ppo_trainer with a gdro: section). Every argument is a Hydra override, e.g.
  size=8b method=rollout_gdro data.train_files=~/data/dapo/train.parquet data.val_files=[...]

  The paper's launches are config groups (recipe/gdro/config/<group>/<choice>.yaml):
{groups}
  Overrides given after them win (gdro.rollout.n_max=8, trainer.n_gpus_per_node=4, ...).
  The groups name the run (launch: in the YAML): project gdro, experiment qwen3_<size>_<method>,
  checkpoints and gdro_metrics.jsonl in <launch.ckpt_root=~/gdro_ckpt>/<project>/<experiment>.

  gdro.dry_run=true     check config and data (files exist, >= data.train_batch_size prompts, prompt
                        ids, reward reports acc), print the plan and the resolved keys, exit;
                        no Ray, no GPU, no model download
  gdro.dry_run=config   the same, without requiring the data files
  --help-all            Hydra's help with every verl key (~1,100 lines)
  --hydra-help          Hydra's own options (--cfg, --multirun, ...)

Exit status: 0 ok; 2 a setting, key or data file refused before anything starts (named in the
message, verl's keys included).
"""


def _help_text(f) -> str:
    """A field's ``help`` metadata as plain text (reST markup dropped: :mod:`x` -> x, ``x`` -> x)."""
    text = f.metadata.get("help", "")
    return re.sub(r":\w+:`([^`]*)`", r"\1", text).replace("``", "")


def gdro_keys_help(cls=GDROConfig, prefix: str = "gdro") -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` for every leaf of the gdro section, from the dataclasses' fields
    (default, ``help`` and ``range`` metadata; the walk is the generator's, gen_config.walk)."""
    from recipe.gdro.startup.gen_config import scalar, walk

    return [
        (
            key,
            scalar(default),
            _help_text(f) + (f" Range {f.metadata['range'].text()}." if "range" in f.metadata else ""),
        )
        for key, f, default, section in walk(cls, prefix)
        if not section
    ]


GROUPS = {
    "size": "the model, its GPU layout and the paper's protocol (App. A.1)",
    "method": "the GDRO switches",
    "paper_exact": "on: the authors' released settings for the method",
}


def config_groups() -> dict[str, list[str]]:
    """``group -> choices`` of the user-facing config groups, read from the config folder."""
    from importlib.resources import files

    root = files(CONFIG_MODULE)
    return {
        g: sorted(f.name[: -len(".yaml")] for f in root.joinpath(g).iterdir() if f.name.endswith(".yaml"))
        for g in GROUPS
    }


def format_help(width: int = 100) -> str:
    import textwrap

    groups = "\n".join(f"    {g}={'|'.join(c)}  {GROUPS[g]}" for g, c in config_groups().items())
    rows = gdro_keys_help() + gdro_keys_help(RecipeConfig)
    key_w = max(len(k) for k, _, _ in rows)
    def_w = min(max(len(d) for _, d, _ in rows), 14)
    out = [USAGE.format(groups=groups), "gdro: keys (default, meaning):"]
    indent = " " * (2 + key_w + 2 + def_w + 2)
    for key, default, meaning in rows:
        head = f"  {key:<{key_w}}  {default:<{def_w}}  "
        text = textwrap.fill(meaning or "-", width=width, initial_indent=head, subsequent_indent=indent)
        out.append(text)
    out.append("")
    out.append("The recipe's YAML: recipe/gdro/config/gdro_trainer.yaml; every verl key: --help-all")
    return "\n".join(out)
