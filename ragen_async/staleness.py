"""Staleness control: admission of new groups, per-token staleness, and staleness statistics.

Definitions (docs/architecture.md). Policy version v = weights after v learner steps (one consumed
batch each, however many optimizer mini-batch steps it takes). A sampled token produced
by version u and trained on by the learner at version v has *staleness* v − u; a trajectory is as stale as
its oldest sampled token, a group as its stalest trajectory. ``max_staleness = k`` bounds it.

The bound is enforced in two places:

1. :class:`AdmissionController` (this module) stops groups from *starting* too early — AReaL's rule: a
   group may start only while ``groups_started < (k + v + 1) · groups_per_step``, where v is the version
   every inference engine has loaded. If the learner consumes groups in admission order, group number i
   is trained on at version ⌊i / B⌋ and was started at a published version v ≥ ⌊i / B⌋ − k, so its tokens
   are at most k versions old. In-order consumption (``staleness.consume: in_order``, the buffer's
   ``consume``) makes the learner consume exactly so, so under a fixed k nothing is dropped.
2. The trajectory buffer drops whatever still exceeds k when it would be consumed (a safety net for
   reordering in arrival order, a bound that tightened, and dropped groups; every drop is counted).

This module is pure: no ray, zmq, vllm or torch.distributed, no I/O, and no clock reads — every time is
passed in by the caller, so decisions are deterministic and unit-testable.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

from ragen_async.protocol import NO_VERSION, AnyGroup, AnyTrajectory

__all__ = [
    "AdaptiveBound",
    "KLTargetBound",
    "AdmissionController",
    "StalenessStats",
    "format_group_id",
    "group_staleness",
    "parse_group_id",
    "trajectory_staleness",
]

# --------------------------------------------------------------------------------------------------
# Group ids carry the admission sequence index

_GROUP_ID = re.compile(r"g(\d+)(?!\d)")


def format_group_id(index: int) -> str:
    """The group id of the group admitted with sequence ``index``: ``g00000042``.

    Producers may append a suffix that starts with a non-digit (``g00000042-sokoban``); the index is what
    orders batches deterministically, so it must come first.
    """
    if index < 0:
        raise ValueError(f"group index must be >= 0, got {index}")
    return f"g{index:08d}"


def parse_group_id(group_id: str) -> int:
    """Inverse of :func:`format_group_id` (ignores any suffix); ``ValueError`` if there is no index."""
    match = _GROUP_ID.match(group_id)
    if match is None:
        raise ValueError(f"group id {group_id!r} does not start with 'g<index>' (see format_group_id)")
    return int(match.group(1))


# --------------------------------------------------------------------------------------------------
# Admission control


class AdmissionController:
    """Decides whether a new group may start, AReaL-style; hands out global group sequence indices and
    accounts for every one of them.

    ``max_staleness=None`` admits everything (unbounded staleness). Indices are 0, 1, 2, … in admission
    order and are never reused for another group, so ``index → (env, seed)`` stays a unique, reproducible
    assignment. Every admitted index is *outstanding* until the driver reports it exactly once, as
    consumed (trained on) or dropped (never will be); reporting an index twice, or one that was never
    admitted, is an error. That per-index accounting is what makes a drop return exactly one slot.

    :meth:`state` / :meth:`restore` carry the accounting across a resume: the indices that were
    outstanding when the checkpoint was taken (in flight or waiting in the buffer, both lost with the
    old processes) are handed out again, lowest first, with their original index and therefore their
    original seed, before any new index. They were admitted before, so they need no new slot.
    """

    def __init__(self, max_staleness: int | None, groups_per_step: int, published_version: int = 0) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        if published_version < 0:
            raise ValueError(f"published_version must be >= 0, got {published_version}")
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self._published_version = published_version
        self._next_index = 0
        self._outstanding: set[int] = set()
        self._owner: dict[int, str] = {}
        self._replay: list[int] = []
        self._dropped = 0
        self._consumed = 0
        self.refusals = 0
        """How many times :meth:`try_admit` or :meth:`admit_up_to` said wait (the bound was binding)."""

    @property
    def published_version(self) -> int:
        """The version every inference engine has loaded (the minimum over engines)."""
        return self._published_version

    @property
    def groups_started(self) -> int:
        """Groups admitted so far, minus those dropped: what counts against the budget."""
        return self._next_index - self._dropped

    @property
    def groups_admitted(self) -> int:
        """All indices ever admitted (the next new sequence index)."""
        return self._next_index

    @property
    def groups_dropped(self) -> int:
        return self._dropped

    @property
    def groups_consumed(self) -> int:
        return self._consumed

    @property
    def outstanding(self) -> list[int]:
        """Admitted indices not yet reported consumed or dropped, ascending."""
        return sorted(self._outstanding)

    def set_max_staleness(self, k: int | None) -> int:
        """Move the bound (adaptive staleness; ``None`` lifts it) for the groups admitted from now on; returns
        the first index that is (:attr:`groups_admitted`), so the buffer can hold each group to the bound it was
        admitted under. Lowering it admits nothing new until the published version catches up."""
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"a bound is an integer >= 0 or None (unbounded), got {k!r}")
        self.max_staleness = k
        return self._next_index

    def limit(self) -> int | None:
        """``(k + v + 1) · groups_per_step``: how many groups may have started at this version."""
        if self.max_staleness is None:
            return None
        return (self.max_staleness + self._published_version + 1) * self.groups_per_step

    def capacity(self) -> int | None:
        """How many more new groups may start now (``None``: unbounded)."""
        limit = self.limit()
        return None if limit is None else max(0, limit - self.groups_started)

    def try_admit(self, owner: str = "") -> int | None:
        """Admit one group for producer ``owner``: its global sequence index, or ``None`` if the budget is
        used up. Indices waiting to be replayed (resume, abandoned) come first and need no new slot."""
        index = self._take(owner)
        if index is None:
            self.refusals += 1
        return index

    def admit_up_to(self, n: int, owner: str = "") -> list[int]:
        """Up to ``n`` groups for ``owner`` at once (one round trip for a remote producer), in admission order;
        an empty answer counts as one refusal."""
        got: list[int] = []
        while len(got) < n and (index := self._take(owner)) is not None:
            got.append(index)
        if not got and n > 0:
            self.refusals += 1
        return got

    def _take(self, owner: str) -> int | None:
        if self._replay:
            index = self._replay.pop(0)
        else:
            capacity = self.capacity()
            if capacity is not None and capacity <= 0:
                return None
            index = self._next_index
            self._next_index += 1
            self._outstanding.add(index)
        self._owner[index] = owner
        return index

    def abandon(self, owner: str) -> list[int]:
        """A producer died: its outstanding groups go back to the front of the queue, to be played again
        under the same index (so the same seed) by another producer. Returns those indices."""
        lost = sorted(i for i, o in self._owner.items() if o == owner)
        for i in lost:
            del self._owner[i]
        self._replay = sorted({*self._replay, *lost})
        return lost

    def set_published_version(self, version: int) -> None:
        """Record that every engine now serves ``version`` (opens ``groups_per_step`` slots per version)."""
        if version < self._published_version:
            raise ValueError(f"published version went backwards: {self._published_version} -> {version}")
        self._published_version = version

    def _resolve(self, indices: Iterable[int], what: str) -> int:
        indices = list(indices)
        if len(set(indices)) != len(indices):
            raise ValueError(f"{what}: index reported twice in one call: {sorted(indices)}")
        for i in indices:
            if i not in self._outstanding:
                raise ValueError(f"{what}: group {i} is not outstanding (never admitted, or already reported)")
        self._outstanding.difference_update(indices)
        for i in indices:
            self._owner.pop(i, None)
            if i in self._replay:  # abandoned, yet its group had arrived: nothing left to replay
                self._replay.remove(i)
        return len(indices)

    def on_consumed(self, indices: Iterable[int]) -> None:
        """The learner took these groups into a batch (kept or filtered out): they are done."""
        self._consumed += self._resolve(indices, "consumed")

    def on_dropped(self, indices: Iterable[int]) -> None:
        """Return the slots of groups the buffer dropped (or a producer abandoned), one per index.

        A dropped group will never be trained on, yet it still counts as started. The learner only advances
        the version (and with it the budget) after consuming a full batch, so without this the budget could
        be spent on groups that never arrive: the learner would wait for data that admission refuses to
        start, a deadlock. Returning the slot lets a replacement start under a new index; the buffer's
        consumption-time check still guarantees the bound for it.
        """
        self._dropped += self._resolve(indices, "dropped")

    def resolve(self, consumed: Iterable[int], dropped: Iterable[int]) -> None:
        """:meth:`on_consumed` and :meth:`on_dropped` in one call (one round trip for a remote gate)."""
        self.on_consumed(consumed)
        self.on_dropped(dropped)

    def state(self) -> dict[str, int | list[int]]:
        """Everything :meth:`restore` needs to continue exactly (JSON-serialisable)."""
        return {"next_index": self._next_index, "outstanding": self.outstanding, "dropped": self._dropped,
                "consumed": self._consumed, "published_version": self._published_version,
                "refusals": self.refusals}

    def restore(self, state: dict) -> None:
        """Continue ``state`` (a checkpoint's): its outstanding indices are replayed first, lowest first."""
        outstanding = {int(i) for i in state["outstanding"]}
        if int(state["consumed"]) + int(state["dropped"]) + len(outstanding) != int(state["next_index"]):
            raise ValueError(f"inconsistent admission state: {state}")
        self._published_version = int(state["published_version"])
        self._next_index = int(state["next_index"])
        self._outstanding, self._owner = outstanding, {}
        self._replay = sorted(outstanding)
        self._dropped, self._consumed = int(state["dropped"]), int(state["consumed"])
        self.refusals = int(state.get("refusals", 0))


class AdaptiveBound:
    """Adaptive staleness: the bound ``max_staleness`` halves (down to ``lowest``) at a step where an
    early-warning signal fired, and grows by one (up to ``start``, where it starts) after ``patience`` quiet
    steps in a row.

    With ``start`` ``None`` it starts unbounded (``max_staleness`` is ``None``): the first warning sets the
    bound to ``engage``, later ones halve it, and the quiet step that would raise it past ``engage`` lifts it
    (unbounded again). Pure and deterministic: the caller feeds one verdict per learner step."""

    def __init__(self, start: int | None, lowest: int = 0, patience: int = 10, engage: int | None = None) -> None:
        top = engage if start is None else start
        if top is None or not 0 <= lowest <= top or patience < 1:
            raise ValueError(f"need 0 <= lowest <= start (or engage, when starting unbounded) and patience >= 1 "
                             f"(got lowest {lowest}, start {start}, engage {engage}, patience {patience})")
        self.start, self.lowest, self.patience, self.engage = start, lowest, patience, engage
        self.max_staleness: int | None = start
        self.quiet = 0
        self.reason = ""
        """Why the last :meth:`update` moved the bound (``""``: it did not)."""

    def update(self, warned: bool) -> int | None:
        """The bound for the next steps (``None``: unbounded), after a step with (``warned``) or without a
        warning."""
        bound = self.max_staleness
        if warned:
            self.max_staleness, self.quiet = max(self.lowest, self.engage if bound is None else bound // 2), 0
        else:
            self.quiet += 1
            if bound is not None and self.quiet >= self.patience:
                if self.start is None and bound >= self.engage:
                    self.max_staleness, self.quiet = None, 0
                elif self.start is None or bound < self.start:
                    self.max_staleness, self.quiet = bound + 1, 0
        self.reason = ("" if self.max_staleness == bound else "a warning" if warned
                       else f"no warning for {self.patience} steps")
        return self.max_staleness

    def state(self) -> dict[str, int | None]:
        return {"max_staleness": self.max_staleness, "quiet": self.quiet}

    def restore(self, state: dict) -> None:
        bound = state["max_staleness"] if "max_staleness" in state else state["k"]  # "k": older checkpoints
        self.max_staleness = None if bound is None else int(bound)
        self.quiet = int(state["quiet"])


class KLTargetBound:
    """Staleness held to a drift target: the bound moves so that the stale tokens' behaviour/learner KL
    (``stale/k3_kl``, :func:`ragen_async.collapse.stale_tokens`) stays under ``target``.

    Each learner step with stale tokens updates a moving average of log KL (span ``span``). Above ``log target``
    the bound is cut at once to ``floor(bound * sqrt(target / KL))`` (at least one lower; KL grows about as the
    square of the age), then held while the groups admitted under the old bound drain (in order they are consumed
    first, at their old age, so the cut shows in the KL only then) and for ``span`` steps after: only a step whose
    consumed groups were all admitted under the current bound or a tighter one (``consumed_bound``) counts towards
    the hold. After ``patience`` steps in a row under half the target it rises by one. It stays within ``lowest`` .. ``highest`` and starts at ``start``: always finite,
    so at most ``(bound + 1) * groups_per_step`` groups are in flight and a cut bites within ``bound`` steps.
    A step without stale tokens (none consumed yet) decides nothing. Pure and deterministic:
    the caller feeds one KL (or ``None``) per learner step and reads :attr:`reason` for the change it made."""

    def __init__(self, target: float, start: int, lowest: int = 1, highest: int | None = None, patience: int = 10,
                 span: int = 5) -> None:
        highest = start if highest is None else highest
        if not target > 0 or not 0 <= lowest <= start <= highest or patience < 1 or span < 1:
            raise ValueError(f"need target > 0, 0 <= lowest <= start <= highest, patience >= 1 and span >= 1 "
                             f"(got target {target}, lowest {lowest}, start {start}, highest {highest}, "
                             f"patience {patience}, span {span})")
        self.target, self.lowest, self.highest, self.patience, self.span = target, lowest, highest, patience, span
        self.max_staleness: int = start
        self.average: float | None = None
        """The moving average of log KL (``None`` before the first step with stale tokens)."""
        self.quiet = 0
        self.hold = 0
        self.reason = ""
        """Why the last :meth:`update` moved the bound (``""``: it did not)."""

    @property
    def kl(self) -> float | None:
        """The averaged KL the controller compares with its target."""
        return None if self.average is None else math.exp(self.average)

    def update(self, kl: float | None, consumed_bound: int | None = None) -> int:
        """The bound for the next steps after a step whose stale tokens' KL was ``kl`` (``None``: none stale) and
        whose consumed groups were admitted under bounds up to ``consumed_bound`` (``None``: not known, the step
        counts as measured under the current bound)."""
        bound, self.reason = self.max_staleness, ""
        if consumed_bound is None or consumed_bound <= bound:
            self.hold = max(0, self.hold - 1)
        if kl is None or not math.isfinite(kl) or kl <= 0:
            return bound  # nothing measured: nothing decided
        alpha = 2.0 / (self.span + 1)
        self.average = math.log(kl) if self.average is None else alpha * math.log(kl) + (1 - alpha) * self.average
        over = self.average > math.log(self.target)
        if over and self.hold == 0 and bound > self.lowest:
            scaled = math.floor(bound * math.sqrt(self.target / math.exp(self.average)) + 1e-9)
            self.max_staleness = max(self.lowest, min(bound - 1, scaled))
            self.hold, self.quiet = self.span, 0
            self.reason = f"stale KL {math.exp(self.average):.2e} over the target {self.target:.2e}"
        elif self.average < math.log(self.target / 2):
            self.quiet += 1
            if self.quiet >= self.patience and bound < self.highest:
                self.max_staleness, self.quiet = bound + 1, 0
                self.reason = f"stale KL under half the target for {self.patience} steps"
        else:
            self.quiet = 0
        return self.max_staleness

    def state(self) -> dict[str, float | int | None]:
        return {"max_staleness": self.max_staleness, "average": self.average, "quiet": self.quiet, "hold": self.hold}

    def restore(self, state: dict) -> None:
        self.max_staleness = int(state["max_staleness"])
        self.average = None if state["average"] is None else float(state["average"])
        self.quiet, self.hold = int(state["quiet"]), int(state["hold"])


# --------------------------------------------------------------------------------------------------
# Staleness of tokens, trajectories and groups


def staleness_of(oldest_versions: Sequence[int], learner_version: int) -> int:
    """Staleness of the stalest of some trajectories, given each one's oldest sampled version
    (``Trajectory.oldest_version``); a trajectory that sampled nothing counts 0 (nothing to train on)."""
    return max(0 if oldest == NO_VERSION else learner_version - oldest for oldest in oldest_versions)


def trajectory_staleness(traj: AnyTrajectory, learner_version: int) -> int:
    """Staleness of the trajectory's oldest sampled token; 0 if it sampled nothing (nothing to train on)."""
    return staleness_of([traj.oldest_version], learner_version)


def group_staleness(group: AnyGroup, learner_version: int) -> int:
    """Staleness of the group's stalest trajectory (what the buffer's drop rule compares with k)."""
    return staleness_of([t.oldest_version for t in group.trajectories], learner_version)


# --------------------------------------------------------------------------------------------------
# Statistics


def _mean(values: list[float] | list[int]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _max(values: Iterable[float]) -> float:
    return float(max(values, default=0.0))


class StalenessStats:
    """Per-learner-step staleness accounting of the groups a batch trains on.

    Record each consumed group with :meth:`record_group` and each dropped group with
    :meth:`record_dropped`; :meth:`summary` returns the step's metrics and resets. The key set is fixed
    (zeros when nothing was recorded) so dashboards line up across steps and runs:

    * ``staleness/mean|max|min``, ``staleness/tokens``: over consumed sampled tokens (token-weighted).
    * ``staleness/token_hist/{i}`` for i = 0..``hist_max`` and ``staleness/token_hist/overflow``: the
      fraction of those tokens with staleness i (negative staleness, which would be a version-accounting
      bug, lands in bin 0 and shows up in ``staleness/min``).
    * ``staleness/traj_mean|traj_max``: per trajectory (its oldest token).
    * ``staleness/turn_mean|turn_max``: per turn, from the version loaded when the turn started.
    * ``staleness/age_in_flight_s`` (finished_at − created_at) and ``staleness/age_queued_s``
      (consumed_at − finished_at), means over groups, plus their ``_max_s``. The two clocks belong to
      different hosts; keep them NTP-synchronised for the queued age to mean anything across machines.
    * ``staleness/groups``, ``staleness/dropped_groups``: groups consumed and dropped since the last summary.
    """

    def __init__(self, hist_max: int = 8) -> None:
        if hist_max < 0:
            raise ValueError(f"hist_max must be >= 0, got {hist_max}")
        self.hist_max = hist_max
        self._reset()

    def _reset(self) -> None:
        self._hist = np.zeros(self.hist_max + 2, dtype=np.int64)  # bins 0..hist_max, then overflow
        self._token_sum = 0
        self._token_count = 0
        self._token_max: int | None = None
        self._token_min: int | None = None
        self._traj: list[int] = []
        self._turn: list[int] = []
        self._in_flight: list[float] = []
        self._queued: list[float] = []
        self._dropped = 0

    def record_group(self, group: AnyGroup, learner_version: int, consumed_at: float) -> None:
        """Account for a group trained on at ``learner_version``, taken from the buffer at ``consumed_at``.

        Token staleness comes from each trajectory's ``version_counts`` (sampled tokens per version), the
        summary the driver holds without the per-token arrays."""
        for traj in group.trajectories:
            if traj.version_counts:
                versions, counts = np.array(traj.version_counts, dtype=np.int64).T
                s = learner_version - versions
                self._hist += np.bincount(np.clip(s, 0, self.hist_max + 1), weights=counts,
                                          minlength=self.hist_max + 2).astype(np.int64)
                self._token_sum += int((s * counts).sum())
                self._token_count += int(counts.sum())
                hi, lo = int(s.max()), int(s.min())
                self._token_max = hi if self._token_max is None else max(self._token_max, hi)
                self._token_min = lo if self._token_min is None else min(self._token_min, lo)
            self._traj.append(trajectory_staleness(traj, learner_version))
            self._turn.extend(learner_version - turn.policy_version for turn in traj.turns)
        self._in_flight.append(group.finished_at - group.created_at)
        self._queued.append(consumed_at - group.finished_at)

    def record_dropped(self, n: int = 1) -> None:
        self._dropped += n

    def summary(self) -> dict[str, float]:
        """This step's metrics (see the class docstring); resets the accumulators."""
        tokens = self._token_count
        out: dict[str, float] = {
            "staleness/mean": self._token_sum / tokens if tokens else 0.0,
            "staleness/max": float(self._token_max or 0),
            "staleness/min": float(self._token_min or 0),
            "staleness/tokens": float(tokens),
        }
        fractions = self._hist / tokens if tokens else np.zeros_like(self._hist, dtype=np.float64)
        for i in range(self.hist_max + 1):
            out[f"staleness/token_hist/{i}"] = float(fractions[i])
        out["staleness/token_hist/overflow"] = float(fractions[-1])
        out.update(
            {
                "staleness/traj_mean": _mean(self._traj),
                "staleness/traj_max": _max(self._traj),
                "staleness/turn_mean": _mean(self._turn),
                "staleness/turn_max": _max(self._turn),
                "staleness/age_in_flight_s": _mean(self._in_flight),
                "staleness/age_in_flight_max_s": _max(self._in_flight),
                "staleness/age_queued_s": _mean(self._queued),
                "staleness/age_queued_max_s": _max(self._queued),
                "staleness/groups": float(len(self._in_flight)),
                "staleness/dropped_groups": float(self._dropped),
            }
        )
        self._reset()
        return out
