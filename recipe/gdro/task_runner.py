# Copyright 2024 Bytedance Ltd. and/or its affiliates
# Copyright 2026 the verl-gdro authors (modifications: the GDRO trainer class selection)
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Adapted from verl 0.9.1's TaskRunnerV1 (verl/trainer/main_ppo.py).
"""The recipe's Ray TaskRunner, modelled on verl 0.9.1's ``TaskRunnerV1`` (verl/trainer/main_ppo.py).

The trainer is verl's own choice, ``get_trainer_cls(trainer.v1.trainer_mode)``: the recipe's default key
``gdro_sync`` is :class:`recipe.gdro.trainer.GDROTrainerSync`, registered by importing that module (done
here, so the Ray actor has it); verl's keys run verl's trainers (allowed only with both GDRO adversaries
disabled, see :func:`recipe.gdro.startup.checks.check_supported_modes`). :meth:`GDROTaskRunner.run` is the
one run of both backends: what differs is a backend object's hooks (:class:`VerlBackend` here, the Ray actor
``run_ppo`` starts; ``gdro.backend=cpu``: the lab's ``CPUBackend``, in-process, found by its entry point).
It lives in its own module (not ``__main__``) so Ray workers import it by reference.
"""

from __future__ import annotations

import os

import ray
import torch
from omegaconf import DictConfig, OmegaConf

import recipe.gdro.trainer  # noqa: F401 - registers "gdro_sync" in verl's trainer registry


def select_trainer_cls(config: DictConfig):
    """verl's registry lookup of ``trainer.v1.trainer_mode`` (what verl's TaskRunnerV1 does)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    return get_trainer_cls(config.trainer.v1.trainer_mode)


RESOLVED_CONFIG_FILE = "resolved_config.yaml"


class VerlBackend:
    """The hooks of :meth:`GDROTaskRunner.run` on verl's path (a Ray actor, verl's workers): verl's TaskRunnerV1."""

    own_transfer_queue = True

    def trainer_cls(self, cls):
        return cls

    def show_config(self, config: DictConfig) -> None:
        """The resolved config as YAML in the run's folder (``RESOLVED_CONFIG_FILE``), one line naming it (verl's
        TaskRunnerV1 prints it whole: about a thousand lines; the launch printed its plan already)."""
        from verl_ext.atomic import atomic_replace

        path = os.path.join(str(config.trainer.default_local_dir), RESOLVED_CONFIG_FILE)
        with atomic_replace(path, "w") as f:
            f.write(OmegaConf.to_yaml(config, resolve=True))
        print(f"[gdro] the resolved config: {path}", flush=True)

    def check_cluster(self, config: DictConfig, runner_cpus: int | None = None) -> None:
        """TransferQueue places one 1-CPU actor per storage unit and verl's resource pool 3 CPUs per GPU: refuse
        a layout this Ray cluster cannot place, rather than waiting forever (cluster.check_transfer_queue_cpus).
        ``runner_cpus``: the CPUs the TaskRunner holds (default: 1 inside its actor, 0 elsewhere); the launch
        checks on the driver, before the actor starts, with 1."""
        from recipe.gdro.startup.cluster import check_transfer_queue_cpus

        if runner_cpus is None:
            in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
            runner_cpus = 1 if in_actor else 0
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")] if ray.is_initialized() else None
        check_transfer_queue_cpus(
            config, ray.cluster_resources().get("CPU", 0), runner_cpus=runner_cpus, node_resources=nodes
        )

    def agent_loop_manager(self, config: DictConfig, trainer):
        """Same as verl's TaskRunnerV1: ``rollout.agent.agent_loop_manager_class`` or AgentLoopManagerTQ."""
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ
        from verl.utils.import_utils import load_class_from_fqn

        manager_class_fqn = config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
        if manager_class_fqn:
            agent_loop_manager_cls = load_class_from_fqn(manager_class_fqn, "AgentLoopManager")
        else:
            agent_loop_manager_cls = AgentLoopManagerTQ
        return agent_loop_manager_cls.create(
            config=config,
            llm_client=trainer.get_llm_client(),
            teacher_client=trainer.get_teacher_client(),
            reward_loop_worker_handles=trainer.get_reward_handles(),
        )

    def before_fit(self, runner) -> None:
        return

    def after_fit(self, runner, fit_seconds: float) -> None:
        return

    def close(self, runner) -> None:
        return


