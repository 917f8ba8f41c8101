"""The ``gdro:`` YAML block and the README's ``gdro.*`` table are written from the dataclasses
(``python -m recipe.gdro.startup.gen_config``); a stale copy fails here with that command."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from recipe.gdro.startup import gen_config
from recipe.gdro.startup.cli import compose_config
from recipe.gdro.startup.recipe_config import RecipeConfig, recipe_config_from_dict, split_gdro_section
from verl_ext import GDROConfig, gdro_config_from_dict, gdro_config_to_dict
from verl_ext.config import BinnerConfig, RolloutGDROConfig


def test_generated_yaml_and_readme_are_current():
    stale = gen_config.stale()
    assert not stale, f"{[str(p.relative_to(gen_config.ROOT)) for p in stale]} are stale: run {gen_config.COMMAND}"


def test_a_changed_default_changes_both_copies(monkeypatch):
    """The generator alone carries a dataclass default into the YAML and the README table."""
    num_bins = {f.name: f for f in dataclasses.fields(BinnerConfig)}["num_bins"]
    monkeypatch.setattr(num_bins, "default", 7)
    out = gen_config.generated()
    assert "\n    num_bins: 7\n" in out[gen_config.YAML_FILE]
    assert "| `gdro.binner.num_bins` | `7` |" in out[gen_config.README]
    assert set(gen_config.stale()) == {gen_config.YAML_FILE, gen_config.README}


def test_check_mode_names_the_stale_file_and_the_command(monkeypatch, capsys):
    monkeypatch.setattr(gen_config, "readme_table", lambda: "| key | default | meaning |")
    assert gen_config.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "README.md is stale: run python -m recipe.gdro.startup.gen_config" in err
    assert "gdro_trainer.yaml" not in err


def test_composed_defaults_are_the_dataclass_defaults():
    """What Hydra composes from the generated block builds the default dataclasses, key for key."""
    config = compose_config([])
    controllers, recipe = split_gdro_section(OmegaConf.to_container(config.gdro, resolve=True))
    assert gdro_config_to_dict(gdro_config_from_dict(controllers)) == gdro_config_to_dict(GDROConfig())
    assert recipe_config_from_dict(recipe) == RecipeConfig()
    # n̄ follows actor_rollout_ref.rollout.n, which the recipe sets to the dataclass default
    assert OmegaConf.to_container(config.gdro)["rollout"]["n_mean"] == "${actor_rollout_ref.rollout.n}"
    assert config.actor_rollout_ref.rollout.n == GDROConfig().rollout.n_mean


@pytest.mark.parametrize("n, n_max", [(4, 12), (8, 24), (2, 6)])
def test_n_max_follows_the_appendix_rule_everywhere(n, n_max):
    """n_max = 3·n̄ (App. A.2.2), resolved by RolloutGDROConfig alone, whatever builds it."""
    assert RolloutGDROConfig(n_mean=n).n_max == n_max
    assert gdro_config_from_dict({"rollout": {"n_mean": n}}).rollout.n_max == n_max
    composed = compose_config([f"actor_rollout_ref.rollout.n={n}"])
    section = split_gdro_section(OmegaConf.to_container(composed.gdro, resolve=True))[0]
    assert gdro_config_from_dict(section).rollout.n_max == n_max
    assert gdro_config_from_dict({"rollout": {"n_mean": n, "n_max": n + 1}}).rollout.n_max == n + 1


def test_readme_table_says_the_derived_default_in_words():
    table = gen_config.readme_table()
    assert "| `gdro.rollout.n_max` | `null` | largest count for any prompt; `null` = 3·n̄ (" in table


def test_a_file_that_cannot_be_written_leaves_both_files_as_they_were(tmp_path):
    """Issue 44 item 6: gen_config rewrote gdro_trainer.yaml, then failed on the README, leaving the two out of
    step. Copies of both, stale, under a file-size limit the README's new text passes (and the YAML's does not:
    a limit binds root too, unlike a read-only mode): exit 2 naming the README, both files byte for byte as
    they were, no temporary file left."""
    import resource
    import subprocess
    import sys

    yaml_file, readme = tmp_path / "gdro_trainer.yaml", tmp_path / "README.md"
    for src, dst in ((gen_config.YAML_FILE, yaml_file), (gen_config.README, readme)):
        text = src.read_text(encoding="utf-8")
        dst.write_text(text.replace("num_bins: 10", "num_bins: 9").replace("| `10` |", "| `9` |"), encoding="utf-8")
    before = {p: p.read_bytes() for p in (yaml_file, readme)}
    limit = (len(before[yaml_file]) + len(before[readme])) // 2  # the YAML fits, the README does not
    assert len(before[yaml_file]) < limit < len(before[readme])
    code = (
        "import sys; from pathlib import Path; from recipe.gdro.startup import gen_config as g; "
        f"g.YAML_FILE, g.README = Path({str(yaml_file)!r}), Path({str(readme)!r}); sys.exit(g.main([]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=gen_config.ROOT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"gen_config: error: [Errno 27] cannot write {readme} (File too large); nothing written (the files stay in "
        "step)"
    )
    assert {p: p.read_bytes() for p in (yaml_file, readme)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "gdro_trainer.yaml"]
