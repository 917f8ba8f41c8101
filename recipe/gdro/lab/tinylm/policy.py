"""Sampling, token log-probs and the PPO update for a Hugging Face causal LM, without a cluster.

Device-agnostic: everything runs on the device the model is on (CPU in the tests, CUDA works the
same). Tensors follow verl's layout:

* ``input_ids`` = prompt (left-padded to a common length P) ‖ response (right-padded to R);
* ``attention_mask`` marks the real tokens of both parts; ``position_ids`` are derived from it the
  way verl does (cumulative sum - 1), so left padding does not shift positions;
* ``responses`` = the last R columns of ``input_ids``; ``response_mask`` marks real response tokens.

The log-probs are the actor's: ``log_softmax(logits / temperature)`` at the sampled token, over
the full vocabulary (top-p / top-k only restrict which token is *drawn*, as in verl, where the
actor recomputes log-probs on the unfiltered distribution). So the rollout log-probs returned by
:func:`sample` equal :func:`response_log_probs` on the same tokens, and the first PPO step starts
at ratio 1.

:func:`ppo_update` is one call of verl's actor update (``update_actor``): verl's registered policy
loss (``core_algos.get_policy_loss_fn``), ``agg_loss`` normalised over each mini-batch (micro-
batch losses sum to the mini-batch loss, as verl's ``ppo_loss`` does with ``batch_num_tokens`` /
``global_batch_size``), optional entropy bonus and KL loss (``core_algos.kl_penalty``), gradient
clipping, a skipped step on a non-finite gradient norm, ``ppo_epochs`` passes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from verl.workers.config import ActorConfig, OptimizerConfig, PolicyLossConfig

__all__ = [
    "left_pad",
    "make_optimizer",
    "position_ids_from_mask",
    "ppo_update",
    "resolve_actor_config",
    "response_log_probs",
    "sample",
]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``compute_position_id_with_mask``: 0-based positions of real tokens (pads get 0)."""
    return torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0, max=None)


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to ``(input_ids, attention_mask)`` of shape [B, max_len] (long)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("left_pad needs a non-empty list of non-empty token lists")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def rollout_batch(
    prompts: list[list[int]], out: list[tuple[list[int], list[float]]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """verl's layout from :func:`sample`'s output: left-padded prompts ‖ right-padded responses, with
    ``response_mask`` and the sampling log-probs as ``old_log_probs`` (the keys :func:`ppo_update` reads,
    but ``advantages``)."""
    ids, mask = left_pad(prompts, pad_token_id)
    width = max(len(r) for r, _ in out)
    responses = torch.full((len(out), width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(out), width), dtype=torch.long)
    old = torch.zeros((len(out), width), dtype=torch.float32)
    for i, (r, lp) in enumerate(out):
        responses[i, : len(r)] = torch.as_tensor(r)
        response_mask[i, : len(r)] = 1
        old[i, : len(r)] = torch.as_tensor(lp)
    return {
        "input_ids": torch.cat([ids, responses], 1),
        "attention_mask": torch.cat([mask, response_mask], 1),
        "responses": responses,
        "response_mask": response_mask,
        "old_log_probs": old,
    }


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and the top-p nucleus; used only to draw."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keeps at least one token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# No forward the savings make runs fewer token rows than this: a one-thread CPU matmul of fewer than 4
# rows takes another kernel, whose rounding differs from the same rows inside a larger batch (torch 2.13).
MIN_FORWARD_ROWS = 8


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    plain: bool = False,
) -> list[tuple[list[int], list[float]]]:
    """Sample one response per prompt (batched, left padding, KV cache).

    Returns, per prompt in order, ``(response_ids, log_probs)``: the sampled tokens, ending with
    ``eos_token_id`` if it was drawn (else exactly ``max_new_tokens`` tokens), and each token's
    log-prob ``log_softmax(logits / temperature)[token]`` (float32). ``temperature == 0`` is greedy
    decoding; its log-probs are then taken at temperature 1. ``generator`` (on the model's device)
    makes the draw reproducible. The model is put in eval mode for the call and restored after.

    Two savings: a prompt that repeats (a GRPO group) is prefilled once and its KV cache copied to its
    rows; each decode step's forward runs only the rows still generating. Neither makes a forward of
    fewer than :data:`MIN_FORWARD_ROWS` token rows, and the draw is still made over all rows, finished
    ones included, so the generator advances as in the plain loop (``plain=True``: every row through
    every step). On one CPU thread (the study's runs) every result is the plain loop's, bit for bit
    (tests/gdro/lab/tinylm/test_tinylm.py); with more threads a row's rounding can depend on how many rows
    share its matmul, so the numbers are the plain loop's up to float rounding, not bit for bit.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = _device(model)
    was_training = model.training
    model.eval()
    try:
        input_ids, attention_mask = left_pad(prompts, pad_token_id)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        batch = input_ids.shape[0]
        position_ids = position_ids_from_mask(attention_mask)
        # Prefill each distinct prompt once (same left-padded width), then give every row its copy:
        # unique_rows[k] is the k-th distinct prompt's first row, inverse[i] the k of row i.
        slot: dict[tuple[int, ...], int] = {}
        first_rows, inverse_list = [], []
        for i, p in enumerate(prompts):
            k = slot.setdefault(tuple(p), len(slot))
            if k == len(first_rows):
                first_rows.append(i)
            inverse_list.append(k)
        if plain or len(first_rows) * input_ids.shape[1] < MIN_FORWARD_ROWS:
            unique_rows = inverse = torch.arange(batch, device=device)
        else:
            unique_rows = torch.tensor(first_rows, device=device)
            inverse = torch.tensor(inverse_list, device=device)
        out = model(
            input_ids=input_ids[unique_rows],
            attention_mask=attention_mask[unique_rows],
            position_ids=position_ids[unique_rows],
            use_cache=True,
        )
        past = out.past_key_values
        logits_all = out.logits[:, -1, :].float()[inverse]
        if len(unique_rows) < batch:
            past.batch_select_indices(inverse)
        next_pos = position_ids[:, -1:] + 1
        tokens = torch.empty((batch, max_new_tokens), dtype=torch.long, device=device)
        logps = torch.empty((batch, max_new_tokens), dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
        rows = torch.arange(batch, device=device)  # the rows the model runs (the others are done)
        for t in range(max_new_tokens):
            # logits_all keeps a finished row's last logits: its draw is discarded, as in the plain loop
            if temperature == 0:
                log_dist = torch.log_softmax(logits_all, dim=-1)
                token = torch.argmax(logits_all, dim=-1)
            else:
                scaled = logits_all / temperature
                log_dist = torch.log_softmax(scaled, dim=-1)
                probs = torch.softmax(_filter_logits(scaled, top_k, top_p), dim=-1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            token = torch.where(done, torch.full_like(token, pad_token_id), token)
            tokens[:, t] = token
            logps[:, t] = log_dist.gather(-1, token[:, None]).squeeze(-1)
            newly_done = (~done) & (token == eos_token_id)
            lengths = torch.where(newly_done, torch.full_like(lengths, t + 1), lengths)
            done = done | newly_done
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            attention_mask = torch.cat([attention_mask, (~done).long()[:, None]], dim=-1)
            live = (~done[rows]).nonzero().squeeze(-1)
            keep = None if plain else _rows_to_keep(live, len(rows))
            if keep is not None:  # drop finished rows from the batch (and their cache)
                past.batch_select_indices(keep)
                rows = rows[keep]
            out = model(
                input_ids=token[rows, None],
                attention_mask=attention_mask[rows],
                position_ids=next_pos[rows],
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits_all[rows] = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
    finally:
        model.train(was_training)
    tokens_l, logps_l, lengths_l = tokens.tolist(), logps.tolist(), lengths.tolist()
    return [(tokens_l[i][: lengths_l[i]], logps_l[i][: lengths_l[i]]) for i in range(batch)]


def _rows_to_keep(live: torch.Tensor, current: int) -> torch.Tensor | None:
    """Positions (in the current decode batch) to keep, or None to keep the batch as it is: shrink
    once a quarter of the batch has finished, never below MIN_FORWARD_ROWS rows (finished rows fill up)."""
    if current - len(live) < max(1, current // 4) or current <= MIN_FORWARD_ROWS:
        return None
    if len(live) >= MIN_FORWARD_ROWS:
        return live
    filler = torch.ones(current, dtype=torch.bool, device=live.device)
    filler[live] = False
    extra = filler.nonzero().squeeze(-1)[: MIN_FORWARD_ROWS - len(live)]
    return torch.sort(torch.cat([live, extra])).values


def response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [B, R] of ``responses`` (the last R columns of ``input_ids``).

    What verl's actor computes: one forward over prompt ‖ response, logits of the positions that
    predict the response tokens, divided by ``temperature`` (0 is treated as 1, matching
    :func:`sample`), ``logprobs_from_logits`` (full log-softmax). With ``return_entropy`` also the
    per-token entropy [B, R] of that distribution (verl's ``entropy_from_logits``). Runs under
    the caller's grad mode; values at padded response positions are meaningless (mask them).
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    width = responses.shape[-1]
    if width >= input_ids.shape[-1]:
        raise ValueError(f"responses ({width} columns) must be shorter than input_ids ({input_ids.shape[-1]})")
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    logits = out.logits[:, -width - 1 : -1, :].float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    log_probs = logprobs_from_logits(logits, responses)
    if return_entropy:
        return log_probs, entropy_from_logits(logits)
    return log_probs


def make_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.AdamW:
    """AdamW over all trainable parameters (verl's FSDP actor defaults: weight decay 0.01)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))


# The tiny model's PPO actor settings have one source, the recipe's size group for it (a YAML file read by
# path: tinylm imports nothing above it). The real-path run composes it; the direct loop and the
# gradient probe read these keys from it.
TINY_SIZE_YAML = Path(__file__).resolve().parents[2] / "config" / "size" / "tiny.yaml"
TINY_ACTOR_KEYS = ("clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "entropy_coeff", "ppo_epochs")


def tiny_actor_config(**overrides: Any) -> dict[str, Any]:
    """The tiny model's ``actor_rollout_ref.actor`` loss settings: ``TINY_ACTOR_KEYS`` from
    config/size/tiny.yaml, and verl's own defaults (ActorConfig, PolicyLossConfig, OptimizerConfig) for
    the clip ratio, loss mode and gradient clip that file leaves to verl; ``overrides`` win."""

    def verl_default(cls: type, name: str) -> Any:
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)

    actor = yaml.safe_load(TINY_SIZE_YAML.read_text(encoding="utf-8"))["actor_rollout_ref"]["actor"]
    return {
        "clip_ratio": verl_default(ActorConfig, "clip_ratio"),
        **{k: actor[k] for k in TINY_ACTOR_KEYS},
        "policy_loss": {"loss_mode": verl_default(PolicyLossConfig, "loss_mode")},
        "use_kl_loss": actor["use_kl_loss"],
        "optim": {"clip_grad": verl_default(OptimizerConfig, "clip_grad")},
        **overrides,
    }


# ActorConfig fields ppo_update reads (documented; anything else in the section is ignored).
_READ_KEYS = (
    "ppo_mini_batch_size",
    "rollout_n",
    "ppo_micro_batch_size_per_gpu",
    "ppo_epochs",
    "shuffle",
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "loss_agg_mode",
    "loss_scale_factor",
    "entropy_coeff",
    "calculate_entropy",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
    "tau_pos",
    "tau_neg",
)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        try:
            value = cfg.get(key, default)
        except Exception:  # omegaconf raises on missing mandatory values ("???")
            value = default
    else:
        value = getattr(cfg, key, default)
    return default if value is None and default is not None else value


def resolve_actor_config(actor_config: Any) -> ActorConfig:
    """verl's ``ActorConfig`` for the loss functions, from the ``actor_rollout_ref.actor`` section.

    An ``ActorConfig`` (or subclass) is used as is. A DictConfig / dict is read for the keys in
    ``_READ_KEYS`` plus ``policy_loss.*`` and ``optim.{lr, weight_decay, betas, clip_grad}``;
    absent keys take verl's ActorConfig defaults; ``rollout_n`` defaults to 1 and the micro-batch
    size to the mini-batch size (no gradient accumulation).
    """
    if isinstance(actor_config, ActorConfig):
        return actor_config
    if actor_config is None:
        raise ValueError("ppo_update needs actor_config (the actor_rollout_ref.actor section)")
    kwargs: dict[str, Any] = {}
    for key in _READ_KEYS:
        value = _get(actor_config, key)
        if value is not None:
            kwargs[key] = value
    kwargs.setdefault("rollout_n", 1)
    kwargs.setdefault("ppo_micro_batch_size_per_gpu", kwargs.get("ppo_mini_batch_size", 256))
    if isinstance(kwargs.get("ppo_mini_batch_size"), str) or isinstance(kwargs.get("rollout_n"), str):
        raise ValueError("actor_config.ppo_mini_batch_size / rollout_n must be integers")
    policy_loss = _get(actor_config, "policy_loss")
    pl_kwargs = {}
    if policy_loss is not None:
        for f in dataclasses.fields(PolicyLossConfig):
            if f.name == "rollout_correction":
                continue
            value = _get(policy_loss, f.name)
            if value is not None:
                pl_kwargs[f.name] = value
    optim = _get(actor_config, "optim")
    opt_kwargs = {}
    if optim is not None:
        for key in ("lr", "weight_decay", "betas", "clip_grad"):
            value = _get(optim, key)
            if value is not None:
                opt_kwargs[key] = tuple(value) if key == "betas" else value
    return ActorConfig(
        strategy="fsdp",
        use_torch_compile=False,
        policy_loss=PolicyLossConfig(**pl_kwargs),
        optim=OptimizerConfig(**opt_kwargs),
        **kwargs,
    )


def _grad_clip(config: ActorConfig) -> float | None:
    optim = config.optim
    clip = getattr(optim, "clip_grad", None)
    if clip is None:
        clip = getattr(optim, "grad_clip", None)
    return clip


_BATCH_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages")


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    *,
    actor_config: Any,
    mini_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """One actor update on a rollout batch, as verl's ``update_actor`` does it; returns metrics.

    ``batch``: tensors with verl's keys ``input_ids``, ``attention_mask`` [N, P+R], ``responses``,
    ``response_mask``, ``old_log_probs``, ``advantages`` [N, R], optional ``ref_log_prob`` (needed
    with ``use_kl_loss``), ``position_ids`` and ``rollout_is_weights``.

    ``actor_config``: the ``actor_rollout_ref.actor`` section (DictConfig, dict or verl's
    ``ActorConfig``). Read: ``ppo_mini_batch_size`` x ``rollout_n`` (sequences per optimizer step,
    as verl's trainer multiplies them; overridden by ``mini_batch_size``),
    ``ppo_micro_batch_size_per_gpu`` (gradient accumulation; overridden by ``micro_batch_size``),
    ``ppo_epochs``, ``shuffle`` (mini-batch order drawn from ``generator``), ``clip_ratio``,
    ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``loss_agg_mode``,
    ``loss_scale_factor``, ``policy_loss.loss_mode`` (and the loss's own ``policy_loss.*`` keys),
    ``entropy_coeff``, ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``, ``optim.clip_grad``.
    The learning rate is the optimizer's (see :func:`make_optimizer`).

    Unlike verl, N need not be a multiple of the mini-batch size: the last mini-batch is smaller
    (Rollout-GDRO's per-prompt counts make N vary). Each mini-batch is one optimizer step; its
    loss is normalised over the whole mini-batch (token count for token-mean, sequence count for
    the seq-mean modes), so splitting it into micro-batches does not change the gradient.

    Metrics (means over mini-batches, as verl's trainer reduces them): ``actor/pg_loss``,
    ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, ``actor/grad_norm``,
    ``actor/entropy`` (token mean of the current policy's entropy, when computed),
    ``actor/entropy_loss`` (when ``entropy_coeff`` != 0), ``actor/kl_loss`` / ``actor/kl_coef``
    (with ``use_kl_loss``), ``actor/lr``, ``actor/num_mini_batches``, ``actor/skipped_steps``
    (non-finite gradient norm: step skipped, as verl's engine does).
    """
    config = resolve_actor_config(actor_config)
    missing = [k for k in _BATCH_KEYS if k not in batch]
    if missing:
        raise KeyError(f"ppo_update: batch is missing {', '.join(missing)}")
    if config.use_kl_loss and "ref_log_prob" not in batch:
        raise KeyError("ppo_update: use_kl_loss is set but the batch has no ref_log_prob")
    device = _device(model)
    tensors = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    n = tensors["input_ids"].shape[0]
    for key in _BATCH_KEYS:
        if tensors[key].shape[0] != n:
            raise ValueError(f"ppo_update: batch[{key!r}] has {tensors[key].shape[0]} rows, input_ids has {n}")
    if mini_batch_size is None:
        mini_batch_size = int(config.ppo_mini_batch_size) * int(config.rollout_n or 1)
    mini_batch_size = max(1, min(int(mini_batch_size), n))
    if micro_batch_size is None:
        micro_batch_size = config.ppo_micro_batch_size_per_gpu or mini_batch_size
    micro_batch_size = max(1, min(int(micro_batch_size), mini_batch_size))
    policy_loss_fn = get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    loss_agg_mode = config.loss_agg_mode
    want_entropy = bool(config.calculate_entropy) or config.entropy_coeff != 0
    clip = _grad_clip(config)

    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def log(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + float(value)
        counts[key] = counts.get(key, 0) + 1

    model.train()
    skipped = 0
    steps = 0
    for _ in range(int(config.ppo_epochs)):
        order = torch.randperm(n, generator=generator) if config.shuffle else torch.arange(n)
        for start in range(0, n, mini_batch_size):
            mini_idx = order[start : start + mini_batch_size].to(device)
            mask_all = tensors["response_mask"][mini_idx]
            # verl's global batch info: the mini-batch's valid tokens and sequences (dp_size 1).
            config.global_batch_info["dp_size"] = 1
            config.global_batch_info["batch_num_tokens"] = int(mask_all.sum().item())
            config.global_batch_info["global_batch_size"] = int(mini_idx.numel())
            config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
            optimizer.zero_grad(set_to_none=True)
            mb = {"pg_loss": 0.0, "entropy_loss": 0.0, "kl_loss": 0.0}
            frac: dict[str, list[float]] = {}
            ent_sum, ent_tok = 0.0, 0
            for m_start in range(0, mini_idx.numel(), micro_batch_size):
                idx = mini_idx[m_start : m_start + micro_batch_size]
                part = {k: v[idx] for k, v in tensors.items()}
                response_mask = part["response_mask"].to(torch.bool)
                result = response_log_probs(
                    model,
                    part["input_ids"],
                    part["attention_mask"],
                    part["responses"],
                    temperature,
                    return_entropy=want_entropy,
                    position_ids=part.get("position_ids"),
                )
                log_prob, entropy = result if want_entropy else (result, None)
                pg_loss, pg_metrics = policy_loss_fn(
                    old_log_prob=part["old_log_probs"],
                    log_prob=log_prob,
                    advantages=part["advantages"],
                    response_mask=response_mask,
                    loss_agg_mode=loss_agg_mode,
                    config=config,
                    rollout_is_weights=part.get("rollout_is_weights"),
                )
                loss = pg_loss
                mb["pg_loss"] += float(pg_loss.detach())
                for key, value in pg_metrics.items():
                    frac.setdefault(key, []).append(float(value))
                if entropy is not None:
                    ent_sum += float((entropy.detach() * response_mask).sum())
                    ent_tok += int(response_mask.sum())
                    if config.entropy_coeff != 0:
                        entropy_loss = agg_loss(
                            loss_mat=entropy,
                            loss_mask=response_mask,
                            loss_agg_mode=loss_agg_mode,
                            **config.global_batch_info,
                        )
                        loss = loss - config.entropy_coeff * entropy_loss
                        mb["entropy_loss"] += float(entropy_loss.detach())
                if config.use_kl_loss:
                    kld = kl_penalty(logprob=log_prob, ref_logprob=part["ref_log_prob"], kl_penalty=config.kl_loss_type)
                    kl_loss = agg_loss(
                        loss_mat=kld, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
                    )
                    loss = loss + config.kl_loss_coef * kl_loss
                    mb["kl_loss"] += float(kl_loss.detach())
                loss.backward()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if clip is not None and clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf"))
            grad_norm = float(grad_norm)
            if math.isfinite(grad_norm):
                optimizer.step()
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            log("actor/pg_loss", mb["pg_loss"])
            for key, values in frac.items():
                log(key, sum(values) / len(values))
            log("actor/grad_norm", grad_norm)
            if ent_tok:
                log("actor/entropy", ent_sum / ent_tok)
            if config.entropy_coeff != 0:
                log("actor/entropy_loss", mb["entropy_loss"])
            if config.use_kl_loss:
                log("actor/kl_loss", mb["kl_loss"])
    metrics = {key: sums[key] / counts[key] for key in sums}
    if config.use_kl_loss:
        metrics["actor/kl_coef"] = float(config.kl_loss_coef)
    metrics["actor/lr"] = float(optimizer.param_groups[0]["lr"])
    metrics["actor/num_mini_batches"] = float(steps)
    metrics["actor/skipped_steps"] = float(skipped)
    return metrics
