"""Prompt-GDRO: the data adversary, an EMA-debiased EXP3P over difficulty bins.

Paper Eq. 12-16 (App. A.2.1). At step t, for every group b present in the batch:

    ℓ̄_t(b) = mean of the prompt-level loss ℓ(x) over batch prompts in b            (Eq. 12)
    q̂_t(b) = max(|B_{b,t}| / |B_t|, floor)          realised batch share          (Eq. 13)
    S_t(b) = (1 - β) S_{t-1}(b) + β ℓ̄_t(b) / q̂_t(b)   EMA of the debiased loss      (Eq. 14)
    ω_t(b) = exp(η · clip(S_t(b), -C, C))                                          (Eq. 15)
    q_t(b) = (1 - γ) ω_t(b) / Σ_j ω_t(j) + γ / K                                   (Eq. 16)

Groups absent from the batch keep their score. Each response's GRPO advantage is multiplied by
its prompt's group weight q_t(b), rescaled to mean 1 over the batch's responses and capped at
ω_max (as in the authors' code); scaling a PPO advantage by a positive constant scales its
clipped surrogate term by the same constant, so this is done on the driver.

Dividing by q̂ is EXP3's importance weight ℓ/q: without it a common bin's loss would count more
simply because the bin is common; with it a rare, consistently hard bin can out-score a common
one. The weights applied at step t already include step t's losses (the released code reads them
after the actor step, one step late).

The per-prompt loss ℓ(x) is pluggable (the paper's PPO-surrogate signal is ≈ 0 in expectation
under GRPO's zero-mean group advantages, see DESIGN §2.2):

    failure_rate        ℓ = 1 - p̂                 (this visit's pass rate p̂ = correct / n)
    learnability        ℓ = p̂ (1 - p̂)             (Bernoulli variance: GRPO's signal strength)
    mean_abs_advantage  ℓ = mean_i |A_i|          (the advantage mass the prompt produced)
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from verl_ext.config import PromptGDROConfig


def prompt_loss(
    signal: str,
    correct: np.ndarray,
    rollouts: np.ndarray,
    mean_abs_advantage: Optional[np.ndarray] = None,
) -> np.ndarray:
    """The per-prompt loss ℓ(x) for the chosen ``signal`` (see the module docstring)."""
    p = np.asarray(correct, dtype=np.float64) / np.maximum(np.asarray(rollouts, dtype=np.float64), 1.0)
    if signal == "failure_rate":
        return 1.0 - p
    if signal == "learnability":
        return p * (1.0 - p)
    if signal == "mean_abs_advantage":
        if mean_abs_advantage is None:
            raise ValueError("prompt.loss_signal=mean_abs_advantage needs the per-prompt mean |advantage|")
        return np.asarray(mean_abs_advantage, dtype=np.float64)
    raise ValueError(f"unknown prompt.loss_signal {signal!r}")


class PromptGDRO:
    """EMA-debiased EXP3P over ``num_groups`` bins producing advantage multipliers."""

    def __init__(self, config: PromptGDROConfig, num_groups: int):
        self.config = config
        self.num_groups = int(num_groups)
        self.scores = np.zeros(self.num_groups, dtype=np.float64)  # S(b)
        self.num_nonfinite_losses = 0
        self.steps = 0

    def group_probabilities(self) -> np.ndarray:
        """q(b) of Eq. 16: a proper distribution over groups, each >= γ/K."""
        c = self.config
        logits = c.eta * np.clip(self.scores, -c.score_clip, c.score_clip)
        w = np.exp(logits - logits.max())  # shift-invariant, never overflows
        return (1.0 - c.gamma) * w / w.sum() + c.gamma / self.num_groups

    def update(self, groups: Any, losses: Any) -> np.ndarray:
        """Fold one batch of per-prompt losses (one entry per prompt) into the scores; return q_t."""
        g = np.asarray(groups, dtype=np.int64)
        loss = np.asarray(losses, dtype=np.float64)
        if g.shape != loss.shape:
            raise ValueError(f"prompt_gdro.update: groups {g.shape} and losses {loss.shape} differ")
        if len(g) == 0:
            return self.group_probabilities()
        if g.min() < 0 or g.max() >= self.num_groups:
            raise ValueError(f"prompt_gdro.update: group ids must lie in [0, {self.num_groups})")
        finite = np.isfinite(loss)
        self.num_nonfinite_losses += int(np.count_nonzero(~finite))
        # A NaN/inf loss is dropped from its bin's mean rather than poisoning the score.
        count = np.bincount(g[finite], minlength=self.num_groups).astype(np.float64)
        total = np.bincount(g[finite], weights=loss[finite], minlength=self.num_groups)
        present = count > 0
        share = np.maximum(count / max(count.sum(), 1.0), self.config.share_floor)
        mean_loss = np.divide(total, count, out=np.full(self.num_groups, np.nan), where=present)
        beta = self.config.beta
        self.scores[present] = (1.0 - beta) * self.scores[present] + beta * mean_loss[present] / share[present]
        self.steps += 1
        return self.group_probabilities()

    def response_multipliers(self, response_groups: Any, scale: Optional[np.ndarray] = None) -> np.ndarray:
        """Per-response advantage multipliers: q(b_i), rescaled to mean 1 over the responses, capped.

        ``scale`` (optional, per response) is applied before normalisation; joint mode passes
        n̄ / n(x) there. The result is positive, finite and at most ``weight_cap``.
        """
        g = np.asarray(response_groups, dtype=np.int64)
        if len(g) == 0:
            return np.ones(0)
        raw = self.group_probabilities()[g]
        if scale is not None:
            raw = raw * np.asarray(scale, dtype=np.float64)
        raw = raw / raw.mean()
        return np.minimum(raw, self.config.weight_cap)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scores": self.scores.copy(),
            "num_nonfinite_losses": self.num_nonfinite_losses,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scores = np.asarray(state["scores"], dtype=np.float64)
        if scores.shape != (self.num_groups,):
            raise ValueError(f"prompt_gdro checkpoint has {scores.shape[0]} groups; this run has {self.num_groups}")
        self.scores = scores.copy()
        self.num_nonfinite_losses = int(state["num_nonfinite_losses"])
        self.steps = int(state["steps"])
