"""Cluster readiness checks that run on CPU (recipe/gdro/startup/cluster.py, recipe/gdro/preflight.py).

flash_attn and vllm are absent on this machine, which is what the attention check and the
preflight's refusal are tested against. The multi-node code shipping is in test_multinode.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from recipe_helpers import standins as S
from recipe_helpers.overrides import paper_overrides
from recipe_helpers.paths import REPO

from recipe.gdro import preflight
from recipe.gdro.main_gdro import cli
from recipe.gdro.startup import cluster
from recipe.gdro.startup.checks import GDRORecipeError
from recipe.gdro.startup.cli import compose_config

SDPA = "++actor_rollout_ref.model.override_config.attn_implementation=sdpa"
NO_FLASH = importlib.util.find_spec("flash_attn") is None


@pytest.fixture
def data(tmp_path) -> Path:
    return Path(
        S.write_parquet(str(tmp_path / "dapo_train.parquet"), S.math_rows(list(range(10, 266))))
    )  # >= data.train_batch_size (256): the dry run checks it


def run_cli(capsys, argv):
    code = cli(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------------- attention
def test_attention_default_is_verls_flash_attention_2():
    config = compose_config([])
    assert cluster.configured_attn_implementation(config) == "flash_attention_2"
    assert cluster.configured_attn_implementation(compose_config([SDPA])) == "sdpa"
    # verl 0.9.1 reads the same key with the same default when it builds the model config
    src = Path(importlib.util.find_spec("verl.workers.config.model").origin).read_text()
    assert 'self.override_config.get("attn_implementation", "flash_attention_2")' in src


@pytest.mark.skipif(not NO_FLASH, reason="flash_attn is installed here")
def test_missing_flash_attn_is_refused_naming_the_key_and_the_sdpa_fallback():
    config = compose_config([])
    with pytest.raises(GDRORecipeError) as e:
        cluster.check_attention(config, strict=True)
    msg = str(e.value)
    assert "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2 (verl's default)" in msg
    assert "flash_attn" in msg and SDPA in msg and "an argument of the launch scripts too" in msg
    # not strict: reported, not raised
    check = cluster.check_attention(config, strict=False)
    assert check.importable is False and "NOT importable" in check.describe()
    # sdpa needs only torch
    assert cluster.check_attention(compose_config([SDPA]), strict=True).importable is True
    # an implementation the recipe does not know is left to transformers
    unknown_impl = compose_config(["++actor_rollout_ref.model.override_config.attn_implementation=x"])
    unknown = cluster.check_attention(unknown_impl, strict=True)
    assert unknown.module is None


@pytest.mark.skipif(not NO_FLASH, reason="flash_attn is installed here")
def test_real_launch_refuses_missing_flash_attn_before_ray(capsys, data, monkeypatch):
    import verl.trainer.main_ppo as main_ppo

    def no_ray(*a, **k):
        raise AssertionError("run_ppo must not start")

    monkeypatch.setattr(main_ppo, "run_ppo", no_ray)
    argv = [a for a in paper_overrides(data) if a != "gdro.dry_run=true"]
    code, out, err = run_cli(capsys, argv)
    assert code == 2, err
    assert "attn_implementation=flash_attention_2" in err and SDPA in err


@pytest.mark.skipif(not NO_FLASH, reason="flash_attn is installed here")
def test_dry_run_reports_attention_on_cpu_and_refuses_it_where_cuda_is(capsys, data, monkeypatch):
    code, out, err = run_cli(capsys, paper_overrides(data))
    assert code == 0, err
    assert "model.override_config.attn_implementation = flash_attention_2 (flash_attn NOT importable" in out
    assert "the real launch refuses it" in out
    code, out, err = run_cli(capsys, paper_overrides(data) + [SDPA])
    assert code == 0, err
    assert "= sdpa (torch importable)" in out
    # a dry run on a machine with CUDA is on the cluster: there the missing kernel is an error
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code, out, err = run_cli(capsys, paper_overrides(data))
    assert code == 2 and "attn_implementation=flash_attention_2" in err


def test_gpu_extra_installs_verls_flash_attn_and_cpu_install_does_not(monkeypatch):
    """setup.py: `gpu` = verl's vllm + flash-attn extras (verl 0.9.1 METADATA); base install has neither."""
    import email
    from importlib.metadata import distribution

    meta = email.message_from_string(distribution("verl").read_text("METADATA"))
    extras = meta.get_all("Provides-Extra")
    assert "vllm" in extras and "flash-attn-cu130torch211" in extras
    flash = [r for r in meta.get_all("Requires-Dist") if r.startswith("flash-attn") and "flash-attn-cu130torch211" in r]
    assert flash and flash[0].startswith("flash-attn==2.8.3")

    monkeypatch.chdir(REPO)  # setup.py reads README.md relative to the repository
    src = (REPO / "setup.py").read_text()
    namespace: dict = {}
    namespace["__file__"] = str(REPO / "setup.py")  # setup.py reads REQUIRED_VERL.txt beside itself
    exec(compile(src.replace("setup(", "SETUP_KWARGS = dict(", 1), "setup.py", "exec"), namespace)
    kwargs = namespace["SETUP_KWARGS"]
    gpu = kwargs["extras_require"]["gpu"]
    assert gpu == ["verl[vllm,flash-attn-cu130torch211]==0.9.1"]
    cpu = kwargs["install_requires"] + kwargs["extras_require"]["test"]
    assert not any("flash" in r or "vllm" in r or "[" in r for r in cpu), cpu


