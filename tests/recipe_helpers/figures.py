"""Compare a figure the docs print with the one the code computes now, to a stated tolerance.

A docs table holds rounded numbers made on one machine; the code recomputes them on another. Two
things separate them even when the code is unchanged: the rounding (both sides print the same
last digit, so equal values can print one unit of that digit apart) and the machine (another CPU's
numpy kernels round the last bit of exp/log differently; the simulator's allocator turns such a bit
into a different integer allocation, and the run moves on from there). :func:`assert_row_close`
(rendered against printed: a whole unit of the last digit) and :func:`assert_unrounded_close` (the
code's unrounded numbers, from :func:`compare_row_numbers`, against printed: half a unit) allow the
rounding and a per-column tolerance for the machine, and nothing else: the text around the numbers
(the lr label, the "–" of the reference row, a "↑" mark) must be the same.

``python tests/recipe_helpers/figures.py`` prints the full-precision figures behind the test's
recomputed rows and the kernels that ran (OpenBLAS core and threads, numpy's dispatch target for
float64 exp/log/tanh, torch's CPU capability), as JSON: run it under two configurations and
compare, as the test's docstring records.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def numbers(cell: str) -> list[float]:
    return [float(x) for x in NUMBER.findall(cell)]


def last_digit(token: str) -> float:
    """One unit of the last printed digit of a number token: 0.1 for '47.7', 1 for '12'."""
    return 10.0 ** -len(token.partition(".")[2])


def assert_row_close(got: Sequence[str], pasted: Sequence[str], tolerance: Sequence[float], label: str) -> None:
    """Cell for cell: the same text around the numbers, and every number within ``tolerance`` of
    its column plus one unit of its last printed digit (two roundings of equal values can differ by
    that much; a docs figure at a rounding boundary still passes)."""
    assert len(got) == len(pasted) == len(tolerance), (label, got, pasted)
    for i, (g, p, tol) in enumerate(zip(got, pasted, tolerance, strict=True)):
        assert NUMBER.sub("#", g) == NUMBER.sub("#", p), f"{label} cell {i}: code {g!r} vs docs {p!r}"
        for a, b in zip(NUMBER.findall(g), NUMBER.findall(p), strict=True):
            allowed = tol + last_digit(b) + 1e-9
            assert abs(float(a) - float(b)) <= allowed, (
                f"{label} cell {i}: code {g!r} vs docs {p!r}: {a} is {abs(float(a) - float(b)):.2f} from {b}, "
                f"more than the {allowed:.2f} allowed (machine tolerance {tol:g} + last digit)"
            )


def assert_unrounded_close(
    raw: Sequence[Sequence[float]], pasted: Sequence[str], tolerance: Sequence[float], label: str
) -> None:
    """The code's unrounded numbers against the docs' printed ones, cell for cell: each within
    ``tolerance`` of its column plus half a unit of the docs' last printed digit (the docs' own
    rounding). Tighter than comparing two rounded strings, which must allow a whole unit."""
    assert len(raw) == len(pasted) == len(tolerance), (label, raw, pasted)
    for i, (values, p, tol) in enumerate(zip(raw, pasted, tolerance, strict=True)):
        tokens = NUMBER.findall(p)
        assert len(values) == len(tokens), f"{label} cell {i}: docs {p!r} has {len(tokens)} numbers, code {values}"
        for x, b in zip(values, tokens, strict=True):
            allowed = tol + 0.5 * last_digit(b) + 1e-9
            assert abs(x - float(b)) <= allowed, (
                f"{label} cell {i}: the code's {x:.4f} is {abs(x - float(b)):.3f} from the docs' {b} ({p!r}), "
                f"more than the {allowed:.3f} allowed (machine tolerance {tol:g} + the docs' rounding)"
            )


def compare_row_numbers(e: Mapping, ref: Mapping, same: bool) -> list[list[float]]:
    """The unrounded numbers behind each cell of ``sweep._compare_rows``'s row for one method, in its
    cells' order and units (points; lr and mass ratio as they are). A cell it prints as "–" has none."""
    import numpy as np

    from recipe.gdro.lab.sim.simulate import paired_ci

    def pm(k: str) -> list[float]:
        return [100 * float(e[k]), 100 * float(e[k + "_std"])]

    def delta(k: str) -> list[float]:
        if same:
            return []
        mean, lo, hi, _ = paired_ci(e["per_seed"][k], ref["per_seed"][k])
        return [100 * mean] if not np.isfinite(lo) else [100 * mean, 100 * lo, 100 * hi]

    def pct(k: str) -> list[float]:
        x = e[k]
        return [] if x is None or not np.isfinite(x) else [100 * float(x)]

    return [
        [],  # scenario
        [],  # method
        [float(e["lr_scale"])],
        pm("mean_accuracy"),
        pm("worst_skill_accuracy"),
        delta("mean_accuracy"),
        delta("worst_skill_accuracy"),
        pct("se_reduction"),
        pct("variance_reduction"),
        pct("efficiency"),
        [float(e["advantage_mass_ratio"])],
    ]


