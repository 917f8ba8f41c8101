"""The CPU backend (``gdro.backend=cpu``): verl 0.9.1's v1 loop training the tiny LM on CPU.

``python -m recipe.gdro.main_gdro gdro.backend=cpu ...`` runs ``recipe.gdro.task_runner.run_cpu`` instead
of verl's ``run_ppo``: Ray is started with 2 CPUs (TransferQueue needs it; with one SimpleStorage unit,
a 2-CPU Ray hangs ``tq.init`` otherwise), and the recipe's one ``GDROTaskRunner.run`` with this module's
:class:`CPUBackend` hooks builds the trainer registered as ``<trainer.v1.trainer_mode>_cpu`` (the recipe's
or verl's class with :class:`CPUBackendMixin` in front, :func:`register_cpu_trainer`) in this process and
runs verl's ``fit``.

What runs for real: ``PPOTrainerSync.fit`` / ``step`` (and the recipe's ``GDROTrainerSync``
overrides), verl's dataset / dataloader and tokenizer loading, TransferQueue, the replay buffer,
``_balance_batch``, verl's advantage estimator, KL / policy loss (``core_algos``), validation and
metrics, verl's ``AgentLoopWorkerTQ`` + ``SingleTurnAgentLoop`` + ``LLMServerClient.generate`` and
the reward loop. What is replaced: ``PPOTrainer._setup``'s GPU parts (resource pools, the
FSDP/Megatron ``RayWorkerGroup``, ``LLMServerManager`` + vLLM replicas, ``CheckpointEngineManager``,
``RewardLoopManager``'s Ray workers) by :mod:`recipe.gdro.lab.backends.cpu_workers` and
:mod:`recipe.gdro.lab.backends.cpu_rollout`, and ``AgentLoopManagerTQ`` by :class:`CPUAgentLoopManager`.

``_balance_batch`` is verl's, followed by one reorder into the canonical order (prompt position in
its batch, session, turn; verl's padding last): TransferQueue returns trajectories in the order they
finished, which varies from run to run, and the actor's mini-batches and float sums depend on row
order. With a fixed seed a run is then reproducible, and a resumed run equals the uninterrupted one.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from recipe.gdro.lab.backends.cpu_rollout import CPUAgentLoopManager, CPURolloutServer
from recipe.gdro.lab.backends.cpu_workers import CPUActorWorkerGroup, CPUCheckpointEngine, install_in_process_workers
from recipe.gdro.startup.checks import CPU_MODE_SUFFIX

logger = logging.getLogger(__name__)

STATS_FILE = "cpu_backend_stats.json"


def is_cpu_backend(config: DictConfig) -> bool:
    return str(OmegaConf.select(config, "gdro.backend", default="verl")) == "cpu"


def _trajectory_order(key: str, positions: dict[str, int]) -> tuple:
    uid, session, turn = key.rsplit("_", 2)
    if uid.startswith("pad") and uid not in positions:
        return (1, 0, int(session), int(turn))
    return (0, positions.get(uid, 1 << 30), int(session), int(turn))


class CPUBackendMixin:
    """Replaces ``PPOTrainer._setup``'s GPU parts with the CPU stand-ins (module docstring)."""

    rollout_server_cls = CPURolloutServer

    def _setup(self):
        from recipe.gdro.lab.tinylm import model as tinylm

        self._init_tokenizer()  # verl's: HFModelConfig(model.path).tokenizer
        self._init_dataloader()
        self._init_dump_executor()
        torch.manual_seed(int(self.config.actor_rollout_ref.rollout.get("seed", 0)))
        rollout_cfg = self.config.actor_rollout_ref.rollout
        model = tinylm.load_model(str(self.config.actor_rollout_ref.model.path), "cpu")
        self.cpu_server = self.rollout_server_cls(
            copy.deepcopy(model),
            response_length=int(rollout_cfg.response_length),
            eos_token_id=int(self.tokenizer.eos_token_id),
            pad_token_id=int(self.tokenizer.pad_token_id),
            seed=int(rollout_cfg.get("seed", 0)),
        )
        actor_wg = CPUActorWorkerGroup(
            self.config,
            model,
            pad_token_id=int(self.tokenizer.pad_token_id),
            server=self.cpu_server,
            use_reference=self.use_reference_policy,
        )
        install_in_process_workers(
            self,
            n_gpus=1,  # throughput metrics per "device"
            actor_wg=actor_wg,
            reward_handle="in-process (CPUAgentLoopManager)",
            checkpoint_manager=CPUCheckpointEngine(actor_wg, self.cpu_server),
        )
        self._load_checkpoint()

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        batch = super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        positions = getattr(getattr(self, "agent_loop_manager", None), "positions", {}) or {}
        order = sorted(range(len(batch)), key=lambda i: _trajectory_order(batch.keys[i], positions))
        if order != list(range(len(batch))):
            batch.reorder(order)
        return batch


