"""Admission: which group may start, and the accounting of every group index ever handed out.

A group may start only while ``groups_started < (k + v + 1) * groups_per_step``, where v is the version every
inference engine has loaded (AReaL's rule). If the learner consumes groups in admission order, group number i
is trained on at version floor(i / B) and was started at a published version >= floor(i / B) - k, so its tokens
are at most k versions old; in-order consumption (``staleness.consume: in_order``) makes the learner consume
exactly so, and under a fixed k nothing is dropped. The controller keeps a copy of the bound, written only by
:meth:`~ragen_async.staleness.bound.StalenessBound.move` (the gate may live in another process).

Pure: no ray, zmq, vllm or torch.distributed, no I/O, no clock reads.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["AdmissionController"]


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
