"""The driver holds a bounded number of groups however fast the producers are.

The trajectory buffer has no size parameter: it is bounded by how the loop feeds it. ``Trainer.collect``
takes groups from the runtime only while the buffer cannot yet assemble a batch, one at a time, so the
buffer never holds more than ``groups_per_step`` usable groups; everything else waits upstream, where
it is bounded too (the receiver's ZeroMQ high-water mark, the senders blocking, and admission control,
which lets at most ``(k + v + 1) x groups_per_step`` groups start). This test floods the loop with
producers that always have a finished group ready, with staleness unbounded (admission never refuses).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ragen_async.config import load_config
from ragen_async.learner.learner import TrainResult
from ragen_async.orchestrator import Trainer
from ragen_async.protocol import NO_VERSION, Trajectory, TrajectoryGroup
from ragen_async.records.metrics import MemorySink
from ragen_async.records.rundir import RunDir
from tests.fakes import TickRuntime

B = 4


def tiny_group(index: int, version: int) -> TrajectoryGroup:
    trajs = []
    for i in range(2):
        tv = np.array([NO_VERSION, version, version], np.int32)
        mask = (tv != NO_VERSION).astype(np.int8)
        trajs.append(Trajectory(
            traj_id=f"g{index}/{i}", env_tag="sim", seed=index, group_id=f"g{index:08d}",
            token_ids=np.arange(3, dtype=np.int32), loss_mask=mask,
            behaviour_logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32), token_versions=tv, turns=(),
            format_penalty=0.0, success=bool(i)))
    return TrajectoryGroup(f"g{index:08d}", index, "sim", index, tuple(trajs))


class FloodRuntime(TickRuntime):
    """Infinitely fast producers: every receive returns a newly finished group at once (the rest of the
    runtime is the loop test's simulation)."""

    def __init__(self, k: int | None):
        super().__init__(k, B, producers=1, seed=0)
        self.receives = 0

    async def receive(self, timeout_s: float) -> TrajectoryGroup | None:
        self.receives += 1
        index = self.admission.controller.try_admit()
        return None if index is None else tiny_group(index, self.served)

    async def train(self, shards):
        return TrainResult(shards[0].learner_version + 1, {"learner/num_tokens": 1.0})


@pytest.mark.parametrize("k", [None, 1])
def test_the_buffer_never_holds_more_than_one_batch(tmp_path, k):
    steps = 30
    cfg = load_config(None, [f"run_root={tmp_path}", "runtime=ray", f"total_steps={steps}", "validation.every=0",
                             f"staleness.max_staleness={'null' if k is None else k}", "algo.filter_mode=none",
                             f"rollout.envs=[{{tag: Bandit, n_groups: {B}}}]", "rollout.group_size=2",
                             "learner.num_ranks=1", "logging.console=false"])
    runtime = FloodRuntime(k)
    trainer = Trainer(cfg, RunDir.create(cfg), MemorySink(), runtime)
    sizes = []
    add = trainer.buffer.add

    def recording_add(group, version, now):
        kept = add(group, version, now)
        sizes.append(len(trainer.buffer))
        return kept

    trainer.buffer.add = recording_add
    asyncio.run(trainer.run())
    trainer.close()
    assert len(sizes) == runtime.receives == steps * B  # not one group taken beyond what the steps needed
    assert max(sizes) == B
    assert len(trainer.buffer) == 0
