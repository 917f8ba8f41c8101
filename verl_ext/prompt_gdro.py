"""Prompt-GDRO: the data adversary, an EMA-debiased EXP3P over difficulty bins.

Paper Eq. 12-16 (App. A.2.1). At step t, for every group b present in the batch:

    ℓ̄_t(b) = mean of the prompt-level loss ℓ(x) over batch prompts in b            (Eq. 12)
    q̂_t(b) = max(|B_{b,t}| / |B_t|, floor)          realised batch share          (Eq. 13)
    S_t(b) = (1 - β) S_{t-1}(b) + β ℓ̄_t(b) / q̂_t(b)   EMA of the debiased loss      (Eq. 14)
    ω_t(b) = exp(η · clip(S_t(b), -C, C))                                          (Eq. 15)
    q_t(b) = (1 - γ) ω_t(b) / Σ_j ω_t(j) + γ / K                                   (Eq. 16)

Groups absent from the batch keep their score. Two departures from Eq. 14 by default: a bin's
step is scaled by its evidence c_b / (c_b + k0) (c_b prompts in the batch; off with
``min_group_prompts=0``), so a bin holding one prompt cannot swing its weight in one step, and a
bin's first observation sets its score (shrunk toward the batch's reference level) instead of
moving it from S_0 = 0 (off with ``score_init=zero``; see :meth:`PromptGDRO.update`). Both off is
Eq. 14 as printed.

Each response's GRPO advantage is multiplied by its prompt's group weight q_t(b), normalised
(``normalize``) and capped at ω_max. ``all_responses`` rescales to mean 1 over all responses (the
authors' code); since all-correct / all-wrong groups carry zero advantage, that inflates the
advantage mass Σ|A·m| / Σ|A| (2.1-2.7 in the simulator study, docs/controllers.md), i.e. acts as a larger
step size. ``advantage_mass`` rescales so Σ|A·m| = Σ|A|: only the direction changes. Scaling a
PPO advantage by a positive constant scales its clipped surrogate term by the same constant, so
this is done on the driver.

Dividing by q̂ is EXP3's importance weight ℓ/q, but ℓ̄(b) is already a *mean* over the bin's
prompts, so the division does not remove a bias toward common bins: it adds a 1/share bias toward
rare ones. At equal loss 0.2 a bin with 8 of 256 prompts gets 20.9× the common bin's q (groups:
the two bins and ``unseen``); with 4× lower loss (0.05 against 0.2) it still gets 2.45×
(docs/controllers.md; pinned in tests). It is the paper's formula, so it is kept.

By default the weights applied at step t already include step t's losses; ``lagged=true``
uses the scores before this step's update (the released code reads them after the actor step).

The per-prompt loss ℓ(x) is pluggable (the paper's PPO-surrogate signal is ≈ 0 in expectation
under GRPO's zero-mean group advantages; docs/controllers.md):

    failure_rate        ℓ = 1 - p̂                 (this visit's pass rate p̂ = correct / n)
    learnability        ℓ = p̂ (1 - p̂)             (Bernoulli variance: GRPO's signal strength)
                        ℓ = p̂ (1 - p̂) n/(n-1)     (``unbiased``; joint mode, where n varies)
    mean_abs_advantage  ℓ = mean_i |A_i|          (the advantage mass the prompt produced)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verl_ext.config import PromptGDROConfig


def prompt_loss(
    signal: str,
    correct: np.ndarray,
    rollouts: np.ndarray,
    mean_abs_advantage: np.ndarray | None = None,
    unbiased: bool = False,
) -> np.ndarray:
    """The per-prompt loss ℓ(x) for the chosen ``signal`` (see the module docstring).

    ``unbiased`` applies to ``learnability``: E[p̂(1-p̂)] = p(1-p)(1-1/n), so with per-prompt
    counts n (Rollout-GDRO) the plain form reports a prompt given 2 rollouts at half its loss and
    the allocation would steer Prompt-GDRO; p̂(1-p̂) n/(n-1) is unbiased for every n >= 2.
    """
    n = np.maximum(np.asarray(rollouts, dtype=np.float64), 1.0)
    p = np.asarray(correct, dtype=np.float64) / n
    if signal == "failure_rate":
        return 1.0 - p
    if signal == "learnability":
        return p * (1.0 - p) * (n / np.maximum(n - 1.0, 1.0) if unbiased else 1.0)
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
        self.observed = np.zeros(self.num_groups, dtype=bool)  # S(b) holds at least one observation
        self.num_nonfinite_losses = 0
        self.steps = 0

    def group_probabilities(self) -> np.ndarray:
        """q(b) of Eq. 16: a proper distribution over groups, each >= γ/K."""
        c = self.config
        logits = c.eta * np.clip(self.scores, -c.score_clip, c.score_clip)
        w = np.exp(logits - logits.max())  # shift-invariant, never overflows
        return (1.0 - c.gamma) * w / w.sum() + c.gamma / self.num_groups

    def update(self, groups: Any, losses: Any) -> np.ndarray:
        """Fold one batch of per-prompt losses (one entry per prompt) into the scores; return q_t.

        With x_b = ℓ̄_t(b) / q̂_t(b) the debiased observation of Eq. 14 and c_b the bin's prompt
        count in the batch, the evidence weight w_b = c_b / (c_b + k0) (k0 = ``min_group_prompts``)
        sets the step:

            S_t(b) = S_{t-1}(b) + β w_b (x_b - S_{t-1}(b))      (Eq. 14 when k0 = 0)
            S_t(b) = S_ref + w_b (x_b - S_ref)                   at the bin's first observation

        With ``score_init=zero`` there is no first-observation rule: S_0(b) = 0 and every
        observation is the EMA step (with k0 = 0, exactly Eq. 14). Otherwise S_ref is the
        prompt-count-weighted mean score of the batch's already observed bins
        (Σ_b w_b x_b / Σ_b w_b over the batch when there are none). So a bin first seen late
        starts at its own level rather than at 0 (which under-weights it for ~1/β steps), and a
        bin holding c prompts moves its score by at most β w_b |x_b - S| per step (w_b |x_b - S_ref|
        at first sight), with x_b <= ℓ_max / share_floor: one prompt can no longer swing a weight.
        """
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
        if not present.any():
            self.steps += 1
            return self.group_probabilities()
        share = np.maximum(count / count.sum(), self.config.share_floor)
        x = total[present] / count[present] / share[present]  # debiased observation ℓ̄/q̂ (Eq. 13-14)
        w = count[present] / (count[present] + self.config.min_group_prompts)
        old = self.scores[present]
        first = ~self.observed[present]
        if self.config.score_init == "zero":  # Eq. 14 from S_0(b) = 0: no first-observation rule
            first = np.zeros_like(first)
        # Reference level for a first observation: the current scores of the batch's known bins
        # (weighted by their prompt counts), or this batch's evidence-weighted x at the start.
        known = ~first
        if known.any():
            s_ref = float((count[present][known] * old[known]).sum() / count[present][known].sum())
        else:
            s_ref = float((w * x).sum() / w.sum())
        start = np.where(first, s_ref, old)
        rate = np.where(first, w, self.config.beta * w)
        self.scores[present] = start + rate * (x - start)
        self.observed |= present
        self.steps += 1
        return self.group_probabilities()

    def response_multipliers(
        self,
        response_groups: Any,
        scale: np.ndarray | None = None,
        abs_advantage: np.ndarray | None = None,
        probabilities: np.ndarray | None = None,
    ) -> np.ndarray:
        """Per-response advantage multipliers m_i ∝ q(b_i), normalised per ``normalize``, capped at ω_max.

        ``scale`` (optional, per response) is applied before normalisation; joint mode passes
        n̄ / n(x) there. ``probabilities`` overrides q (``lagged`` passes the pre-update q).

        * ``all_responses``: mean(m) = 1 over the batch's responses, then the cap (the released
          code's; the cap can leave the mean below 1).
        * ``advantage_mass``: Σ_i |A_i| m_i = Σ_i |A_i| (needs ``abs_advantage``), so reweighting
          changes the direction of the update, not its size. The cap is honoured exactly: m_i =
          min(c · raw_i, ω_max) with c solved by water-filling (the capped set only grows, so a
          few passes reach the fixed point), which keeps the equality whenever ω_max >= 1. A
          batch with no advantage mass (every group all-correct or all-wrong) gets all ones.

        The result is positive, finite and at most ``weight_cap``.
        """
        g = np.asarray(response_groups, dtype=np.int64)
        if len(g) == 0:
            return np.ones(0)
        q = self.group_probabilities() if probabilities is None else np.asarray(probabilities, dtype=np.float64)
        raw = q[g]
        if scale is not None:
            raw = raw * np.asarray(scale, dtype=np.float64)
        cap = self.config.weight_cap
        if self.config.normalize == "all_responses":
            return np.minimum(raw / raw.mean(), cap)
        if abs_advantage is None:
            raise ValueError(
                "gdro.prompt.normalize=advantage_mass needs |advantage| per response (response_abs_advantage); "
                "pass it to observe() or set gdro.prompt.normalize=all_responses"
            )
        a = np.abs(np.asarray(abs_advantage, dtype=np.float64))
        if a.shape != raw.shape:
            raise ValueError(f"prompt_gdro: {a.shape[0]} |advantage| values for {raw.shape[0]} responses")
        a = np.where(np.isfinite(a), a, 0.0)
        mass = a.sum()
        if not mass > 0:
            return np.ones(len(g))
        c = mass / (a * raw).sum()
        capped = c * raw >= cap
        for _ in range(len(g)):
            free_mass = (a * raw)[~capped].sum()
            rest = mass - cap * a[capped].sum()
            if free_mass <= 0 or rest <= 0:  # only when ω_max = 1: everything at the cap
                break
            c = rest / free_mass
            now = capped | (c * raw >= cap)
            if np.array_equal(now, capped):
                break
            capped = now
        return np.where(capped, cap, np.minimum(c * raw, cap))

    def state_dict(self) -> dict[str, Any]:
        return {
            "scores": self.scores.copy(),
            "observed": self.observed.copy(),
            "num_nonfinite_losses": self.num_nonfinite_losses,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scores = np.asarray(state["scores"], dtype=np.float64)
        if scores.shape != (self.num_groups,):
            raise ValueError(f"prompt_gdro checkpoint has {scores.shape[0]} groups; this run has {self.num_groups}")
        self.scores = scores.copy()
        self.observed = np.asarray(state["observed"], dtype=bool).copy()
        self.num_nonfinite_losses = int(state["num_nonfinite_losses"])
        self.steps = int(state["steps"])
