"""The SYNTHETIC learner of the GDRO simulator (DESIGN §5). It is a stand-in, not an LLM.

Model
-----
Prompt x belongs to skill s(x). Its success probability (pass@1 of one rollout) is

    p(x) = σ(θ_s(x) + d_x + φ_x)          (0 for the scenario's "unsolvable" prompts)

* θ_s  — the skill's ability, shared by all prompts of the skill (starts at 0);
* d_x  — the prompt's fixed difficulty offset, drawn from the skill's difficulty distribution;
* φ_x  — the prompt's own parameter (memorisation; starts at 0).

A response is a Bernoulli(p(x)) draw r ∈ {0, 1}; the policy is Bernoulli with logit z = θ + d + φ,
so ∂ log π(r) / ∂z = r − p. One step:

1. draw B distinct prompts (a shuffled epoch sampler, like verl's dataloader);
2. the controller decides n(x) per prompt (Σ n = B · n̄);
3. sample the rewards; compute GRPO advantages A with verl's own
   ``compute_grpo_outcome_advantage`` (one call on the whole batch, T = 1);
4. the controller returns per-response multipliers m (Prompt-GDRO; 1 otherwise);
5. policy-gradient step. Prompt x's update is

       u_x = lr / n̄ · Σ_{j ∈ x} A_j m_j [ (r_j − p(x)) + grad_noise · ξ_j ],   ξ_j ~ N(0, 1)

   (the token-mean policy gradient of the batch, scaled by B so ``lr`` is per prompt visit),
   and it is split by the transfer coefficient τ_s of the prompt's skill:

       θ_s += τ_s · Σ_{x ∈ batch, s(x)=s} u_x          φ_x += (1 − τ_s) · u_x

   τ = 1: all practice transfers to the skill; τ = 0: prompts are learned in isolation.
   ``grad_noise`` models the part of a real score function that does not point at the task:
   zero-mean, proportional to the advantage mass A·m a prompt carries, so extreme
   reweighting costs noise.

Evaluation is exact (no sampling): the expected accuracy on a held-out set of prompts drawn
from the same skills (own parameter 0, so only skill ability transfers), the worst skill's
accuracy, and pass@8 = 1 − (1 − p)^8 pooled over the held-out prompts.

Randomness is split into independent streams keyed by the seed: the dataset, the sampler, and
per-step reward draws indexed by (batch position, rollout slot). Methods run with the same seed
therefore see the same dataset, the same batches and common random numbers for the rewards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from recipe.gdro.sim_scenario import Scenario

PASS_K = 8


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _allocate_counts(freqs: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder split of ``total`` items by ``freqs``, at least one per entry."""
    share = freqs / freqs.sum()
    base = np.maximum(np.floor(share * (total - len(freqs))).astype(np.int64), 0) + 1
    rest = total - base.sum()
    if rest > 0:
        frac = share * (total - len(freqs)) - np.floor(share * (total - len(freqs)))
        base[np.argsort(-frac, kind="stable")[:rest]] += 1
    return base


