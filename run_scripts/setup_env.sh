#!/usr/bin/env bash
# Creates (or reuses) a virtual environment and installs this package into it:
#   torch==2.13.0, then verl==0.9.1 and the project, editable, with the test extra.
# Source it (the environment stays active in your shell):  source run_scripts/setup_env.sh
# or run it:                                               bash run_scripts/setup_env.sh
#
# torch: on a machine without an NVIDIA GPU (no working `nvidia-smi`) torch comes from PyTorch's
# CPU wheel index (GDRO_TORCH_INDEX). Where that index is unreachable (a 5 s probe), the plain
# `pip install torch==2.13.0` is used instead, with a printed note, but only after pip's dry run
# shows it would not pull CUDA libraries (nvidia-* packages, several GB): never a CUDA torch on a
# CPU machine. On a GPU machine the plain install is used (PyPI's default torch is the CUDA build).
# A torch already importable in the environment is kept.
#
# Environment (all optional):
#   GDRO_VENV            virtual environment folder            default <repo>/.venv
#   GDRO_USE_CURRENT_ENV=1  install into the active Python instead of a virtual environment
#   GDRO_EXTRAS          extras of this package                default test
#   GDRO_OWN_VERL=1      you manage verl yourself: keep the installed verl and install this
#                        package with `pip install --no-deps -e .` (see REQUIRED_VERL.txt)
#   GDRO_TORCH_INDEX     PyTorch's CPU wheel index             default https://download.pytorch.org/whl/cpu
#   GDRO_ALLOW_CUDA_TORCH=1  let the fallback install a CUDA torch on a machine without a GPU
#   PYTHON               interpreter that creates the venv     default python3
#
# When sourced, the caller's shell options (errexit, nounset, pipefail, ...) are exactly as they
# were afterwards: the install steps run in a subshell with `set -euo pipefail`, and a failure
# returns non-zero instead of closing an interactive terminal.

_gdro_saved_opts="$(set +o)"
set +e

GDRO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GDRO_TORCH_VERSION="2.13.0"

# `python -m pip ARGS` without the pip-config noise ("WARNING: Location ... is ignored").
gdro_pip() {
  local log rc=0
  log="$(mktemp)"
  python -m pip "$@" >"$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$log" >&2 || true
  rm -f "$log"
  return "$rc"
}

# Installs torch into the active `python`; see the header for the choice of source.
gdro_install_torch() {
  local index="${GDRO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  local spec="torch==$GDRO_TORCH_VERSION"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] NVIDIA GPU found: installing $spec (PyPI's default CUDA build)"
    gdro_pip install -q "$spec"
    return
  fi
  if python - "$index" <<'EOF'; then
import sys
import urllib.request

try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception as e:  # unreachable, DNS failure, HTTP error
    print(f"[setup] {sys.argv[1]} is not reachable ({type(e).__name__}: {e})", file=sys.stderr)
    sys.exit(1)
EOF
    echo "[setup] no GPU: installing $spec (CPU build) from $index"
    gdro_pip install -q --timeout 30 --retries 1 --index-url "$index" "$spec"
    return
  fi
  echo "[setup] note: PyTorch's CPU wheel index is unreachable; falling back to the plain" \
    "\`pip install $spec\` (checked first: it must not pull CUDA libraries)" >&2
  local report
  report="$(mktemp)"
  gdro_pip install -q --dry-run --ignore-installed --report "$report" "$spec"
  local cuda
  cuda="$(python - "$report" <<'EOF'
import json
import sys

plan = json.load(open(sys.argv[1]))["install"]
print(" ".join(p["metadata"]["name"] for p in plan if p["metadata"]["name"].lower().startswith("nvidia-")))
EOF
)"
  rm -f "$report"
  if [[ -n "$cuda" && "${GDRO_ALLOW_CUDA_TORCH:-0}" != 1 ]]; then
    echo "[setup] error: on this machine the plain \`pip install $spec\` resolves to the CUDA build" \
      "(it would download $cuda). Install a CPU torch $GDRO_TORCH_VERSION first (e.g. from a local" \
      "wheel: pip install /path/to/torch-$GDRO_TORCH_VERSION+cpu-*.whl) and run this again, or set" \
      "GDRO_ALLOW_CUDA_TORCH=1 to accept the CUDA build." >&2
    return 1
  fi
  gdro_pip install -q "$spec"
}

