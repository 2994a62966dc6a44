"""Trajectory buffer: turns a stream of finished groups into deterministic, balanced learner batches.

Job, in order, for every learner step:

1. **Staleness gate.** Groups older than ``max_staleness`` versions are dropped — on arrival if they are
   already too old for the learner's current version, and again when a batch is taken. Staleness only
   grows as the learner advances, so a group dropped as too stale could never have become usable. Drops
   are never silent: they are counted in the step's metrics and queued as :class:`DropRecord`\\ s that
   the caller drains (:meth:`TrajectoryBuffer.drain_drops`, the only drop channel) to return each slot to
   the admission controller exactly once.
2. **Deterministic selection**, in one of two consumption modes (``consume``, config ``staleness.consume``).
   ``arrival``: a batch is the ``groups_per_step`` waiting groups with the lowest global sequence index
   (``TrajectoryGroup.index``), in index order, so it does not depend on the order in which groups happened
   to arrive. Lowest index first also means oldest first, which keeps staleness low. The learner does not
   wait for missing indices: a slow group is overtaken by younger ones and trained on later, which is where
   the staleness gate above can catch it. ``in_order``: a batch is the ``groups_per_step`` lowest indices
   not yet consumed or dropped, and the learner waits for every one of them; with the admission rule this
   means a fixed bound drops nothing (docs/architecture.md, "Consumption order").
3. **StarPO-S filter** on the groups' raw scores (``algo.filtering.select_groups_by_reward_std``).
4. **Scores.** Raw trajectory scores and scores normalised within their group
   (``algo.advantages.group_normalize``), computed once for the whole batch.
5. **Sharding.** Kept trajectories are split into ``num_ranks`` :class:`BatchShard`\\ s balanced by total
   token count, the cost of a forward/backward pass (greedy longest-processing-time: deterministic, and the
   heaviest shard exceeds the lightest by at most one trajectory). Every shard carries the whole batch's
   ``batch_num_tokens`` / ``batch_num_seqs`` so that data-parallel loss aggregation equals the
   single-process loss.

In *fixed-lag* mode the engines serve the weights of version v − k (docs/architecture.md), so every consumed
group must have staleness exactly ``min(k, v)``; a group that does not is dropped as ``off_lag``.

Pure Python + numpy + torch (for the algo calls); no zmq or ray. Times are passed in, never read.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ragen_async.algo.advantages import GROUP_NORM_MODES, group_normalize
from ragen_async.algo.filtering import FILTER_MODES, select_groups_by_reward_std
from ragen_async.protocol import AnyGroup, AnyTrajectory, BatchShard
from ragen_async.staleness.ages import StalenessStats, group_staleness, staleness_of
from ragen_async.staleness.bound import StalenessBound
from ragen_async.staleness.ids import group_index

__all__ = [
    "Batch",
    "BufferNotReady",
    "DropRecord",
    "TrajectoryBuffer",
    "balance_by_tokens",
]

DropReason = Literal["stale", "off_lag"]
DropSite = Literal["add", "consume"]
CONSUME_MODES = ("arrival", "in_order")
"""How a batch picks its groups (module docstring, 2.)."""

@dataclass(frozen=True, slots=True)
class DropRecord:
    """One group the buffer refused to train on, with what a comparison with the consumed groups needs."""

    group_id: str
    index: int
    staleness: int
    learner_version: int
    where: DropSite
    reason: DropReason
    bound: int | None = None
    """The bound the group was held to: the one in force at the drop, or in in-order mode the one it was
    admitted under (``StalenessBound.of``)."""
    waited_s: float | None = None
    """Seconds the group had waited in the buffer (0 when dropped on arrival; ``None``: no time was given)."""
    env_tag: str = ""
    seed: int = 0
    """The environment seed (level) the group played."""
    worker: str = ""
    facts: dict[str, float | int] | None = None
    """``turns``, ``tokens``, ``success``, ``in_flight_s`` (:meth:`~ragen_async.protocol._GroupFacts.episode_facts`)."""
    scores: tuple[float, ...] = ()

    @property
    def past_bound(self) -> int | None:
        """How late it was: versions past the bound (``staleness - bound``; under fixed lag, off the lag)."""
        return None if self.bound is None else self.staleness - self.bound

    def as_record(self) -> dict:
        """The drop as ``provenance.jsonl`` keeps it (``index``, ``reason``, ``where``, ``staleness`` as before;
        then the bound, how late, the level, the worker and the episode statistics)."""
        return {"index": self.index, "reason": self.reason, "where": self.where, "staleness": self.staleness,
                "group_id": self.group_id, "learner_version": self.learner_version, "bound": self.bound,
                "past_bound": self.past_bound,
                "waited_s": None if self.waited_s is None else round(self.waited_s, 4),
                "env_tag": self.env_tag, "seed": self.seed, "worker": self.worker, **(self.facts or {}),
                "scores": [round(float(x), 6) for x in self.scores]}


@dataclass(frozen=True, slots=True)
class Batch:
    """What one learner step trains on, as the buffer assembled it."""

    shards: list[BatchShard]
    """One per learner rank (``shards[r].rank == r``)."""
    groups: list[AnyGroup]
    """The ``groups_per_step`` groups taken, before the StarPO-S filter (all of them are consumed)."""
    metrics: dict[str, float]
    """``filter/*``, ``batch/*``, ``rollout/queue_groups``, ``rollout/buffer_wait_s``, ``staleness/*``."""

    @property
    def indices(self) -> list[int]:
        return [g.index for g in self.groups]


class BufferNotReady(RuntimeError):
    """``next_batch`` was called while fewer than ``groups_per_step`` usable groups were waiting."""


def balance_by_tokens(costs: Sequence[int], num_bins: int) -> list[list[int]]:
    """Split item indices into ``num_bins`` lists with near-equal total cost (greedy LPT).

    Items are placed heaviest first (ties: lower index first) onto the bin with the least cost so far
    (ties: fewer items, then lower bin), which is deterministic, gives every bin an item when there are
    at least ``num_bins`` items, and bounds max − min bin cost by the largest item. Each returned list is
    in ascending index order.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heap = [(0, 0, b) for b in range(num_bins)]  # (cost, items, bin)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        cost, count, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (cost + costs[i], count + 1, b))
    return [sorted(items) for items in bins]


class TrajectoryBuffer:
    """Holds finished groups until the learner asks for a batch; see the module docstring.

    Not thread-safe: call it from the thread that owns the learner loop.
    """

    def __init__(
        self,
        groups_per_step: int,
        max_staleness: int | None = None,
        filter_mode: str = "std",
        filter_ratio: float = 0.25,
        norm_mode: str = "mean_std",
        num_ranks: int = 1,
        fixed_lag: bool = False,
        group_size: int | None = None,
        consume: str = "in_order",
        hist_max: int | None = None,
        bound: StalenessBound | None = None,
    ) -> None:
        """
        Args:
            groups_per_step: groups consumed per learner step (B).
            max_staleness: k; ``None`` for unbounded (then nothing is ever dropped). Without ``bound``, the
                buffer holds a bound of its own that never moves.
            filter_mode / filter_ratio: StarPO-S filter (``"std"`` | ``"std_rev"`` | ``"none"``, keep ratio).
            norm_mode: group normalisation of scores (``"mean_std"`` | ``"mean"`` | ``"identity"`` | ``"asym_clip"``).
            num_ranks: learner data-parallel world size; one shard per rank.
            fixed_lag: require staleness exactly ``min(k, v)`` (needs a finite k).
            group_size: trajectories per group, if known up front; used only to check at construction that
                every rank will get at least one trajectory. Without it the check happens per batch.
            consume: ``"arrival"`` (the lowest-index groups waiting) or ``"in_order"`` (the lowest indices not
                yet consumed or dropped, waited for); see the module docstring.
            hist_max: the token-age histogram's last bin before overflow (``staleness/token_hist/*``); default
                ``max_staleness``, or 16 when unbounded (ignored with ``bound``, which carries its own).
            bound: the run's :class:`~ragen_async.staleness.bound.StalenessBound`, which the buffer asks for each
                group's bound (``max_staleness`` and ``fixed_lag`` then come from it).

        Raises:
            ValueError: invalid settings, or a batch that cannot give every rank a trajectory.
        """
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        if consume not in CONSUME_MODES:
            raise ValueError(f"unknown consume mode {consume!r}; valid: {', '.join(CONSUME_MODES)}")
        if bound is None:  # the bound checks k itself
            bound = StalenessBound(max_staleness, per_group=consume == "in_order", fixed_lag=fixed_lag,
                                   hist_max=hist_max)
        elif max_staleness is not None or fixed_lag or bound.per_group != (consume == "in_order"):
            raise ValueError("with a bound given, max_staleness and fixed_lag come from it, and its per_group must "
                             f"match consume={consume!r}")
        if filter_mode not in FILTER_MODES:
            raise ValueError(f"unknown filter_mode {filter_mode!r}; valid: {', '.join(FILTER_MODES)}")
        if not 0.0 < filter_ratio <= 1.0:
            raise ValueError(f"filter_ratio must be in (0, 1], got {filter_ratio}")
        if norm_mode not in GROUP_NORM_MODES:
            raise ValueError(f"unknown norm_mode {norm_mode!r}; valid: {', '.join(GROUP_NORM_MODES)}")
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.groups_per_step = groups_per_step
        self.bound = bound
        """The run's bound, which the buffer only asks (:meth:`StalenessBound.of`); only it moves."""
        self.filter_mode = filter_mode
        self.filter_ratio = filter_ratio
        self.norm_mode = norm_mode
        self.num_ranks = num_ranks
        self.fixed_lag = bound.fixed_lag
        self.consume = consume

        # Ask the filter itself how many groups it keeps (it depends only on the count), rather than
        # re-deriving its rounding rule here.
        kept, _ = select_groups_by_reward_std(torch.zeros(groups_per_step, 1), filter_ratio, filter_mode)
        self.kept_groups_per_step = int(kept.numel())
        if group_size is not None and self.kept_groups_per_step * group_size < num_ranks:
            raise ValueError(
                f"each batch keeps {self.kept_groups_per_step} groups × {group_size} trajectories = "
                f"{self.kept_groups_per_step * group_size} < num_ranks={num_ranks}: some learner ranks would "
                "get no data; raise groups_per_step, group_size or filter_ratio"
            )

        self._waiting: dict[int, AnyGroup] = {}
        self._arrived_at: dict[int, float] = {}
        self._oldest: dict[int, list[int]] = {}
        """Each waiting group's per-trajectory oldest versions, computed once on arrival: the staleness
        checks that run after every received group then cost a few integer operations per group."""
        self._learner_version = 0
        self._usable: int = 0
        self._counted_at: tuple[int, int] | None = None
        """The version and bound revision :attr:`_usable` (waiting groups usable right now) was counted at; ``None``
        when the waiting set changed other than by an arrival, so that the next :meth:`ready` scans again."""
        self._drops: list[DropRecord] = []
        self._dropped_total = 0
        self._frontier = 0
        """In-order mode: the lowest index not yet consumed or dropped (the head of the line)."""
        self._resolved_ahead: set[int] = set()
        """In-order mode: indices above :attr:`_frontier` already dropped (or known resolved on resume)."""
        self._blocked: tuple[int, int] | None = None
        """In-order mode: (version, missing index) of the last :meth:`ready` that found the head of the line
        missing: until that index arrives (or the version moves) the answer stays no, at O(1) cost."""
        self._stats = StalenessStats(bound.hist_max)

    # -- queue state -------------------------------------------------------------------------------

    @property
    def max_staleness(self) -> int | None:
        """The bound for groups admitted from now on (the bound's :attr:`~StalenessBound.current`)."""
        return self.bound.current

    def __len__(self) -> int:
        """Groups waiting (not yet checked against the current version)."""
        return len(self._waiting)

    @property
    def nbytes(self) -> int:
        """Bytes of the per-token arrays of the groups waiting: the memory the buffer holds."""
        return sum(t.nbytes for g in self._waiting.values() for t in g.trajectories)

    @property
    def dropped_total(self) -> int:
        """Groups dropped since construction."""
        return self._dropped_total

    def drain_drops(self) -> list[DropRecord]:
        """Drops since the last call: the one channel through which drops reach admission control
        (``AdmissionController.on_dropped([d.index for d in drops])``)."""
        drops, self._drops = self._drops, []
        return drops

    def ready(self, learner_version: int | None = None, now: float | None = None) -> bool:
        """Whether :meth:`next_batch` at ``learner_version`` (default: the latest seen) would succeed.

        Waiting groups that are over the bound at ``learner_version`` are dropped here (site ``consume``):
        staleness only grows, so they can never be used, and their admission slots must come back now,
        not at the next batch, which might otherwise never become ready (a tight bound holds no spare slot).
        ``now`` (the caller's clock) dates those drops (``DropRecord.waited_s``).

        Arrival mode: the scan runs once per version (staleness moves only with it); between scans
        :meth:`add` keeps the count of usable groups, so the loop may ask after every received group at O(1)
        cost. In-order mode: the walk from the head of the line stops at the first missing index, and until
        that index arrives or the version moves the answer is no at O(1) cost.
        """
        version = self._learner_version if learner_version is None else learner_version
        if self.consume == "in_order":
            return self._ready_in_order(version, now)
        if (version, self.bound.revision) != self._counted_at:  # one scan per version (and per move of the bound)
            usable = 0
            for index in sorted(self._waiting):
                reason = self._violation(index, self._oldest[index], version, consuming=True)
                if reason == "stale":
                    self._drop_waiting(index, version, reason, now)
                usable += reason is None
            self._usable, self._counted_at = usable, (version, self.bound.revision)
        return self._usable >= self.groups_per_step

    def _ready_in_order(self, version: int, now: float | None) -> bool:
        """In-order :meth:`ready`: the ``groups_per_step`` lowest unresolved indices, from the head of the line,
        have all arrived (stale ones on the way are dropped now; off-lag ones are dropped when taken)."""
        if self._blocked is not None and self._blocked[0] == version:
            return False
        usable, index = 0, self._frontier
        while usable < self.groups_per_step:
            if self._is_resolved(index):
                index += 1
                continue
            if index not in self._waiting:
                self._blocked = (version, index)
                return False
            reason = self._violation(index, self._oldest[index], version, consuming=True)
            if reason == "stale":
                self._drop_waiting(index, version, reason, now)
            usable += reason is None
            index += 1
        self._blocked = None
        return True

    def _remove(self, index: int) -> tuple[AnyGroup, float]:
        """Take a waiting group out; returns it and its arrival time."""
        del self._oldest[index]
        return self._waiting.pop(index), self._arrived_at.pop(index)

    # -- staleness gate ----------------------------------------------------------------------------

    def _violation(self, index: int, oldest: Sequence[int], learner_version: int, consuming: bool) -> DropReason | None:
        """Why group ``index``, whose trajectories' oldest versions are ``oldest``, cannot be used at
        ``learner_version`` (``None``: it can)."""
        k = self.bound.of(index)
        if k is None:
            return None
        staleness = staleness_of(oldest, learner_version)
        if staleness > k:
            return "stale"
        # Exactness can only be judged at consumption: before that the version may still advance.
        if consuming and self.fixed_lag and staleness != min(k, learner_version):
            return "off_lag"
        return None

    def _drop(self, group: AnyGroup, learner_version: int, where: DropSite, reason: DropReason,
              waited_s: float | None) -> None:
        record = DropRecord(
            group_id=group.group_id,
            index=group_index(group),
            staleness=group_staleness(group, learner_version),
            learner_version=learner_version,
            where=where,
            reason=reason,
            bound=self.bound.of(group_index(group)),
            waited_s=waited_s,
            env_tag=group.env_tag,
            seed=group.seed,
            worker=group.worker_id,
            facts=group.episode_facts(),
            scores=tuple(group.scores),
        )
        self._drops.append(record)
        self._dropped_total += 1
        self._stats.record_dropped()
        self._resolved(record.index)

    def _drop_waiting(self, index: int, learner_version: int, reason: DropReason, now: float | None) -> None:
        """Drop waiting group ``index`` at consumption (site ``consume``), dated by ``now`` if given."""
        group, arrived = self._remove(index)
        self._drop(group, learner_version, "consume", reason, None if now is None else max(0.0, now - arrived))

    def _resolved(self, index: int) -> None:
        """``index`` is consumed or dropped: in-order mode moves the head of the line past it."""
        if self.consume != "in_order":
            return
        if index != self._frontier:
            self._resolved_ahead.add(index)
            return
        self._frontier += 1
        while self._frontier in self._resolved_ahead:
            self._resolved_ahead.discard(self._frontier)
            self._frontier += 1

    def restore(self, next_index: int, outstanding: Sequence[int]) -> None:
        """Continue a run at a checkpoint (its admission state: ``next_index`` and the ``outstanding`` indices,
        which will be played again): in-order mode's head of the line is the lowest outstanding index, and
        every other index below ``next_index`` is already resolved. Call it on an empty buffer."""
        if self._waiting:
            raise ValueError("restore needs an empty buffer")
        pending = set(outstanding)
        self._frontier = min(pending, default=next_index)
        self._resolved_ahead = set(range(self._frontier, next_index)) - pending
        self._blocked, self._counted_at = None, None

    def _observe_version(self, learner_version: int) -> None:
        # Versions only move forward; a caller holding an older view must not un-stale anything.
        self._learner_version = max(self._learner_version, learner_version)

    # -- producer side -----------------------------------------------------------------------------

    def add(self, group: AnyGroup, learner_version: int, now: float) -> bool:
        """Queue a finished group; ``False`` if it was dropped as already too stale. The drop is reported
        through :meth:`drain_drops` like every other: do not also count the ``False``.

        ``learner_version`` is the learner's current version: the earliest version the group could be
        consumed at, so a group over the bound now is over it forever. ``now`` (the caller's clock) is
        the arrival time, for ``rollout/buffer_wait_s``.

        Raises:
            ValueError: a group with the same index is waiting (or, in-order, was already consumed or dropped).
        """
        index = group_index(group)
        if index in self._waiting:
            raise ValueError(f"group index {index} ({group.group_id!r}) is already waiting in the buffer")
        if self.consume == "in_order" and self._is_resolved(index):
            raise ValueError(f"group index {index} ({group.group_id!r}) was already consumed or dropped")
        if not group.trajectories:
            raise ValueError(f"group {group.group_id!r} has no trajectories")
        self._observe_version(learner_version)
        if self._blocked is not None and self._blocked[1] == index:  # the head of the line arrived
            self._blocked = None
        oldest = [t.oldest_version for t in group.trajectories]
        reason = self._violation(index, oldest, self._learner_version, consuming=False)
        if reason is not None:
            self._drop(group, self._learner_version, "add", reason, 0.0)
            return False
        self._waiting[index] = group
        self._arrived_at[index] = now
        self._oldest[index] = oldest
        if self._counted_at is not None and self._counted_at[1] == self.bound.revision:
            counted = self._counted_at[0]  # do for it what the scan in ready() would: count it, or drop it
            reason = self._violation(index, oldest, counted, consuming=True)
            if reason == "stale":
                self._drop_waiting(index, counted, reason, now)
            self._usable += reason is None
        return True

    # -- consumer side -----------------------------------------------------------------------------

    def _take_groups(self, learner_version: int, now: float) -> tuple[list[AnyGroup], list[float]]:
        """Remove and return the B lowest-index usable groups and their arrival times, dropping unusable
        ones on the way (in-order: the B lowest unresolved indices, which must all have arrived)."""
        self._counted_at = None  # the waiting set changes here whatever happens
        self._blocked = None
        taken: list[int] = []
        if self.consume == "in_order":
            candidates = self._head_of_line()
        else:
            candidates = iter(sorted(self._waiting))
        for index in candidates:
            if index not in self._waiting:  # in-order: the head of the line has not arrived
                break
            reason = self._violation(index, self._oldest[index], learner_version, consuming=True)
            if reason is not None:
                self._drop_waiting(index, learner_version, reason, now)
                continue
            taken.append(index)
            if len(taken) == self.groups_per_step:
                break
        if len(taken) < self.groups_per_step:
            raise BufferNotReady(
                f"{len(taken)} usable groups waiting at version {learner_version}, need {self.groups_per_step}"
            )
        removed = [self._remove(index) for index in taken]
        return [g for g, _ in removed], [t for _, t in removed]

    def _head_of_line(self) -> Iterator[int]:
        """In-order mode: the unresolved indices from the head of the line up, in order (lazily: drops on the
        way move the line's state, never below the index being looked at)."""
        index = self._frontier
        while True:
            if not self._is_resolved(index):
                yield index
            index += 1

    def _is_resolved(self, index: int) -> bool:
        """In-order mode: ``index`` was consumed or dropped (below the head of the line, or dropped ahead)."""
        return index < self._frontier or index in self._resolved_ahead

    def _put_back(self, groups: Sequence[AnyGroup], arrived_at: Sequence[float]) -> None:
        self._counted_at = None
        for group, t in zip(groups, arrived_at, strict=True):
            index = group_index(group)
            self._waiting[index], self._arrived_at[index] = group, t
            self._oldest[index] = [tr.oldest_version for tr in group.trajectories]

    def next_batch(self, learner_version: int, step: int, now: float) -> Batch:
        """Assemble the batch the learner at ``learner_version`` trains on at ``step``.

        Returns:
            a :class:`Batch`: one :class:`BatchShard` per rank, the groups taken, and the step's metrics: ``filter/*`` (StarPO-S), ``rollout/queue_groups`` (groups still waiting),
            ``batch/*``, ``rollout/buffer_wait_s`` (mean time the taken groups spent in the buffer) and the
            :class:`~ragen_async.staleness.ages.StalenessStats` summary of the kept groups (those trained on)
            plus the groups dropped since the previous batch.

        Raises:
            BufferNotReady: fewer than ``groups_per_step`` usable groups (check :meth:`ready` first); the
                waiting groups stay queued, stale ones are dropped.
            ValueError: the filter kept fewer trajectories than there are ranks (the groups stay queued).
        """
        self._observe_version(learner_version)
        groups, arrived = self._take_groups(learner_version, now)

        kept_idx, filter_metrics = select_groups_by_reward_std(
            [torch.tensor(g.scores, dtype=torch.float64) for g in groups], self.filter_ratio, self.filter_mode
        )
        kept = [groups[i] for i in kept_idx.tolist()]
        trajs: list[AnyTrajectory] = [t for g in kept for t in g.trajectories]
        if len(trajs) < self.num_ranks:
            self._put_back(groups, arrived)  # a configuration error must not also lose data
            raise ValueError(
                f"the filter kept {len(trajs)} trajectories for {self.num_ranks} ranks: every rank needs at "
                "least one; raise groups_per_step, group size or filter_ratio"
            )
        for group in groups:  # all taken groups are consumed, kept by the filter or not
            self._resolved(group_index(group))

        scores = torch.tensor([t.score for t in trajs], dtype=torch.float64)
        owners = torch.tensor([group_index(g) for g in kept for _ in g.trajectories], dtype=torch.int64)
        normalized = group_normalize(scores, owners, self.norm_mode)
        scores_np = scores.numpy().astype(np.float32)
        normalized_np = normalized.numpy().astype(np.float32)

        batch_num_tokens = sum(t.num_response_tokens for t in trajs)
        bins = balance_by_tokens([t.num_tokens for t in trajs], self.num_ranks)
        shards = [
            BatchShard(
                step=step,
                learner_version=learner_version,
                trajectories=tuple(trajs[i] for i in items),
                scores=scores_np[items],
                normalized_scores=normalized_np[items],
                batch_num_tokens=batch_num_tokens,
                batch_num_seqs=len(trajs),
                rank=rank,
                world_size=self.num_ranks,
            )
            for rank, items in enumerate(bins)
        ]

        for group in kept:
            self._stats.record_group(group, learner_version, consumed_at=now)
        shard_tokens = [sum(t.num_tokens for t in s.trajectories) for s in shards]
        metrics: dict[str, float] = {f"filter/{name}": float(value) for name, value in filter_metrics.items()}
        metrics.update(
            {
                "rollout/queue_groups": float(len(self._waiting)),
                "batch/num_groups": float(len(kept)),
                "batch/num_seqs": float(len(trajs)),
                "batch/num_loss_tokens": float(batch_num_tokens),
                "batch/shard_tokens_max": float(max(shard_tokens)),
                "batch/shard_tokens_min": float(min(shard_tokens)),
                "batch/shard_seqs_max": float(max(len(s.trajectories) for s in shards)),
                "batch/shard_seqs_min": float(min(len(s.trajectories) for s in shards)),
                "rollout/buffer_wait_s": float(np.mean([now - t for t in arrived])),
            }
        )
        metrics.update(self._stats.summary())
        return Batch(shards=shards, groups=groups, metrics=metrics)