# ----------------------------------------------------------------------------------- code shipping
def test_ship_code_adds_the_three_packages_to_the_ray_runtime_env():
    config = compose_config(["+ray_kwargs.ray_init.runtime_env.py_modules=[/opt/mine]"])
    added = cluster.ship_code_to_workers(config, environ={})
    assert [Path(p).name for p in added] == ["recipe", "verl_ext", "data_prep"]
    for p in added:
        assert Path(p).parent == REPO
    # regular packages, except the namespace package recipe, whose portion holding recipe/gdro is shipped
    assert (Path(added[0]) / "gdro" / "__init__.py").exists()
    assert all((Path(p) / "__init__.py").exists() for p in added[1:])
    modules = OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env.py_modules)
    assert modules == ["/opt/mine", *added]  # the user's entry kept, first
    assert cluster.ship_code_to_workers(config, environ={}) == []  # idempotent
    # verl merges it into what ray.init gets, keeping its own env_vars
    kwargs = preflight.ray_init_kwargs(config)
    assert kwargs["runtime_env"]["py_modules"] == modules
    assert "env_vars" in kwargs["runtime_env"]
    # opt-out
    other = compose_config([])
    assert cluster.ship_code_to_workers(other, environ={"GDRO_SHIP_CODE": "0"}) == []
    assert OmegaConf.select(other, cluster.PY_MODULES_KEY, default=None) is None


def test_namespace_recipe_ships_this_repositorys_portion_whatever_its_path_entries(monkeypatch):
    """An editable install lists a setuptools path hook, not a folder, in ``recipe.__path__``."""
    import types

    fake = types.ModuleType("recipe")
    fake.__path__ = ["__editable__.verl_gdro-0.1.0.finder.__path_hook__", "/site-packages/recipe"]
    monkeypatch.setitem(sys.modules, "recipe", fake)
    assert Path(cluster.package_dir("recipe")) == REPO / "recipe"
    other = types.ModuleType("other_ns")
    other.__path__ = ["/somewhere"]
    monkeypatch.setitem(sys.modules, "other_ns", other)
    with pytest.raises(GDRORecipeError, match="namespace package"):
        cluster.package_dir("other_ns")


