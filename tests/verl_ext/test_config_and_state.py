"""Typed configs reject impossible settings by name; controller state round-trips exactly."""

import pickle

import numpy as np
import pytest

from verl_ext import GDROConfigError, GDROController, gdro_config_from_dict


@pytest.mark.parametrize(
    "section, field",
    [
        ({"rollout": {"n_min": 1}}, "rollout.n_min"),
        ({"rollout": {"n_min": 5, "n_mean": 4}}, "rollout.n_min"),
        ({"rollout": {"n_max": 3, "n_mean": 4}}, "rollout.n_max"),
        ({"rollout": {"allocator": "greedy"}}, "rollout.allocator"),
        ({"rollout": {"n_min": "abc"}}, "rollout.n_min"),
        ({"rollout": {"n_min": 2.5}}, "rollout.n_min"),
        ({"rollout": {"enable": "yes"}}, "rollout.enable"),
        ({"binner": {"bin_edges": [0.0, 0.5, 0.3, 1.0]}}, "binner.bin_edges"),
        ({"binner": {"bin_edges": [0.1, 0.5, 1.0]}}, "binner.bin_edges"),
        ({"binner": {"window": 0}}, "binner.window"),
        ({"binner": {"unseen": "hardest"}}, "binner.unseen"),
        ({"prompt": {"gamma": 1.5}}, "prompt.gamma"),
        ({"prompt": {"gamma": -0.1}}, "prompt.gamma"),
        ({"prompt": {"eta": 0}}, "prompt.eta"),
        ({"prompt": {"weight_cap": 0.5}}, "prompt.weight_cap"),
        ({"prompt": {"loss_signal": "ppo"}}, "prompt.loss_signal"),
        ({"rollout": {"n_mn": 2}}, "gdro.rollout.n_mn"),
        ({"promt": {}}, "gdro.promt"),
    ],
)
def test_impossible_settings_name_the_field(section, field):
    with pytest.raises(GDROConfigError, match=field.replace(".", r"\.")):
        gdro_config_from_dict(section)


@pytest.mark.parametrize(
    "section, key",
    [
        ({"rollout": {"n_min": "3"}}, "gdro.rollout.n_min"),
        ({"rollout": {"enable": "yes"}}, "gdro.rollout.enable"),
        ({"prompt": {"lagged": "true"}}, "gdro.prompt.lagged"),
        ({"prompt": {"eta": "0.5"}}, "gdro.prompt.eta"),
        ({"binner": {"bin_edges": [0, "0.5", 1]}}, "gdro.binner.bin_edges"),
        ({"rollout": {"n_max": True}}, "gdro.rollout.n_max"),
        ({"prompt": {"normalize": 3}}, "gdro.prompt.normalize"),
        ({"binner": 5}, "gdro.binner"),
    ],
)
def test_strings_are_not_numbers_or_booleans(section, key):
    """OmegaConf alone would turn "3" into 3 and "yes" into True; a config typo must fail instead."""
    with pytest.raises(GDROConfigError, match=key.replace(".", r"\.")):
        gdro_config_from_dict(section)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"rollout": {"n_min": 2.5}}, "gdro.rollout.n_min=2.5 must be an integer"),
        ({"rollout": {"n_max": True}}, "gdro.rollout.n_max=True must be an integer"),
        ({"rollout": {"seed": None}}, "gdro.rollout.seed=None must be an integer"),
        ({"binner": {"bin_edges": "x"}}, "gdro.binner.bin_edges='x' must be a list of numbers"),
    ],
)
def test_wrong_types_name_the_key_the_value_and_the_type(section, message):
    """pydantic's strict types: a float, a bool or null is not an integer; the line names all three."""
    with pytest.raises(GDROConfigError) as e:
        gdro_config_from_dict(section)
    assert str(e.value) == f"gdro config: {message}"


def test_unknown_keys_suggest_the_closest_name():
    with pytest.raises(GDROConfigError, match=r"unknown key\(s\) gdro\.rollout\.n_mn; did you mean n_min\?"):
        gdro_config_from_dict({"rollout": {"n_mn": 2}})
    with pytest.raises(GDROConfigError, match=r"unknown key\(s\) gdro\.promt; did you mean prompt\?"):
        gdro_config_from_dict({"promt": {}})


def test_hydra_section_is_accepted_as_is():
    from omegaconf import OmegaConf

    root = OmegaConf.create({"n": 8, "gdro": {"rollout": {"n_mean": "${n}", "mu_init": None}, "binner": None}})
    cfg = gdro_config_from_dict(root.gdro)
    assert cfg.rollout.n_mean == 8 and cfg.rollout.mu_init is None and cfg.binner.num_bins == 10
    assert gdro_config_from_dict({"prompt": {"eta": 1}}).prompt.eta == 1.0  # an int where a float is due is fine
    assert isinstance(gdro_config_from_dict({"prompt": {"eta": 1}}).prompt.eta, float)


def test_defaults_are_the_paper_appendix_values():
    cfg = gdro_config_from_dict({})
    assert (cfg.prompt.eta, cfg.prompt.gamma, cfg.prompt.beta, cfg.prompt.weight_cap) == (0.65, 0.01, 0.12, 15.0)
    assert (cfg.rollout.n_min, cfg.rollout.n_mean, cfg.rollout.n_max, cfg.rollout.mu_lr) == (2, 4, 12, 0.05)
    assert cfg.binner.num_bins == 10 and cfg.binner.edges() == pytest.approx([i / 10 for i in range(11)])
    assert not cfg.enabled


def test_bin_edges_override_num_bins():
    cfg = gdro_config_from_dict({"binner": {"bin_edges": [0, 0.2, 0.8, 1]}})
    assert cfg.binner.num_bins == 3


