#!/usr/bin/env bash
# Creates (or reuses) a virtual environment and installs this package for CPU use:
#   torch==2.13.0 (the CPU build; never a bare `torch`, which would pull a multi-GB CUDA build),
#   then verl==0.9.1 and the project, editable, with the test extra.
# Source it:  source run_scripts/setup_env.sh
# Environment: GDRO_VENV (default: <repo>/.venv); GDRO_USE_CURRENT_ENV=1 installs into the active
# Python instead; GDRO_EXTRAS (default: test).
set -euo pipefail
GDRO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${GDRO_USE_CURRENT_ENV:-0}" != "1" ]]; then
  GDRO_VENV="${GDRO_VENV:-$GDRO_ROOT/.venv}"
  if [[ ! -x "$GDRO_VENV/bin/python" ]]; then
    echo "[setup] creating virtual environment $GDRO_VENV"
    "${PYTHON:-python3}" -m venv "$GDRO_VENV"
  fi
  # shellcheck disable=SC1091
  source "$GDRO_VENV/bin/activate"
fi
stamp="$(python -c 'import sys; print(sys.prefix)')/.gdro_installed"
want="$(cat "$GDRO_ROOT/setup.py" | sha256sum | cut -c1-16)-${GDRO_EXTRAS:-test}"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && python -c "import verl, verl_ext, torch" 2>/dev/null; then
  echo "[setup] environment up to date ($(python -c 'import sys; print(sys.prefix)'))"
else
  if ! python -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch 2.13.0 (CPU build)"
    python -m pip install -q "torch==2.13.0"
  fi
  echo "[setup] installing verl 0.9.1 and this package [${GDRO_EXTRAS:-test}]"
  log="$(mktemp)"
  if ! python -m pip install -q -e "$GDRO_ROOT[${GDRO_EXTRAS:-test}]" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1 2>/dev/null || exit 1
  fi
  rm -f "$log"
  python -c "import verl, verl_ext, torch; print('[setup] verl', verl.__version__, '| torch', torch.__version__)"
  echo "$want" > "$stamp"
fi
set +u
