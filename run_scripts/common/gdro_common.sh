# shellcheck shell=bash
# Shared launcher for the paper-reproduction scripts run_scripts/qwen3_<size>_<method>.sh.
# Sourced, not run: each launch script is three lines that call
#
#     gdro_launch <size> <method> "$@"        # size: 1.7b | 4b | 8b
#                                             # method: grpo | prompt_gdro | rollout_gdro | joint_gdro
#
# Every setting of the paper's protocol lives here, once (gdro_protocol_overrides); the per-size
# hardware layout is in gdro_size_profile; the per-method GDRO switches in gdro_method_overrides.
# Override order on the command line: protocol < size < method < user environment < "$@".
# Hydra applies overrides left to right, so anything passed to a script as an argument wins.
#
# Environment variables (all optional):
#   MODEL_PATH        HF id or local dir           default Qwen/Qwen3-<size>-Base. A local dir must hold
#                                                  config.json (checked) and exist at the same path on
#                                                  every node. With HF_HUB_OFFLINE=1 an HF id must already
#                                                  be in the hub cache of every node; the recipe forwards
#                                                  HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE
#                                                  to every Ray worker (runtime_env env_vars).
#   DATA_DIR          data_prep output folder      default $HOME/data/dapo
#   TRAIN_FILE        training parquet             default $DATA_DIR/train.parquet
#   VAL_DIR           evaluation parquets          default $DATA_DIR/eval
#   EVAL_SETS         space/comma list of sets     default the paper's seven (see GDRO_EVAL_SETS)
#   CKPT_DIR          checkpoint root              default $HOME/gdro_ckpt (outside the repository: an 8B
#                                                  checkpoint with optimizer states is ~100 GB)
#                     checkpoints + gdro_metrics.jsonl go to $CKPT_DIR/$PROJECT_NAME/$EXPERIMENT_NAME
#   NNODES            nodes in the Ray cluster     default 1
#   N_GPUS_PER_NODE   GPUs per node                default 8
#   PROJECT_NAME      tracker project              default gdro
#   EXPERIMENT_NAME   run name                     default qwen3_<size>_<method>
#   LOGGER            e.g. console,wandb           default console,wandb if wandb credentials are
#                                                  found (WANDB_API_KEY or ~/.netrc), else console
#   SAVE_FREQ         checkpoint every N steps     default 100
#   MAX_CKPT_TO_KEEP  keep the newest N ckpts      default 2 (verl's trainer.max_actor_ckpt_to_keep);
#                                                  0 = keep all
#   ATTN_IMPLEMENTATION  actor/ref attention       default unset = verl's flash_attention_2 (needs the
#                                                  flash-attn package: docs/cluster.md, Install); sdpa needs
#                                                  only torch (sets ++actor_rollout_ref.model.override_config
#                                                  .attn_implementation)
#   TQ_STORAGE_UNITS  TransferQueue storage units  default 8 (verl's default): Ray then needs >= 10 CPUs
#                                                  (units + controller + TaskRunner; checked at start-up)
#   PAPER_EXACT=1     Rollout-GDRO with the authors' released settings (bandit allocator, eta 0.65,
#                     EMA beta 0.4, n in [2, 3 x n̄]) instead of the recipe's defaults (sqrt allocator)
#   ROLLOUT_TP, GPU_MEMORY_UTILIZATION, USE_DYNAMIC_BSZ (1/0), ACTOR_PARAM_OFFLOAD,
#   ACTOR_OPTIMIZER_OFFLOAD, REF_PARAM_OFFLOAD (True/False), PPO_MICRO_BSZ_PER_GPU,
#   LOGPROB_MICRO_BSZ_PER_GPU, PPO_MAX_TOKEN_LEN_PER_GPU, LOGPROB_MAX_TOKEN_LEN_PER_GPU
#                     the per-size hardware layout (see gdro_size_profile)
#   DRY_RUN=1         append gdro.dry_run=true: compose + validate the exact config of the real
#                     launch and its data files, and print it, on a CPU-only machine (no Ray, GPU
#                     or model); DRY_RUN=config appends gdro.dry_run=config: the configuration
#                     alone, the data files need not exist yet
#   PREFLIGHT=1       run python -m recipe.gdro.startup.preflight with the exact same overrides instead of
#                     training: the start-up checks, the attention kernel, the code on every Ray node,
#                     and vLLM on the model for one prompt with two per-prompt rollout counts (about a
#                     minute on a GPU node; refuses cleanly without a GPU or vLLM)
#   PYTHON            interpreter                  default python3

