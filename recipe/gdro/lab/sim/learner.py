"""The SYNTHETIC learners of the GDRO simulator. They are stand-ins, not LLMs.

Two learners share the data model, the sampler, the rollouts and verl's GRPO advantage; they
differ in what a policy-gradient step does to the policy.

Data model (both learners)
--------------------------
Prompt x belongs to skill s(x) and has a fixed difficulty offset d_x drawn from its skill's
difficulty distribution; a scenario may mark a share of prompts unsolvable (p ≡ 0). A response is
a Bernoulli(p(x)) draw r ∈ {0, 1}; the policy is Bernoulli with logit z(x), so
∂ log π(r) / ∂z = r − p. One step:

1. draw B distinct prompts (a shuffled epoch sampler, like verl's dataloader);
2. the controller decides n(x) per prompt (Σ n = B · n̄);
3. sample the rewards; compute GRPO advantages A with verl's own
   ``compute_grpo_outcome_advantage`` (one call on the whole batch, T = 1);
4. the controller returns per-response multipliers m (Prompt-GDRO; 1 otherwise);
5. a policy-gradient step with step size ``lr`` (per prompt visit). The task part of prompt x's
   update is

       g_x = lr / n̄ · Σ_{j ∈ x} A_j m_j (r_j − p(x))

   and the noise that comes with it scales with the advantage mass the prompt carries,

       ε_x = lr / n̄ · σ · sqrt(Σ_{j ∈ x} (A_j m_j)²) · ζ_x,     ζ_x ~ N(0, 1) (or N(0, I_D))

   (σ = ``grad_noise``: the part of a real score function that does not point at the task; the sum
   of per-response N(0, 1) noise weighted by A_j m_j). Extreme reweighting therefore costs noise.

``--learner shared`` (the default): shared representation, interference, capacity, curvature
------------------------------------------------------------------------------------------------
The skills read one shared weight vector w ∈ R^D through fixed unit feature vectors e_s:

    z(x) = b + e_s(x) · w + d_x + φ_x

* e_s = normalise(sqrt(ρ) c + sqrt(1 − ρ) g_s) with c, g_s ~ N(0, I_D / D) drawn per seed;
  ρ = ``learner.feature_overlap``. With D = ``learner.rep_dim`` < S skills the features cannot be
  orthogonal: practising skill a moves skill b's ability by (e_a · e_b) times the step, which is
  negative for some pairs (interference, forgetting).
* the update of a step, with τ_s the skill's transfer coefficient:

      Δw = Σ_{x ∈ batch} τ_s(x) (g_x e_s(x) + ε_x),       ε_x ∈ R^D (isotropic: noise points anywhere)
      φ_x ← φ_x + (1 − τ_s(x)) (g_x + ε'_x)
      w ← Π_C((1 − λ) w + Δw),       Π_C = projection onto the ball ‖w‖ ≤ C

  λ = ``learner.forgetting`` (what is not practised decays), C = ``learner.capacity`` (a capacity
  limit: once ‖w‖ = C, raising one skill's ability must lower another's);
* curvature: b is a general-competence offset shared by every prompt (starts at 0),

      b ← (1 − ρ_b) b − κ ‖Δw‖²,        κ = ``learner.curvature``, ρ_b = ``learner.recovery``

  the second-order term of a smooth objective (a step Δ gains g·Δ to first order and loses
  (L/2)‖Δ‖²): the gain of a step grows like lr, its damage like lr², so a too-large (or
  noise-inflated) step hurts and GRPO has an interior best learning rate.

``--learner logistic`` (the earlier learner): per-skill abilities, monotone, noise only if set
-----------------------------------------------------------------------------------------------
    z(x) = θ_s(x) + d_x + φ_x,    θ_s += Σ_{x: s(x)=s} τ_s (g_x + ε_x),    φ_x += (1 − τ_s)(g_x + ε_x)

Skills never interfere, nothing is forgotten, and a bigger step never hurts.

Evaluation is exact (no sampling): the expected accuracy on a held-out set of prompts drawn
from the same skills (own parameter 0, so only the skills' abilities transfer), the worst skill's
accuracy, and pass@8 = 1 − (1 − p)^8 pooled over the held-out prompts.

Randomness is split into independent streams keyed by the seed: the dataset (and the shared
learner's features), the sampler, and per-step reward and noise draws indexed by (batch position,
rollout slot). Methods run with the same seed therefore see the same dataset, the same batches
and common random numbers for the rewards and the noise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from recipe.gdro.lab.sim.scenario import Scenario

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


def _draw_prompts(
    scenario: Scenario, total: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


class _LearnerBase:
    """Data, sampler, rollouts, verl's GRPO advantage and exact evaluation; subclasses define the policy."""

    name = "base"

    def __init__(self, scenario: Scenario, seed: int, lr: float | None = None):
        self.sc = scenario
        self.seed = int(seed)
        self.lr = float(scenario.lr if lr is None else lr)
        data_rng = np.random.default_rng([self.seed, 0])
        self.skill_of, self.offset, self.solvable = _draw_prompts(scenario, scenario.num_prompts, data_rng)
        self.eval_skill_of, self.eval_offset, self.eval_solvable = _draw_prompts(
            scenario, scenario.num_eval_prompts, data_rng
        )
        self.num_skills = len(scenario.skills)
        self.own = np.zeros(scenario.num_prompts)
        self.tau = np.asarray(scenario.skill_transfer(), dtype=np.float64)
        self.skill_freq = np.bincount(self.skill_of, minlength=self.num_skills) / scenario.num_prompts
        self._eval_count = np.bincount(self.eval_skill_of, minlength=self.num_skills).astype(np.float64)
        # Response-length model per skill (scenario ``length``): mean tokens if correct / wrong, spread σ.
        self.len_correct = np.array([sk.length.correct for sk in scenario.skills], dtype=np.float64)
        self.len_wrong = np.array([sk.length.wrong for sk in scenario.skills], dtype=np.float64)
        self.len_spread = np.array([sk.length.spread for sk in scenario.skills], dtype=np.float64)
        self._sampler_rng = np.random.default_rng([self.seed, 1])
        self._epoch: np.ndarray = np.empty(0, dtype=np.int64)
        self._cursor = 0

    # ------------------------------------------------------------------ policy (subclasses)
    def ability(self) -> np.ndarray:
        """Per-skill logit shift (everything in z(x) except d_x and φ_x)."""
        raise NotImplementedError

    def _apply(self, ids: np.ndarray, g: np.ndarray, mass: np.ndarray, zeta: np.ndarray) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ probabilities
    def p_train(self, ids: np.ndarray | None = None) -> np.ndarray:
        ids = np.arange(self.sc.num_prompts) if ids is None else ids
        p = _sigmoid(self.ability()[self.skill_of[ids]] + self.offset[ids] + self.own[ids])
        return np.where(self.solvable[ids], p, 0.0)

    def p_eval(self) -> np.ndarray:
        p = _sigmoid(self.ability()[self.eval_skill_of] + self.eval_offset)
        return np.where(self.eval_solvable, p, 0.0)

    def true_variance(self, ids: np.ndarray) -> np.ndarray:
        """Each prompt's TRUE reward variance p(1 − p) under the current policy (the per-prompt oracle)."""
        p = self.p_train(ids)
        return p * (1.0 - p)

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
        pos = np.repeat(np.arange(len(ids)), counts)
        starts = np.cumsum(counts) - counts
        slot = np.arange(R) - np.repeat(starts, counts)
        p = self.p_train(ids)
        rewards = (U[pos, slot] < p[pos]).astype(np.float64)
        # Noise by batch position from its own stream: the same for every method and both learners.
        zeta = np.random.default_rng([self.seed, 3, int(step)]).standard_normal((len(ids), _NOISE_WIDTH))
        lengths = self.response_lengths(ids, pos, slot, rewards, step, width)
        return {"pos": pos, "prompt_ids": ids[pos], "rewards": rewards, "p": p, "zeta": zeta, "lengths": lengths}

    def response_lengths(
        self, ids: np.ndarray, pos: np.ndarray, slot: np.ndarray, rewards: np.ndarray, step: int, width: int
    ) -> np.ndarray:
        """Tokens per response: the skill's correct / wrong mean × exp(σ z - σ²/2), rounded, in [1, max].

        z comes from its own stream by (position, slot), so every method sees the same draws (common
        random numbers); a response at ``max_response_length`` is a truncated one.
        """
        sk = self.skill_of[ids][pos]
        mean = np.where(rewards > 0.5, self.len_correct[sk], self.len_wrong[sk])
        sigma = self.len_spread[sk]
        z = np.random.default_rng([self.seed, 4, int(step)]).standard_normal((len(ids), width))[pos, slot]
        raw = np.rint(mean * np.exp(sigma * z - 0.5 * sigma**2))
        return np.clip(raw, 1.0, float(self.sc.max_response_length))

    # ------------------------------------------------------------------ advantages
    def grpo_advantages(self, rewards: np.ndarray, group_index: np.ndarray) -> np.ndarray:
        """verl's own GRPO outcome advantage on the whole batch (T = 1)."""
        from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

        scores = torch.from_numpy(rewards.astype(np.float32))[:, None]
        mask = torch.ones_like(scores)
        adv, _ = compute_grpo_outcome_advantage(
            scores, mask, np.asarray(group_index), norm_adv_by_std_in_grpo=self.sc.norm_adv_by_std
        )
        return adv[:, 0].numpy().astype(np.float64)

    # ------------------------------------------------------------------ update
    def update(self, ids: np.ndarray, roll: dict[str, np.ndarray], adv: np.ndarray, mult: np.ndarray) -> None:
        """One policy-gradient step: g_x (task part) and the advantage mass behind the noise ε_x."""
        pos, r, p = roll["pos"], roll["rewards"], roll["p"]
        weight = adv * mult
        scale = self.lr / self.sc.n_mean
        g = scale * np.bincount(pos, weights=weight * (r - p[pos]), minlength=len(ids))
        mass = scale * self.sc.grad_noise * np.sqrt(np.bincount(pos, weights=weight * weight, minlength=len(ids)))
        self._apply(ids, g, mass, roll["zeta"])

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


