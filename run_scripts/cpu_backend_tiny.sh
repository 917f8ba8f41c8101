#!/usr/bin/env bash
# A short real RL run on CPU with the in-process CPU backend (gdro.backend=cpu: the tiny LM's CPU
# stand-ins for verl's GPU workers and LLM server, docs/cpu_backend.md): the shipped tiny LM
# (recipe/gdro/lab/tinylm/base) trained on arithmetic through verl 0.9.1's real v1 loop.
#
#   METHOD=grpo|prompt_gdro|rollout_gdro|joint_gdro bash run_scripts/cpu_backend_tiny.sh [hydra overrides...]
#
# Defaults: 64 prompts x 4 rollouts per step (one optimizer step each, lr 1e-4), 30 steps, validation
# (one sample per prompt at temperature 1) before training and every 10 steps; arithmetic data made on the fly (python -m data_prep.arith:
# $NUM_TRAIN=640 training prompts, so each is revisited every 10 steps and the difficulty binner,
# which keys prompts by id, can place them; $NUM_VAL=300) under $DATA_DIR (default tiny_cpu_data/); outputs (checkpoints, gdro_metrics.jsonl) under
# $OUT_DIR (default tiny_cpu_out/$METHOD). Arguments are Hydra overrides and win over the defaults,
# e.g. trainer.total_training_steps=100 actor_rollout_ref.actor.optim.lr=1e-3.
# Uses .venv/ when it exists (run_scripts/setup_env.sh makes it).
set -eo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python

METHOD=${METHOD:-grpo}
DATA_DIR=${DATA_DIR:-tiny_cpu_data}
OUT_DIR=${OUT_DIR:-tiny_cpu_out/$METHOD}
NUM_TRAIN=${NUM_TRAIN:-640}
NUM_VAL=${NUM_VAL:-300}
# Named here, as the variables the user set: data_prep.arith would name its own flags (--num_train).
for var in NUM_TRAIN NUM_VAL; do
  [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || { echo "cpu_backend_tiny.sh: $var='${!var}' is not a positive whole number (prompts for data_prep.arith)" >&2; exit 2; }
done

# The method is config/method/$METHOD.yaml, as for every launcher (Hydra's method=<name>).
if [ ! -f "recipe/gdro/config/method/$METHOD.yaml" ]; then
  echo "cpu_backend_tiny.sh: METHOD=$METHOD: use grpo, prompt_gdro, rollout_gdro or joint_gdro (recipe/gdro/config/method/)" >&2; exit 2
fi

if [ ! -f "$DATA_DIR/train.parquet" ] || [ ! -f "$DATA_DIR/val.parquet" ]; then
  "$PY" -m data_prep.arith --local_dir "$DATA_DIR" --num_train "$NUM_TRAIN" --num_val "$NUM_VAL" --seed 0 --name_script_variables
fi
BASE=$("$PY" -c "from recipe.gdro.lab.tinylm.model import BASE_MODEL_DIR; print(BASE_MODEL_DIR)")

exec "$PY" -m recipe.gdro.main_gdro \
  gdro.backend=cpu \
  method="$METHOD" \
  gdro.binner.num_bins=6 \
  data.train_files="[$DATA_DIR/train.parquet]" \
  data.val_files="[$DATA_DIR/val.parquet]" \
  data.train_batch_size=64 \
  data.max_prompt_length=32 \
  data.max_response_length=16 \
  data.dataloader_num_workers=0 \
  data.seed=0 \
  actor_rollout_ref.model.path="$BASE" \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.seed=0 \
  actor_rollout_ref.rollout.val_kwargs.n=1 \
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
  actor_rollout_ref.rollout.val_kwargs.do_sample=true \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128 \
  actor_rollout_ref.actor.optim.lr=1e-4 \
  actor_rollout_ref.actor.use_kl_loss=false \
  actor_rollout_ref.actor.entropy_coeff=0 \
  algorithm.use_kl_in_reward=false \
  reward.custom_reward_function.path=pkg://data_prep.reward_fn \
  reward.custom_reward_function.name=compute_score \
  trainer.logger=[console] \
  trainer.project_name=gdro_tiny_cpu \
  trainer.experiment_name="$METHOD" \
  trainer.val_before_train=true \
  trainer.test_freq=10 \
  trainer.save_freq=-1 \
  trainer.total_training_steps=30 \
  trainer.default_local_dir="$OUT_DIR" \
  trainer.resume_mode=disable \
  trainer.n_gpus_per_node=1 \
  hydra.job_logging.root.level=WARNING \
  "$@"
