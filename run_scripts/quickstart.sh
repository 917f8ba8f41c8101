#!/usr/bin/env bash
# Quick start on a CPU-only machine: installs everything (see setup_env.sh), then trains the shipped
# tiny LM (recipe/gdro/lab/tinylm/base) on arithmetic for real -- verl 0.9.1's v1 loop with the recipe's
# trainer and the CPU backend (gdro.backend=cpu, docs/cpu_backend.md) -- once with GRPO and once with
# GDRO (Prompt-GDRO + Rollout-GDRO, joint), at equal rollouts (64 prompts x 4 a step), one seed.
#   bash run_scripts/quickstart.sh [--steps 30] [--runs grpo,prompt_gdro,rollout_gdro,joint_gdro] [hydra overrides]
# Results: quickstart_out/<run>/gdro_metrics.jsonl (training + validation lines), quickstart_out/report.md
# (per-skill validation accuracy before/after, mean and worst skill, tokens, wall time) and PNG plots.
# The synthetic simulator is still there: python -m recipe.gdro.lab.sim.simulate (docs/simulator.md).
set -eo pipefail
cd "$(dirname "$0")/.."
INSTALL_START=$(date +%s)
source run_scripts/setup_env.sh
INSTALL_SECONDS=$(( $(date +%s) - INSTALL_START ))
python -m recipe.gdro.lab.experiments.quickstart --install-seconds "$INSTALL_SECONDS" "$@"
