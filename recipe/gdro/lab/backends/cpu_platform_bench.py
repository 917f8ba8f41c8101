"""Step time split of two runs from verl's file logger (``trainer.logger=[console,file]``,
``VERL_FILE_LOGGER_PATH``): median seconds per step of each phase over steps 2.. (step 1 warms up).

    python -m recipe.gdro.lab.backends.cpu_platform_bench real=REAL.jsonl cpu=CPU.jsonl

Prints the markdown table docs/real_path.md carries ("Step time, side by side").
"""

from __future__ import annotations

import json
import statistics
import sys

# (row, verl metric, scale to seconds); verl's marked_timer names (verl/trainer/ppo/v1/trainer_base.py)
PHASES = (
    ("generation (rollout + reward)", "timing_s/gen", 1.0),
    ("log-prob, actor", "timing_s/old_log_prob", 1.0),
    ("log-prob, reference", "timing_s/ref", 1.0),
    ("advantage (GRPO + GDRO)", "timing_s/adv", 1.0),
    ("update", "timing_s/update_actor", 1.0),
    ("weight sync", "timing_s/update_weights", 1.0),
    ("GDRO driver work", "gdro/recipe/driver_ms", 1e-3),
    ("step", "timing_s/step", 1.0),
)


def step_rows(path: str) -> dict[int, dict]:
    rows = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if "timing_s/step" in row.get("data", {}):
                    rows[int(row["step"])] = row["data"]
    return rows


def split(path: str) -> dict[str, float | None]:
    rows = step_rows(path)
    used = [rows[s] for s in sorted(rows) if s >= 2] or list(rows.values())
    out = {}
    for name, key, scale in PHASES:
        values = [r[key] * scale for r in used if key in r]
        out[name] = statistics.median(values) if values else None
    named = sum(out[name] or 0.0 for name, key, _ in PHASES if key.startswith("timing_s/") and key != "timing_s/step")
    out["outside verl's timers"] = (out["step"] - named) if out["step"] is not None else None
    out["steps"] = len(used)
    return out


def table(runs: dict[str, str]) -> str:
    splits = {label: split(path) for label, path in runs.items()}
    labels = list(splits)
    lines = ["| phase (median s/step) | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name in [p[0] for p in PHASES] + ["outside verl's timers"]:
        cells = [f"{splits[lab][name]:.3f}" if splits[lab][name] is not None else "-" for lab in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| steps measured | " + " | ".join(str(splits[lab]["steps"]) for lab in labels) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = dict(a.rsplit("=", 1) for a in sys.argv[1:] if "=" in a)
    if not args or len(args) != len(sys.argv) - 1:
        sys.exit("usage: python -m recipe.gdro.lab.backends.cpu_platform_bench LABEL=verl_metrics.jsonl ...")
    print(table(args))