GDRO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# gdro_activate_venv: use <repo>/.venv (setup_env.sh's) when present and no venv is active.
# shellcheck source=activate_venv.sh
source "$GDRO_ROOT/run_scripts/common/activate_venv.sh"

# The seven evaluation sets of Table 1, named as data_prep/eval_sets.py writes them
# (<VAL_DIR>/<name>.parquet). verl reports val-core/<name>/acc/mean@8 per set.
GDRO_EVAL_SETS="math500 aime2024 aime2025 amc23 minerva olympiadbench gpqa_diamond"

gdro_log() { echo "[gdro-launch] $*" >&2; }
gdro_die() {
  echo "[gdro-launch] error: $*" >&2
  exit 2
}

# ------------------------------------------------------------------------------------------------
# The paper's protocol (arXiv 2601.19280, App. A.1). Identical for every size and method, so the
# GRPO baseline and the GDRO runs differ only in the adversaries.
#
# Where the authors' released scripts (kishanpb/verl-gdro, algorithm_comparison/) disagree with
# the appendix, we follow the appendix:
#   * batch 256 prompts / 1000 steps. Their Prompt-GDRO script uses 512 prompts / 500 steps (and
#     val n=16, validation every 40 steps, no validation before training); their Rollout-GDRO
#     script matches the appendix (256 / 1000, val n=8 every 50 steps).
#   * validation samples at temperature 0.6, top-p 0.8, top-k 20 (their Prompt-GDRO script sets
#     only the temperature). verl 0.9.1's v1 agent loop always samples validation with the
#     val_kwargs temperature / top-p / top-k; val_kwargs.do_sample=true says so explicitly (it
#     defaults to false, which meant greedy validation in the older verl the authors patched).
#   * their scripts clip advantages to [-5, 5] through keys of their own patch; the appendix does
#     not mention it and verl 0.9.1 has no such option, so there is no advantage clipping here.
# ------------------------------------------------------------------------------------------------
GDRO_TRAIN_BATCH_SIZE=256     # prompts per step (appendix; authors' Prompt-GDRO script: 512)
GDRO_TOTAL_STEPS=1000         # appendix (authors' Prompt-GDRO script: 500)
GDRO_ROLLOUT_N=4              # rollouts per prompt = the mean budget n̄ of Rollout-GDRO
GDRO_PPO_MINI_BATCH_SIZE=128  # prompts per optimizer step -> 2 optimizer steps per training step
GDRO_MAX_PROMPT_LENGTH=3200
GDRO_MAX_RESPONSE_LENGTH=4096
GDRO_TEST_FREQ=50

