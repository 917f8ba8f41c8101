"""The CPU backend (``gdro.backend=cpu``): verl 0.9.1's v1 loop training the tiny LM on CPU.

``python -m recipe.gdro.main_gdro gdro.backend=cpu ...`` runs :func:`run_cpu` instead of verl's
``run_ppo``: Ray is started with 2 CPUs (TransferQueue needs it; with one SimpleStorage unit,
a 2-CPU Ray hangs ``tq.init`` otherwise), and :class:`CPUTaskRunner` (modelled on
``recipe.gdro.task_runner.GDROTaskRunner``) builds the recipe's trainer in this process with
:class:`CPUBackendMixin` in front of it and runs verl's ``fit``.

What runs for real: ``PPOTrainerSync.fit`` / ``step`` (and the recipe's ``GDROTrainerSync``
overrides), verl's dataset / dataloader and tokenizer loading, TransferQueue, the replay buffer,
``_balance_batch``, verl's advantage estimator, KL / policy loss (``core_algos``), validation and
metrics, verl's ``AgentLoopWorkerTQ`` + ``SingleTurnAgentLoop`` + ``LLMServerClient.generate`` and
the reward loop. What is replaced: ``PPOTrainer._setup``'s GPU parts (resource pools, the
FSDP/Megatron ``RayWorkerGroup``, ``LLMServerManager`` + vLLM replicas, ``CheckpointEngineManager``,
``RewardLoopManager``'s Ray workers) by :mod:`recipe.gdro.backends.cpu_workers` and
:mod:`recipe.gdro.backends.cpu_rollout`, and ``AgentLoopManagerTQ`` by :class:`CPUAgentLoopManager`.

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
import time

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from recipe.gdro.backends.cpu_rollout import CPUAgentLoopManager, CPURolloutServer
from recipe.gdro.backends.cpu_workers import CPUActorWorkerGroup, CPUCheckpointEngine, install_in_process_workers

logger = logging.getLogger(__name__)

RAY_CPUS = 2
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
        from recipe.gdro.tinylm import model as tinylm

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


def cpu_trainer_cls(base):
    """``base`` (the recipe's or verl's trainer class) on the CPU backend."""
    return type(f"CPU{base.__name__}", (CPUBackendMixin, base), {})


class CPUTaskRunner:
    """``GDROTaskRunner`` for the CPU backend: trainer, in-process agent loop manager, ``fit``."""

    def __init__(
        self, trainer_mixins: tuple = (), own_transfer_queue: bool = True, agent_loop_options=None, freeze_gc=True
    ):
        self.trainer_mixins = tuple(trainer_mixins)  # e.g. the benchmark's timers
        self.agent_loop_options = dict(agent_loop_options or {})  # CPUAgentLoopManager's keyword arguments
        self.freeze_gc = freeze_gc
        self.own_transfer_queue = own_transfer_queue  # False: the caller has called tq.init (tests)
        self.config = None
        self.trainer = None
        self.agent_loop_manager = None

    def run(self, config: DictConfig):
        import transfer_queue as tq

        from recipe.gdro.task_runner import select_trainer_cls

        config.transfer_queue.enable = True
        OmegaConf.resolve(config)
        self.config = config
        if self.own_transfer_queue:
            tq.init(config.transfer_queue)
        succeeded = False
        try:
            cls = cpu_trainer_cls(select_trainer_cls(config))
            if self.trainer_mixins:
                cls = type(cls.__name__, (*self.trainer_mixins, cls), {})
            self.trainer = cls(config=config)
            self.trainer.init()
            self.agent_loop_manager = CPUAgentLoopManager(config, self.trainer.cpu_server, **self.agent_loop_options)
            # Python's full collections traverse every object the imports and setup made (torch,
            # transformers, verl: ~0.25 s each, several a step); freezing them leaves only the step's own.
            if self.freeze_gc:
                gc.collect()
                gc.freeze()
            start = time.perf_counter()
            self.trainer.fit(self.agent_loop_manager)
            succeeded = True
            self.write_stats(time.perf_counter() - start)
        finally:
            gc.unfreeze()
            try:
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
                if self.agent_loop_manager is not None:
                    self.agent_loop_manager.close()
            finally:
                if self.own_transfer_queue:
                    tq.close()
        return self.trainer

    def write_stats(self, fit_seconds: float) -> None:
        """``<trainer.default_local_dir>/cpu_backend_stats.json``: what the rollout generated, and the fit time."""
        server = self.trainer.cpu_server
        stats = {
            "fit_seconds": fit_seconds,
            "generated_tokens": int(server.stats["tokens"]),
            "generated_responses": int(server.stats["requests"]),
            "generation_seconds": server.stats["generate_s"],
            "global_steps": int(self.trainer.global_steps) - 1,
            "torch_threads": torch.get_num_threads(),
        }
        folder = str(self.config.trainer.default_local_dir)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, STATS_FILE), "w") as f:
            json.dump(stats, f, indent=1)


def prepare_cpu_config(config: DictConfig) -> DictConfig:
    """The settings a 2-CPU Ray needs: one TransferQueue storage unit, the v1 sync trainer, and no
    rollout tensor parallelism (the in-process CPU server has none; verl's default TP 2 would fail
    the start-up layout check on the backend's single "GPU")."""
    with open_dict(config):
        config.transfer_queue.backend.SimpleStorage.num_data_storage_units = 1
        config.trainer.device = "cpu"
        config.actor_rollout_ref.rollout.tensor_model_parallel_size = 1
    return config


def run_cpu(
    config: DictConfig, trainer_mixins: tuple = (), agent_loop_options: dict | None = None, freeze_gc: bool = True
):
    """Start Ray (2 CPUs) and train on the CPU backend in this process; returns the trainer.
    ``agent_loop_options`` (keyword arguments of :class:`CPUAgentLoopManager`) and ``freeze_gc`` exist for
    the benchmark's baseline."""
    import ray

    prepare_cpu_config(config)
    # One intra-op thread: the tiny LM's matrices are too small to split, and on a loaded 2-core machine
    # two OpenMP threads made a batched sample 5-20x slower (0.35 s vs 1.9-7.6 s for 256 x 16 tokens).
    from recipe.gdro.startup.environment import cpu_threads

    torch.set_num_threads(cpu_threads())
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
        started = True
        from verl_ext.interrupt import reinstall

        reinstall()  # ray.init replaced the command's SIGTERM handler with sys.exit(15)
    try:
        return CPUTaskRunner(trainer_mixins, agent_loop_options=agent_loop_options, freeze_gc=freeze_gc).run(config)
    finally:
        if started:
            ray.shutdown()
