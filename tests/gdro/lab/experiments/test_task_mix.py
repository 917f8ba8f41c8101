"""The task mix (issue 45, protocol tiny_lm_v3): a protocol's ``shape.mix`` sets each skill's share of the
training, validation and test rows (data_prep.arith.mix_shares), it keys the runs of the protocols that
use it and leaves the v2 runs' keys as they were; a tail can be split into its skills. Cost: < 2 s."""

from __future__ import annotations

from collections import Counter

import pytest
import yaml

from data_prep import arith
from data_prep.common import DataPrepError
from recipe.gdro.lab.experiments import study
from recipe.gdro.lab.experiments.protocol import TINY_LM_PROTOCOL, TINY_LM_V1, ProtocolError, load_protocol
from recipe.gdro.lab.results.outcomes import Endpoint, Tail, endpoint_value

MIX = {"add2": 0.1, "add3": 0.3, "add4": 0.6}


def _skills(rows):
    return Counter(r["extra_info"]["skill"] for r in rows)


def test_a_mix_sets_each_skills_rows_and_a_skill_keeps_its_problems():
    assert _skills(arith.build_split(200, 3, val=False, mix=MIX)) == {"add2": 20, "add3": 60, "add4": 120}
    test = arith.build_test_split(50, 3, 100, mix=MIX)
    assert _skills(test) == {"add2": 5, "add3": 15, "add4": 30}
    val = {r["prompt"][-1]["content"] for r in arith.build_split(100, 3, val=True, mix=MIX)}
    assert not val & {r["prompt"][-1]["content"] for r in test}  # beside the validation split of the same mix
    # the default mix is arith's shares; a skill drawn as many times under two mixes draws the same problems
    assert arith.build_split(100, 3, val=False) == arith.build_split(100, 3, val=False, mix=None)

    def add4(mix):
        return [
            r["prompt"][-1]["content"]
            for r in arith.build_split(100, 3, val=False, mix=mix)
            if r["extra_info"]["skill"] == "add4"
        ]

    assert sorted(add4({"add4": 0.5, "add2": 0.5})) == sorted(add4({"add4": 0.5, "add3": 0.5}))


@pytest.mark.parametrize(
    ("mix", "message"),
    [
        ({"add9": 1.0}, "unknown skill 'add9'"),
        ({"add2": -1.0}, "add2=-1.0: a share is a finite number >= 0"),
        ({"add2": 0.0}, "every share is 0"),
    ],
)
def test_a_bad_mix_is_named(mix, message, tmp_path):
    with pytest.raises(DataPrepError, match=message):
        arith.build_split(10, 0, val=False, mix=mix)
    data = yaml.safe_load(TINY_LM_PROTOCOL.read_text())
    data["shape"]["mix"] = mix
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProtocolError, match=f"shape.mix: task mix: .*{message[:12]}"):
        load_protocol(path)


def test_the_mix_keys_a_runs_config_and_v2s_keys_leave_it_out(tmp_path):
    data = yaml.safe_load(TINY_LM_PROTOCOL.read_text())
    data["shape"]["mix"] = MIX
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    mixed = study.run_config(load_protocol(path), "grpo", 1e-4, 0)
    assert mixed["direct"]["mix"] == MIX
    v2 = load_protocol(TINY_LM_PROTOCOL)
    assert "mix" not in study.run_config(v2, "grpo", 1e-4, 0)["direct"]  # the committed v2 runs keep their keys
    assert "mix" not in study.run_config(load_protocol(TINY_LM_V1), "grpo", 1e-4, 0)["direct"]  # and v1's
    with pytest.raises(ValueError, match="shape.mix=.*this protocol's runs predate it"):
        study.run_config(v2, "grpo", 1e-4, 0, shape={"mix": MIX})


def test_a_tail_split_into_its_skills():
    """base_below and skills together: the skill's prompts whose base p is below the threshold."""
    p = {"step": [0, 10], "p": [[0.9, 0.01, 0.02], [0.95, 0.2, 0.1]]}
    run = {"per_prompt": {"test": {"id": ["a", "b", "c"], "skill": ["s", "s", "t"], **p}}}
    tail_s = Endpoint("tail s", k=1, tail=Tail(base_below=0.05, skills=("s",)))  # b only: a is not below
    assert endpoint_value(run, tail_s) == pytest.approx(0.2)
    assert Tail(base_below=0.05, skills=("s",)).describe() == "skill s, prompts with base p < 0.05"
    with pytest.raises(ValueError, match="base_below .*skills .*or both"):
        Tail()