gdro_protocol_overrides() {
  GDRO_OVERRIDES+=(
    # --- algorithm: GRPO with std-normalised group advantages, KL as a loss term ---
    algorithm.adv_estimator=grpo
    algorithm.norm_adv_by_std_in_grpo=true
    algorithm.use_kl_in_reward=false
    # --- data ---
    "data.train_batch_size=$GDRO_TRAIN_BATCH_SIZE"
    "data.max_prompt_length=$GDRO_MAX_PROMPT_LENGTH"
    "data.max_response_length=$GDRO_MAX_RESPONSE_LENGTH"
    data.filter_overlong_prompts=true
    data.truncation=error
    data.prompt_key=prompt
    data.reward_fn_key=data_source
    # --- actor: AdamW lr 1e-6, clip 0.2 / 0.28 (clip-higher), KL loss 0.001 (low_var_kl, the
    #     k3 estimator verl uses for GRPO's KL loss), PPO mini-batch 128 prompts, one PPO epoch ---
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.0
    "actor_rollout_ref.actor.ppo_mini_batch_size=$GDRO_PPO_MINI_BATCH_SIZE"
    actor_rollout_ref.actor.ppo_epochs=1
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.model.enable_gradient_checkpointing=true
    actor_rollout_ref.model.use_remove_padding=true
    # --- rollout: vLLM, 4 samples per prompt at temperature 1.0 ---
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=async
    "actor_rollout_ref.rollout.n=$GDRO_ROLLOUT_N"
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    # --- validation: n=8 sampled at temperature 0.6, top-p 0.8, top-k 20 -> mean@8 and best@8
    #     (= pass@8 for 0/1 accuracy) per set, every 50 steps and before training ---
    actor_rollout_ref.rollout.val_kwargs.n=8
    actor_rollout_ref.rollout.val_kwargs.do_sample=true
    actor_rollout_ref.rollout.val_kwargs.temperature=0.6
    actor_rollout_ref.rollout.val_kwargs.top_p=0.8
    actor_rollout_ref.rollout.val_kwargs.top_k=20
    "trainer.test_freq=$GDRO_TEST_FREQ"
    trainer.val_before_train=true
    # --- reward: math_dapo (score ±1, acc) for the math sets, multiple choice for GPQA. verl 0.9.1's
    #     v1 trainer reads reward.* only (top-level custom_reward_function.* is legacy) ---
    reward.reward_manager.name=naive
    reward.custom_reward_function.path=pkg://data_prep.reward_fn
    reward.custom_reward_function.name=compute_score
    # --- length of the run: total_training_steps stops it. 1000 steps x 256 prompts over
    #     DAPO-14.1k's 14,116 prompts is ~18 epochs (55 steps/epoch); total_epochs is only a
    #     ceiling, since the loop stops at whichever of the two comes first ---
    "trainer.total_training_steps=$GDRO_TOTAL_STEPS"
    trainer.total_epochs=100
    trainer.resume_mode=auto
    trainer.log_val_generations=0
    # --- GDRO binner, shared by both adversaries (and logged in the GRPO run as well):
    #     10 equal-width accuracy bins (appendix). Window H = 50 visits (authors: 50 in the
    #     Rollout-GDRO and 3-bin Prompt-GDRO runs, 100 in the 6-bin ones). At this protocol a
    #     prompt is visited ~18 times in 1000 steps, so the window never fills and 50 vs 100 makes
    #     no difference. ---
    gdro.binner.num_bins=10
    gdro.binner.window=50
  )
}

