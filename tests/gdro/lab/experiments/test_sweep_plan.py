"""The simulator sweep's plan (protocols/sim_sweep.yaml, recipe/gdro/lab/experiments/sweep.py load_plan): typed
as the study's protocol is, so a misspelt key, a string for a number, a value out of range or a short row is
one line naming the file, the key and the value (before issue 43 item 4: accepted, or a KeyError)."""

from __future__ import annotations

import pytest
import yaml

from recipe.gdro.lab.experiments.sweep import SWEEP_PLAN, load_plan


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr_gird": [1.0]}, r"lr_gird: unknown key \(did you mean lr_grid\?\)"),
        ({"tune_seed0": "100"}, r"tune_seed0: '100' must be an integer"),
        ({"lr_grid": [0.5, -1.0]}, r"lr_grid\[1\]: -1.0 must be a finite number > 0"),
        ({"allocator_rows": [["grpo"]]}, r"allocator_rows\[0\]: \['grpo'\] must hold at least 2 items"),
        (
            {"defaults": [{"question": "q", "variant": "grpo", "lr_of": "grpo"}]},
            r"defaults\[0\].label: missing \(a required key\)",
        ),
    ],
)
def test_a_bad_plan_is_one_line_naming_the_key(tmp_path, change, message):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(SWEEP_PLAN.read_text()), **change}))
    with pytest.raises(ValueError, match=f"^{path}: {message}"):
        load_plan(path)
