"""GDRO for verl: Multi-Adversary Group DRO (Prompt-GDRO, Rollout-GDRO) as a verl 0.9.1 recipe.

Install on a CPU machine (tests, simulator, dry runs)::

    pip install torch==2.13.0          # the local CPU build; never let pip pick a CUDA torch
    pip install -e ".[test]"

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

from setuptools import find_packages, setup

VERL_VERSION = "0.9.1"

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
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["verl_ext", "verl_ext.*", "recipe", "recipe.*", "data_prep", "data_prep.*"]),
    package_data={"recipe.gdro": ["config/*.yaml", "scenarios/*.yaml"]},
    include_package_data=True,
    # torch is deliberately not listed: verl does not list it either, and a bare `torch`
    # requirement would let pip fetch a multi-GB CUDA build on a CPU machine. Install
    # torch first (see the docstring above), or use the `gpu` extra.
    install_requires=[
        f"verl=={VERL_VERSION}",
        *V1_TRAINER_DEPS,
        "numpy>=2.0",
        "pandas",
        "pyarrow>=19.0.0",
        "datasets",
        "hydra-core",
        "omegaconf",
        "pyyaml",
        "matplotlib",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "hypothesis"],
        # verl 0.9.1's own extras for FSDP + vLLM (see the docstring); GPU machines only.
        "gpu": [f"verl[vllm,flash-attn-cu130torch211]=={VERL_VERSION}"],
    },
)
