"""The run's admission gate: the one :class:`~ragen_async.staleness.admission.AdmissionController` behind an event loop,
which the Ray runtime runs as an actor (``rollout.actor.GateActor``) and every rollout actor asks before it
starts a group.

A rollout actor with free group slots calls :meth:`AdmissionGate.admit` for up to that many indices. While
the bound is binding the call does not come back empty at once, to be repeated every few milliseconds by every
blocked actor (which at a hundred actors would be thousands of calls a second, all refused): it waits, up to
``wait_s``, for a change that can free a slot — a published version, a dropped group, a raised bound, a
restored checkpoint, an abandoned producer — and then admits. Each call's work runs to completion on the
actor's one event loop between awaits, so the controller's accounting is as exact as when it is called
directly: the same indices, in the same order, under the same bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from ragen_async.staleness.admission import AdmissionController


class AdmissionGate:
    def __init__(self, max_staleness: int | None, groups_per_step: int):
        self.controller = AdmissionController(max_staleness, groups_per_step)
        self._changed = asyncio.Event()
        self._abandoned: dict[str, int] = {}
        """How many times each producer name was abandoned: a call that began before the latest abandon of its
        name is the dead producer's and takes nothing (its replacement keeps the name)."""

    async def admit(self, owner: str, n: int = 1, wait_s: float = 0.0) -> list[int]:
        """Up to ``n`` group indices for producer ``owner``; with none free, wait up to ``wait_s`` for a
        change that frees one. An empty answer means none yet (ask again). Every attempt that finds none counts
        one refusal (``AdmissionController.refusals``). A call still waiting when ``owner`` is abandoned belongs
        to the dead producer: it answers none, so the replays go to a producer that will play them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        epoch = self._abandoned.get(owner, 0)
        while True:
            if self._abandoned.get(owner, 0) != epoch:
                return []
            got = self.controller.admit_up_to(n, owner)
            remaining = deadline - loop.time()
            if got or remaining <= 0:
                return got
            changed = self._changed  # set by the next change; each change makes a new one
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return []

    def _wake(self) -> None:
        """Something that can free a slot happened: every waiting call tries again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def try_admit(self, owner: str = "") -> int | None:
        """One index, or None at once (no waiting)."""
        return self.controller.try_admit(owner)

    async def resolve(self, consumed: Iterable[int], dropped: Iterable[int]) -> None:
        self.controller.resolve(consumed, dropped)
        self._wake()

    async def set_published_version(self, version: int) -> None:
        self.controller.set_published_version(version)
        self._wake()

    async def set_max_staleness(self, k: int | None) -> int:
        first = self.controller.set_max_staleness(k)
        self._wake()
        return first

    async def abandon(self, owner: str) -> list[int]:
        self._abandoned[owner] = self._abandoned.get(owner, 0) + 1
        lost = self.controller.abandon(owner)
        self._wake()
        return lost

    async def restore(self, state: dict[str, Any]) -> None:
        self.controller.restore(state)
        self._wake()

    async def state(self) -> dict[str, Any]:
        return self.controller.state()

    async def ping(self) -> None:
        """Nothing: its round trip is the gate's responsiveness (``bench cluster`` times it)."""
