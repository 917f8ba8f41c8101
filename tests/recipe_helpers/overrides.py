"""Command-line overrides shared by the dry-run tests (tests/gdro/test_recipe_dry_run.py and
tests/gdro/startup/test_cluster.py)."""

from __future__ import annotations

from pathlib import Path


def paper_overrides(data: Path) -> list[str]:
    """The paper's Qwen3-8B Rollout-GDRO run on one 8-GPU node (App. A.1), with a local train file."""
    return [
        "gdro.dry_run=true",
        "gdro.rollout.enable=true",
        "actor_rollout_ref.model.path=Qwen/Qwen3-8B-Base",
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        "data.train_batch_size=256",
        "data.max_prompt_length=3200",
        "data.max_response_length=4096",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.val_kwargs.n=8",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
        "actor_rollout_ref.rollout.val_kwargs.top_p=0.8",
        "actor_rollout_ref.rollout.val_kwargs.top_k=20",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.total_training_steps=1000",
        "trainer.test_freq=50",
        "trainer.save_freq=50",
        "trainer.logger=[console]",
    ]
