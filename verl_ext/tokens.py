"""Token accounting: per-prompt and per-bin expected response length ĉ, and the loss's own units.

A step's cost is its generated tokens, not its rollouts. :class:`LengthTracker` keeps, on the
driver, an EMA of the mean response length of every prompt (updated at each visit) and of every
bin (updated at each step the bin is in the batch), both with rate ``rollout.length_beta``; a
first observation replaces the "unknown" state (NaN). :meth:`LengthTracker.expected_lengths`
gives the ĉ the token budget uses: the prompt's own EMA shrunk toward its bin's,

    ĉ_x = (r_x L_x + κ L_b) / (r_x + κ),      r_x ← (1 - β) r_x + n_x at each visit

(r_x the EMA-discounted count of the prompt's responses, κ = ``rollout.length_shrinkage``), else
its bin's L_b, else the mean of the batch's known values, else 1 (nothing known: every prompt
costs the same, and the token budget coincides with the rollout budget). The shrinkage matters:
a prompt's last few responses are a noisy length estimate (one more failure among four makes it
much longer), and an allocator that moves rollouts toward prompts that *looked* short picks the
lucky ones, whose next responses are longer (regression to the mean); the realised tokens then
exceed the planned ones (found with the simulator).

:func:`token_weighted_loss` says whether verl's ``actor.loss_agg_mode`` weights a response by its
token count (``token-mean``, ``token-sum``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``: a
response's term sums over its tokens) or not (``seq-mean-token-mean``: each response is averaged
over its own tokens first). Prompt-GDRO's ``normalize=advantage_mass`` preserves the mass in those
units: Σ |A_i| m_i L_i = Σ |A_i| L_i when token-weighted, Σ |A_i| m_i = Σ |A_i| otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TOKEN_WEIGHTED_LOSS_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
PER_RESPONSE_LOSS_MODES = ("seq-mean-token-mean",)


def token_weighted_loss(loss_agg_mode: str | None) -> bool:
    """True when verl's ``loss_agg_mode`` sums a response's loss over its tokens (module docstring).

    ``None`` (the simulator, or a caller that does not say) means per response.
    """
    if loss_agg_mode is None:
        return False
    if loss_agg_mode in TOKEN_WEIGHTED_LOSS_MODES:
        return True
    if loss_agg_mode in PER_RESPONSE_LOSS_MODES:
        return False
    raise ValueError(
        f"actor.loss_agg_mode={loss_agg_mode!r} is not one GDRO knows; expected one of "
        f"{TOKEN_WEIGHTED_LOSS_MODES + PER_RESPONSE_LOSS_MODES}"
    )


class LengthTracker:
    """EMA of the mean response length per prompt (per visit) and per group (per step)."""

    def __init__(self, num_prompts: int, num_groups: int, beta: float, shrinkage: float = 0.0):
        self.beta = float(beta)
        self.shrinkage = float(shrinkage)
        self.prompt_length = np.full(int(num_prompts), np.nan)
        self.prompt_weight = np.zeros(int(num_prompts))  # r_x, EMA-discounted response count
        self.group_length = np.full(int(num_groups), np.nan)

    def expected_lengths(self, prompt_ids: Any, groups: Any) -> np.ndarray:
        """ĉ per prompt: own EMA, else its group's, else the batch mean of the known ones, else 1."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        c = self.prompt_length[ids].copy()
        bin_c = self.group_length[np.asarray(groups, dtype=np.int64)]
        if self.shrinkage > 0:
            r = self.prompt_weight[ids]
            both = ~np.isnan(c) & ~np.isnan(bin_c)
            c[both] = (r[both] * c[both] + self.shrinkage * bin_c[both]) / (r[both] + self.shrinkage)
        unknown = np.isnan(c)
        c[unknown] = bin_c[unknown]
        unknown = np.isnan(c)
        if unknown.all():
            c[:] = 1.0
        elif unknown.any():
            c[unknown] = c[~unknown].mean()
        return np.maximum(c, 1.0)  # a response has at least one token (EOS)

    def update(self, ids: np.ndarray, groups: np.ndarray, tokens: np.ndarray, rollouts: np.ndarray) -> None:
        """Fold one step's per-prompt token sums (``tokens``) over ``rollouts`` responses into the EMAs."""
        b = self.beta
        mean = tokens / np.maximum(rollouts, 1.0)
        old = self.prompt_length[ids]
        self.prompt_length[ids] = np.where(np.isnan(old), mean, (1.0 - b) * old + b * mean)
        self.prompt_weight[ids] = (1.0 - b) * self.prompt_weight[ids] + rollouts
        G = len(self.group_length)
        resp = np.bincount(groups, weights=rollouts, minlength=G)
        present = resp > 0
        g_mean = np.bincount(groups, weights=tokens, minlength=G)[present] / resp[present]
        old_g = self.group_length[present]
        self.group_length[present] = np.where(np.isnan(old_g), g_mean, (1.0 - b) * old_g + b * g_mean)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prompt_length": self.prompt_length.copy(),
            "prompt_weight": self.prompt_weight.copy(),
            "group_length": self.group_length.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        p = np.asarray(state["prompt_length"], dtype=np.float64)
        g = np.asarray(state["group_length"], dtype=np.float64)
        if p.shape != self.prompt_length.shape or g.shape != self.group_length.shape:
            raise ValueError(
                f"length state has {p.shape[0]} prompts / {g.shape[0]} groups; this run has "
                f"{self.prompt_length.shape[0]} / {self.group_length.shape[0]}"
            )
        self.prompt_length = p.copy()
        self.prompt_weight = np.asarray(state["prompt_weight"], dtype=np.float64).copy()
        self.group_length = g.copy()
