# shellcheck shell=bash
# Sourced by the launch scripts: use the repository's virtual environment when it exists, so that
# `bash run_scripts/qwen3_8b_rollout_gdro.sh` works right after `source run_scripts/setup_env.sh`
# in a new shell, without `source .venv/bin/activate` first.
#
#   source run_scripts/common/activate_venv.sh && gdro_activate_venv "$GDRO_ROOT"
#
# The venv is GDRO_VENV (default <repo>/.venv, the one setup_env.sh creates). Nothing changes when
# a virtual environment is already active (VIRTUAL_ENV set), when GDRO_USE_CURRENT_ENV=1, or when
# the folder has no bin/python: then `python3` is whatever the caller's PATH gives. Only PATH and
# VIRTUAL_ENV are set (what `activate` does that matters to a child process); no shell options
# are touched.
gdro_activate_venv() {
  local root="$1"
  local venv="${GDRO_VENV:-$root/.venv}" current="${GDRO_USE_CURRENT_ENV:-0}"
  case "${current,,}" in
    0 | false) current=0 ;;
    1 | true) current=1 ;;
    *) echo "[gdro] error: GDRO_USE_CURRENT_ENV='$GDRO_USE_CURRENT_ENV' is not 0, 1, true or false" >&2 && exit 2 ;;
  esac
  [[ -z "${VIRTUAL_ENV:-}" && "$current" != 1 && -x "$venv/bin/python" ]] || return 0
  venv="$(cd "$venv" && pwd)"
  export VIRTUAL_ENV="$venv"
  export PATH="$venv/bin:$PATH"
  echo "[gdro] using the virtual environment $venv" >&2
}
