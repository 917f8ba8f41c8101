#!/usr/bin/env bash
# Quick start on a CPU-only machine: installs everything (see setup_env.sh), then runs the
# simulator's default scenario (a SYNTHETIC learner shaped like DAPO-14.1k) comparing GRPO,
# Prompt-GDRO, Rollout-GDRO (sqrt / bandit / knapsack) and joint mode at equal total rollouts,
# each method at its own tuned learning rate (recipe/gdro/sim/scenarios/tuned_lr.csv, written by
# `python -m recipe.gdro.sim.sweep tune`). About 1 min of simulation on 2 idle cores.
#   bash run_scripts/quickstart.sh [simulator args, e.g. --steps 100 --seeds 2]
# Results: quickstart_out/report.md, results.json and PNG plots. The full study (lr tuning,
# equal advantage mass, defaults) is `python -m recipe.gdro.sim.sweep all` (docs/simulator.md).
set -eo pipefail
cd "$(dirname "$0")/.."
source run_scripts/setup_env.sh
python -m recipe.gdro.sim.simulate --scenario dapo_like --tuned-lr --out quickstart_out "$@"
echo "[quickstart] report: quickstart_out/report.md"
