"""The in-process runtime, one placement of the runtime seam (``runtime/base.py``) under the one training loop.

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
from ragen_async.runtime.base import Admission, Runtime
from ragen_async.staleness.admission import AdmissionController
from ragen_async.weight_sync.inproc import InProcessPublisher
from ragen_async.weight_sync.verify import published_digests


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

