"""What the GDRO trainer knows about one training step, as typed objects (no Ray, no TransferQueue).

:class:`GroupSchedule` is the uid -> (prompt id, scheduled count, fetch step, visit) map of every group
fetched and not yet observed; it lives across steps, so a trainer whose groups arrive steps after their fetch
(verl's asynchronous trainers) finds them. :class:`StepPlan` is one training batch's sessions, prompt ids and
outcomes; :class:`GDROStep` is one advantage stage: the plan, what it read inside verl's advantage
computation, the multipliers and the step's metrics. :func:`inside_verl_advantage` is the one seam through which
the recipe touches verl's advantage stage.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import verl.trainer.ppo.v1.trainer_base as verl_trainer_base

ROLLOUT_N_FIELD = "__rollout_n__"  # the per-prompt rollout count verl's AgentLoopWorkerTQ reads
_MISSING = object()


def split_trajectory_key(key: str) -> tuple[str, str, int]:
    """``{uid}_{session_id}_{turn}`` -> (uid, session_id, turn): verl's v1 trajectory key, split as verl 0.9.1
    splits it (``key.rsplit("_", 2)`` inline in ``v1/utils.compute_advantage_for_multi_trajectories`` and
    ``trainer_base``; verl has no parser function to call)."""
    parts = key.rsplit("_", 2)
    if len(parts) != 3:
        raise ValueError(f"unexpected trajectory key {key!r}; expected '{{uid}}_{{session_id}}_{{turn}}'")
    return parts[0], parts[1], int(parts[2])


def _session_number(session_id: str) -> int:
    try:
        return int(session_id)
    except ValueError:
        return 0


def _acc_value(extra_fields: Any) -> tuple[Any, list[str]]:
    """``reward_extra_info["acc"]`` of one trajectory's ``extra_fields`` (``_MISSING`` if absent)."""
    extra = getattr(extra_fields, "data", extra_fields)
    if not isinstance(extra, dict):
        return _MISSING, []
    info = extra.get("reward_extra_info") or {}
    if not isinstance(info, dict):
        return _MISSING, []
    return info.get("acc", _MISSING), sorted(info)


@dataclass(frozen=True)
class ScheduledGroup:
    """One fetched prompt's group: its prompt id, rollout count, the global step of the fetch and its visit
    (fetch sequence number: a prompt fetched twice is two visits, told apart and ordered by it)."""

    prompt_id: int
    count: int
    step: int
    visit: int


