"""GDROController: the binner and both adversaries behind one driver-side interface.

One training step, as the recipe and the simulator drive it::

    counts = ctl.schedule(prompt_ids)                  # before generation: n(x) per prompt
    ... generate counts[i] rollouts for prompt i, score them, GRPO advantages ...
    mult = ctl.observe(response_prompt_ids, response_acc,
                       response_abs_advantage=...,
                       response_length=...)            # after rewards: per-response multipliers
    advantages *= mult[:, None]                        # Prompt-GDRO reweighting
    metrics = ctl.metrics()                            # per-bin shares, weights, μ, se proxy

Within ``observe`` the order is: group each prompt by its bin *before* this visit (the bin it
was scheduled in), update Prompt-GDRO with this step's losses, update Rollout-GDRO's variance
estimates, then record the visit in the binner (which may move the prompt for the next step).
Token accounting (:mod:`verl_ext.tokens`) runs in every mode, observe-only GRPO included: the
per-prompt and per-bin response-length EMAs are updated from ``response_length`` (the tokens of
each response, from verl's response mask), and ``gdro/tokens/*`` compares the step's generated
tokens with what the uniform allocation n̄ would have generated on the same prompts. With
``rollout.budget=tokens`` ``schedule`` also keeps the expected tokens Σ n ĉ <= n̄ Σ ĉ.

With an adversary disabled its part is skipped: ``schedule`` returns n̄ for every prompt and
``observe`` returns all-ones multipliers, so the step is plain GRPO.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from typing import Any

import numpy as np

from verl_ext.atomic import atomic_replace
from verl_ext.binner import BinnerUpdate, OnlineDifficultyBinner, aggregate_responses, check_prompt_ids
from verl_ext.config import GDROConfig, gdro_config_to_dict
from verl_ext.prompt_gdro import PromptGDRO, prompt_loss
from verl_ext.rollout_gdro import WINDOW_ALLOCATORS, RolloutGDRO, allocation_quality
from verl_ext.tokens import LengthTracker, token_weighted_loss

# 2: Prompt-GDRO keeps per-group ``observed`` flags (scores start from a bin's first observation).
# 3: response-length state (``lengths``) and Rollout-GDRO's token price.
STATE_VERSION = 3

# allocation_quality() keys → gdro/se/<name> (measured with the controller's per-prompt estimates).
_SE_METRIC_NAMES = {
    "se_proxy": "proxy",
    "se_proxy_uniform": "proxy_uniform",
    "se_proxy_oracle": "proxy_oracle",
    "se_reduction": "reduction",
    "variance_reduction": "variance_reduction",
    "oracle_se_reduction": "oracle_reduction",
    "oracle_variance_reduction": "oracle_variance_reduction",
    "efficiency": "efficiency",
}


class GDROController:
    """Driver-side GDRO state for a dataset of ``num_prompts`` prompts with ids 0..num_prompts-1."""

    def __init__(
        self,
        config: GDROConfig,
        num_prompts: int,
        *,
        loss_agg_mode: str | None = None,
        max_response_length: int | None = None,
    ):
        """``loss_agg_mode`` is verl's ``actor.loss_agg_mode`` (Prompt-GDRO's mass is preserved in its
        units; ``None`` = per response); ``max_response_length`` (verl's ``data.max_response_length``)
        defines a truncated response (length >= it) for the truncation-rate metrics."""
        self.config = config
        self.loss_agg_mode = loss_agg_mode
        self.token_weighted = token_weighted_loss(loss_agg_mode)
        self.max_response_length = None if max_response_length is None else int(max_response_length)
        self.binner = OnlineDifficultyBinner(config.binner, num_prompts)
        self.num_groups = self.binner.num_groups
        self.prompt = PromptGDRO(config.prompt, self.num_groups)
        self.rollout = RolloutGDRO(config.rollout, self.num_groups)
        self.lengths = LengthTracker(
            num_prompts, self.num_groups, config.rollout.length_beta, config.rollout.length_shrinkage
        )
        self.step = 0
        self._metrics: dict[str, float] = {}
        self._schedule_metrics: dict[str, float] = {}  # allocation quality of the last schedule()

    # ------------------------------------------------------------------ names
    def group_names(self) -> list[str]:
        names = [f"bin_{b:02d}" for b in range(self.binner.num_bins)]
        if self.num_groups > self.binner.num_bins:
            names.append("unseen")
        return names

    # ------------------------------------------------------------------ step
    def schedule(self, prompt_ids: Any) -> np.ndarray:
        """Rollout count per prompt for the next generation; Σ = len(prompt_ids) · n̄ exactly.

        A prompt may appear twice (verl's dataloader restarts its epoch inside a step when
        ``data.gen_batch_size`` < ``train_batch_size``): each occurrence is its own visit and gets its own count.
        """
        ids = check_prompt_ids(
            prompt_ids, num_prompts=self.binner.num_prompts, what="batch prompt ids", check_unique=False
        )
        groups = self.binner.groups_of(ids)
        rc = self.config.rollout
        window_correct, window_rollouts = self.binner.window_sums(ids)
        # Per-prompt variance estimate (empirical Bayes, shrunk toward v_b): the allocator's input
        # with variance_source=prompt, and always the yardstick of the gdro/se/* metrics.
        v_prompt = self.rollout.prompt_variance_estimate(groups, window_correct, window_rollouts)
        cost = self.lengths.expected_lengths(ids, groups)  # ĉ per prompt (verl_ext.tokens)
        if rc.enable:
            accuracy = self.binner.accuracy_of(ids) if rc.allocator == "knapsack" else None
            counts = self.rollout.allocate(
                groups,
                accuracy,
                v_prompt if rc.variance_source == "prompt" else None,
                prompt_cost=cost if rc.budget == "tokens" else None,
                window_counts=(window_correct, window_rollouts) if rc.allocator in WINDOW_ALLOCATORS else None,
            )
        else:
            counts = np.full(len(ids), rc.n_mean, dtype=np.int64)
        if len(ids):
            quality = allocation_quality(counts, v_prompt, rc.n_mean, rc.n_min, rc.n_max)
            self._schedule_metrics = {f"gdro/se/{_SE_METRIC_NAMES[k]}": v for k, v in quality.items()}
            self._schedule_metrics["gdro/se/seen_share"] = float(np.count_nonzero(window_rollouts)) / len(ids)
            planned, planned_u = float(np.dot(cost, counts)), float(cost.sum() * rc.n_mean)
            self._schedule_metrics["gdro/tokens/planned"] = planned
            self._schedule_metrics["gdro/tokens/planned_uniform"] = planned_u
            self._schedule_metrics["gdro/tokens/planned_ratio"] = planned / planned_u
        return counts

    def observe(
        self,
        response_prompt_ids: Any,
        response_correct: Any,
        response_abs_advantage: Any | None = None,
        response_visit_ids: Any | None = None,
        response_length: Any | None = None,
    ) -> np.ndarray:
        """Record one step's outcomes; return the per-response advantage multipliers.

        Args:
            response_prompt_ids: the prompt id of each response (padding rows excluded).
            response_correct: verl's boolean ``acc`` per response, or a reward where > 0 is
                correct; NaN/inf count as incorrect and are reported in the metrics.
            response_abs_advantage: |A| per response (GRPO's per-response scalar). Needed by
                ``prompt.normalize=advantage_mass`` and ``loss_signal=mean_abs_advantage`` when
                Prompt-GDRO is on; always used for ``gdro/prompt/advantage_mass_ratio``.
            response_visit_ids: an integer per response naming its group (one visit of one prompt). Needed
                only when a prompt has two groups in the step (two visits, e.g. after an epoch restart inside
                the step); by default the responses of one prompt id form one group. Each visit is one
                observation for the adversaries, and the binner records the visits of one prompt in
                increasing visit id.
            response_length: generated tokens per response (verl's response mask summed). Feeds
                the length state and the ``gdro/tokens/*`` metrics; needed by Prompt-GDRO's
                ``advantage_mass`` under a token-weighted ``loss_agg_mode`` (mass Σ |A|·m·tokens).
        """
        cfg = self.config
        if response_abs_advantage is None and cfg.prompt.enable:
            for needs, key in (
                (cfg.prompt.normalize == "advantage_mass", "gdro.prompt.normalize=advantage_mass"),
                (cfg.prompt.loss_signal == "mean_abs_advantage", "gdro.prompt.loss_signal=mean_abs_advantage"),
            ):
                if needs:
                    raise ValueError(f"{key} needs response_abs_advantage (|A| per response) in observe()")
        if cfg.prompt.enable and cfg.prompt.normalize == "advantage_mass" and self.token_weighted:
            if response_length is None:
                raise ValueError(
                    f"gdro.prompt.normalize=advantage_mass under loss_agg_mode={self.loss_agg_mode} preserves "
                    "Σ|A|·m·tokens and needs response_length (tokens per response) in observe()"
                )
        pid = np.asarray(response_prompt_ids, dtype=np.int64)
        if response_visit_ids is None:
            ids, correct, rollouts, nonfinite, inverse = aggregate_responses(pid, response_correct, return_inverse=True)
            visits = ids
        else:
            visit = np.asarray(response_visit_ids, dtype=np.int64)
            if visit.shape != pid.shape:
                raise ValueError(f"observe: {visit.shape[0]} visit ids for {pid.shape[0]} responses")
            visits, correct, rollouts, nonfinite, inverse = aggregate_responses(
                visit, response_correct, return_inverse=True
            )
            ids = np.empty(len(visits), dtype=np.int64)
            ids[inverse] = pid
            if np.any(ids[inverse] != pid):
                row = int(np.argmax(ids[inverse] != pid))
                raise ValueError(f"observe: visit {int(visit[row])} holds responses of more than one prompt id")
        # Range check before any state changes.
        check_prompt_ids(ids, num_prompts=self.binner.num_prompts, what="response prompt ids", check_unique=False)
        groups = self.binner.groups_of(ids)  # bins before this visit = the bins it was scheduled in

        mean_abs_adv = abs_adv = None
        if response_abs_advantage is not None:
            abs_adv = np.abs(np.asarray(response_abs_advantage, dtype=np.float64))
            if abs_adv.shape != pid.shape:
                raise ValueError(f"observe: {abs_adv.shape[0]} |advantage| values for {pid.shape[0]} responses")
            mean_abs_adv = np.bincount(inverse, weights=abs_adv, minlength=len(ids)) / rollouts
        length = prompt_tokens = None
        if response_length is not None:
            length = np.asarray(response_length, dtype=np.float64)
            if length.shape != pid.shape or not np.all(np.isfinite(length)) or (len(length) and length.min() < 0):
                raise ValueError(f"observe: response_length must be {pid.shape[0]} finite token counts >= 0")
            prompt_tokens = np.bincount(inverse, weights=length, minlength=len(ids))
        # Prompt-GDRO's mass in the loss's units: |A|·tokens under a token-weighted loss_agg_mode.
        mass_adv = abs_adv
        if abs_adv is not None and self.token_weighted and length is not None:
            mass_adv = abs_adv * length

        if cfg.prompt.enable:
            # Joint mode: n varies per prompt, so learnability uses the unbiased n/(n-1) form.
            losses = prompt_loss(cfg.prompt.loss_signal, correct, rollouts, mean_abs_adv, unbiased=cfg.rollout.enable)
            before = self.prompt.group_probabilities() if cfg.prompt.lagged else None
            self.prompt.update(groups, losses)
            scale = None
            if cfg.rollout.enable and cfg.prompt.rollout_coupling == "divide_by_allocation":
                scale = cfg.rollout.n_mean / rollouts[inverse]
            multipliers = self.prompt.response_multipliers(groups[inverse], scale, mass_adv, probabilities=before)
        else:
            multipliers = np.ones(len(pid))
        self.rollout.observe(groups, correct, rollouts, update_allocator=cfg.rollout.enable)
        update = self._record_visits(ids, visits, correct, rollouts, nonfinite)

        self._metrics = self._step_metrics(groups, correct, rollouts, multipliers, groups[inverse], update, mass_adv)
        if length is not None:
            self._metrics.update(self._token_metrics(groups, rollouts, prompt_tokens, groups[inverse], length))
            self.lengths.update(ids, groups, prompt_tokens, rollouts)
        self._schedule_metrics = {}
        self.step += 1
        return multipliers

    def _record_visits(self, ids, visits, correct, rollouts, nonfinite) -> BinnerUpdate:
        """Record every visit in the binner. The binner takes one visit per prompt per update, so a prompt
        visited twice in the step is recorded in rounds (its visits in increasing visit id)."""
        if len(np.unique(ids)) == len(ids):
            return self.binner.update(ids, correct, rollouts, num_nonfinite=nonfinite)
        order = np.lexsort((visits, ids))
        sorted_ids = ids[order]
        start = np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]
        first = np.maximum.accumulate(np.where(start, np.arange(len(ids)), 0))
        rank = np.empty(len(ids), dtype=np.int64)
        rank[order] = np.arange(len(ids)) - first  # 0 for a prompt's first visit, 1 for its second, ...
        accuracy = np.empty(len(ids), dtype=np.float64)
        moved = 0
        for r in range(int(rank.max()) + 1):
            sel = np.flatnonzero(rank == r)
            part = self.binner.update(ids[sel], correct[sel], rollouts[sel], num_nonfinite=nonfinite if r == 0 else 0)
            accuracy[sel] = part.batch_accuracy
            moved += part.num_moved
        return BinnerUpdate(batch_accuracy=accuracy, num_nonfinite=int(nonfinite), num_moved=moved)

    # ------------------------------------------------------------------ metrics
    def _step_metrics(
        self, groups, correct, rollouts, multipliers, response_groups, update, abs_adv
    ) -> dict[str, float]:
        G = self.num_groups
        n_prompts = max(len(groups), 1)
        prompt_count = np.bincount(groups, minlength=G)
        rollout_count = np.bincount(groups, weights=rollouts, minlength=G)
        correct_count = np.bincount(groups, weights=correct, minlength=G)
        weight_sum = np.bincount(response_groups, weights=multipliers, minlength=G)
        probs = self.prompt.group_probabilities()
        # q(b) relative to the mean q of the groups in this batch (1 = average weight). Raw q is
        # normalised over all groups, including ones that hold no prompt any more (e.g. `unseen`
        # after the first epoch keeps its last score), which would distort a per-batch view.
        in_batch = prompt_count > 0
        relative = probs / probs[in_batch].mean() if in_batch.any() else np.ones(G)
        m: dict[str, float] = {}
        for b, name in enumerate(self.group_names()):
            m[f"gdro/{name}/data_share"] = prompt_count[b] / n_prompts
            m[f"gdro/{name}/compute_share"] = rollout_count[b] / max(rollout_count.sum(), 1.0)
            m[f"gdro/{name}/adversary_prob"] = float(probs[b]) if self.config.prompt.enable else 1.0 / G
            if in_batch[b]:
                m[f"gdro/{name}/adversary_weight"] = float(relative[b]) if self.config.prompt.enable else 1.0
            m[f"gdro/{name}/variance"] = float(self.rollout.variance[b])
            if prompt_count[b]:
                m[f"gdro/{name}/accuracy"] = correct_count[b] / rollout_count[b]
                m[f"gdro/{name}/rollouts_per_prompt"] = rollout_count[b] / prompt_count[b]
                m[f"gdro/{name}/advantage_multiplier"] = weight_sum[b] / rollout_count[b]
        last = self.rollout.last
        if self.config.rollout.enable and last:
            m["gdro/mu"] = self.rollout.mu
            m["gdro/budget_gap"] = last["proposal_mean"] - self.config.rollout.n_mean
            m["gdro/se_proxy"] = last["se_proxy"]
            m["gdro/se_proxy_uniform"] = last["se_proxy_uniform"]
            m["gdro/se_proxy_reduction"] = 1.0 - last["se_proxy"] / last["se_proxy_uniform"]
            if self.config.rollout.budget == "tokens":
                m["gdro/token_price"] = self.rollout.token_price  # ρ = λ c̄ / μ
                m["gdro/lambda"] = self.rollout.lam
        m.update(self._schedule_metrics)
        if abs_adv is not None:
            # Σ|A·m| / Σ|A| (each |A| times its tokens under a token-weighted loss_agg_mode): how much
            # Prompt-GDRO changes the update's size in the loss's units (1 = direction only).
            mass = abs_adv.sum()
            m["gdro/prompt/advantage_mass_ratio"] = float((abs_adv * multipliers).sum() / mass) if mass > 0 else 1.0
        else:
            m["gdro/prompt/advantage_mass_ratio"] = 1.0 if not self.config.prompt.enable else float("nan")
        m["gdro/rollouts_per_prompt"] = float(rollouts.mean()) if len(rollouts) else 0.0
        m["gdro/multiplier_max"] = float(multipliers.max()) if len(multipliers) else 1.0
        m["gdro/multiplier_min"] = float(multipliers.min()) if len(multipliers) else 1.0
        has_unseen_group = self.num_groups > self.binner.num_bins
        m["gdro/binner/unseen_in_batch"] = (
            float(prompt_count[self.binner.unseen_group]) if has_unseen_group else float("nan")
        )
        m["gdro/binner/nonfinite_rewards"] = float(update.num_nonfinite)
        m["gdro/binner/nonfinite_rewards_total"] = float(self.binner.total_nonfinite)
        m["gdro/binner/moved"] = float(update.num_moved)
        m["gdro/binner/seen_fraction"] = self.binner.seen_fraction()
        return {k: float(v) for k, v in m.items()}

    def _token_metrics(self, groups, rollouts, prompt_tokens, response_groups, length) -> dict[str, float]:
        """``gdro/tokens/*`` and per-bin length / truncation (before this step enters the length state).

        ``uniform_expected`` = Σ_x n̄ ℓ̄_x, with ℓ̄_x this step's mean length of prompt x: the tokens the
        uniform allocation would have generated on the same prompts (unbiased, since n_x is fixed before
        generation). In a GRPO run the ratio is exactly 1.
        """
        G = self.num_groups
        n_mean = self.config.rollout.n_mean
        generated = float(length.sum())
        uniform = float((n_mean * prompt_tokens / np.maximum(rollouts, 1.0)).sum())
        m: dict[str, float] = {
            "gdro/tokens/generated": generated,
            "gdro/tokens/uniform_expected": uniform,
            "gdro/tokens/ratio_to_uniform": generated / uniform if uniform > 0 else 1.0,
            "gdro/tokens/mean_response_length": generated / max(len(length), 1),
        }
        resp = np.bincount(response_groups, minlength=G)
        tok = np.bincount(response_groups, weights=length, minlength=G)
        limit = self.max_response_length
        trunc = None
        if limit is not None:
            hit = (length >= limit).astype(np.float64)
            trunc = np.bincount(response_groups, weights=hit, minlength=G)
            m["gdro/tokens/truncation_rate"] = float(hit.mean()) if len(hit) else 0.0
        for b, name in enumerate(self.group_names()):
            if resp[b]:
                m[f"gdro/{name}/response_length"] = tok[b] / resp[b]
                if trunc is not None:
                    m[f"gdro/{name}/truncation_rate"] = trunc[b] / resp[b]
        return {k: float(v) for k, v in m.items()}

    def metrics(self) -> dict[str, float]:
        """Metrics of the last observed step (empty before the first)."""
        return dict(self._metrics)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "config": gdro_config_to_dict(self.config),
            "step": self.step,
            "binner": self.binner.state_dict(),
            "prompt": self.prompt.state_dict(),
            "rollout": self.rollout.state_dict(),
            "lengths": self.lengths.state_dict(),
            "metrics": dict(self._metrics),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"GDRO state version {state.get('version')!r} is not {STATE_VERSION}: this checkpoint was written by "
                "an older verl_ext whose controller state this version cannot continue exactly; resume with that "
                "version or start the GDRO state afresh (delete gdro_state.pkl)"
            )
        self.binner.load_state_dict(state["binner"])
        self.prompt.load_state_dict(state["prompt"])
        self.rollout.load_state_dict(state["rollout"])
        self.lengths.load_state_dict(state["lengths"])
        self.step = int(state["step"])
        self._metrics = dict(state["metrics"])

    def save(self, path: str) -> None:
        """Write the state atomically: a temporary file in the same folder, then a rename."""
        with atomic_replace(path, "wb") as f:
            pickle.dump(self.state_dict(), f, protocol=pickle.HIGHEST_PROTOCOL)

    def load(self, path: str) -> None:
        with open(path, "rb") as f:
            self.load_state_dict(pickle.load(f))


def state_fingerprint(state: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """One short SHA-256 per leaf of a controller ``state_dict()`` (dotted names: ``binner.ring``,
    ``prompt.scores``, ``rollout.log_mu``, ``rollout.rng.state.state``, ...): two states are equal field by
    field exactly when their fingerprints are. An array's digest covers its dtype, shape and bytes."""
    out: dict[str, str] = {}
    for key in sorted(state):
        name, value = f"{prefix}{key}", state[key]
        if isinstance(value, dict):
            out.update(state_fingerprint(value, f"{name}."))
            continue
        h = hashlib.sha256()
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode())
            h.update(np.ascontiguousarray(value).tobytes())
        else:
            h.update(json.dumps(value, sort_keys=True, default=repr).encode())
        out[name] = h.hexdigest()[:16]
    return out
