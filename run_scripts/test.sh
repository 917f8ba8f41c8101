#!/usr/bin/env bash
# Installs everything on a fresh machine (see setup_env.sh) and runs the whole test suite.
#   bash run_scripts/test.sh [pytest args]
set -eo pipefail
cd "$(dirname "$0")/.."
source run_scripts/setup_env.sh
python -m pytest "$@"