def test_what_the_workers_read_is_forwarded_to_them():
    """Workers of a cluster the launch joins inherit their own `ray start`'s environment: the hub switches, the
    weight-sync bound and TransferQueue's send/recv timeout (read in the TaskRunner) go in the runtime_env."""
    config = compose_config([])
    assert cluster.forward_worker_env(config, environ={}) == {}
    timeouts = {"GDRO_WEIGHT_SYNC_TIMEOUT": "60", "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": "20", "OTHER": "x"}
    assert cluster.forward_worker_env(config, environ=timeouts) == {k: v for k, v in timeouts.items() if k != "OTHER"}
    config = compose_config([])
    forwarded = cluster.forward_worker_env(config, environ={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": ""})
    assert forwarded == {"HF_HUB_OFFLINE": "1"}
    assert preflight.ray_init_kwargs(config)["runtime_env"]["env_vars"]["HF_HUB_OFFLINE"] == "1"
    # a value the user set in the runtime_env wins
    config = compose_config(["+ray_kwargs.ray_init.runtime_env.env_vars={HF_HUB_OFFLINE: '0'}"])
    assert cluster.forward_worker_env(config, environ={"HF_HUB_OFFLINE": "1"}) == {}
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.HF_HUB_OFFLINE == "0"


def test_dry_run_shows_the_shipped_modules(capsys, data):
    layout = [
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    ]
    code, out, err = run_cli(capsys, paper_overrides(data) + layout + [SDPA])
    assert code == 0, err
    assert "workers      Ray runtime_env py_modules ships recipe, verl_ext, data_prep to every node" in out
    line = next(x for x in out.splitlines() if x.startswith("ray_kwargs.ray_init.runtime_env.py_modules:"))
    assert f"{REPO}/recipe" in line and f"{REPO}/verl_ext" in line and f"{REPO}/data_prep" in line
    assert "transfer_queue.backend.SimpleStorage.num_data_storage_units: 8" in out
    assert "needs >= 10 Ray CPUs with the TaskRunner" in out
    assert "verl's resource pool reserves {CPU: 3, GPU: 1} per GPU (24 CPUs)" in out and "needs >= 34 Ray CPUs" in out
    # the paper's 8B layout on one node: the KV-cache estimate of docs/cluster.md
    assert "kv cache     ~515k tokens per vLLM replica" in out and "256 sequences x 7296 tokens" in out


# ----------------------------------------------------------------------------------- TransferQueue
def test_transfer_queue_cpu_check():
    """verl's resource pool (3 CPUs per GPU) + TransferQueue (units + controller) + the TaskRunner."""
    config = compose_config([])  # verl's defaults: 8 GPUs on 1 node, 8 storage units
    assert cluster.tq_storage_units(config) == 8  # verl 0.9.1's default
    assert cluster.resource_pool_cpus(config) == 24
    with pytest.raises(GDRORecipeError, match=r"needs >= 34 Ray CPUs; this Ray cluster has 2: verl's resource pool 24"):
        cluster.check_transfer_queue_cpus(config, 2)
    with pytest.raises(GDRORecipeError, match=r"needs >= 34 Ray CPUs; this Ray cluster has 10"):
        cluster.check_transfer_queue_cpus(config, 10)  # enough for TransferQueue alone (the old, undercounting check)
    cluster.check_transfer_queue_cpus(config, 34)
    one = compose_config([f"{cluster.TQ_UNITS_KEY}=1", "trainer.n_gpus_per_node=1"])
    cluster.check_transfer_queue_cpus(one, 5, runner_cpus=0)  # 3 + 1 unit + controller
    with pytest.raises(GDRORecipeError, match="needs >= 6 Ray CPUs"):
        cluster.check_transfer_queue_cpus(one, 5)  # inside run_ppo's TaskRunner actor
    with pytest.raises(GDRORecipeError, match="must be >= 1"):
        cluster.check_transfer_queue_cpus(compose_config([f"{cluster.TQ_UNITS_KEY}=0"]), 64)
    other = compose_config(["transfer_queue.backend.storage_backend=MooncakeStore", "trainer.n_gpus_per_node=1"])
    cluster.check_transfer_queue_cpus(other, 4)  # not SimpleStorage: only the pool (3) and the runner (1)
    with pytest.raises(GDRORecipeError, match="needs >= 4 Ray CPUs"):
        cluster.check_transfer_queue_cpus(other, 3)


def test_cpu_check_per_node_placement_groups():
    """2 nodes x 8 GPUs: each node must hold one placement group of 8 bundles {CPU: 3, GPU: 1}."""
    config = compose_config(["trainer.nnodes=2", f"{cluster.TQ_UNITS_KEY}=2"])
    big = {"CPU": 32.0, "GPU": 8.0}
    cluster.check_transfer_queue_cpus(config, 64, node_resources=[big, big])
    small = {"CPU": 16.0, "GPU": 8.0}  # 8 GPUs but only 16 CPUs: the 24-CPU placement group never fits
    with pytest.raises(GDRORecipeError, match=r"2 node\(s\) need >= 8 GPUs and >= 24 CPUs each; 1 of the Ray"):
        cluster.check_transfer_queue_cpus(config, 64, node_resources=[big, small, {"CPU": 16.0}])


def test_task_runner_refuses_before_tq_init(monkeypatch):
    """GDROTaskRunner.run checks Ray's CPUs before tq.init, which would otherwise wait forever."""
    import ray
    import transfer_queue as tq

    from recipe.gdro import task_runner as TR

    calls = []
    monkeypatch.setattr(tq, "init", lambda conf=None: calls.append("init"))
    monkeypatch.setattr(tq, "close", lambda: calls.append("close"))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setattr(TR, "select_trainer_cls", lambda cfg: object)
    with pytest.raises(GDRORecipeError, match="needs >= 33 Ray CPUs; this Ray cluster has 4"):
        TR.GDROTaskRunner().run(compose_config([]))  # 8 GPUs x 3 + 8 units + controller (driver: no runner CPU)
    assert calls == []


# ----------------------------------------------------------------------------------- group sizes
def test_group_size_check_on_fake_engine_output():
    ok = cluster.check_group_sizes({"a": 2, "b": 12}, ["a"] * 2 + ["b"] * 12)
    assert ok.ok and ok.describe() == "prompt a: scheduled 2, got 2; prompt b: scheduled 12, got 12"
    # an engine that ignores the per-request count gives every group the same size
    flat = cluster.check_group_sizes({"a": 2, "b": 12}, ["a"] * 4 + ["b"] * 4)
    assert not flat.ok and flat.mismatched == {"a": (2, 4), "b": (12, 4)}
    short = cluster.check_group_sizes({"a": 2, "b": 12}, ["a"] * 2 + ["b"] * 11)
    assert short.mismatched == {"b": (12, 11)}
    missing = cluster.check_group_sizes({"a": 2, "b": 3}, ["a", "a"])
    assert missing.mismatched == {"b": (3, 0)}
    stray = cluster.check_group_sizes({"a": 1}, ["a", "z"])
    assert not stray.ok and stray.unexpected == ["z"] and "never scheduled" in stray.describe()


def test_preflight_counts_use_the_rollout_bounds():
    from recipe.gdro.startup.checks import build_gdro_config

    on = compose_config(["gdro.rollout.enable=true"])
    assert preflight.scheduled_counts(on, build_gdro_config(on)) == {"a": 2, "b": 12}
    off = compose_config([])
    assert preflight.scheduled_counts(off, build_gdro_config(off)) == {"a": 4, "b": 5}


# ----------------------------------------------------------------------------------- preflight on CPU
@pytest.mark.skipif(not NO_FLASH, reason="flash_attn is installed here")
def test_preflight_on_cpu_prints_the_plan_then_refuses_cleanly(capsys, data):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    base = [a for a in paper_overrides(data) if a != "gdro.dry_run=true"]
    config = compose_config(base)
    assert preflight.run_preflight(config) == 2
    out, err = capsys.readouterr()
    # the launch's own checks (main_gdro.check_launch) include the attention kernel's: refused before the plan
    assert "gdro preflight: error:" in err and "attn_implementation=flash_attention_2" in err

    config = compose_config(base + [SDPA])
    assert preflight.run_preflight(config) == 2
    out, err = capsys.readouterr()
    assert "two prompts through verl's agent loop with __rollout_n__ = 2 and 12" in out
    assert "1/4 start-up checks passed" in out
    assert "2/4 attention: sdpa (torch importable)" in out
    assert "no CUDA device visible" in err and "DRY_RUN=1" in err
    assert "3/4" not in out  # Ray was never started

    bad = compose_config(base + ["gdro.rollout.n_max=1"])
    assert preflight.run_preflight(bad) == 2  # a start-up check refuses before anything else


# ----------------------------------------------------------------------------------- KV-cache estimate
def _paper(size: str, tp: int, gmu: float, *extra: str):
    return compose_config(
        [
            f"actor_rollout_ref.model.path=Qwen/Qwen3-{size}-Base",
            "data.train_batch_size=256",
            "data.max_prompt_length=3200",
            "data.max_response_length=4096",
            "trainer.n_gpus_per_node=8",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={gmu}",
            *extra,
        ]
    )


def test_kv_cache_estimate_matches_the_documented_arithmetic():
    # parameter counts of the three models from their shapes: 1.72B / 4.02B / 8.19B
    assert [
        round(cluster.approx_params(cluster.KNOWN_MODELS[f"Qwen/Qwen3-{s}-Base"]) / 1e9, 2)
        for s in ("1.7B", "4B", "8B")
    ] == [1.72, 4.02, 8.19]
    e = cluster.kv_cache_estimate(_paper("8B", 2, 0.6))
    assert e.bytes_per_token_per_gpu == 2 * 36 * 8 * 128 * 2 / 2  # 72 KiB
    # verl's server captures CUDA graphs (rollout.enforce_eager=false): 3 GiB + the assumed 1.5 GiB for graphs
    assert e.kv_gib_per_gpu == pytest.approx(0.6 * 79.2 - 8.19e9 * 2 / 2 / 2**30 - 4.5, abs=0.01)
    assert e.tokens_per_replica == pytest.approx(515e3, rel=0.01)
    eager = cluster.kv_cache_estimate(_paper("8B", 2, 0.6, "actor_rollout_ref.rollout.enforce_eager=true"))
    assert eager.tokens_per_replica == pytest.approx(537e3, rel=0.01) and "(eager)" in eager.line(0.6)
    # max_model_len as verl's vLLM server sets it: rollout.max_model_len, else max_position_embeddings
    assert e.max_model_len == 32768 and e.line(0.6).endswith("max_model_len 32768: one sequence fits")
    capped = cluster.kv_cache_estimate(_paper("8B", 2, 0.6, "actor_rollout_ref.rollout.max_model_len=8192"))
    assert capped.max_model_len == 8192
    huge = cluster.kv_cache_estimate(_paper("8B", 1, 0.3, "actor_rollout_ref.rollout.max_model_len=400000"))
    assert "vLLM refuses to start" in huge.line(0.3)
    assert (e.replicas, e.sequences_per_replica, e.worst_case_tokens_per_replica) == (4, 256, 256 * 7296)
    assert "vLLM queues what does not fit" in e.line(0.6)
    assert cluster.kv_cache_estimate(_paper("1.7B", 1, 0.7)).tokens_per_replica == pytest.approx(447e3, rel=0.01)
    assert cluster.kv_cache_estimate(_paper("4B", 1, 0.65)).tokens_per_replica == pytest.approx(288e3, rel=0.01)
    # short sequences fit
    small = cluster.kv_cache_estimate(
        _paper("8B", 2, 0.6, "data.max_prompt_length=512", "data.max_response_length=1024")
    )
    assert "(4 replicas): fits; max_model_len" in small.line(0.6)
    # more memory, more cache
    assert cluster.kv_cache_estimate(_paper("8B", 2, 0.6), gpu_gib=139.8).tokens_per_replica > 1e6


def test_kv_cache_line_names_the_device_it_assumed_or_the_size_set():
    """The plan's KV line says whose memory it multiplies: an assumed 80 GB card where no GPU is visible (a
    CPU host's dry run), the node's card where one is; and a size set in bytes (size=tiny on vLLM-CPU) is
    what vLLM allocates, not a fraction of any card."""
    assumed = cluster.kv_cache_estimate(_paper("8B", 2, 0.6)).line(0.6)
    assert "0.6 x 79.2 GiB of an assumed 79.2 GiB GPU (none visible here)" in assumed
    seen = cluster.kv_cache_estimate(_paper("8B", 2, 0.6), 139.8, "this node's NVIDIA H200").line(0.6)
    assert "0.6 x 139.8 GiB of this node's NVIDIA H200" in seen
    kv_bytes = "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=268435456"
    explicit = cluster.kv_cache_estimate(_paper("8B", 2, 0.6, kv_bytes))
    assert explicit.kv_gib_per_gpu == 0.25 and explicit.tokens_per_replica == pytest.approx(0.25 * 2**30 / (72 * 1024))
    assert "(set: engine_kwargs.vllm.kv_cache_memory_bytes = 0.25 GiB, at 72 KiB/token/GPU)" in explicit.line(0.6)
    assert "GPU" not in explicit.line(0.6).split("KiB/token/GPU")[0]


def test_kv_cache_estimate_reads_a_local_model_and_skips_unknown_ones(tmp_path):
    import json

    model = tmp_path / "my-qwen"
    model.mkdir()
    shape = dict(cluster.KNOWN_MODELS["Qwen/Qwen3-8B-Base"])
    shape.pop("head_dim")  # derived as hidden_size / heads when absent
    (model / "config.json").write_text(json.dumps(shape))
    local = cluster.kv_cache_estimate(_paper("8B", 2, 0.6, f"actor_rollout_ref.model.path={model}"))
    assert local.tokens_per_replica == pytest.approx(cluster.kv_cache_estimate(_paper("8B", 2, 0.6)).tokens_per_replica)
    assert cluster.kv_cache_estimate(_paper("8B", 2, 0.6, "actor_rollout_ref.model.path=org/unknown")) is None


def test_a_launch_joining_a_running_cluster_passes_no_resource_counts_to_ray_init():
    """Ray refuses num_cpus / num_gpus when ray.init joins a cluster ("When connecting to an existing cluster,
    num_cpus and num_gpus must not be provided"); size=tiny sets both for its own one-node Ray."""
    from recipe.gdro.startup.checks import join_existing_cluster
    from recipe.gdro.startup.ray_address import resolve_ray_address

    def joins(config, environ) -> bool:  # the launch's one decision (main_gdro: resolve_ray_address(...).joins)
        return resolve_ray_address(config, environ).joins

    counts = ["ray_kwargs.ray_init.num_cpus=16", "+ray_kwargs.ray_init.num_gpus=1"]
    own = compose_config(counts)
    assert join_existing_cluster(own, joins=False) == []
    assert (own.ray_kwargs.ray_init.num_cpus, own.ray_kwargs.ray_init.num_gpus) == (16, 1)
    # address=local starts a Ray here: its counts stay (before, any address value cleared them)
    local = compose_config([*counts, "+ray_kwargs.ray_init.address=local"])
    assert join_existing_cluster(local, joins=joins(local, {})) == []
    assert (local.ray_kwargs.ray_init.num_cpus, local.ray_kwargs.ray_init.num_gpus) == (16, 1)
    for config, environ in (
        (compose_config(counts), {"RAY_ADDRESS": "10.0.0.1:6379"}),
        (compose_config([*counts, "+ray_kwargs.ray_init.address=10.0.0.2:6379"]), {}),
    ):
        lines = join_existing_cluster(config, joins=joins(config, environ))
        assert [line.split(":")[1].split("=")[0].strip() for line in lines] == [
            "ray_kwargs.ray_init.num_cpus",
            "ray_kwargs.ray_init.num_gpus",
        ], lines
        assert (config.ray_kwargs.ray_init.num_cpus, config.ray_kwargs.ray_init.num_gpus) == (None, None)
