"""The tiny model's PPO actor settings have one source, config/size/tiny.yaml: the direct loop and the
gradient probe read them from it."""

from __future__ import annotations

import yaml

from recipe.gdro.lab.experiments.direct import DirectConfig
from recipe.gdro.lab.tinylm import gradsignal, policy


def test_direct_loop_and_gradient_probe_read_size_tiny_yaml():
    actor = yaml.safe_load(policy.TINY_SIZE_YAML.read_text())["actor_rollout_ref"]["actor"]
    for settings in (DirectConfig().actor, gradsignal.ACTOR):
        assert {k: settings[k] for k in policy.TINY_ACTOR_KEYS} == {k: actor[k] for k in policy.TINY_ACTOR_KEYS}
        assert settings["use_kl_loss"] is False  # neither loop has a reference model
    assert gradsignal.ACTOR["optim"] == {"clip_grad": 1e30}  # the raw gradient
    assert DirectConfig().actor["optim"] == {"clip_grad": 1.0}  # verl's OptimizerConfig default


def test_a_changed_tiny_yaml_changes_the_direct_loop(tmp_path, monkeypatch):
    text = policy.TINY_SIZE_YAML.read_text().replace("clip_ratio_high: 0.28", "clip_ratio_high: 0.31")
    (tmp_path / "tiny.yaml").write_text(text)
    monkeypatch.setattr(policy, "TINY_SIZE_YAML", tmp_path / "tiny.yaml")
    assert DirectConfig().actor["clip_ratio_high"] == 0.31
    assert policy.resolve_actor_config(DirectConfig().actor).clip_ratio_high == 0.31
