"""The weight plane's seam: a publisher on learner rank 0, a receiver next to every engine, and their errors.

A :class:`WeightPublisher` lives on learner rank 0 and pushes checkpoint-format (HF-named) tensors tagged with a
policy version; a :class:`WeightReceiver` loads them into its engine. The wire format both sides share is
:mod:`.wire`, the weight group's rank layout :mod:`.groups`, the fixed-lag store of old versions :mod:`.ring`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import torch


class WeightSyncError(RuntimeError):
    """A weight sync failed (peer dead, mismatch, ...). The message names the group and peer."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A weight-sync collective did not complete within its timeout."""


# ---- manifest and packing -------------------------------------------------------------------


Ticket = dict[str, Any]
"""What every receiver needs to load one version (plain data: it travels through Ray unchanged)."""


class WeightPublisher(ABC):
    """Learner rank 0's side of the weight plane. One sync, as the driver runs it::

        ticket = publisher.ticket(named, v)        # None: the publisher drives the receivers itself
        concurrently: publisher.publish(named, v)  and  receiver.receive(ticket) on every engine
    """

    def connect(self) -> None:  # noqa: B027 - optional hook: publishers without a group need none
        """Form the group with the receivers (blocks until every one joined); ``publish`` calls it.
        Run it concurrently with each receiver's ``join(receiver_info(i))``."""

    def receiver_info(self, i: int) -> dict | None:
        """What receiver ``i`` (0-based) passes to :meth:`WeightReceiver.join`; ``None`` when it needs
        nothing (no group, or the publisher makes the receivers join itself)."""
        return None

    ticket_carries_tensors = False
    """Whether :meth:`ticket` needs the tensors' data; otherwise only their names, shapes and dtypes
    are read (meta tensors will do)."""

    def ticket(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: int) -> Ticket | None:
        """What every receiver's :meth:`WeightReceiver.receive` needs for ``version``; ``None`` when the
        publisher drives the receivers itself (NCCL)."""
        return {"version": int(version)}

    @abstractmethod
    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Make ``named_tensors`` (HF checkpoint names) the engines' weights at ``version``.
        Blocks until the transfer is done (or raises :class:`WeightSyncError`)."""

    @abstractmethod
    def close(self) -> None:
        """Tear down the transport. Idempotent."""


class WeightReceiver(ABC):
    """An engine's side of the weight plane; it lives with the engine (in the rollout actor), so the
    engine itself knows nothing about transfers.

    Contract of :meth:`receive`: it returns or raises within ``timeout_s`` (plus the load), and the error
    names the group, the peer and the phase. When it raises, the engine is either serving again with its
    previous weights and version or, when the failure left its weights part-loaded (NCCL: the workers had
    started vLLM's update), marked failed (``engine.mark_failed``): dead, serving nothing, its actor exiting.
    It never serves a mix of versions.
    """

    def __init__(self, engine: Any, timeout_s: float):
        self.engine = engine
        self.timeout_s = float(timeout_s)

    async def join(self, info: dict | None) -> None:  # noqa: B027 - optional hook
        """Join the publisher's group (``info`` from :meth:`WeightPublisher.receiver_info`)."""

    @abstractmethod
    async def receive(self, ticket: Ticket) -> dict:
        """Load one version (``ticket`` from :meth:`WeightPublisher.ticket`); returns receive stats."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Leave the group. Idempotent."""
