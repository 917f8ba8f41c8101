"""run_scripts/setup_env.sh and run_scripts/common/activate_venv.sh, driven with a stub interpreter.

The stub ``python`` (first on PATH, with ``GDRO_USE_CURRENT_ENV=1``) records every ``pip`` command
line instead of installing, answers the import checks as told by environment variables, and hands
the script's own stdin programs (the index probe, the dry-run report reader) to the real Python.
So each case takes well under a second and exercises the real shell logic: which torch source is
chosen, what is printed, and that a sourced run leaves the caller's shell options as they were.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from recipe_helpers.paths import REPO

SETUP = REPO / "run_scripts" / "setup_env.sh"
ACTIVATE = REPO / "run_scripts" / "common" / "activate_venv.sh"

STUB = r"""#!/usr/bin/env bash
# Stand-in for `python`: logs pip calls, fakes import checks, runs stdin programs for real.
log="$STUB_DIR/calls.log"
if [[ "$1" == -m && "$2" == pip ]]; then
  printf '%s\n' "${*:3}" >>"$log"
  if [[ " $* " == *" --dry-run "* ]]; then
    args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do
      [[ "${args[i]}" == --report ]] && cp "$STUB_DIR/plan.json" "${args[i + 1]}"
    done
  fi
  exit "${STUB_PIP_RC:-0}"
fi
if [[ "$1" == -c ]]; then
  case "$2" in
    *sys.prefix*) echo "$STUB_DIR/prefix"; exit 0 ;;
    "import torch") exit "${STUB_HAS_TORCH:-1}" ;;
    "import verl") exit "${STUB_HAS_VERL:-1}" ;;
    "import verl, verl_ext, torch") exit "${STUB_INSTALLED:-1}" ;;
    *) echo "stub: $2"; exit 0 ;;
  esac