_NOISE_WIDTH = 33  # ζ'_x (column 0) and up to 32 dimensions of ζ_x


class LogisticLearner(_LearnerBase):
    """Per-skill abilities θ_s, no interference, no forgetting (``--learner logistic``)."""

    name = "logistic"

    def __init__(self, scenario: Scenario, seed: int, lr: float | None = None):
        super().__init__(scenario, seed, lr)
        self.theta = np.zeros(self.num_skills)

    def ability(self) -> np.ndarray:
        return self.theta

    def _apply(self, ids: np.ndarray, g: np.ndarray, mass: np.ndarray, zeta: np.ndarray) -> None:
        u = g + mass * zeta[:, 0]
        sk = self.skill_of[ids]
        self.theta += np.bincount(sk, weights=self.tau[sk] * u, minlength=self.num_skills)
        self.own[ids] += (1.0 - self.tau[sk]) * u


class SharedLearner(_LearnerBase):
    """Shared representation w ∈ R^D read through skill features (``--learner shared``, the default)."""

    name = "shared"

    def __init__(self, scenario: Scenario, seed: int, lr: float | None = None):
        super().__init__(scenario, seed, lr)
        lp = scenario.learner
        self.D = int(lp.rep_dim or max(2, (self.num_skills + 1) // 2))
        if self.D > _NOISE_WIDTH - 1:
            raise ValueError(f"learner.rep_dim={self.D} must be <= {_NOISE_WIDTH - 1}")
        rng = np.random.default_rng([self.seed, 4])
        c = rng.standard_normal(self.D) / np.sqrt(self.D)
        gs = rng.standard_normal((self.num_skills, self.D)) / np.sqrt(self.D)
        e = np.sqrt(lp.feature_overlap) * c[None, :] + np.sqrt(1.0 - lp.feature_overlap) * gs
        self.features = e / np.linalg.norm(e, axis=1, keepdims=True)
        self.w = np.zeros(self.D)
        self.b = 0.0
        self.lp = lp

    def ability(self) -> np.ndarray:
        return self.b + self.features @ self.w

    def _apply(self, ids: np.ndarray, g: np.ndarray, mass: np.ndarray, zeta: np.ndarray) -> None:
        sk = self.skill_of[ids]
        t = self.tau[sk]
        noise = (t * mass)[:, None] * zeta[:, 1 : 1 + self.D]
        dw = (t * g) @ self.features[sk] + noise.sum(axis=0)
        self.own[ids] += (1.0 - t) * (g + mass * zeta[:, 0])
        w = (1.0 - self.lp.forgetting) * self.w + dw
        norm = float(np.linalg.norm(w))
        if norm > self.lp.capacity:
            w *= self.lp.capacity / norm
        self.w = w
        self.b = (1.0 - self.lp.recovery) * self.b - self.lp.curvature * float(dw @ dw)


LEARNERS = {"shared": SharedLearner, "logistic": LogisticLearner}
DEFAULT_LEARNER = "shared"
SyntheticLearner = SharedLearner  # the default learner


def make_learner(name: str, scenario: Scenario, seed: int, lr: float | None = None) -> _LearnerBase:
    if name not in LEARNERS:
        raise ValueError(f"unknown learner {name!r}; choose from {', '.join(LEARNERS)}")
    return LEARNERS[name](scenario, seed, lr)