def kernels() -> dict[str, object]:
    """Which BLAS / SIMD kernels this process runs (threadpoolctl is not a dependency: ctypes)."""
    import ctypes

    import numpy as np
    import torch
    from numpy.lib.introspect import opt_func_info

    out: dict[str, object] = {}
    libs = sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas64_*.so"))
    if libs:
        ob = ctypes.CDLL(str(libs[0]))
        ob.scipy_openblas_get_corename64_.restype = ctypes.c_char_p
        out["openblas_core"] = ob.scipy_openblas_get_corename64_().decode()
        out["openblas_threads"] = ob.scipy_openblas_get_num_threads64_()
    for f in ("exp", "log", "tanh"):
        out[f"numpy_{f}_float64"] = opt_func_info(func_name=f"^{f}$", signature="float64")[f]["dd"]["current"]
    out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    out["torch_threads"] = torch.get_num_threads()
    return out


HEADLINE_METHODS = ["grpo", "rollout_gdro"]


def headline_run() -> dict:
    """The simulator run behind the two headline rows test_docs recomputes: dapo_like, grpo and
    rollout_gdro, seeds 0-4, each at its shipped tuned lr."""
    from recipe.gdro.lab.sim.methods import lookup_tuned_lr
    from recipe.gdro.lab.sim.scenario import load_scenario
    from recipe.gdro.lab.sim.simulate import run_experiment

    return run_experiment(
        load_scenario("dapo_like"),
        "unused",
        methods=HEADLINE_METHODS,
        seeds=list(range(5)),
        lr_scales=lookup_tuned_lr("dapo_like", "shared", HEADLINE_METHODS),
        workers=1,
        progress=False,
        plots=False,
        write_files=False,
    )


def simulator_headline_figures() -> dict[str, object]:
    """The rows of :func:`headline_run`: rendered, and the unrounded numbers behind each cell (points,
    except the mass ratio)."""
    from recipe.gdro.lab.experiments.sweep import _compare_rows
    from recipe.gdro.lab.results.stats import paired_ci

    methods = HEADLINE_METHODS
    res = headline_run()
    ref = res["methods"]["grpo"]
    raw: dict[str, Mapping[str, object]] = {}
    for m in methods:
        e = res["methods"][m]
        r: dict[str, object] = {k: 100 * float(e[k]) for k in ("se_reduction", "variance_reduction", "efficiency")}
        for k in ("mean_accuracy", "worst_skill_accuracy"):
            r[k] = [100 * float(e[k]), 100 * float(e[k + "_std"])]
            r["delta_" + k] = [100 * x for x in paired_ci(e["per_seed"][k], ref["per_seed"][k])[:3]]
            r["per_seed_" + k] = [100 * float(x) for x in e["per_seed"][k]]
        r["advantage_mass_ratio"] = float(e["advantage_mass_ratio"])
        raw[m] = r
    rows = [[str(c) for c in row] for row in _compare_rows("dapo_like", res, ref, methods)]
    return {"kernels": kernels(), "rows": rows, "raw": raw}


if __name__ == "__main__":
    # run as a script (.ci/run; no pytest, so no `pythonpath` setting): the repository root, for `recipe`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    what = sys.argv[1] if len(sys.argv) > 1 else "simulator"
    print(json.dumps(kernels() if what == "kernels" else simulator_headline_figures(), indent=1))