def _run(ctl, rng_seed, steps, num_prompts, start=0):
    """Drive ``steps`` steps; the data of step t depends only on (seed, t), not on the controller."""
    out = []
    for t in range(start, start + steps):
        rng = np.random.default_rng([rng_seed, t])
        p_true = np.random.default_rng(rng_seed).random(num_prompts)
        ids = rng.choice(num_prompts, 32, replace=False)
        n = ctl.schedule(ids)
        rp = np.repeat(ids, n)
        acc = rng.random(len(rp)) < p_true[rp]
        mult = ctl.observe(rp, acc, response_abs_advantage=rng.random(len(rp)))
        out.append((n.copy(), mult.copy(), ctl.metrics()))
    return out


@pytest.mark.parametrize(
    "allocator, prompt_extra, rollout_extra",
    [
        ("sqrt", {}, {}),
        ("bandit", {}, {}),
        ("knapsack", {}, {}),
        ("discovery", {}, {}),
        ("failure_weighted", {}, {}),
        ("fixed_tail_share", {}, {}),
        ("sqrt", {"lagged": True, "loss_signal": "learnability"}, {"variance_source": "prompt"}),
        ("bandit", {"normalize": "all_responses", "min_group_prompts": 0.0}, {"variance_source": "prompt"}),
    ],
)
def test_state_round_trip_is_exact(tmp_path, allocator, prompt_extra, rollout_extra):
    section = {
        "binner": {"window": 4, "hysteresis": 0.03},
        "prompt": {
            "enable": True,
            "loss_signal": "mean_abs_advantage",
            "rollout_coupling": "divide_by_allocation",
            **prompt_extra,
        },
        "rollout": {"enable": True, "allocator": allocator, "seed": 7, **rollout_extra},
    }
    N, k, P = 12, 5, 200
    straight = _run(GDROController(gdro_config_from_dict(section), P), 3, N, P)

    first = GDROController(gdro_config_from_dict(section), P)
    head = _run(first, 3, k, P)
    first.save(str(tmp_path / "gdro_state.pkl"))
    assert not list(tmp_path.glob(".gdro_state.*"))  # no temporary left behind
    resumed = GDROController(gdro_config_from_dict(section), P)
    resumed.load(str(tmp_path / "gdro_state.pkl"))
    tail = _run(resumed, 3, N - k, P, start=k)

    for (n1, m1, met1), (n2, m2, met2) in zip(straight, head + tail, strict=True):
        assert np.array_equal(n1, n2)
        assert np.array_equal(m1, m2)
        assert met1.keys() == met2.keys()
        for key in met1:
            assert met1[key] == met2[key] or (np.isnan(met1[key]) and np.isnan(met2[key])), key


def test_old_state_version_fails_with_a_clear_message():
    ctl = GDROController(gdro_config_from_dict({"prompt": {"enable": True}}), 10)
    state = ctl.state_dict()
    assert state["version"] == 3 and "observed" in state["prompt"] and "lengths" in state
    state["version"] = 2
    with pytest.raises(ValueError, match=r"version 2 is not 3.*older verl_ext"):
        ctl.load_state_dict(state)


def test_state_is_plain_picklable_and_checks_shape():
    ctl = GDROController(gdro_config_from_dict({"rollout": {"enable": True}}), 10)
    state = pickle.loads(pickle.dumps(ctl.state_dict()))
    other = GDROController(gdro_config_from_dict({"binner": {"num_bins": 6}}), 10)
    with pytest.raises(ValueError, match="bin edges"):
        other.load_state_dict(state)
    bigger = GDROController(gdro_config_from_dict({}), 11)
    with pytest.raises(ValueError, match="num_prompts=10"):
        bigger.load_state_dict(state)


def test_atomic_replace_keeps_the_old_file_when_writing_fails(tmp_path):
    from verl_ext.atomic import atomic_replace

    target = tmp_path / "gdro_state.pkl"
    target.write_bytes(b"old")
    with pytest.raises(OSError, match="No space"), atomic_replace(target) as f:
        f.write(b"half")
        raise OSError(28, "No space left on device")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["gdro_state.pkl"]
    with atomic_replace(target, "w") as f:
        f.write("new")
    assert target.read_text() == "new"


def test_state_fingerprint_names_every_field_and_changes_with_each():
    """The per-field digests a resume records (recipe trainer's gdro_resume.jsonl): equal for a state and
    its reload; each of the binner windows, EXP3P scores, mu, variances, lengths and the RNG is its own field,
    and changing one value changes that field's digest alone."""
    from verl_ext.controller import state_fingerprint

    section = {"prompt": {"enable": True}, "rollout": {"enable": True, "seed": 3}}
    ctl = GDROController(gdro_config_from_dict(section), 50)
    _run(ctl, 3, 4, 50)
    state = ctl.state_dict()
    fields = state_fingerprint(state)
    assert fields == state_fingerprint(pickle.loads(pickle.dumps(state)))
    for name in ("binner.ring", "binner.meta", "prompt.scores", "rollout.log_mu", "rollout.variance", "step"):
        assert name in fields, name
    assert any(k.startswith("rollout.rng.") for k in fields) and any(k.startswith("lengths.") for k in fields)
    changed = pickle.loads(pickle.dumps(state))
    changed["prompt"]["scores"][0] += 1e-12
    other = state_fingerprint(changed)
    assert [k for k in fields if fields[k] != other[k]] == ["prompt.scores"]
    changed["rollout"]["rng"]["state"]["state"] += 1
    assert state_fingerprint(changed)["rollout.rng.state.state"] != fields["rollout.rng.state.state"]