def _draw_prompts(scenario: Scenario, total: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Skill id, difficulty offset and solvable flag for ``total`` prompts (shuffled order)."""
    freqs = np.array([s.frequency for s in scenario.skills], dtype=np.float64)
    counts = _allocate_counts(freqs, total)
    skill_of = np.repeat(np.arange(len(scenario.skills)), counts)
    offset = np.empty(total)
    solvable = np.ones(total, dtype=bool)
    for k, sk in enumerate(scenario.skills):
        idx = np.flatnonzero(skill_of == k)
        w = np.array([c.weight for c in sk.components])
        comp = rng.choice(len(w), size=len(idx), p=w / w.sum())
        means = np.array([c.mean for c in sk.components])[comp]
        stds = np.array([c.std for c in sk.components])[comp]
        offset[idx] = means + stds * rng.standard_normal(len(idx))
        if sk.unsolvable > 0:
            n_bad = int(round(sk.unsolvable * len(idx)))
            solvable[rng.choice(idx, size=n_bad, replace=False)] = False
    perm = rng.permutation(total)
    return skill_of[perm], offset[perm], solvable[perm]


class SyntheticLearner:
    """Skills × prompts logit model with a GRPO policy-gradient update (see the module docstring)."""

    def __init__(self, scenario: Scenario, seed: int):
        self.sc = scenario
        self.seed = int(seed)
        data_rng = np.random.default_rng([self.seed, 0])
        self.skill_of, self.offset, self.solvable = _draw_prompts(scenario, scenario.num_prompts, data_rng)
        self.eval_skill_of, self.eval_offset, self.eval_solvable = _draw_prompts(scenario, scenario.num_eval_prompts, data_rng)
        self.num_skills = len(scenario.skills)
        self.theta = np.zeros(self.num_skills)
        self.own = np.zeros(scenario.num_prompts)
        self.tau = np.asarray(scenario.skill_transfer(), dtype=np.float64)
        self.skill_freq = np.bincount(self.skill_of, minlength=self.num_skills) / scenario.num_prompts
        self._eval_count = np.bincount(self.eval_skill_of, minlength=self.num_skills).astype(np.float64)
        self._sampler_rng = np.random.default_rng([self.seed, 1])
        self._epoch: np.ndarray = np.empty(0, dtype=np.int64)
        self._cursor = 0

    # ------------------------------------------------------------------ probabilities
    def p_train(self, ids: np.ndarray | None = None) -> np.ndarray:
        ids = np.arange(self.sc.num_prompts) if ids is None else ids
        p = _sigmoid(self.theta[self.skill_of[ids]] + self.offset[ids] + self.own[ids])
        return np.where(self.solvable[ids], p, 0.0)

    def p_eval(self) -> np.ndarray:
        p = _sigmoid(self.theta[self.eval_skill_of] + self.eval_offset)
        return np.where(self.eval_solvable, p, 0.0)

    # ------------------------------------------------------------------ sampling
    def next_batch(self) -> np.ndarray:
        """B distinct prompt ids: consecutive slices of a shuffled epoch; an incomplete tail is dropped."""
        B = self.sc.batch_size
        if self._cursor + B > len(self._epoch):
            self._epoch = self._sampler_rng.permutation(self.sc.num_prompts)
            self._cursor = 0
        batch = self._epoch[self._cursor : self._cursor + B]
        self._cursor += B
        return batch

    def rollout(self, ids: np.ndarray, counts: np.ndarray, step: int) -> dict[str, np.ndarray]:
        """Sample counts[i] Bernoulli rewards for prompt ids[i]; common random numbers by (position, slot)."""
        counts = np.asarray(counts, dtype=np.int64)
        R = int(counts.sum())
        rng = np.random.default_rng([self.seed, 2, int(step)])
        # A fixed width keeps draw (i, j) the same for every method (common random numbers);
        # it only grows past 64 if some prompt gets more than 64 rollouts.
        width = max(64, int(counts.max()) if len(counts) else 1)
        U = rng.random((len(ids), width))
        Z = rng.standard_normal((len(ids), width)) if self.sc.grad_noise > 0 else None
        pos = np.repeat(np.arange(len(ids)), counts)
        starts = np.cumsum(counts) - counts
        slot = np.arange(R) - np.repeat(starts, counts)
        p = self.p_train(ids)
        rewards = (U[pos, slot] < p[pos]).astype(np.float64)
        noise = Z[pos, slot] if Z is not None else None
        return {"pos": pos, "prompt_ids": ids[pos], "rewards": rewards, "p": p, "noise": noise}

    # ------------------------------------------------------------------ advantages
    def grpo_advantages(self, rewards: np.ndarray, group_index: np.ndarray) -> np.ndarray:
        """verl's own GRPO outcome advantage on the whole batch (T = 1)."""
        from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

        scores = torch.from_numpy(rewards.astype(np.float32))[:, None]
        mask = torch.ones_like(scores)
        adv, _ = compute_grpo_outcome_advantage(scores, mask, np.asarray(group_index), norm_adv_by_std_in_grpo=self.sc.norm_adv_by_std)
        return adv[:, 0].numpy().astype(np.float64)

    # ------------------------------------------------------------------ update
    def update(self, ids: np.ndarray, roll: dict[str, np.ndarray], adv: np.ndarray, mult: np.ndarray) -> None:
        pos, r, p = roll["pos"], roll["rewards"], roll["p"]
        weight = adv * mult
        score = r - p[pos]
        if roll["noise"] is not None:
            score = score + self.sc.grad_noise * roll["noise"]
        u = (self.sc.lr / self.sc.n_mean) * np.bincount(pos, weights=weight * score, minlength=len(ids))
        sk = self.skill_of[ids]
        self.theta += np.bincount(sk, weights=self.tau[sk] * u, minlength=self.num_skills)
        self.own[ids] += (1.0 - self.tau[sk]) * u

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, Any]:
        """Exact expected metrics on the held-out prompts (and the training prompts' mean accuracy)."""
        pe = self.p_eval()
        per_skill = np.bincount(self.eval_skill_of, weights=pe, minlength=self.num_skills) / self._eval_count
        return {
            "mean_accuracy": float(pe.mean()),
            "worst_skill_accuracy": float(per_skill.min()),
            "pass_at_8": float((1.0 - (1.0 - pe) ** PASS_K).mean()),
            "train_mean_accuracy": float(self.p_train().mean()),
            "skill_accuracy": per_skill,
        }