class GDROTaskRunner:
    """Builds the trainer and the agent loop manager and runs ``fit`` (inside Ray on verl's path)."""

    def __init__(self, backend=None):
        self.backend = backend if backend is not None else VerlBackend()
        self.config = None
        self.trainer = None
        self.agent_loop_manager = None

    def init_agent_loop_manager(self):
        self.agent_loop_manager = self.backend.agent_loop_manager(self.config, self.trainer)

    def run(self, config: DictConfig):
        """verl's TaskRunnerV1.run, with the backend's hooks. Returns nothing, as verl's does: on verl's path
        this is a Ray actor's method, whose result Ray pickles (a trainer holds a live dataloader iterator,
        which cannot be); in-process callers read :attr:`trainer`."""
        import time

        import transfer_queue as tq
        from verl.utils.logging_utils import configure_verl_logging

        from recipe.gdro.logs import drop_lines, install_log_filters

        backend = self.backend
        configure_verl_logging()
        install_log_filters()
        trainer_cls = backend.trainer_cls(select_trainer_cls(config))
        config.transfer_queue.enable = True
        backend.show_config(config)
        OmegaConf.resolve(config)
        self.config = config
        backend.check_cluster(config)
        if backend.own_transfer_queue:
            tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = trainer_cls(config=config)
            self.trainer.init()
            self.init_agent_loop_manager()
            backend.before_fit(self)
            start = time.perf_counter()
            with drop_lines():  # verl's raw validation dictionaries: the run's summary replaces them (recipe.gdro.logs)
                self.trainer.fit(self.agent_loop_manager)
            succeeded = True
            backend.after_fit(self, time.perf_counter() - start)
        finally:
            try:
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
                backend.close(self)
            finally:
                if backend.own_transfer_queue:
                    tq.close()


# The Ray actor verl's run_ppo starts (TaskRunnerV1 is declared the same way).
GDROTaskRunnerActor = ray.remote(GDROTaskRunner)

RAY_CPUS = 2


def run_cpu(
    config: DictConfig,
    trainer_mixins: tuple = (),
    agent_loop_options: dict | None = None,
    freeze_gc: bool = True,
    ray_address: str | None = None,
):
    """``gdro.backend=cpu``: start Ray (2 CPUs; TransferQueue needs it), or join the cluster at ``ray_address``
    (passing it no resources), and run :class:`GDROTaskRunner` in this process with the CPU backend's hooks;
    returns the trainer. A failed ``ray.init`` is a ``RayJoinError`` (one line). ``agent_loop_options``
    (keyword arguments of ``CPUAgentLoopManager``) and ``freeze_gc`` exist for the benchmark's baseline."""
    from recipe.gdro.backend_plugins import in_process_backend

    plugin = in_process_backend(config)  # the gdro.backends entry point of gdro.backend (setup.py)
    plugin.prepare_config(config)
    # One intra-op thread: the tiny LM's matrices are too small to split, and on a loaded 2-core machine
    # two OpenMP threads made a batched sample 5-20x slower (0.35 s vs 1.9-7.6 s for 256 x 16 tokens).
    from recipe.gdro.startup.environment import cpu_threads

    torch.set_num_threads(cpu_threads())  # GDRO_CPU_THREADS, checked by the start-up checks
    started = False
    if not ray.is_initialized():
        from verl_ext.interrupt import EndAtSignal, reinstall

        # joining a cluster (ray_address): its nodes declare their resources, Ray refuses num_cpus there
        kwargs = {"address": ray_address} if ray_address else {"num_cpus": RAY_CPUS, "include_dashboard": False}
        during = EndAtSignal("gdro", "while ray.init was connecting to Ray; no training had started").start()
        try:
            ray.init(log_to_driver=False, **kwargs)
        except SystemExit as e:  # Ray's own SIGTERM handler: the same end as the signal's
            during.exit_if_signalled(e)
            raise
        except Exception as e:  # noqa: BLE001 - the cluster refused or never answered: one line (main_gdro)
            from recipe.gdro.startup.ray_address import RayJoinError

            raise RayJoinError.from_init_error(config, e, ray_address) from e
        finally:
            during.stop()
        started = True
        reinstall()  # ray.init replaced the command's SIGTERM handler with sys.exit(15)
    try:
        backend = plugin.Backend(trainer_mixins, agent_loop_options=agent_loop_options, freeze_gc=freeze_gc)
        runner = GDROTaskRunner(backend)
        runner.run(config)
        return runner.trainer
    finally:
        if started:
            ray.shutdown()
