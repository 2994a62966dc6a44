"""The runtime seam under the one training loop (``orchestrator.py``), and the in-process runtime.

The loop decides *what* happens and in which order (collect a batch, train, publish, validate,
checkpoint); a :class:`Runtime` decides *where* the parts run and how they are connected:

* :class:`LocalRuntime` (``runtime: local``): one process. The rollout worker plays groups on an
  in-process engine when the loop asks for data, the learner trains in this process, weights go to
  the engine through the in-process publisher. Synchronous, so staleness is 0 by construction.
* ``RayRuntime`` (``runtime: ray``, ``ragen_async.runtime.ray_runtime``): rollout actors play continuously
  and stream groups over ZeroMQ, a torch.distributed learner pool trains, weights are broadcast.

Both go through the same admission controller (here in-process, there a Ray actor) and the loop's
trajectory buffer, so ``k = 0`` on Ray and the local runtime are two placements of one loop.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import Any

from ragen_async.agent.chat import ChatFormat
from ragen_async.config import RunConfig
from ragen_async.inference.base import InferenceEngine
from ragen_async.learner.learner import Learner, TrainResult
from ragen_async.protocol import AnyGroup, BatchShard, TrajectoryGroup
from ragen_async.rollout.engines import make_engine
from ragen_async.rollout.worker import RolloutWorker, validate_engine
from ragen_async.staleness import AdmissionController
from ragen_async.weight_sync.inproc import InProcessPublisher
from ragen_async.weight_sync.verify import published_digests


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


class LocalAdmission(Admission):
    """The controller in this process."""

    def __init__(self, max_staleness: int | None, groups_per_step: int):
        self.controller = AdmissionController(max_staleness, groups_per_step)

    async def resolve(self, consumed: list[int], dropped: list[int]) -> None:
        self.controller.resolve(consumed, dropped)

    async def set_published_version(self, version: int) -> None:
        self.controller.set_published_version(version)

    async def state(self) -> dict[str, Any]:
        return self.controller.state()

    async def set_max_staleness(self, k: int | None) -> int:
        return self.controller.set_max_staleness(k)

    async def restore(self, state: dict[str, Any]) -> None:
        self.controller.restore(state)


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


class LocalRuntime(Runtime):
    """Everything in this process; groups are played on demand, all of one admission budget at once."""

    def __init__(self, cfg: RunConfig, engine: InferenceEngine | None = None):
        self.cfg = cfg
        self.learner = Learner(cfg)
        self.engine = engine if engine is not None else make_engine(cfg, seed=cfg.seed)
        self.chat = ChatFormat.from_pretrained(cfg.model.path, enable_think=cfg.agent.enable_think)
        self.worker = RolloutWorker(cfg, self.engine, self.chat)
        self.publisher = InProcessPublisher([self.engine])
        self.admission = LocalAdmission(cfg.staleness.max_staleness, cfg.rollout.groups_per_step)
        self._ready: deque[TrajectoryGroup] = deque()
        self._gen_s = 0.0

    async def start(self) -> None:
        pass

    async def receive(self, timeout_s: float) -> AnyGroup | None:
        if not self._ready:
            indices = []
            while (index := self.admission.controller.try_admit()) is not None:
                indices.append(index)
            if not indices:
                raise RuntimeError("local runtime: admission allows no new group, yet the loop still needs data "
                                   "(a group was lost without being reported)")
            t0 = time.perf_counter()
            self._ready.extend(await asyncio.gather(*[self.worker.play_group(i) for i in indices]))
            self._gen_s += time.perf_counter() - t0
        return self._ready.popleft() if self._ready else None

    async def train(self, shards: list[BatchShard]) -> TrainResult:
        (shard,) = shards
        return self.learner.train_step(shard)

    async def publish(self, version: int) -> None:
        assert version == self.learner.policy_version, "the local runtime serves the current version only"
        await self.publisher.apublish(self.learner.named_weights(), version)

    async def probe(self, token_ids: list[int], version: int) -> tuple[list[float], list[list[float]]]:
        assert version == self.learner.policy_version, "the local runtime serves the current version only"
        return self.learner.probe_logprobs(token_ids), [await self.engine.prompt_logprobs(token_ids)]

    async def served_weights(self) -> list[tuple[int, list]]:
        return [await self.engine.served_weights()]

    async def published_digests(self, version: int, needed: list[tuple[str, str]]) -> dict:
        assert version == self.learner.policy_version, "the local runtime serves the current version only"
        return published_digests(self.learner.full_weights(), needed)

    async def validate(self) -> dict[str, float]:
        return await validate_engine(self.cfg, self.engine, self.chat)

    async def rollout_stats(self) -> list[dict[str, float]]:
        return [{"busy_s": self._gen_s, "admission_wait_s": 0.0,
                 "policy_version": float(self.engine.policy_version)}]

    async def save(self, path: Path, step: int) -> None:
        self.learner.save_checkpoint(path, extra={"step": step})

    async def load(self, path: Path) -> int:
        self.learner.load_checkpoint(path)
        return self.learner.policy_version

    @property
    def vocab_size(self) -> int:
        return int(self.learner.actor.config.vocab_size)

    def close(self) -> None:
        self.engine.shutdown()

