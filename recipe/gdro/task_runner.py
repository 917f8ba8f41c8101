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

The only difference is the trainer class: ``trainer.v1.trainer_mode=sync`` runs
:class:`recipe.gdro.trainer.GDROTrainerSync`; the other v1 modes (allowed only with both GDRO
adversaries disabled, see :func:`recipe.gdro.startup.checks.check_supported_modes`) run verl's own class.
It lives in its own module (not ``__main__``) so Ray workers import it by reference.
"""

from __future__ import annotations

from pprint import pprint

import ray
from omegaconf import DictConfig, OmegaConf


def select_trainer_cls(config: DictConfig):
    """The trainer class for ``trainer.v1.trainer_mode``: GDRO's for sync, verl's otherwise."""
    mode = config.trainer.v1.trainer_mode
    if mode == "sync":
        from recipe.gdro.trainer import GDROTrainerSync

        return GDROTrainerSync
    from verl.trainer.ppo.v1 import get_trainer_cls

    return get_trainer_cls(mode)


class GDROTaskRunner:
    """Builds the trainer and the agent loop manager inside Ray and runs ``fit``."""

    def __init__(self):
        self.config = None
        self.trainer = None
        self.agent_loop_manager = None

    def init_agent_loop_manager(self):
        """Same as verl's TaskRunnerV1: ``rollout.agent.agent_loop_manager_class`` or AgentLoopManagerTQ."""
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ
        from verl.utils.import_utils import load_class_from_fqn

        manager_class_fqn = self.config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
        if manager_class_fqn:
            agent_loop_manager_cls = load_class_from_fqn(manager_class_fqn, "AgentLoopManager")
        else:
            agent_loop_manager_cls = AgentLoopManagerTQ
        self.agent_loop_manager = agent_loop_manager_cls.create(
            config=self.config,
            llm_client=self.trainer.get_llm_client(),
            teacher_client=self.trainer.get_teacher_client(),
            reward_loop_worker_handles=self.trainer.get_reward_handles(),
        )

    def run(self, config: DictConfig):
        import transfer_queue as tq
        from verl.utils.logging_utils import configure_verl_logging

        configure_verl_logging()
        trainer_cls = select_trainer_cls(config)
        config.transfer_queue.enable = True
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        self.config = config

        # TransferQueue places one 1-CPU actor per storage unit and verl's resource pool 3 CPUs per GPU: refuse
        # a layout this Ray cluster cannot place, rather than waiting forever (cluster.check_transfer_queue_cpus).
        from recipe.gdro.startup.cluster import check_transfer_queue_cpus

        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")] if ray.is_initialized() else None
        check_transfer_queue_cpus(
            config, ray.cluster_resources().get("CPU", 0), runner_cpus=1 if in_actor else 0, node_resources=nodes
        )
        tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = trainer_cls(config=config)
            self.trainer.init()
            self.init_agent_loop_manager()
            self.trainer.fit(self.agent_loop_manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()


# The Ray actor verl's run_ppo starts (TaskRunnerV1 is declared the same way).
GDROTaskRunnerActor = ray.remote(GDROTaskRunner)