def register_cpu_trainer(key: str) -> str:
    """Register ``<key>_cpu`` in verl's trainer registry: the trainer registered as ``key`` on the CPU stand-ins.

    The base class is looked up in verl's registry (``recipe.gdro.trainer`` registers ``gdro_sync`` when it
    is imported), so this package imports nothing above it. Guarded: a key already registered is kept."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, get_trainer_cls, register_trainer

    cpu_key = key if key.endswith(CPU_MODE_SUFFIX) else key + CPU_MODE_SUFFIX
    if cpu_key not in TRAINER_REGISTRY:
        base_key = cpu_key.removesuffix(CPU_MODE_SUFFIX)
        base = get_trainer_cls(base_key)
        attrs = {}
        if not isinstance(getattr(base, "trainer_mode", None), property):  # verl's own: its mode is its key
            attrs["trainer_mode"] = property(lambda self: base_key, lambda self, key: None)
        register_trainer(cpu_key)(type(f"CPU{base.__name__}", (CPUBackendMixin, base), attrs))
    return cpu_key


class CPUBackend:
    """The hooks of ``recipe.gdro.task_runner.GDROTaskRunner.run`` on the CPU backend: the trainer in this
    process (with ``trainer_mixins`` in front, e.g. the benchmark's timers), :class:`CPUAgentLoopManager`,
    TransferQueue owned unless the caller has called ``tq.init`` (tests), gc frozen for ``fit``, and
    ``cpu_backend_stats.json`` after it."""

    def __init__(
        self, trainer_mixins: tuple = (), own_transfer_queue: bool = True, agent_loop_options=None, freeze_gc=True
    ):
        self.trainer_mixins = tuple(trainer_mixins)
        self.agent_loop_options = dict(agent_loop_options or {})  # CPUAgentLoopManager's keyword arguments
        self.freeze_gc = freeze_gc
        self.own_transfer_queue = own_transfer_queue

    def trainer_cls(self, cls):
        if not issubclass(cls, CPUBackendMixin):  # a key without the suffix: prepare_cpu_config was not called
            raise ValueError(f"{cls.__name__} is not a CPU backend trainer; run prepare_cpu_config(config) first")
        return type(cls.__name__, (*self.trainer_mixins, cls), {}) if self.trainer_mixins else cls

    def show_config(self, config: DictConfig) -> None:
        return  # the command printed the plan; the resolved config is in the dry run

    def check_cluster(self, config: DictConfig) -> None:
        return  # no resource pool: the workers are in this process, TransferQueue has one storage unit

    def agent_loop_manager(self, config: DictConfig, trainer):
        return CPUAgentLoopManager(config, trainer.cpu_server, **self.agent_loop_options)

    def before_fit(self, runner) -> None:
        # Python's full collections traverse every object the imports and setup made (torch,
        # transformers, verl: ~0.25 s each, several a step); freezing them leaves only the step's own.
        if self.freeze_gc:
            gc.collect()
            gc.freeze()

    def after_fit(self, runner, fit_seconds: float) -> None:
        write_stats(runner.trainer, runner.config, fit_seconds)

    def close(self, runner) -> None:
        gc.unfreeze()
        if runner.agent_loop_manager is not None:
            runner.agent_loop_manager.close()


def write_stats(trainer, config: DictConfig, fit_seconds: float) -> None:
    """``<trainer.default_local_dir>/cpu_backend_stats.json``: what the rollout generated, and the fit time."""
    server = trainer.cpu_server
    stats = {
        "fit_seconds": fit_seconds,
        "generated_tokens": int(server.stats["tokens"]),
        "generated_responses": int(server.stats["requests"]),
        "generation_seconds": server.stats["generate_s"],
        "global_steps": int(trainer.global_steps) - 1,
        "torch_threads": torch.get_num_threads(),
    }
    folder = str(config.trainer.default_local_dir)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, STATS_FILE), "w") as f:
        json.dump(stats, f, indent=1)


def prepare_cpu_config(config: DictConfig) -> DictConfig:
    """The settings a 2-CPU Ray needs: one TransferQueue storage unit, no rollout tensor parallelism (the
    in-process CPU server has none; verl's default TP 2 would fail the start-up layout check on the
    backend's single "GPU"), and the trainer's CPU variant: ``trainer.v1.trainer_mode`` gets the suffix
    ``_cpu`` (``gdro_sync_cpu``), registered here (:func:`register_cpu_trainer`)."""
    with open_dict(config):
        config.transfer_queue.backend.SimpleStorage.num_data_storage_units = 1
        config.trainer.device = "cpu"
        config.actor_rollout_ref.rollout.tensor_model_parallel_size = 1
        config.trainer.v1.trainer_mode = register_cpu_trainer(str(config.trainer.v1.trainer_mode))
    return config


# The gdro.backends plugin interface (setup.py's entry point ``cpu``; recipe/gdro/backend_plugins.py).
prepare_config = prepare_cpu_config
Backend = CPUBackend
