# shellcheck shell=bash
# Shared launcher of run_scripts/qwen3_<size>_<method>.sh (sourced): `gdro_launch <size> <method> "$@"`.
# The paper's protocol is YAML: the launch selects the Hydra config groups `size=<size>
# method=<method>` (recipe/gdro/config/size/, method/, protocol/paper.yaml), and `paper_exact=on`
# with PAPER_EXACT=1. Bash turns the environment into overrides (order: groups < environment <
# "$@"), checks what only the shell can (data files before a real launch, a running Ray cluster, a
# local model directory), picks the venv and execs python. The environment variables, all
# optional, are in docs/reproducing.md ("Environment").

GDRO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=activate_venv.sh
source "$GDRO_ROOT/run_scripts/common/activate_venv.sh"
# The seven evaluation sets of Table 1 as data_prep/eval_sets.py writes them (<VAL_DIR>/<name>.parquet).
GDRO_EVAL_SETS="math500 aime2024 aime2025 amc23 minerva olympiadbench gpqa_diamond"
gdro_log() { echo "[gdro-launch] $*" >&2; }
gdro_die() { echo "[gdro-launch] error: $*" >&2 && exit 2; }
gdro_is_true() { [[ "${1:-0}" == 1 || "${1:-}" == true || "${1:-}" == True || "${1:-}" == yes ]]; }
gdro_is_uint() { [[ "$1" =~ ^[0-9]+$ ]] && (($1 > 0)); }
gdro_abspath() { local p="${1/#\~/$HOME}" && { [[ "$p" == /* ]] && printf '%s' "$p" || printf '%s' "$PWD/$p"; }; }
# Hydra-quoted string: 'value' with ' escaped (paths with spaces, '=', ',' or brackets arrive verbatim;
# Hydra keeps backslashes literally except before a quote, so a backslash is refused, not guessed at).
gdro_hq() {
  [[ "$1" != *\\* ]] || gdro_die "backslash in a path or value is not supported: $1"
  printf "'%s'" "${1//\'/\\\'}"
}
# gdro_env VAR KEY...: KEY=$VAR for each KEY when VAR is set (a plain value: number, boolean, name).
gdro_env() {
  local var="$1" key && shift
  [[ -n "${!var:-}" ]] || return 0
  [[ "${!var}" =~ ^[A-Za-z0-9_./-]+$ ]] || gdro_die "$var has unexpected characters: '${!var}'"
  for key in "$@"; do GDRO_OVERRIDES+=("$key=${!var}"); done
}
# gdro_args_set KEY... -- ARGS...: whether an argument sets one of the keys (KEY=, +KEY=, ++KEY=, ~KEY).
gdro_args_set() {
  local keys=() arg key
  while (($#)) && [[ "$1" != -- ]]; do keys+=("$1") && shift; done
  (($#)) && shift
  for arg in "$@"; do
    arg="${arg#\~}" && arg="${arg#++}" && arg="${arg#+}"
    for key in "${keys[@]}"; do [[ "$arg" == "$key="* || "$arg" == "$key" ]] && return 0; done
  done
  return 1
}
gdro_launch() {
  local size="$1" method="$2" config="$GDRO_ROOT/recipe/gdro/config" && shift 2
  [[ -f "$config/size/$size.yaml" ]] || gdro_die "unknown model size '$size' (expected 1.7b, 4b or 8b)"
  [[ -f "$config/method/$method.yaml" ]] || gdro_die "unknown method '$method' (expected grpo, prompt_gdro, rollout_gdro or joint_gdro)"
  GDRO_OVERRIDES=("size=$size" "method=$method") && local paper_exact=0
  if gdro_is_true "${PAPER_EXACT:-0}"; then
    paper_exact=1 && GDRO_OVERRIDES+=(paper_exact=on)
    [[ -f "$config/paper_exact_settings/on_$method.yaml" ]] || gdro_log "PAPER_EXACT=1: method '$method' has no released settings of its own; it runs as without PAPER_EXACT"
  fi
  # --- the GPU layout of size/<size>.yaml, where the environment changes it ---
  gdro_env ROLLOUT_TP actor_rollout_ref.rollout.tensor_model_parallel_size
  gdro_env GPU_MEMORY_UTILIZATION actor_rollout_ref.rollout.gpu_memory_utilization
  if [[ -n "${USE_DYNAMIC_BSZ:-}" ]]; then
    local dyn=true && [[ "$USE_DYNAMIC_BSZ" == 0 || "$USE_DYNAMIC_BSZ" == [fF]alse ]] && dyn=false
    GDRO_OVERRIDES+=("actor_rollout_ref.actor.use_dynamic_bsz=$dyn")
  fi
  gdro_env PPO_MAX_TOKEN_LEN_PER_GPU actor_rollout_ref.actor.ppo_max_token_len_per_gpu
  gdro_env LOGPROB_MAX_TOKEN_LEN_PER_GPU actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu actor_rollout_ref.ref.log_prob_max_token_len_per_gpu
  gdro_env PPO_MICRO_BSZ_PER_GPU actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
  gdro_env LOGPROB_MICRO_BSZ_PER_GPU actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
  gdro_env ACTOR_PARAM_OFFLOAD actor_rollout_ref.actor.fsdp_config.param_offload
  gdro_env ACTOR_OPTIMIZER_OFFLOAD actor_rollout_ref.actor.fsdp_config.optimizer_offload
  gdro_env REF_PARAM_OFFLOAD actor_rollout_ref.ref.fsdp_config.param_offload

  # --- where the run reads and writes, and who it is ---
  local data_dir train_file val_dir ckpt_dir
  data_dir="$(gdro_abspath "${DATA_DIR:-$HOME/data/dapo}")"
  train_file="$(gdro_abspath "${TRAIN_FILE:-$data_dir/train.parquet}")"
  val_dir="$(gdro_abspath "${VAL_DIR:-$data_dir/eval}")"
  ckpt_dir="$(gdro_abspath "${CKPT_DIR:-$HOME/gdro_ckpt}")"
  local nnodes="${NNODES:-1}" gpus="${N_GPUS_PER_NODE:-8}" project="${PROJECT_NAME:-gdro}"
  local experiment="${EXPERIMENT_NAME:-qwen3_${size}_${method}}" eval_sets="${EVAL_SETS:-$GDRO_EVAL_SETS}"
  eval_sets="${eval_sets//,/ }"
  gdro_is_uint "$nnodes" || gdro_die "NNODES must be a positive integer, got '$nnodes'"
  gdro_is_uint "$gpus" || gdro_die "N_GPUS_PER_NODE must be a positive integer, got '$gpus'"
  [[ "$project" =~ ^[A-Za-z0-9._-]+$ ]] || gdro_die "PROJECT_NAME may use letters, digits, '.', '_', '-' only, got '$project'"
  [[ "$experiment" =~ ^[A-Za-z0-9._-]+$ ]] || gdro_die "EXPERIMENT_NAME may use letters, digits, '.', '_', '-' only, got '$experiment'"
  [[ -z "${SAVE_FREQ:-}" ]] || gdro_is_uint "$SAVE_FREQ" || [[ "$SAVE_FREQ" == -1 ]] || gdro_die "SAVE_FREQ must be a positive integer or -1, got '$SAVE_FREQ'"
  [[ "${MAX_CKPT_TO_KEEP:-1}" =~ ^[0-9]+$ ]] || gdro_die "MAX_CKPT_TO_KEEP must be a non-negative integer (0 = keep all), got '$MAX_CKPT_TO_KEEP'"
  [[ -z "${TQ_STORAGE_UNITS:-}" ]] || gdro_is_uint "$TQ_STORAGE_UNITS" || gdro_die "TQ_STORAGE_UNITS must be a positive integer, got '$TQ_STORAGE_UNITS'"
  local logger="${LOGGER:-}"  # "console,wandb" | "console wandb" | "[console,wandb]"
  if [[ -z "$logger" ]] && { [[ -n "${WANDB_API_KEY:-}" ]] || grep -qs "api.wandb.ai" "$HOME/.netrc"; }; then
    logger="console,wandb"
  elif [[ -z "$logger" ]]; then
    logger=console && gdro_log "no wandb credentials found: logging to the console only (set LOGGER=console,wandb or console,tensorboard to change)"
  fi
  logger="$(echo "$logger" | tr -d "[]'\"" | tr ', ' '\n\n' | grep -v '^$' | paste -sd, -)"
  [[ -n "$logger" ]] || gdro_die "LOGGER is empty"
  local val_list="" set_name
  for set_name in $eval_sets; do val_list+="${val_list:+,}$(gdro_hq "$val_dir/$set_name.parquet")"; done
  [[ -n "$val_list" ]] || gdro_die "EVAL_SETS is empty"
  [[ -z "${MODEL_PATH:-}" ]] || GDRO_OVERRIDES+=("actor_rollout_ref.model.path=$(gdro_hq "$MODEL_PATH")")
  GDRO_OVERRIDES+=(
    "data.train_files=$(gdro_hq "$train_file")" "data.val_files=[$val_list]"
    "trainer.nnodes=$nnodes" "trainer.n_gpus_per_node=$gpus"
    "trainer.project_name=$project" "trainer.experiment_name=$experiment" "trainer.logger=[$logger]"
    "trainer.default_local_dir=$(gdro_hq "$ckpt_dir/$project/$experiment")"
  )
  gdro_env SAVE_FREQ trainer.save_freq
  [[ "${MAX_CKPT_TO_KEEP:-}" == 0 ]] && GDRO_OVERRIDES+=("trainer.max_actor_ckpt_to_keep=null") || gdro_env MAX_CKPT_TO_KEEP trainer.max_actor_ckpt_to_keep
  gdro_env TQ_STORAGE_UNITS transfer_queue.backend.SimpleStorage.num_data_storage_units
  gdro_env ATTN_IMPLEMENTATION ++actor_rollout_ref.model.override_config.attn_implementation
  GDRO_OVERRIDES+=("$@")  # the user's own Hydra overrides come last, so they win

  local dry=0 dry_value=true preflight=0
  [[ "${DRY_RUN:-0}" == config ]] && dry=1 dry_value=config
  gdro_is_true "${DRY_RUN:-0}" && dry=1
  gdro_is_true "${PREFLIGHT:-0}" && preflight=1
  ((dry && preflight)) && gdro_die "DRY_RUN and PREFLIGHT=1 are exclusive: the dry run checks the config on any machine, the preflight checks a GPU node"
  local model="${MODEL_PATH:-Qwen3-${size^^}-Base (size/$size.yaml)}"
  if [[ "${MODEL_PATH:-}" == /* || "${MODEL_PATH:-}" == .* || "${MODEL_PATH:-}" == "~"* ]] && ! ((dry)); then
    local model_dir && model_dir="$(gdro_abspath "$MODEL_PATH")"
    [[ -f "$model_dir/config.json" ]] || gdro_die "MODEL_PATH=$MODEL_PATH: no config.json in $model_dir (a local model directory must exist at the same path on every node)"
  elif gdro_is_true "${HF_HUB_OFFLINE:-0}"; then
    gdro_log "HF_HUB_OFFLINE=1: $model must already be in the hub cache of every node (forwarded to all Ray workers)"
  fi
  if ((dry)); then GDRO_OVERRIDES+=("gdro.dry_run=$dry_value"); else
    # fail before Ray starts (files given as arguments are the recipe's to check)
    local missing=() f
    gdro_args_set data.train_files -- "$@" || [[ -f "$train_file" ]] || missing+=("$train_file")
    if ! gdro_args_set data.val_files -- "$@"; then
      for set_name in $eval_sets; do f="$val_dir/$set_name.parquet" && { [[ -f "$f" ]] || missing+=("$f"); }; done
    fi
    ((${#missing[@]} == 0)) || gdro_die "missing data file(s): ${missing[*]}
  prepare them with:  python data_prep/dapo.py --local_dir $data_dir
                      python data_prep/eval_sets.py --local_dir $val_dir
  or point DATA_DIR / TRAIN_FILE / VAL_DIR at them (DRY_RUN=config checks the config without data)."
    if ((nnodes > 1)) && command -v ray >/dev/null 2>&1 && ! ray status >/dev/null 2>&1; then
      gdro_die "NNODES=$nnodes needs a running Ray cluster: 'ray start --head' on this node and 'ray start --address=<head>:6379' on the others (see docs/cluster.md, \"Multi-node\"), or set RAY_ADDRESS"
    fi
  fi

  gdro_activate_venv "$GDRO_ROOT"
  local python="${PYTHON:-python3}" entry=recipe.gdro.main_gdro note=""
  # The repository importable on this node even if not pip-installed; Ray workers on every node get
  # it through the job's runtime_env (py_modules, recipe/gdro/startup/cluster.py).
  export PYTHONPATH="$GDRO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  ((dry)) && note=" | DRY RUN"
  ((preflight)) && entry=recipe.gdro.preflight && note=" | PREFLIGHT"
  ((paper_exact)) && note+=" | PAPER_EXACT"
  gdro_log "qwen3 $size / $method | model $model | $nnodes node(s) x $gpus GPU(s) | run $project/$experiment$note"
  gdro_log "checkpoints + gdro_metrics.jsonl: $ckpt_dir/$project/$experiment"
  { printf '[gdro-launch] command:\n  %q -m %s' "$python" "$entry" && printf ' \\\n    %q' "${GDRO_OVERRIDES[@]}" && printf '\n'; } >&2
  exec "$python" -m "$entry" "${GDRO_OVERRIDES[@]}"
}
