"""The runtime seam under the one training loop (``orchestrator.py``): what the loop asks of a placement.

The loop decides *what* happens and in which order (collect a batch, train, publish, validate, checkpoint); a
:class:`Runtime` decides *where* the parts run and how they are connected (``runtime/local.py``: one process;
``runtime/ray_runtime.py``: Ray actors, ZeroMQ, a torch.distributed learner pool). :class:`Admission` is the loop's
handle on the run's one admission controller (``staleness.admission.AdmissionController``), in-process or a Ray actor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from ragen_async.learner.learner import TrainResult
from ragen_async.protocol import AnyGroup, BatchShard


class Admission(ABC):
    """The loop's handle on the run's one admission controller (in-process, or a Ray actor)."""

    @abstractmethod
    async def resolve(self, consumed: list[int], dropped: list[int]) -> None:
        """Report groups consumed by a batch and groups the buffer dropped (each index exactly once)."""

    @abstractmethod
    async def set_published_version(self, version: int) -> None:
        """Every engine now serves (the weights admitted for) ``version``: open its slots."""

    @abstractmethod
    async def state(self) -> dict[str, Any]:
        """The controller's state (``AdmissionController.state``) for a checkpoint."""

    @abstractmethod
    async def set_max_staleness(self, k: int | None) -> int:
        """Move the bound for groups admitted from now on; returns the first index admitted under it
        (``AdmissionController.set_max_staleness``)."""

    @abstractmethod
    async def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (before any producer starts)."""


class Runtime(ABC):
    """Where a run's parts live. The loop calls these in its fixed order; see the module docstring."""

    admission: Admission

    @abstractmethod
    async def start(self) -> None:
        """Start producing groups (after restore, initial publish and step-0 validation)."""

    @abstractmethod
    async def receive(self, timeout_s: float) -> AnyGroup | None:
        """The next finished group, or ``None`` after ``timeout_s``. Raises if a producer failed."""

    @abstractmethod
    async def train(self, shards: list[BatchShard]) -> TrainResult:
        """One learner step on the batch (one shard per rank): the new version and merged metrics."""

    @abstractmethod
    async def publish(self, version: int) -> None:
        """Load the weights of ``version`` (the current one, or an older one under fixed lag) into every engine."""

    @abstractmethod
    async def probe(self, token_ids: list[int], version: int) -> tuple[list[float], list[list[float]]]:
        """Log-probs of ``token_ids`` from learner rank 0 under the weights of ``version`` (the current
        ones, or under fixed lag the published older ones) and from every engine (weight-sync check)."""

    @abstractmethod
    async def served_weights(self) -> list[tuple[int, list]]:
        """Per engine, the version it serves and what its forward reads (``InferenceEngine.served_weights``)."""

    @abstractmethod
    async def published_digests(self, version: int, needed: list[tuple[str, str]]) -> dict:
        """Learner rank 0's digests of the weights published as ``version`` in the dtypes ``needed``
        (``weight_sync.verify.published_digests``), for the byte-exact weight check."""

    @abstractmethod
    async def validate(self) -> dict[str, float]:
        """Validation episodes on an engine (fixed seeds, validation temperature)."""

    @abstractmethod
    async def rollout_stats(self) -> list[dict[str, float]]:
        """Per producer, cumulative: ``busy_s``, ``admission_wait_s``, ``policy_version``."""

    @abstractmethod
    async def save(self, path: Path, step: int) -> None:
        """Write the learner side of a checkpoint (model, optimizers, RNG, fixed-lag ring) to ``path``."""

    @abstractmethod
    async def load(self, path: Path) -> int:
        """Restore the learner side of a checkpoint; returns its policy version."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def close(self) -> None:
        """Stop producers and release everything (also after a failure)."""