@dataclass
class GroupSchedule:
    """uid -> :class:`ScheduledGroup` of every group fetched and not yet observed (insertion ordered), plus the
    fetch-side metrics and driver time accrued since the last step's metrics were taken."""

    groups: OrderedDict[str, ScheduledGroup] = field(default_factory=OrderedDict)
    # taken out by an eviction (verl's replay buffer), observed with the next trained batch:
    evicted: list[StepPlan] = field(default_factory=list)  # the evicted groups with trajectories
    evicted_lost: list[ScheduledGroup] = field(default_factory=list)  # those with none (every session failed)
    fetches: int = 0
    fetch_metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, uids: Sequence[str], pids: np.ndarray, counts: np.ndarray, step: int, n_mean: float) -> None:
        """Record one dispatch (``_next_train_batch``: a step's batch, the warm-up window or a refill). Its counts
        must sum to len(uids) · n̄ exactly (the controller's schedule guarantees it; a dispatch that does not is
        refused here, before generation)."""
        gap = float(counts.sum()) - len(uids) * n_mean
        if gap != 0:
            raise RuntimeError(
                f"GDRO: a dispatch of {len(uids)} prompts was scheduled {int(counts.sum())} rollouts, not "
                f"{len(uids)} x n̄={n_mean}: the per-dispatch budget Σn = B·n̄ does not hold"
            )
        for uid, pid, n in zip(uids, pids.tolist(), counts.tolist(), strict=True):
            if "_" in uid:
                raise RuntimeError(f"uid {uid!r} contains '_', which breaks verl's trajectory keys")
            if uid in self.groups:
                raise RuntimeError(f"GDRO: uid {uid!r} dispatched twice")
            self.groups[uid] = ScheduledGroup(int(pid), int(n), int(step), self.fetches)
            self.fetches += 1
        p = self.fetch_metrics
        p["gdro/recipe/dispatches"] = p.get("gdro/recipe/dispatches", 0.0) + 1.0
        p["gdro/recipe/prompts"] = p.get("gdro/recipe/prompts", 0.0) + float(len(pids))
        p["gdro/recipe/scheduled_rollouts"] = p.get("gdro/recipe/scheduled_rollouts", 0.0) + float(counts.sum())
        p["gdro/recipe/budget_target"] = p.get("gdro/recipe/budget_target", 0.0) + float(len(pids) * n_mean)
        p["gdro/recipe/scheduled_n_min"] = float(min(p.get("gdro/recipe/scheduled_n_min", math.inf), counts.min()))
        p["gdro/recipe/scheduled_n_max"] = float(max(p.get("gdro/recipe/scheduled_n_max", -math.inf), counts.max()))

    def take(self, uids: Sequence[str]) -> dict[str, ScheduledGroup]:
        """Remove and return the groups of ``uids`` (each once); a uid never scheduled is an error."""
        missing = [u for u in dict.fromkeys(uids) if u not in self.groups]
        if missing:
            raise RuntimeError(
                f"GDRO: {len(missing)} prompt group(s) in the training batch were not scheduled by this trainer "
                f"(first uid {missing[0]!r}); a custom sampler or refill path bypassed _next_train_batch"
            )
        return {u: self.groups.pop(u) for u in dict.fromkeys(uids)}

    def evict(self, uids: set[str], keys: list[str], tags: list[dict], read_extra_fields, n_mean: float) -> None:
        """verl evicts the groups ``uids`` (their trajectories ``keys`` / ``tags``): each leaves the map, its realised
        size checked, and waits in :attr:`evicted` (or, with no trajectory, :attr:`evicted_lost`) for the next
        trained batch."""
        if keys:
            self.evicted.append(StepPlan.build(keys, tags, self, read_extra_fields, n_mean))
        empty = uids - {split_trajectory_key(k)[0] for k in keys}
        self.evicted_lost.extend(self.take(sorted(empty)).values())

    def take_evicted(self) -> tuple[list[StepPlan], list[ScheduledGroup]]:
        """The evicted groups since the last call (with trajectories, without), reset."""
        taken = (self.evicted, self.evicted_lost)
        self.evicted, self.evicted_lost = [], []
        return taken

    def drop(self, fetched_at_or_before: int) -> list[ScheduledGroup]:
        """Remove and return the groups fetched at or before that global step (groups that will not arrive)."""
        gone = [u for u, g in self.groups.items() if g.step <= fetched_at_or_before]
        return [self.groups.pop(u) for u in gone]

    def take_fetch_side(self) -> tuple[dict[str, float], float]:
        """The fetch metrics and driver seconds since the last call, reset."""
        taken = (self.fetch_metrics, self.seconds)
        self.fetch_metrics, self.seconds = {}, 0.0
        return taken

    def state_dict(self) -> dict[str, Any]:
        """The groups in flight (dispatched, not yet trained or evicted) as arrays, in dispatch order, and the
        fetch counter: what a resume needs to find the counts of the prompts verl re-issues."""
        g = list(self.groups.values())
        return {
            "uids": list(self.groups),
            "prompt_id": np.array([x.prompt_id for x in g], dtype=np.int64),
            "count": np.array([x.count for x in g], dtype=np.int64),
            "step": np.array([x.step for x in g], dtype=np.int64),
            "visit": np.array([x.visit for x in g], dtype=np.int64),
            "fetches": int(self.fetches),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = zip(state["uids"], state["prompt_id"], state["count"], state["step"], state["visit"], strict=True)
        self.groups = OrderedDict((u, ScheduledGroup(int(p), int(n), int(s), int(v))) for u, p, n, s, v in rows)
        self.fetches = int(state["fetches"])


@dataclass
class StepPlan:
    """What the recipe knows about a training batch before verl computes its advantages."""

    keys: list[str]  # all batch keys, in verl's row order (padding included)
    row_session: np.ndarray  # batch row -> session number, -1 for padding rows
    session_final_row: np.ndarray  # session -> batch row of its final turn
    session_uids: list[str]
    session_pid: np.ndarray
    session_visit: np.ndarray  # fetch sequence number of each session's group (one visit of its prompt)
    acc: np.ndarray
    order: np.ndarray  # canonical (prompt id, visit, session) feeding order of the sessions
    padding_rows: int
    failed_sessions: int  # sessions missing from the groups that arrived
    repeated_prompts: int  # groups whose prompt already has another group in this batch
    session_singleton: np.ndarray  # session -> its group holds one response (the others failed)
    row_response_len: np.ndarray  # batch row -> verl's ``response_len`` tag (NaN if absent)
    group_fetch_step: np.ndarray  # the global step each group of the batch was dispatched at
    scheduled_rollouts: int  # Σ of the batch's groups' scheduled counts

    def session_tokens_from_tags(self) -> np.ndarray:
        """Each session's generated tokens from verl's ``response_len`` tags (all turns): what an evicted group,
        whose rows never reach verl's advantage stage, has in place of its ``response_mask``."""
        real = self.row_session >= 0
        lengths = np.nan_to_num(self.row_response_len[real], nan=0.0)
        return np.bincount(self.row_session[real], weights=lengths, minlength=len(self.session_uids))

    @classmethod
    def build(
        cls,
        keys: list[str],
        tags: list[dict],
        schedule: GroupSchedule,
        read_extra_fields: Callable[[list[str]], list],
        n_mean: float,
    ) -> StepPlan:
        """Sessions, prompt ids (taken out of ``schedule``), the group-size check and each session's ``acc``
        (``read_extra_fields(final-turn keys)``: the trainer's one TransferQueue get of ``extra_fields``)."""
        # 1. real rows (skip _balance_batch's padding), grouped into sessions (one response each).
        rows = [i for i, tag in enumerate(tags) if not tag.get("is_padding", False)]
        real_keys = [keys[i] for i in rows]
        session_of_row: list[int] = []
        session_index: dict[tuple[str, str], int] = {}
        session_final: list[tuple[int, int]] = []  # (turn, local row) of each session's final output
        for key in real_keys:
            uid, session_id, turn = split_trajectory_key(key)
            s = session_index.setdefault((uid, session_id), len(session_index))
            if s == len(session_final):
                session_final.append((turn, len(session_of_row)))
            elif turn > session_final[s][0]:
                session_final[s] = (turn, len(session_of_row))
            session_of_row.append(s)
        sessions = list(session_index)  # insertion order = session number s
        session_uids = [uid for uid, _ in sessions]
        groups = schedule.take(session_uids)
        session_pid = np.array([groups[u].prompt_id for u in session_uids], dtype=np.int64)
        session_visit = np.array([groups[u].visit for u in session_uids], dtype=np.int64)
        group_size = Counter(session_uids)
        failed_sessions = check_group_sizes(groups, group_size, n_mean)

        # 2. one TransferQueue read of extra_fields, for each session's final-turn acc.
        final_keys = [real_keys[local] for _, local in session_final]
        extra = list(read_extra_fields(final_keys)) if final_keys else []
        acc_raw = []
        for s, key in enumerate(final_keys):
            value, info_keys = _acc_value(extra[s])
            if value is _MISSING:
                raise RuntimeError(
                    f"GDRO: the reward of trajectory {key!r} (prompt id {int(session_pid[s])}) reports no "
                    f"'acc' in reward_extra_info (keys: {info_keys}); the difficulty binner needs a per-response "
                    "correctness. Use a reward function returning {'score': ..., 'acc': bool} (e.g. math_dapo)"
                )
            acc_raw.append(value)
        if all(isinstance(v, (bool, np.bool_)) for v in acc_raw):
            acc = np.asarray(acc_raw, dtype=bool)
        else:
            acc = np.array([np.nan if v is None else float(v) for v in acc_raw], dtype=np.float64)

        # Canonical feeding order (prompt id, visit, session): the controller's state does not depend on
        # TransferQueue's key order, so a resumed run reproduces the uninterrupted one bit for bit.
        session_numbers = np.array([_session_number(sid) for _, sid in sessions])
        row_session = np.full(len(keys), -1, dtype=np.int64)  # -1: padding rows keep verl's advantage
        row_session[np.asarray(rows, dtype=np.int64)] = np.asarray(session_of_row, dtype=np.int64)
        return cls(
            keys=list(keys),
            row_session=row_session,
            session_final_row=np.array([rows[local] for _, local in session_final], dtype=np.int64),
            session_uids=session_uids,
            session_pid=session_pid,
            session_visit=session_visit,
            acc=acc,
            order=np.lexsort((session_numbers, session_visit, session_pid)),
            padding_rows=len(keys) - len(rows),
            failed_sessions=failed_sessions,
            repeated_prompts=len(groups) - len({g.prompt_id for g in groups.values()}),
            session_singleton=np.array([group_size[u] == 1 for u in session_uids], dtype=bool),
            row_response_len=np.array([float(t.get("response_len", np.nan)) for t in tags], dtype=np.float64),
            group_fetch_step=np.array([g.step for g in groups.values()], dtype=np.int64),
            scheduled_rollouts=sum(g.count for g in groups.values()),
        )


def check_group_sizes(groups: dict[str, ScheduledGroup], realised: Counter, n_mean: float) -> int:
    """Realised group size of each prompt against its scheduled count (issue 11 item 3); returns the sessions
    missing from the groups that arrived.

    A group may come back smaller than scheduled only because sessions failed (verl leaves a failed session's
    trajectory out). A group LARGER than its count means the rollout worker did not honour ``__rollout_n__``:
    since the counts of a step sum to exactly B·n̄, a worker ignoring them (every group gets
    ``actor_rollout_ref.rollout.n``) always makes some group exceed its count as soon as the counts differ.
    """
    failed_sessions = 0
    for uid, got in realised.items():
        group = groups[uid]
        if got > group.count:
            raise RuntimeError(
                f"GDRO: prompt id {group.prompt_id} (uid {uid}) was scheduled {group.count} rollouts but {got} "
                f"responses reached the advantage stage. The rollout worker does not honour the per-prompt count "
                f"`{ROLLOUT_N_FIELD}` (a verl without it gives every group actor_rollout_ref.rollout.n={n_mean}), "
                "so the Rollout-GDRO allocation is not what was trained on. Use verl 0.9.1's AgentLoopWorkerTQ "
                "(trainer.use_v1=true)"
            )
        failed_sessions += group.count - got
    return failed_sessions


@dataclass
class GDROStep:
    """One advantage stage: the plan, what was read inside verl's advantage computation, the multipliers.

    ``adjust``: the advantages must change (Prompt-GDRO on, or a singleton group with an adversary on);
    ``zero_singletons``: an adversary is on (a group of one response gets advantage 0)."""

    plan: StepPlan
    adjust: bool
    zero_singletons: bool
    lost: list[ScheduledGroup] = field(default_factory=list)  # groups that will not arrive
    # groups verl's replay buffer evicted since the last step (stale, failed): observed with this step, never trained
    evicted: list[StepPlan] = field(default_factory=list)
    row_score: np.ndarray | None = None
    session_tokens: np.ndarray | None = None
    multipliers: np.ndarray | None = None  # per session, canonical order (the controller's)
    row_multiplier: np.ndarray | None = None
    adjusted: bool = False
    train_step: int = 0  # the global step that trains the batch
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def read_advantages(self, data, batch_keys: list[str]) -> None:
        """Inside verl's advantage stage: each row's score (for the per-prompt metrics) and each session's
        generated tokens (its rows' ``response_mask`` summed: all turns, padding skipped)."""
        plan = self.plan
        if list(batch_keys) != plan.keys:
            raise RuntimeError("GDRO: verl computed advantages for other keys than the batch the recipe read")
        if "token_level_scores" in data.batch.keys():
            self.row_score = data.batch["token_level_scores"].sum(dim=-1).double().numpy()
        row_tokens = data.batch["response_mask"].sum(dim=-1).double().numpy()
        real = plan.row_session >= 0
        self.session_tokens = np.bincount(
            plan.row_session[real], weights=row_tokens[real], minlength=len(plan.session_uids)
        )

    def observe(self, controller, abs_adv: np.ndarray | None) -> np.ndarray:
        """Feed the controller in canonical order, the batch's sessions then each evicted group's (their |A| is
        0: they carry no gradient); the batch's per-session multipliers (canonical order)."""
        o, plan, tokens = self.plan.order, self.plan, self.session_tokens
        pid, acc, visit = [plan.session_pid[o]], [plan.acc[o]], [plan.session_visit[o]]
        adv = None if abs_adv is None else [abs_adv[o]]
        length = None if tokens is None else [tokens[o]]
        for ev in self.evicted:
            pid.append(ev.session_pid[ev.order])
            acc.append(ev.acc[ev.order])
            visit.append(ev.session_visit[ev.order])
            adv = None if adv is None else [*adv, np.zeros(len(ev.order))]
            length = None if length is None else [*length, ev.session_tokens_from_tags()[ev.order]]
        multipliers = controller.observe(
            np.concatenate(pid),
            np.concatenate(acc),
            None if adv is None else np.concatenate(adv),
            response_visit_ids=np.concatenate(visit),
            response_length=None if length is None else np.concatenate(length),
        )
        self.multipliers = multipliers[: len(o)]
        return self.multipliers

    def scale(self, data, controller, prompt_weights: bool) -> None:
        """Inside verl's advantage stage: zero singleton groups, and with ``prompt_weights`` observe with |A|
        and multiply each response's advantage row by its Prompt-GDRO weight, A(x, i) × w(bin(x)) (paper, Eq. 6).
        GRPO gives one scalar per response, broadcast over its masked tokens, so |A| = max_t |A_t|.

        verl's GRPO gives a group of one mean 0 and std 1, so its advantage is the raw ±1 reward, not a
        baseline-corrected one; a failed session at n_min = 2 leaves such a group (``singleton_groups``)."""
        plan, adv = self.plan, data.batch["advantages"]
        real = plan.row_session >= 0
        singleton = (
            np.where(plan.session_singleton, 0.0, 1.0) if self.zero_singletons else np.ones(len(plan.session_singleton))
        )
        row_mult = np.ones(len(plan.keys), dtype=np.float64)
        row_mult[real] = singleton[plan.row_session[real]]
        if prompt_weights:
            row_abs = torch.linalg.vector_norm(adv, ord=float("inf"), dim=1)  # one pass, no temporary
            abs_adv = row_abs[torch.as_tensor(plan.session_final_row)].double().numpy()
            observed = self.observe(controller, np.nan_to_num(abs_adv, nan=0.0) * singleton)
            per_session = np.empty(len(observed), dtype=np.float64)
            per_session[plan.order] = observed
            row_mult[real] *= per_session[plan.row_session[real]]
        # A new tensor (not in place): verl's ``returns`` is the same tensor and stays GRPO's.
        data.batch["advantages"] = adv * torch.from_numpy(row_mult).to(adv.dtype).unsqueeze(-1)
        self.row_multiplier = row_mult
        self.adjusted = True

    def in_advantage_stage(self, controller, prompt_weights: bool) -> Callable[[Any, list[str]], None]:
        """The hook :func:`inside_verl_advantage` calls on verl's advantages."""

        def hook(data, batch_keys: list[str]) -> None:
            self.read_advantages(data, batch_keys)
            if self.adjust:
                start = time.perf_counter()
                self.scale(data, controller, prompt_weights)
                self.seconds += time.perf_counter() - start

        return hook

    def row_multiplier_of_key(self) -> dict[str, float]:
        """Batch key -> the factor GDRO applied to that row's advantage (1 where nothing changed)."""
        mult = self.row_multiplier if self.row_multiplier is not None else np.ones(len(self.plan.keys))
        return dict(zip(self.plan.keys, mult.tolist(), strict=True))

    def per_prompt_metrics(self) -> dict[str, float]:
        """verl's ``critic/score/mean`` and ``response_length/mean`` average over responses, so under
        Rollout-GDRO a prompt with more rollouts counts more. These average each group (one visit of one
        prompt) first, then the groups: comparable across methods with different per-prompt counts."""
        plan = self.plan
        rows = np.flatnonzero(plan.row_session >= 0)
        if len(rows) == 0:
            return {}
        uids = np.asarray(plan.session_uids, dtype=object)[plan.row_session[rows]]
        _, group = np.unique(uids.astype(str), return_inverse=True)
        size = np.bincount(group)

        def per_prompt_mean(values: np.ndarray) -> float:
            return float(np.mean(np.bincount(group, weights=values) / size))

        out = {}
        if self.row_score is not None:
            out["gdro/per_prompt/score_mean"] = per_prompt_mean(self.row_score[rows])
        lengths = plan.row_response_len[rows]
        if np.all(np.isfinite(lengths)):
            out["gdro/per_prompt/response_length_mean"] = per_prompt_mean(lengths)
        return out

    def finish(self, controller, fetch_metrics: dict[str, float], fetch_seconds: float) -> dict[str, float]:
        """The step's ``gdro/*`` metrics (kept in ``self.metrics`` for the metrics file); the finite ones are
        returned for verl's metrics dict."""
        plan, observed = self.plan, self.multipliers
        m = dict(controller.metrics())
        m.update(fetch_metrics)
        m["gdro/recipe/realised_rollouts"] = float(len(plan.session_uids))
        m["gdro/recipe/trained_scheduled_rollouts"] = float(plan.scheduled_rollouts)
        m["gdro/recipe/trained_groups"] = float(len(plan.group_fetch_step))
        m["gdro/recipe/trained_rows"] = float(np.count_nonzero(plan.row_session >= 0))
        if self.session_tokens is not None:
            m["gdro/recipe/trained_tokens"] = float(self.session_tokens.sum())
        if len(plan.group_fetch_step):  # dispatch-to-train lag, in global steps (= weight versions)
            lag = dispatch_lag(plan.group_fetch_step, self.train_step)
            m["gdro/recipe/lag_mean"], m["gdro/recipe/lag_max"] = float(lag.mean()), float(lag.max())
        m["gdro/recipe/evicted_groups"] = float(sum(len(ev.group_fetch_step) for ev in self.evicted))
        m["gdro/recipe/evicted_rollouts"] = float(sum(len(ev.session_uids) for ev in self.evicted))
        m["gdro/recipe/failed_sessions"] = float(
            plan.failed_sessions + sum(ev.failed_sessions for ev in self.evicted) + sum(g.count for g in self.lost)
        )
        m["gdro/recipe/failed_groups"] = float(len(self.lost))
        m["gdro/recipe/singleton_groups"] = float(plan.session_singleton.sum())
        m["gdro/recipe/padding_rows"] = float(plan.padding_rows)
        m["gdro/recipe/repeated_prompts"] = float(plan.repeated_prompts)
        m["gdro/recipe/multiplier_mean"] = float(np.mean(observed)) if observed is not None and len(observed) else 1.0
        m["gdro/recipe/driver_ms"] = 1000.0 * (fetch_seconds + self.seconds)
        m.update(self.per_prompt_metrics())
        self.metrics = m
        return {k: v for k, v in m.items() if math.isfinite(v)}

    def take_metrics(self) -> dict[str, float]:
        """The step's metrics once (for the metrics file's line); empty afterwards."""
        taken, self.metrics = self.metrics, {}
        return taken


def dispatch_lag(fetch_steps: np.ndarray, train_step: int) -> np.ndarray:
    """Global steps between each group's dispatch and the step that trains it (0 on the sync trainer)."""
    return train_step - np.asarray(fetch_steps, dtype=np.int64)


@contextmanager
def inside_verl_advantage(hook: Callable[[Any, list[str]], None]) -> Iterator[list[bool]]:
    """The recipe's one seam into verl's advantage stage: within the block, verl's v1 ``_compute_advantage`` calls
    ``hook(data, batch_keys)`` on the DataProto returned by ``compute_advantage_for_multi_trajectories`` (verl's
    GRPO advantages, broadcast over the response tokens), before it converts them to nested tensors and writes
    them to TransferQueue in its single put: the recipe adds no write. Yields a one-element list set to True
    once the hook ran (the caller checks it: a verl whose stage does not call that function is refused).

    verl 0.9.1 offers no smaller extension point: ``_compute_advantage`` reads, computes and writes in one method,
    and an estimator registered with ``core_algos.register_adv_est`` would change ``algorithm.adv_estimator``
    (verl then skips its GRPO final-turn broadcast) and receives no batch keys. So the module-level name, looked
    up in ``verl.trainer.ppo.v1.trainer_base`` at call time, is swapped for the block and restored in ``finally``;
    nothing outside the block (validation, other trainers) sees the wrapper."""
    original = verl_trainer_base.compute_advantage_for_multi_trajectories
    ran = [False]

    def wrapped(data, batch_keys, *args, **kwargs):
        out = original(data, batch_keys, *args, **kwargs)
        hook(out, batch_keys)
        ran[0] = True
        return out

    verl_trainer_base.compute_advantage_for_multi_trajectories = wrapped
    try:
        yield ran
    finally:
        verl_trainer_base.compute_advantage_for_multi_trajectories = original


class PinnedExtraInfo(dict):
    """A ``KVBatchMeta.extra_info`` whose ``pinned`` keys survive verl's ``extra_info.update(...)``: the seam
    through which the asynchronous GDRO trainers set the rows of each actor mini-batch (``mini_batch_size``,
    ``global_batch_size``) while verl's own ``_update_actor`` builds and sends the rest. It pickles (to the
    worker, through Ray) and deep-copies as a plain dict."""

    def __init__(self, base: dict, pinned: dict):
        super().__init__(base)
        self.pinned = dict(pinned)
        super().update(self.pinned)

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        super().update(self.pinned)

    def __reduce__(self):
        return dict, (dict(self),)


def rows_per_update(batch_rows: int, updates: int) -> int:
    """The rows of each of ``updates`` equal actor mini-batches of a batch of ``batch_rows`` (padding included)."""
    if updates <= 0 or batch_rows % updates:
        raise RuntimeError(f"GDRO: a batch of {batch_rows} rows does not split into {updates} equal mini-batches")
    return batch_rows // updates


class EvictionObserver:
    """In front of verl's ``ReplayBuffer`` / ``ReplayBufferAsync`` (:func:`observe_evictions`): every group its
    ``_clear_groups`` removes from the ``train`` partition (stale, failed, filtered or surplus: the one method all
    of verl 0.9.1's evictions go through) is handed to ``gdro_on_evict(uids, keys, tags)`` with its trajectories'
    keys and tags, before TransferQueue forgets them."""

    gdro_on_evict: Callable[[set, list, list], None] | None = None

    def _clear_groups(self, partition_id: str, uids: set[str]) -> None:
        if uids and partition_id == "train" and self.gdro_on_evict is not None:
            trajectories = self.partitions[partition_id]
            keys = [k for k in trajectories if k.split("_")[0] in uids]
            self.gdro_on_evict(set(uids), keys, [trajectories[k] for k in keys])
        super()._clear_groups(partition_id, uids)


def observe_evictions(buffer, on_evict: Callable[[set, list, list], None]):
    """``buffer`` (built by verl's ``_build_replay_buffer``) as an instance of its class with
    :class:`EvictionObserver` in front, calling ``on_evict``."""
    buffer.__class__ = type(f"GDRO{type(buffer).__name__}", (EvictionObserver, type(buffer)), {})
    buffer.gdro_on_evict = on_evict
    return buffer
