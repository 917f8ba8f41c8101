"""Online difficulty binner (paper §3.1.2; docs/controllers.md).

Each prompt, keyed by its stable dataset id, keeps a ring buffer of its last H visits, one
``(correct, rollouts)`` pair per visit. Its difficulty statistic is the windowed mean accuracy

    p̂(x) = Σ_{visits in window} correct / Σ_{visits in window} rollouts          (pass@1 estimate)

and pass@k = 1 - (1 - p̂)^k is a derived view. With ``half_life`` h set, the statistic is instead
recency-weighted over all of the prompt's visits, the visit j visits ago weighted λ^j, λ = 2^(-1/h):

    p̂(x) = C / N,   C ← λ C + correct,   N ← λ N + rollouts          (two floats per prompt)

We record counts rather than "solved at least
once" because with Rollout-GDRO a prompt given 12 rollouts is solved at least once far more
often than one given 2: an any-correct statistic would depend on the allocation itself.

Bins are accuracy intervals a_0 = 0 < a_1 < ... < a_K = 1; bin 0 is the hardest. A prompt moves
out of its current bin only when p̂ lies beyond the bin's boundary by more than the hysteresis
margin δ. Never-visited prompts form their own group K (``unseen=own_bin``) or are placed at a
prior accuracy (``unseen=prior``); they are never lumped into the hardest bin.

All state is dense arrays indexed by prompt id (ids must be integers in [0, num_prompts)); an
update touches only the rows of the batch, so its cost is O(batch) whatever the dataset size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from verl_ext.config import BinnerConfig

UNSEEN = -1  # bin of a prompt with no visit yet
_SUM_C, _SUM_N, _VISITS, _PACK = range(4)  # columns of OnlineDifficultyBinner._meta


class PromptIdError(ValueError):
    """Prompt ids that cannot key the binner: missing, non-integer, out of range or duplicated."""


def check_prompt_ids(
    ids: Any, *, num_prompts: int | None = None, what: str = "prompt ids", check_unique: bool = True
) -> np.ndarray:
    """Validate a batch (or a whole dataset column) of prompt ids and return them as int64.

    Raises :class:`PromptIdError` naming the first offending row and value when an id is missing
    (None / NaN), not an integer, negative, >= ``num_prompts``, or appears twice.
    """
    arr = np.asarray(ids, dtype=object) if not isinstance(ids, np.ndarray) else ids
    if arr.ndim != 1:
        raise PromptIdError(f"{what}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        # Slow path only for object / float input: find the first row that is not an integer.
        out = np.empty(len(arr), dtype=np.int64)
        for row, value in enumerate(arr.tolist()):
            if value is None or (isinstance(value, float) and not np.isfinite(value)):
                raise PromptIdError(
                    f"{what}: row {row} has no id (value {value!r}); every prompt needs extra_info.index"
                )
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
                raise PromptIdError(
                    f"{what}: row {row} has id {value!r} of type {type(value).__name__}; ids must be integers"
                )
            if not float(value).is_integer():
                raise PromptIdError(f"{what}: row {row} has a non-integer id {value!r}")
            out[row] = int(value)
        arr = out
    else:
        arr = arr.astype(np.int64, copy=False)
    if len(arr) and arr.min() < 0:
        row = int(np.argmax(arr < 0))
        raise PromptIdError(f"{what}: row {row} has a negative id {int(arr[row])}")
    if num_prompts is not None and len(arr) and arr.max() >= num_prompts:
        row = int(np.argmax(arr >= num_prompts))
        raise PromptIdError(f"{what}: row {row} has id {int(arr[row])} outside [0, {num_prompts}) (binner capacity)")
    if check_unique and len(arr) > 1:
        order = np.argsort(arr, kind="stable")
        sorted_ids = arr[order]
        dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
        if len(dup):
            first, second = sorted(order[dup[0] : dup[0] + 2].tolist())
            raise PromptIdError(
                f"{what}: id {int(arr[first])} appears at rows {first} and {second}; ids must be unique "
                "(verl's RLHFDataset fills a missing extra_info.index with 0, so every prompt collides)"
            )
    return arr


@dataclass
class BinnerUpdate:
    """What one update saw: per-prompt accuracy of this visit and counters for metrics."""

    batch_accuracy: np.ndarray  # (B,) correct / rollouts of this visit
    num_nonfinite: int  # rewards that were NaN/inf and counted as incorrect
    num_moved: int  # prompts whose bin changed


class OnlineDifficultyBinner:
    """Sliding-window pass-rate binner with hysteresis, keyed by dense prompt ids.

    Groups are numbered 0..K-1 for the accuracy bins (0 = hardest) and K for unseen prompts
    (``unseen=own_bin``), so controllers size their arrays with :attr:`num_groups`.
    """

    def __init__(self, config: BinnerConfig, num_prompts: int):
        if not isinstance(num_prompts, (int, np.integer)) or num_prompts < 1:
            raise ValueError(f"num_prompts={num_prompts!r} must be a positive integer")
        self.config = config
        self.num_prompts = int(num_prompts)
        self.edges = np.asarray(config.edges(), dtype=np.float64)
        self.num_bins = len(self.edges) - 1
        self.num_groups = self.num_bins + (1 if config.unseen == "own_bin" else 0)
        self.unseen_group = (
            self.num_bins if config.unseen == "own_bin" else self._bin_of(np.array([config.unseen_prior]))[0]
        )
        h = config.window
        # Layout for O(batch) steps on a 1M-prompt table (every array is zero-initialised, so
        # np.zeros maps pages lazily and untouched prompts cost no memory):
        # * ``_meta`` (P, 4) int32, one 16-byte row per prompt: Σ correct and Σ rollouts over the
        #   window, total visits, and (bin + 1) << 16 | ring cursor (0 = never seen): a batch
        #   gather touches one cache line per prompt instead of one per array.
        # * ``_ring`` (P, H, 2) uint16: (correct, rollouts) of the last H visits, interleaved so a
        #   visit's eviction and write touch one slot. uint16: RolloutGDROConfig caps n_max.
        if h >= 1 << 16:
            raise ValueError(f"binner.window={h} must be < 65536")
        self._meta = np.zeros((self.num_prompts, 4), dtype=np.int32)
        self._ring = np.zeros((self.num_prompts, h, 2), dtype=np.uint16)
        self._num_seen = 0  # prompts with at least one visit (seen_fraction without an O(P) scan)
        # half_life: recency-weighted (Σ λ^j correct, Σ λ^j rollouts) per prompt, float64.
        self._decay_rate = None if config.half_life is None else float(0.5 ** (1.0 / config.half_life))
        self._decayed = None if config.half_life is None else np.zeros((self.num_prompts, 2), dtype=np.float64)
        self.total_nonfinite = 0

    def _bins(self, meta: np.ndarray) -> np.ndarray:
        """Bin per gathered meta row (UNSEEN = -1 for a prompt never seen)."""
        return (meta[:, _PACK] >> 16) - 1

    # ------------------------------------------------------------------ queries
    def _bin_of(self, accuracy: np.ndarray) -> np.ndarray:
        """Plain interval lookup; accuracy 1.0 falls in the last bin."""
        return np.clip(np.searchsorted(self.edges, accuracy, side="right") - 1, 0, self.num_bins - 1).astype(np.int32)

    def groups_of(self, prompt_ids: np.ndarray) -> np.ndarray:
        """Current group of each prompt (0..K-1 by accuracy, :attr:`unseen_group` if never seen)."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        bins = (self._meta[ids, _PACK] >> 16).astype(np.int64) - 1
        return np.where(bins == UNSEEN, self.unseen_group, bins)

    def accuracy_of(self, prompt_ids: np.ndarray) -> np.ndarray:
        """Windowed mean accuracy p̂ (NaN for a prompt never seen)."""
        num, den = self.window_sums(prompt_ids)
        num, den = num.astype(np.float64), den.astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.maximum(den, 1), np.nan)

    def pass_at_k(self, prompt_ids: np.ndarray, k: int) -> np.ndarray:
        """Derived pass@k = 1 - (1 - p̂)^k from the windowed accuracy."""
        return 1.0 - (1.0 - self.accuracy_of(prompt_ids)) ** k

    def visits_of(self, prompt_ids: np.ndarray) -> np.ndarray:
        return self._meta[np.asarray(prompt_ids, dtype=np.int64), _VISITS].astype(np.int64)

    def window_sums(self, prompt_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(Σ correct, Σ rollouts) over each prompt's window (zeros for a prompt never seen).

        With ``half_life`` set, the recency-weighted sums (float64): N is then the effective number
        of rollouts the estimate rests on.
        """
        if self._decayed is not None:
            d = self._decayed[np.asarray(prompt_ids, dtype=np.int64)]
            return d[:, 0], d[:, 1]
        meta = self._meta[np.asarray(prompt_ids, dtype=np.int64)]
        return meta[:, _SUM_C].astype(np.int64), meta[:, _SUM_N].astype(np.int64)

    def seen_fraction(self) -> float:
        return self._num_seen / self.num_prompts

    # ------------------------------------------------------------------ update
    def update(self, prompt_ids: Any, correct: Any, rollouts: Any, num_nonfinite: int = 0) -> BinnerUpdate:
        """Record one visit per prompt: ``correct[i]`` successes out of ``rollouts[i]`` rollouts.

        ``prompt_ids`` must be unique within the batch. ``num_nonfinite`` is the number of
        NaN/inf rewards the caller already counted as incorrect (see :func:`aggregate_responses`).
        """
        ids = check_prompt_ids(prompt_ids, num_prompts=self.num_prompts)
        correct = np.asarray(correct, dtype=np.int64)
        rollouts = np.asarray(rollouts, dtype=np.int64)
        if correct.shape != ids.shape or rollouts.shape != ids.shape:
            raise ValueError(
                f"binner.update: shapes differ: ids {ids.shape}, correct {correct.shape}, rollouts {rollouts.shape}"
            )
        if np.any(rollouts < 1) or np.any(correct < 0) or np.any(correct > rollouts):
            row = int(np.argmax((rollouts < 1) | (correct < 0) | (correct > rollouts)))
            raise ValueError(
                f"binner.update: row {row} (prompt {int(ids[row])}) has correct={int(correct[row])}, "
                f"rollouts={int(rollouts[row])}; need 0 <= correct <= rollouts and rollouts >= 1"
            )
        if np.any(rollouts > np.iinfo(np.uint16).max):
            raise ValueError("binner.update: more than 65535 rollouts in one visit")

        meta = self._meta[ids]  # one gather of every per-prompt scalar
        cursor = meta[:, _PACK] & 0xFFFF
        old = self._bins(meta)
        # Evict the visit leaving the window from the running sums (zeros until the ring is full).
        evicted = self._ring[ids, cursor].astype(np.int32)
        sum_c = meta[:, _SUM_C] + correct - evicted[:, 0]
        sum_n = meta[:, _SUM_N] + rollouts - evicted[:, 1]
        self._ring[ids, cursor] = np.stack([correct, rollouts], axis=1).astype(np.uint16)

        if self._decayed is None:
            acc = sum_c / sum_n
        else:
            decayed = self._decayed[ids] * self._decay_rate + np.stack([correct, rollouts], axis=1)
            self._decayed[ids] = decayed
            acc = decayed[:, 0] / decayed[:, 1]
        target = self._bin_of(acc)
        delta = self.config.hysteresis
        if delta > 0:
            seen = old != UNSEEN
            lo = self.edges[np.where(seen, old, 0)]
            hi = self.edges[np.where(seen, old, 0) + 1]
            inside = (acc >= lo - delta) & (acc <= hi + delta)
            new = np.where(seen & inside, old, target)
        else:
            new = target
        meta[:, _SUM_C] = sum_c
        meta[:, _SUM_N] = sum_n
        meta[:, _VISITS] += 1
        meta[:, _PACK] = ((new + 1) << 16) | ((cursor + 1) % self.config.window)
        self._meta[ids] = meta
        self._num_seen += int(np.count_nonzero(old == UNSEEN))
        self.total_nonfinite += int(num_nonfinite)
        return BinnerUpdate(
            batch_accuracy=correct / rollouts,
            num_nonfinite=int(num_nonfinite),
            num_moved=int(np.count_nonzero((old != UNSEEN) & (old != new))),
        )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "window": self.config.window,
            "edges": self.edges.copy(),
            "meta": self._meta.copy(),
            "ring": self._ring.copy(),
            "total_nonfinite": self.total_nonfinite,
            "half_life": self.config.half_life,
            "decayed": None if self._decayed is None else self._decayed.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_prompts"]) != self.num_prompts or int(state["window"]) != self.config.window:
            raise ValueError(
                f"binner checkpoint is for num_prompts={state['num_prompts']}, window={state['window']}; "
                f"this run has num_prompts={self.num_prompts}, window={self.config.window}"
            )
        if not np.array_equal(np.asarray(state["edges"]), self.edges):
            raise ValueError(
                f"binner checkpoint bin edges {list(state['edges'])} differ from the config's {list(self.edges)}"
            )
        if state.get("half_life") != self.config.half_life:
            raise ValueError(
                f"binner checkpoint has half_life={state.get('half_life')!r}; this run has "
                f"binner.half_life={self.config.half_life!r}"
            )
        self._meta[...] = state["meta"]
        if self._decayed is not None:
            self._decayed[...] = state["decayed"]
        self._ring[...] = state["ring"]
        self._num_seen = int(np.count_nonzero(self._meta[:, _VISITS]))
        self.total_nonfinite = int(state["total_nonfinite"])


def aggregate_responses(response_prompt_ids: Any, response_correct: Any, return_inverse: bool = False) -> tuple:
    """Per-response outcomes → per-prompt ``(ids, correct, rollouts)`` plus the NaN/inf count.

    ``response_correct`` may be verl's boolean ``acc`` or a float reward where > 0 means correct;
    NaN and inf values count as incorrect and are counted (never crash, never poison the state).
    Prompts are returned in order of first appearance; with ``return_inverse`` a fifth element
    maps each response to its prompt's row.
    """
    pid = np.asarray(response_prompt_ids, dtype=np.int64)
    raw = np.asarray(response_correct)
    if raw.dtype == bool:
        ok = raw
        nonfinite = 0
    else:
        val = raw.astype(np.float64)
        finite = np.isfinite(val)
        nonfinite = int(np.count_nonzero(~finite))
        ok = finite & (val > 0)
    uniq, first, inverse = np.unique(pid, return_index=True, return_inverse=True)
    correct = np.bincount(inverse, weights=ok, minlength=len(uniq)).astype(np.int64)
    rollouts = np.bincount(inverse, minlength=len(uniq)).astype(np.int64)
    order = np.argsort(first, kind="stable")
    out = (uniq[order], correct[order], rollouts[order], nonfinite)
    if return_inverse:
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        out = out + (rank[inverse],)
    return out