# ------------------------------------------------------------------------------------------------
# Per-size hardware layout. Assumption: nodes of 8 x 80 GB GPUs (A100/H100 80GB), actor, reference
# and vLLM colocated on every GPU (verl's hybrid engine), FSDP over all GPUs. Memory budget per GPU:
# the FSDP-sharded actor (fp32 params + AdamW states = 12 bytes/param / world size) stays resident
# while vLLM runs; vLLM gets GPU_MEMORY_UTILIZATION of the card for weights + KV cache and releases
# it during training (free_cache_engine). With 8 GPUs the resident actor is 2.6 / 6 / 12 GB for
# 1.7B / 4B / 8B, so no FSDP offload is needed; the 8B reference (bf16, 2 GB/GPU) is offloaded
# to CPU because it is only used once per step.
#
# Micro-batching: dynamic batch size (token-budget packing) is on by default, since response
# lengths vary from a few hundred to 4096 tokens. The per-GPU token budgets below are multiples of
# the longest sequence (3200 + 4096 = 7296 tokens) and are estimates sized for the logits of
# Qwen3's 151,936-token vocabulary; if a run OOMs, lower them (e.g. PPO_MAX_TOKEN_LEN_PER_GPU).
# The fixed micro-batch sizes are used only when USE_DYNAMIC_BSZ=0.
#
# Budget divisibility (checked below): train_batch_size x n = 1024 responses and ppo_mini_batch
# x n = 512 responses must both divide by the data-parallel size NNODES x N_GPUS_PER_NODE (so
# verl's _balance_batch never pads), and N_GPUS_PER_NODE by the rollout tensor-parallel size.
# ------------------------------------------------------------------------------------------------
gdro_size_profile() {
  local size="$1" model tp gmu ppo_mbs lp_mbs train_x infer_x a_param a_opt r_param
  case "$size" in
    # 1.7B: vLLM TP 1 (8 replicas/node); 0.7 of the card for vLLM (weights ~3.4 GB, rest KV).
    1.7b) model=Qwen/Qwen3-1.7B-Base; tp=1; gmu=0.7; ppo_mbs=8; lp_mbs=16; train_x=3; infer_x=6
          a_param=False; a_opt=False; r_param=False ;;
    # 4B: vLLM TP 1 (weights ~8 GB/replica); 0.65 for vLLM.
    4b)   model=Qwen/Qwen3-4B-Base; tp=1; gmu=0.65; ppo_mbs=4; lp_mbs=8; train_x=2; infer_x=4
          a_param=False; a_opt=False; r_param=False ;;
    # 8B: vLLM TP 2 (4 replicas/node, weights ~8 GB/GPU); 0.6 for vLLM; reference offloaded. KV
    #     cache: ~0.5M tokens per replica (docs/cluster.md has the arithmetic), against up to
    #     256 x 7296 = 1.9M tokens per replica if every response ran to 4096 tokens: vLLM queues the
    #     rest (continuous batching), it does not fail.
    8b)   model=Qwen/Qwen3-8B-Base; tp=2; gmu=0.6; ppo_mbs=2; lp_mbs=4; train_x=2; infer_x=3
          a_param=False; a_opt=False; r_param=True ;;
    *) gdro_die "unknown model size '$size' (expected 1.7b, 4b or 8b)" ;;
  esac
  local seq=$((GDRO_MAX_PROMPT_LENGTH + GDRO_MAX_RESPONSE_LENGTH))
  GDRO_DEFAULT_MODEL="$model"
  ROLLOUT_TP="${ROLLOUT_TP:-$tp}"
  GPU_MEMORY_UTILIZATION="${GPU_MEMORY_UTILIZATION:-$gmu}"
  PPO_MICRO_BSZ_PER_GPU="${PPO_MICRO_BSZ_PER_GPU:-$ppo_mbs}"
  LOGPROB_MICRO_BSZ_PER_GPU="${LOGPROB_MICRO_BSZ_PER_GPU:-$lp_mbs}"
  PPO_MAX_TOKEN_LEN_PER_GPU="${PPO_MAX_TOKEN_LEN_PER_GPU:-$((seq * train_x))}"
  LOGPROB_MAX_TOKEN_LEN_PER_GPU="${LOGPROB_MAX_TOKEN_LEN_PER_GPU:-$((seq * infer_x))}"
  ACTOR_PARAM_OFFLOAD="${ACTOR_PARAM_OFFLOAD:-$a_param}"
  ACTOR_OPTIMIZER_OFFLOAD="${ACTOR_OPTIMIZER_OFFLOAD:-$a_opt}"
  REF_PARAM_OFFLOAD="${REF_PARAM_OFFLOAD:-$r_param}"
  USE_DYNAMIC_BSZ="${USE_DYNAMIC_BSZ:-1}"
  local dyn=true
  [[ "$USE_DYNAMIC_BSZ" == 0 || "$USE_DYNAMIC_BSZ" == false || "$USE_DYNAMIC_BSZ" == False ]] && dyn=false
  if ((PPO_MAX_TOKEN_LEN_PER_GPU < seq || LOGPROB_MAX_TOKEN_LEN_PER_GPU < seq)); then
    gdro_die "token budgets per GPU must hold one full sequence ($seq tokens): PPO_MAX_TOKEN_LEN_PER_GPU=$PPO_MAX_TOKEN_LEN_PER_GPU LOGPROB_MAX_TOKEN_LEN_PER_GPU=$LOGPROB_MAX_TOKEN_LEN_PER_GPU"
  fi
  GDRO_OVERRIDES+=(
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
    "actor_rollout_ref.rollout.gpu_memory_utilization=$GPU_MEMORY_UTILIZATION"
    "actor_rollout_ref.actor.use_dynamic_bsz=$dyn"
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN_PER_GPU"
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$LOGPROB_MAX_TOKEN_LEN_PER_GPU"
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$LOGPROB_MAX_TOKEN_LEN_PER_GPU"
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$PPO_MICRO_BSZ_PER_GPU"
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$LOGPROB_MICRO_BSZ_PER_GPU"
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$LOGPROB_MICRO_BSZ_PER_GPU"
    "actor_rollout_ref.actor.fsdp_config.param_offload=$ACTOR_PARAM_OFFLOAD"
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=$ACTOR_OPTIMIZER_OFFLOAD"
    "actor_rollout_ref.ref.fsdp_config.param_offload=$REF_PARAM_OFFLOAD"
  )
}

