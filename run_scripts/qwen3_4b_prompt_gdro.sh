#!/usr/bin/env bash
# Qwen3-4B-Base x Prompt-GDRO: the data adversary reweights each response's GRPO advantage by its
# prompt's difficulty-bin weight (EMA-debiased EXP3P); binner hysteresis 0.03 (authors' setting).
#
# The paper's protocol (App. A.1: 256 prompts x 4 rollouts, 1000 steps, lr 1e-6, KL loss 0.001,
# clip 0.2/0.28, validation n=8 @ T=0.6/top-p 0.8/top-k 20 every 50 steps on the seven sets) and
# this size's GPU layout are in run_scripts/common/gdro_common.sh; docs/cluster.md and the README explain
# every environment variable.
#
#   bash run_scripts/qwen3_4b_prompt_gdro.sh                          # 1 node x 8 GPUs (80 GB)
#   bash run_scripts/qwen3_4b_prompt_gdro.sh trainer.nnodes=2         # on a running Ray cluster
#   bash run_scripts/qwen3_4b_prompt_gdro.sh trainer.save_freq=50     # extra Hydra overrides win
#   DRY_RUN=1 bash run_scripts/qwen3_4b_prompt_gdro.sh                # check the config on a CPU-only machine
#   PREFLIGHT=1 bash run_scripts/qwen3_4b_prompt_gdro.sh              # check a GPU node in ~1 min (attention kernel, Ray nodes, vLLM)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common/gdro_common.sh"
gdro_launch 4b prompt_gdro "$@"
