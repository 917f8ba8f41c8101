#!/usr/bin/env bash
# Quick start on a CPU-only machine: installs everything (see setup_env.sh), then runs the
# simulator's default scenario (a synthetic learner shaped like DAPO-14.1k) comparing GRPO,
# Prompt-GDRO, Rollout-GDRO (sqrt / bandit / knapsack) and joint mode at equal total rollouts.
#   bash run_scripts/quickstart.sh [simulator args, e.g. --steps 100 --seeds 2]
# Results: quickstart_out/report.md, results.json and PNG plots.
set -eo pipefail
cd "$(dirname "$0")/.."
source run_scripts/setup_env.sh
python -m recipe.gdro.simulate --scenario dapo_like --out quickstart_out "$@"
echo "[quickstart] report: quickstart_out/report.md"