# ------------------------------------------------------------------------------------------------
# Per-method GDRO switches. Every run executes the same recipe (same binner, same metrics, same
# data path); only the adversaries differ.
# ------------------------------------------------------------------------------------------------
gdro_method_overrides() {
  case "$1" in
    # GRPO baseline: both adversaries off. The recipe then runs verl's GRPO unchanged (same
    # entry point, data, reward, validation and verl metrics as the GDRO runs). With gdro.observe
    # (true by default) the binner still runs and logs the gdro/* metrics, so the baseline can be
    # compared with the GDRO runs bin by bin; advantages and rollout counts stay verl's.
    grpo)
      GDRO_OVERRIDES+=(gdro.prompt.enable=false gdro.rollout.enable=false gdro.binner.hysteresis=0.0) ;;
    # Prompt-GDRO: EMA-debiased EXP3P reweighting of GRPO advantages per difficulty bin.
    # Hysteresis 0.03 as in the authors' Prompt-GDRO scripts.
    prompt_gdro)
      GDRO_OVERRIDES+=(gdro.prompt.enable=true gdro.rollout.enable=false gdro.binner.hysteresis=0.03) ;;
    # Rollout-GDRO: per-prompt rollout counts in [2, 12] with a mean of exactly n̄ = rollout.n = 4
    # (gdro.rollout.n_mean follows actor_rollout_ref.rollout.n in the recipe config). Hysteresis 0
    # as in the authors' Rollout-GDRO scripts. Allocator: the recipe default (sqrt, the
    # shadow-price square-root law); PAPER_EXACT=1 switches to the paper's EXP3P arms with the
    # released settings (gdro_paper_exact_overrides).
    rollout_gdro)
      GDRO_OVERRIDES+=(gdro.prompt.enable=false gdro.rollout.enable=true gdro.binner.hysteresis=0.0) ;;
    # Joint mode (beyond the paper): both adversaries on one shared binner. Hysteresis 0.03 (the
    # Prompt-GDRO setting: stable bin labels matter most for the advantage weights). Coupling is
    # the recipe default; compare with gdro.prompt.rollout_coupling=divide_by_allocation.
    joint_gdro)
      GDRO_OVERRIDES+=(gdro.prompt.enable=true gdro.rollout.enable=true gdro.binner.hysteresis=0.03) ;;
    *) gdro_die "unknown method '$1' (expected grpo, prompt_gdro, rollout_gdro or joint_gdro)" ;;
  esac
}

# ------------------------------------------------------------------------------------------------
# PAPER_EXACT=1: the Rollout-GDRO settings of the authors' released scripts (kishanpb/verl-gdro,
# algorithm_comparison/), next to the recipe's defaults:
#   released                        here (gdro.rollout.*)         recipe default
#   bandit allocator (EXP3P arms)   allocator=bandit              sqrt (shadow-price square-root law)
#   rollout_budget_eta=0.65         bandit_eta=0.65               5.0 (on scores rescaled to [0, 1]
#                                                                 per bin, 0.65 leaves the arm
#                                                                 distribution nearly flat)
#   ema_beta=0.4                    bandit_beta=0.4               0.12
#   n up to 3 x n̄ = 12, n >= 2      n_min=2, n_max=3 x n̄          same (2, 12)
#   3200 prompt / 4096 response     data.max_*_length             same (the protocol above)
# The released code's defects stay fixed (EMA not cumulative scores, the arm update's sign, a dual
# price that moves, allocation by prompt id): PAPER_EXACT reproduces the settings, not the bugs.
# ------------------------------------------------------------------------------------------------
gdro_paper_exact_overrides() {
  case "$1" in
    rollout_gdro | joint_gdro)
      GDRO_OVERRIDES+=(
        gdro.rollout.allocator=bandit
        gdro.rollout.bandit_eta=0.65
        gdro.rollout.bandit_beta=0.4
        gdro.rollout.n_min=2
        "gdro.rollout.n_max=$((3 * GDRO_ROLLOUT_N))"
      ) ;;
    *) gdro_log "PAPER_EXACT=1 changes only Rollout-GDRO settings; method '$1' runs as without it" ;;
  esac
}