# The install steps; run in a subshell with strict options (see the header).
gdro_setup_install() {
  set -euo pipefail
  local extras="${GDRO_EXTRAS:-test}" own_verl="${GDRO_OWN_VERL:-0}"
  local prefix stamp want
  prefix="$(python -c 'import sys; print(sys.prefix)')"
  stamp="$prefix/.gdro_installed"
  want="$(cat "$GDRO_ROOT/setup.py" "$GDRO_ROOT/pyproject.toml" 2>/dev/null | sha256sum | cut -c1-16)-$extras-$own_verl"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && python -c "import verl, verl_ext, torch" 2>/dev/null; then
    echo "[setup] environment up to date ($prefix)"
    return 0
  fi
  if ! python -c "import torch" 2>/dev/null; then
    gdro_install_torch
  fi
  local log
  log="$(mktemp)"
  if [[ "$own_verl" == 1 ]]; then
    python -c "import verl" 2>/dev/null || {
      echo "[setup] error: GDRO_OWN_VERL=1 but verl is not importable; install $(cat "$GDRO_ROOT/REQUIRED_VERL.txt") first" >&2
      return 1
    }
    echo "[setup] GDRO_OWN_VERL=1: keeping your verl; installing this package with --no-deps"
    if ! python -m pip install -q --no-deps -e "$GDRO_ROOT" >"$log" 2>&1; then
      grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1
    fi
  else
    echo "[setup] installing $(cat "$GDRO_ROOT/REQUIRED_VERL.txt") and this package [$extras]"
    if ! python -m pip install -q -e "$GDRO_ROOT[$extras]" >"$log" 2>&1; then
      grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1
    fi
  fi
  rm -f "$log"
  python -c "import verl, verl_ext, torch; print('[setup] verl', verl.__version__, '| torch', torch.__version__)"
  echo "$want" >"$stamp"
}

_gdro_rc=0
if [[ "${GDRO_USE_CURRENT_ENV:-0}" != "1" ]]; then
  GDRO_VENV="${GDRO_VENV:-$GDRO_ROOT/.venv}"
  if [[ ! -x "$GDRO_VENV/bin/python" ]]; then
    echo "[setup] creating virtual environment $GDRO_VENV"
    "${PYTHON:-python3}" -m venv "$GDRO_VENV" || _gdro_rc=$?
  fi
  if ((_gdro_rc == 0)); then
    # shellcheck disable=SC1091
    source "$GDRO_VENV/bin/activate" || _gdro_rc=$?
  fi
fi
if ((_gdro_rc == 0)); then
  # Not `(...) || rc=$?`: bash ignores errexit inside a subshell that is part of an || list.
  (gdro_setup_install)
  _gdro_rc=$?
fi
if ((_gdro_rc == 0)) && [[ "${GDRO_USE_CURRENT_ENV:-0}" != "1" ]]; then
  if [[ "$GDRO_VENV" -ef "$GDRO_ROOT/.venv" ]]; then
    echo "[setup] ready. In a new shell: source .venv/bin/activate (the run_scripts launchers use .venv by themselves)"
  else
    echo "[setup] ready. In a new shell: source $GDRO_VENV/bin/activate (or export GDRO_VENV=$GDRO_VENV for the launchers)"
  fi
fi
eval "$_gdro_saved_opts"
unset _gdro_saved_opts
if ((_gdro_rc != 0)); then
  unset _gdro_rc
  return 1 2>/dev/null || exit 1
fi
unset _gdro_rc
