# shellcheck shell=bash
# Shared launcher of run_scripts/qwen3_<size>_<method>.sh (sourced): `gdro_launch <size> <method> "$@"`.
# The paper's protocol is YAML: the launch selects the Hydra config groups `size=<size>
# method=<method>` (recipe/gdro/config/size/, method/, protocol/paper.yaml); every other setting is
# a Hydra override given as an argument (`paper_exact=on`, `trainer.nnodes=2`, ...), and arguments
# win over the script's (order: groups < data paths < "$@"); `mode=colocate_async|separate_async` picks verl's
# asynchronous loop (recipe/gdro/config/mode/). The run's name and folders come from
# the config (gdro_trainer.yaml, `launch:`), so `method=prompt_gdro` on a script is named for what
# it trains. Bash reads only what does work of its own: DRY_RUN / PREFLIGHT (which entry point),
# DATA_DIR / VAL_DIR / EVAL_SETS (the train file and the seven evaluation files) and PYTHON; every
# check of files, values and paths is the recipe's (recipe/gdro/startup/checks.py), before Ray or
# Hydra's job runtime starts. docs/reproducing.md ("Environment") lists the variables.

GDRO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=activate_venv.sh
source "$GDRO_ROOT/run_scripts/common/activate_venv.sh"
# The seven evaluation sets of Table 1 as data_prep/eval_sets.py writes them (<VAL_DIR>/<name>.parquet).
GDRO_EVAL_SETS="math500 aime2024 aime2025 amc23 minerva olympiadbench gpqa_diamond"
GDRO_LOG_LEVELS="CRITICAL FATAL ERROR WARN WARNING INFO DEBUG NOTSET"
# Variables earlier versions read, each only an alias of a Hydra key: refused (not silently ignored),
# naming the argument that replaces it.
GDRO_REMOVED_VARS=(
  "MODEL_PATH=actor_rollout_ref.model.path=PATH"
  "TRAIN_FILE=data.train_files=PATH"
  "CKPT_DIR=launch.ckpt_root=DIR (checkpoints go to DIR/<project>/<experiment>)"
  "NNODES=trainer.nnodes=N"
  "N_GPUS_PER_NODE=trainer.n_gpus_per_node=N"
  "PROJECT_NAME=trainer.project_name=NAME"
  "EXPERIMENT_NAME=trainer.experiment_name=NAME"
  "LOGGER=trainer.logger=[console,wandb]"
  "SAVE_FREQ=trainer.save_freq=N"
  "MAX_CKPT_TO_KEEP=trainer.max_actor_ckpt_to_keep=N (null keeps all)"
  "ROLLOUT_TP=actor_rollout_ref.rollout.tensor_model_parallel_size=N"
  "GPU_MEMORY_UTILIZATION=actor_rollout_ref.rollout.gpu_memory_utilization=F"
  "USE_DYNAMIC_BSZ=actor_rollout_ref.actor.use_dynamic_bsz=true|false"
  "PPO_MAX_TOKEN_LEN_PER_GPU=actor_rollout_ref.actor.ppo_max_token_len_per_gpu=N"
  "LOGPROB_MAX_TOKEN_LEN_PER_GPU=actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=N actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=N"
  "PPO_MICRO_BSZ_PER_GPU=actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=N"
  "LOGPROB_MICRO_BSZ_PER_GPU=actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=N actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=N"
  "ACTOR_PARAM_OFFLOAD=actor_rollout_ref.actor.fsdp_config.param_offload=true|false"
  "ACTOR_OPTIMIZER_OFFLOAD=actor_rollout_ref.actor.fsdp_config.optimizer_offload=true|false"
  "REF_PARAM_OFFLOAD=actor_rollout_ref.ref.fsdp_config.param_offload=true|false"
  "TQ_STORAGE_UNITS=transfer_queue.backend.SimpleStorage.num_data_storage_units=N"
  "ATTN_IMPLEMENTATION=++actor_rollout_ref.model.override_config.attn_implementation=sdpa"
  "PAPER_EXACT=paper_exact=on"
)
gdro_log() { echo "[gdro-launch] $*" >&2; }
gdro_die() { echo "[gdro-launch] error: $*" >&2 && exit 2; }
# gdro_flag VAR [EXTRA]: VAR's value as 0 or 1 (unset or empty = 0). Accepted: 0, 1, true, false in any
# case, and EXTRA (returned as itself); anything else exits 2 naming VAR. Prints nothing: the result
# is in GDRO_FLAG, so a refusal exits the launcher itself, not a $(...) subshell.
gdro_flag() {
  local var="$1" extra="${2:-}" value="${!1:-}"
  local lower="${value,,}"
  case "$lower" in
    "" | 0 | false) GDRO_FLAG=0 ;;
    1 | true) GDRO_FLAG=1 ;;
    *) [[ -n "$extra" && "$lower" == "$extra" ]] && GDRO_FLAG="$extra" \
      || gdro_die "$var='$value' is not 0, 1, true or false${extra:+ (or $extra)}" ;;
  esac
}
gdro_abspath() { local p="${1/#\~/$HOME}" && { [[ "$p" == /* ]] && printf '%s' "$p" || printf '%s' "$PWD/$p"; }; }
# gdro_hq OUT VAR VALUE: OUT='value', Hydra-quoted (paths with spaces, '=', ',' or brackets arrive
# verbatim; Hydra keeps backslashes literally except before a quote, so a backslash is refused, not
# guessed at). Runs in the launcher's shell (printf -v), so its refusal stops the launch.
gdro_hq() {
  [[ "$3" != *\\* ]] || gdro_die "$2: a backslash in a path is not supported: $3"
  printf -v "$1" "'%s'" "${3//\'/\\\'}"
}
# gdro_choice GROUP DEFAULT ARGS...: the last `GROUP=choice` among the arguments, else DEFAULT (in GDRO_CHOICE).
gdro_choice() {
  local group="$1" arg && GDRO_CHOICE="$2" && shift 2
  for arg in "$@"; do [[ "$arg" == "$group="* ]] && GDRO_CHOICE="${arg#"$group="}"; done
  return 0
}
gdro_launch() {
  local size="$1" method="$2" config="$GDRO_ROOT/recipe/gdro/config" entry note item && shift 2
  [[ -f "$config/size/$size.yaml" ]] || gdro_die "unknown model size '$size' (expected 1.7b, 4b, 8b or tiny)"
  [[ -f "$config/method/$method.yaml" ]] || gdro_die "unknown method '$method' (expected grpo, prompt_gdro, rollout_gdro or joint_gdro)"
  for item in "${GDRO_REMOVED_VARS[@]}"; do
    local name="${item%%=*}"
    [[ -z "${!name:-}" ]] || gdro_die "$name is no longer read by the launch scripts: pass ${item#*=} as an argument instead (docs/reproducing.md), or unset $name"
  done

  # verl's (and the recipe's) loggers call setLevel on it at import: a bad level is a traceback there.
  [[ -z "${VERL_LOGGING_LEVEL:-}" || " $GDRO_LOG_LEVELS " == *" $VERL_LOGGING_LEVEL "* ]] \
    || gdro_die "VERL_LOGGING_LEVEL='$VERL_LOGGING_LEVEL' is not a logging level: use one of $GDRO_LOG_LEVELS"

  # --- which entry point ---
  gdro_flag DRY_RUN config && local dry="$GDRO_FLAG"
  gdro_flag PREFLIGHT && local preflight="$GDRO_FLAG"
  [[ "$dry" == 0 || "$preflight" == 0 ]] || gdro_die "DRY_RUN and PREFLIGHT=1 are exclusive: the dry run checks the config on any machine, the preflight checks a GPU node"

  # --- the data the recipe checks (files given as arguments win: Hydra's last override) ---
  local data_dir val_dir train_q val_q val_list="" set_name eval_sets="${EVAL_SETS:-$GDRO_EVAL_SETS}"
  data_dir="$(gdro_abspath "${DATA_DIR:-$HOME/data/dapo}")"
  val_dir="$(gdro_abspath "${VAL_DIR:-$data_dir/eval}")"
  # a file where a folder is meant is named as such (the recipe would report <file>/<set>.parquet missing)
  [[ ! -e "$data_dir" || -d "$data_dir" ]] || gdro_die "DATA_DIR=$data_dir is a file, not a folder: set DATA_DIR to the folder holding train.parquet"
  [[ ! -e "$val_dir" || -d "$val_dir" ]] || gdro_die "VAL_DIR=$val_dir is a file, not a folder: set VAL_DIR to the folder holding the evaluation sets' <name>.parquet files (or leave it unset: \$DATA_DIR/eval)"
  gdro_hq train_q DATA_DIR "$data_dir/train.parquet"
  [[ ! "$eval_sets" =~ (^|,)[[:space:]]*(,|$) ]] || gdro_die "EVAL_SETS='$eval_sets' has an empty item (names are separated by commas or spaces)"
  for set_name in ${eval_sets//,/ }; do
    # A name that is neither one of the seven sets nor a file in VAL_DIR is a typo, not data to prepare.
    [[ " $GDRO_EVAL_SETS " == *" $set_name "* || -e "$val_dir/$set_name.parquet" ]] \
      || gdro_die "EVAL_SETS: '$set_name' is not an evaluation set (${GDRO_EVAL_SETS// /, }) and $val_dir/$set_name.parquet does not exist"
    gdro_hq val_q VAL_DIR "$val_dir/$set_name.parquet" && val_list+="${val_list:+,}$val_q"
  done
  [[ -n "$val_list" ]] || gdro_die "EVAL_SETS is empty"
  GDRO_OVERRIDES=("size=$size" "method=$method" "data.train_files=$train_q" "data.val_files=[$val_list]" "$@")
  [[ "$dry" == 0 ]] || GDRO_OVERRIDES+=("gdro.dry_run=$([[ "$dry" == config ]] && echo config || echo true)")

  gdro_activate_venv "$GDRO_ROOT"
  local python="${PYTHON:-python3}"
  # The repository importable on this node even if not pip-installed; Ray workers on every node get
  # it through the job's runtime_env (py_modules, recipe/gdro/startup/cluster.py).
  export PYTHONPATH="$GDRO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  entry=recipe.gdro.main_gdro note=""
  ((preflight)) && entry=recipe.gdro.preflight && note=" | PREFLIGHT"
  [[ "$dry" == 0 ]] || note=" | DRY RUN"
  [[ "$dry" != config ]] || note+=" (configuration only)"
  # What runs, from the groups the arguments choose (the run's name and folder: the recipe's plan).
  gdro_choice size "$size" "$@" && size="$GDRO_CHOICE"
  gdro_choice method "$method" "$@" && method="$GDRO_CHOICE"
  gdro_choice mode sync "$@"
  [[ "$GDRO_CHOICE" == sync ]] || note+=" | mode=$GDRO_CHOICE"
  gdro_choice paper_exact off "$@"
  if [[ "$GDRO_CHOICE" == on ]]; then
    note+=" | PAPER_EXACT"
    [[ -f "$config/paper_exact_settings/on_$method.yaml" ]] || gdro_log "paper_exact=on: method '$method' has no released settings of its own; it runs (and is named) as without paper_exact"
  fi
  gdro_log "$([[ "$size" == tiny ]] || echo "qwen3 ")$size / $method$note (run name, checkpoint folder: the plan below)"
  { printf '[gdro-launch] command:\n  %q -m %s' "$python" "$entry" && printf ' \\\n    %q' "${GDRO_OVERRIDES[@]}" && printf '\n'; } >&2
  exec "$python" -m "$entry" "${GDRO_OVERRIDES[@]}"
}