# Hydra-quoted string value: 'value' with ' escaped, so paths with spaces, '=', ',' or brackets
# reach the config verbatim. (Hydra keeps backslashes literally except before a quote; a value
# with a backslash is refused rather than guessed at.)
gdro_hq() {
  local v="$1"
  [[ "$v" != *\\* ]] || gdro_die "backslash in a path or value is not supported: $v"
  printf "'%s'" "${v//\'/\\\'}"
}

gdro_is_true() { [[ "${1:-0}" == 1 || "${1:-}" == true || "${1:-}" == True || "${1:-}" == yes ]]; }

gdro_abspath() {
  local p="$1"
  [[ "$p" == "~"* ]] && p="$HOME${p:1}"
  [[ "$p" == /* ]] || p="$PWD/$p"
  printf '%s' "$p"
}

gdro_is_uint() { [[ "$1" =~ ^[0-9]+$ ]] && (($1 > 0)); }

# gdro_args_set KEY... -- ARGS...: true if an argument overrides one of the keys (KEY=, +KEY=,
# ++KEY=, ~KEY). The launcher's own checks of those values then defer to the recipe's.
gdro_args_set() {
  local keys=() arg key
  while (($#)) && [[ "$1" != -- ]]; do keys+=("$1"); shift; done
  (($#)) && shift
  for arg in "$@"; do
    arg="${arg#\~}"
    arg="${arg#++}"
    arg="${arg#+}"
    for key in "${keys[@]}"; do
      [[ "$arg" == "$key="* || "$arg" == "$key" ]] && return 0
    done
  done
  return 1
}

# ------------------------------------------------------------------------------------------------
gdro_launch() {
  local size="$1" method="$2"
  shift 2
  GDRO_OVERRIDES=()

  gdro_protocol_overrides
  gdro_size_profile "$size"
  gdro_method_overrides "$method"
  local paper_exact=0
  gdro_is_true "${PAPER_EXACT:-0}" && paper_exact=1
  ((paper_exact)) && gdro_paper_exact_overrides "$method"

  # --- user environment ---
  local model_path="${MODEL_PATH:-$GDRO_DEFAULT_MODEL}"
  local data_dir
  data_dir="$(gdro_abspath "${DATA_DIR:-$HOME/data/dapo}")"
  local train_file val_dir ckpt_dir
  train_file="$(gdro_abspath "${TRAIN_FILE:-$data_dir/train.parquet}")"
  val_dir="$(gdro_abspath "${VAL_DIR:-$data_dir/eval}")"
  ckpt_dir="$(gdro_abspath "${CKPT_DIR:-$HOME/gdro_ckpt}")"
  local nnodes="${NNODES:-1}" gpus="${N_GPUS_PER_NODE:-8}"
  local project="${PROJECT_NAME:-gdro}"
  local experiment="${EXPERIMENT_NAME:-qwen3_${size}_${method}}"
  local save_freq="${SAVE_FREQ:-100}"
  local eval_sets="${EVAL_SETS:-$GDRO_EVAL_SETS}"
  eval_sets="${eval_sets//,/ }"

  gdro_is_uint "$nnodes" || gdro_die "NNODES must be a positive integer, got '$nnodes'"
  gdro_is_uint "$gpus" || gdro_die "N_GPUS_PER_NODE must be a positive integer, got '$gpus'"
  gdro_is_uint "$save_freq" || [[ "$save_freq" == -1 ]] || gdro_die "SAVE_FREQ must be a positive integer or -1, got '$save_freq'"
  [[ "$project" =~ ^[A-Za-z0-9._-]+$ ]] || gdro_die "PROJECT_NAME may use letters, digits, '.', '_', '-' only, got '$project'"
  [[ "$experiment" =~ ^[A-Za-z0-9._-]+$ ]] || gdro_die "EXPERIMENT_NAME may use letters, digits, '.', '_', '-' only, got '$experiment'"

  # Budget divisibility of the layout set here. When an argument overrides one of the values
  # involved, the check is left to the recipe's own (it sees the final config).
  local world=$((nnodes * gpus))
  local responses=$((GDRO_TRAIN_BATCH_SIZE * GDRO_ROLLOUT_N))
  local mini_responses=$((GDRO_PPO_MINI_BATCH_SIZE * GDRO_ROLLOUT_N))
  gdro_is_uint "$ROLLOUT_TP" || gdro_die "ROLLOUT_TP must be a positive integer, got '$ROLLOUT_TP'"
  if ! gdro_args_set trainer.nnodes trainer.n_gpus_per_node data.train_batch_size actor_rollout_ref.rollout.n \
    actor_rollout_ref.actor.ppo_mini_batch_size actor_rollout_ref.rollout.tensor_model_parallel_size -- "$@"; then
    ((gpus % ROLLOUT_TP == 0)) || gdro_die "N_GPUS_PER_NODE=$gpus is not divisible by the rollout tensor-parallel size ROLLOUT_TP=$ROLLOUT_TP"
    ((responses % world == 0)) || gdro_die "train_batch_size x rollout.n = $responses responses is not divisible by the data-parallel size NNODES x N_GPUS_PER_NODE = $world (verl would pad every step)"
    ((mini_responses % world == 0)) || gdro_die "ppo_mini_batch_size x rollout.n = $mini_responses responses is not divisible by the data-parallel size $world"
  fi

  # Logger: "console,wandb" | "console wandb" | "[console,wandb]".
  local logger="${LOGGER:-}"
  if [[ -z "$logger" ]]; then
    if [[ -n "${WANDB_API_KEY:-}" ]] || grep -qs "api.wandb.ai" "$HOME/.netrc"; then
      logger="console,wandb"
    else
      logger="console"
      gdro_log "no wandb credentials found: logging to the console only (set LOGGER=console,wandb or console,tensorboard to change)"
    fi
  fi
  logger="${logger#[}"
  logger="${logger%]}"
  logger="$(echo "$logger" | tr ', ' '\n\n' | tr -d "'\"" | grep -v '^$' | paste -sd, -)"
  [[ -n "$logger" ]] || gdro_die "LOGGER is empty"

  # Validation files: one parquet per evaluation set.
  local val_list="" set_name
  for set_name in $eval_sets; do
    val_list+="${val_list:+,}$(gdro_hq "$val_dir/$set_name.parquet")"
  done
  [[ -n "$val_list" ]] || gdro_die "EVAL_SETS is empty"

  GDRO_OVERRIDES+=(
    "actor_rollout_ref.model.path=$(gdro_hq "$model_path")"
    "data.train_files=$(gdro_hq "$train_file")"
    "data.val_files=[$val_list]"
    "trainer.nnodes=$nnodes"
    "trainer.n_gpus_per_node=$gpus"
    "trainer.project_name=$project"
    "trainer.experiment_name=$experiment"
    "trainer.logger=[$logger]"
    "trainer.default_local_dir=$(gdro_hq "$ckpt_dir/$project/$experiment")"
    "trainer.save_freq=$save_freq"
  )
  # Bounded checkpoints: verl deletes the oldest beyond trainer.max_actor_ckpt_to_keep (null = all).
  local keep="${MAX_CKPT_TO_KEEP:-2}"
  [[ "$keep" =~ ^[0-9]+$ ]] || gdro_die "MAX_CKPT_TO_KEEP must be a non-negative integer (0 = keep all), got '$keep'"
  if ((keep == 0)); then
    GDRO_OVERRIDES+=("trainer.max_actor_ckpt_to_keep=null")
  else
    GDRO_OVERRIDES+=("trainer.max_actor_ckpt_to_keep=$keep")
  fi
  # TransferQueue storage units (one 1-CPU Ray actor each; the recipe checks the cluster has them).
  local tq_units="${TQ_STORAGE_UNITS:-8}"
  gdro_is_uint "$tq_units" || gdro_die "TQ_STORAGE_UNITS must be a positive integer, got '$tq_units'"
  GDRO_OVERRIDES+=("transfer_queue.backend.SimpleStorage.num_data_storage_units=$tq_units")
  # Attention implementation of the FSDP actor / reference (verl's default: flash_attention_2).
  if [[ -n "${ATTN_IMPLEMENTATION:-}" ]]; then
    [[ "$ATTN_IMPLEMENTATION" =~ ^[A-Za-z0-9_./-]+$ ]] || gdro_die "ATTN_IMPLEMENTATION has unexpected characters: '$ATTN_IMPLEMENTATION'"
    GDRO_OVERRIDES+=("++actor_rollout_ref.model.override_config.attn_implementation=$ATTN_IMPLEMENTATION")
  fi

  # The user's own Hydra overrides come last, so they win.
  GDRO_OVERRIDES+=("$@")

  local dry=0 dry_value=true preflight=0
  if [[ "${DRY_RUN:-0}" == config ]]; then
    dry=1 dry_value=config
  elif gdro_is_true "${DRY_RUN:-0}"; then
    dry=1
  fi
  gdro_is_true "${PREFLIGHT:-0}" && preflight=1
  ((dry && preflight)) && gdro_die "DRY_RUN and PREFLIGHT=1 are exclusive: the dry run checks the config on any machine, the preflight checks a GPU node"
  # A local model directory must be a model (an HF id has no leading / . ~).
  if [[ "$model_path" == /* || "$model_path" == .* || "$model_path" == "~"* ]] && ! ((dry)); then
    local model_dir
    model_dir="$(gdro_abspath "$model_path")"
    [[ -f "$model_dir/config.json" ]] || gdro_die "MODEL_PATH=$model_path: no config.json in $model_dir (a local model directory must exist at the same path on every node)"
  elif gdro_is_true "${HF_HUB_OFFLINE:-0}"; then
    gdro_log "HF_HUB_OFFLINE=1: $model_path must already be in the hub cache of every node (forwarded to all Ray workers)"
  fi
  if ((dry)); then
    GDRO_OVERRIDES+=("gdro.dry_run=$dry_value")
  else
    # Fail before Ray starts rather than minutes into worker start-up (files given as arguments
    # are the recipe's to check).
    local missing=() f
    if ! gdro_args_set data.train_files -- "$@"; then
      [[ -f "$train_file" ]] || missing+=("$train_file")
    fi
    if ! gdro_args_set data.val_files -- "$@"; then
      for set_name in $eval_sets; do
        f="$val_dir/$set_name.parquet"
        [[ -f "$f" ]] || missing+=("$f")
      done
    fi
    if ((${#missing[@]})); then
      gdro_die "missing data file(s): ${missing[*]}
  prepare them with:  python data_prep/dapo.py --local_dir $data_dir
                      python data_prep/eval_sets.py --local_dir $val_dir
  or point DATA_DIR / TRAIN_FILE / VAL_DIR at them (DRY_RUN=config checks the config without data)."
    fi
    if ((nnodes > 1)) && command -v ray >/dev/null 2>&1 && ! ray status >/dev/null 2>&1; then
      gdro_die "NNODES=$nnodes needs a running Ray cluster: 'ray start --head' on this node and 'ray start --address=<head>:6379' on the others (see docs/cluster.md, "Multi-node"), or set RAY_ADDRESS"
    fi
  fi

  gdro_activate_venv "$GDRO_ROOT"
  local python="${PYTHON:-python3}"
  # Make the repository importable on this node even if it is not pip-installed; Ray workers on
  # every node get it through the job's runtime_env (py_modules, see recipe/gdro/startup/cluster.py).
  export PYTHONPATH="$GDRO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  local entry=recipe.gdro.main_gdro mode_note=""
  ((dry)) && mode_note=" | DRY RUN"
  ((preflight)) && entry=recipe.gdro.startup.preflight && mode_note=" | PREFLIGHT"
  ((paper_exact)) && mode_note+=" | PAPER_EXACT"
  gdro_log "qwen3 $size / $method | model $model_path | $nnodes node(s) x $gpus GPU(s) | run $project/$experiment$mode_note"
  gdro_log "checkpoints + gdro_metrics.jsonl: $ckpt_dir/$project/$experiment"
  {
    printf '[gdro-launch] command:\n  %q -m %s' "$python" "$entry"
    printf ' \\\n    %q' "${GDRO_OVERRIDES[@]}"
    printf '\n'
  } >&2
  exec "$python" -m "$entry" "${GDRO_OVERRIDES[@]}"
}