fi
exec "$REAL_PYTHON" "$@"
"""


def _plan(*names: str) -> dict:
    return {"install": [{"metadata": {"name": n, "version": "1"}} for n in names]}


@pytest.fixture
def stub(tmp_path):
    """Returns run(script, **env) -> (CompletedProcess, pip calls)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "prefix").mkdir()
    exe = bindir / "python"
    exe.write_text(STUB)
    exe.chmod(0o755)
    (tmp_path / "plan.json").write_text(json.dumps(_plan("torch", "filelock", "sympy")))

    def run(script: str, *, plan: dict | None = None, gpu: bool = False, **env: str):
        if plan is not None:
            (tmp_path / "plan.json").write_text(json.dumps(plan))
        if gpu:
            smi = bindir / "nvidia-smi"
            smi.write_text("#!/bin/sh\necho 'GPU 0: stub'\n")
            smi.chmod(0o755)
        log = tmp_path / "calls.log"
        if log.exists():
            log.unlink()
        full_env = {
            "PATH": f"{bindir}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "STUB_DIR": str(tmp_path),
            "REAL_PYTHON": sys.executable,
            "GDRO_USE_CURRENT_ENV": "1",
            "GDRO_TORCH_INDEX": "http://127.0.0.1:9/unreachable",
            **env,
        }
        proc = subprocess.run(
            ["bash", "-c", script], env=full_env, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        calls = log.read_text().splitlines() if log.exists() else []
        return proc, calls

    return run


@pytest.fixture
def cpu_index(tmp_path):
    """A reachable stand-in for PyTorch's CPU index on 127.0.0.1 (it serves a torch/ page)."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(root), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- shell options
OPTION_CASES = {
    "interactive_like": "set +e +u; set +o pipefail",
    "strict": "set -eu -o pipefail",
    "mixed": "set +e -u; set -o pipefail",
}


@pytest.mark.parametrize("outcome", ["success", "failure"])
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_sourcing_restores_the_callers_shell_options(stub, case, outcome):
    """setup_env.sh used to `set -euo pipefail` and restore only -u: a terminal that sourced it
    kept errexit and closed on the next failing command."""
    script = f"""
        {OPTION_CASES[case]}
        before="$(set +o)"
        rc=0
        source {SETUP} >/dev/null 2>&1 || rc=$?
        after="$(set +o)"
        [[ "$before" == "$after" ]] && echo SAME || diff <(echo "$before") <(echo "$after")
        echo "rc=$rc"
    """
    env = {"STUB_PIP_RC": "1"} if outcome == "failure" else {}
    proc, calls = stub(script, **env)
    assert "SAME" in proc.stdout, proc.stdout + proc.stderr
    assert f"rc={1 if outcome == 'failure' else 0}" in proc.stdout
    assert calls, "the install steps did not run"


def test_a_failed_setup_returns_instead_of_closing_an_errexit_free_shell(stub):
    proc, _ = stub(
        f"set +e; source {SETUP}; echo still-here; set -o | grep -E '^(errexit|nounset|pipefail)'", STUB_PIP_RC="1"
    )
    assert "still-here" in proc.stdout
    for opt in ("errexit", "nounset", "pipefail"):
        assert any(line.split() == [opt, "off"] for line in proc.stdout.splitlines()), proc.stdout


# ----------------------------------------------------------------------------- torch source
def test_cpu_machine_installs_torch_from_the_cpu_index(stub, cpu_index):
    proc, calls = stub(f"bash {SETUP}", GDRO_TORCH_INDEX=cpu_index)
    assert proc.returncode == 0, proc.stderr
    torch_calls = [c for c in calls if "torch==2.13.0" in c]
    assert torch_calls == [f"install -q --timeout 30 --retries 1 --index-url {cpu_index} torch==2.13.0"]
    assert "(CPU build) from" in proc.stdout
    assert "unreachable" not in proc.stderr
    # then the package itself, editable, with the test extra
    assert calls[-1] == f"install -q -e {REPO}[test]"


def test_unreachable_index_falls_back_to_the_plain_install_with_a_note(stub):
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    proc, calls = stub(f"bash {SETUP}", GDRO_TORCH_INDEX=index)
    assert proc.returncode == 0, proc.stderr
    assert "note: PyTorch's CPU wheel index is unreachable" in proc.stderr
    assert f"{index} is not reachable" in proc.stderr
    torch_calls = [c for c in calls if "torch==2.13.0" in c]
    assert torch_calls[0].startswith("install -q --dry-run --ignore-installed --report ")
    assert torch_calls[1] == "install -q torch==2.13.0"
    assert not any("--index-url" in c for c in calls)


def test_fallback_refuses_a_cuda_torch_on_a_cpu_machine(stub):
    plan = _plan("torch", "nvidia-cublas-cu12", "nvidia-cudnn-cu12", "sympy")
    proc, calls = stub(f"bash {SETUP}", plan=plan)
    assert proc.returncode == 1
    assert "resolves to the CUDA build" in proc.stderr
    assert "nvidia-cublas-cu12 nvidia-cudnn-cu12" in proc.stderr
    assert "install -q torch==2.13.0" not in calls  # nothing was downloaded
    assert not any(c.startswith("install -q -e") for c in calls)


def test_gpu_machine_uses_the_plain_install(stub):
    proc, calls = stub(f"bash {SETUP}", gpu=True)
    assert proc.returncode == 0, proc.stderr
    assert [c for c in calls if "torch==" in c] == ["install -q torch==2.13.0"]
    assert "NVIDIA GPU found" in proc.stdout


def test_an_installed_torch_is_kept(stub):
    proc, calls = stub(f"bash {SETUP}", STUB_HAS_TORCH="0")
    assert proc.returncode == 0, proc.stderr
    assert not any("torch==" in c for c in calls)


def test_own_verl_installs_with_no_deps(stub):
    proc, calls = stub(f"bash {SETUP}", STUB_HAS_TORCH="0", STUB_HAS_VERL="0", GDRO_OWN_VERL="1")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"install -q --no-deps -e {REPO}"]
    proc, calls = stub(f"bash {SETUP}", STUB_HAS_TORCH="0", STUB_HAS_VERL="1", GDRO_OWN_VERL="1")
    assert proc.returncode == 1
    assert "verl is not importable; install verl==0.9.1 first" in proc.stderr


def test_an_up_to_date_environment_is_not_reinstalled(stub):
    proc, calls = stub(f"bash {SETUP}")
    assert proc.returncode == 0 and calls
    proc, calls = stub(f"bash {SETUP}", STUB_INSTALLED="0")
    assert proc.returncode == 0
    assert "environment up to date" in proc.stdout
    assert calls == []


# ----------------------------------------------------------------------------- launchers' venv
def _fake_venv(root: Path) -> Path:
    venv = root / ".venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "python3"):
        exe = venv / "bin" / name
        exe.write_text("#!/bin/sh\necho venv-python\n")
        exe.chmod(0o755)
    return venv


def _which_python3(root: Path, **env: str) -> subprocess.CompletedProcess:
    script = (
        f"set -euo pipefail; source {ACTIVATE}; gdro_activate_venv {root}; "
        'command -v python3; echo "V=${VIRTUAL_ENV:-}"'
    )
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "GDRO_VENV", "GDRO_USE_CURRENT_ENV")}
    return subprocess.run(["bash", "-c", script], env={**base, **env}, capture_output=True, text=True, timeout=30)


def test_launchers_use_the_repos_venv(tmp_path):
    venv = _fake_venv(tmp_path)
    proc = _which_python3(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{venv}/bin/python3", f"V={venv}"]
    assert "using the virtual environment" in proc.stderr


def test_launchers_respect_an_active_env_or_a_missing_venv(tmp_path):
    _fake_venv(tmp_path)
    proc = _which_python3(tmp_path, VIRTUAL_ENV="/somewhere/else")
    assert f"{tmp_path}/.venv" not in proc.stdout
    proc = _which_python3(tmp_path, GDRO_USE_CURRENT_ENV="1")
    assert f"{tmp_path}/.venv" not in proc.stdout
    empty = tmp_path / "no_venv_here"
    empty.mkdir()
    proc = _which_python3(empty)
    assert proc.returncode == 0 and "V=" in proc.stdout.splitlines()[-1]
    assert str(empty) not in proc.stdout


def test_cuda_fallback_only_when_explicitly_allowed(stub):
    plan = _plan("torch", "nvidia-cublas-cu12")
    proc, calls = stub(f"bash {SETUP}", plan=plan, GDRO_ALLOW_CUDA_TORCH="1")
    assert proc.returncode == 0, proc.stderr
    assert "install -q torch==2.13.0" in calls
