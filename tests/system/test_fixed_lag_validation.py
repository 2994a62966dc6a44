"""Validation scores the learner's current policy in every mode, fixed lag included, and does so without
touching what the fixed-lag run trains on.

A simulated runtime (no Ray, no model): the engines serve the version last published; producers play the
admitted groups a turn per tick, each token tagged with the version served when it was sampled, and keep
playing while the learner trains and while validation runs (as the Ray runtime's rollout actors do).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from ragen_async.config import load_config
from ragen_async.learner.learner import TrainResult
from ragen_async.orchestrator import Trainer
from ragen_async.protocol import NO_VERSION, Trajectory, TrajectoryGroup
from ragen_async.records.metrics import MemorySink
from ragen_async.records.provenance import read_provenance
from ragen_async.records.rundir import RunDir
from ragen_async.runtime import LocalAdmission, Runtime

TURNS = 3
"""Ticks a group takes to play (one turn, three sampled tokens, per tick)."""


def _group(index: int, versions: list[int]) -> TrajectoryGroup:
    tv = np.array([NO_VERSION] + [v for v in versions for _ in range(3)], np.int32)
    mask = (tv != NO_VERSION).astype(np.int8)
    trajs = tuple(Trajectory(
        traj_id=f"g{index}/{i}", env_tag="sim", seed=index, group_id=f"g{index:08d}",
        token_ids=np.arange(len(tv), dtype=np.int32), loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32), token_versions=tv, turns=(),
        format_penalty=0.0, success=bool(index % 2)) for i in range(2))
    return TrajectoryGroup(f"g{index:08d}", index, "sim", index, trajs)


class LaggedRuntime(Runtime):
    """Fixed-lag admission as the Ray runtime sets it (the gate at k = 0: a version's groups start once the
    engines got its weights); ``publish`` changes what the engines serve at once."""

    def __init__(self, groups_per_step: int):
        self.admission = LocalAdmission(0, groups_per_step)
        self.served = 0
        self.published: list[int] = []
        self.in_flight: list[tuple[int, list[int]]] = []
        self.done: list[TrajectoryGroup] = []

    def _tick(self) -> None:
        while (i := self.admission.controller.try_admit()) is not None:
            self.in_flight.append((i, []))
        for index, versions in list(self.in_flight):
            versions.append(self.served)
            if len(versions) == TURNS:
                self.in_flight.remove((index, versions))
                self.done.append(_group(index, versions))

    async def start(self) -> None:
        pass

    async def receive(self, timeout_s: float) -> TrajectoryGroup | None:
        self._tick()
        return self.done.pop(0) if self.done else None

    async def train(self, shards):
        self._tick()  # producers go on while the learner trains
        return TrainResult(shards[0].learner_version + 1, {"learner/num_tokens": 1.0})

    async def publish(self, version: int) -> None:
        self.served = version
        self.published.append(version)

    async def probe(self, token_ids, version):
        raise AssertionError("not used")

    async def served_weights(self):
        raise AssertionError("not used")

    async def published_digests(self, version, needed):
        raise AssertionError("not used")

    async def validate(self) -> dict[str, float]:
        version = self.served
        for _ in range(2 * TURNS):
            self._tick()  # producers keep playing during validation
        return {"val/success": 0.5, "val/policy_version": float(version)}

    async def rollout_stats(self):
        return [{"busy_s": 0.0, "admission_wait_s": 0.0, "policy_version": float(self.served)}]

    async def save(self, path: Path, step: int) -> None:
        path.mkdir(parents=True, exist_ok=True)

    async def load(self, path: Path) -> int:
        raise AssertionError("not used")

    @property
    def vocab_size(self) -> int:
        return 16

    def close(self) -> None:
        pass


@pytest.mark.timeout(60)  # a group played on the lent weights can stall the fixed-lag batch: fail, do not hang
@pytest.mark.parametrize("k", [2, 0])
def test_validation_scores_the_current_policy_and_fixed_lag_stays_exact(tmp_path, k):
    steps, groups = 8, 3
    cfg = load_config(None, [f"run_root={tmp_path}", "runtime=ray", f"total_steps={steps}", "validation.every=2",
                             f"staleness.max_staleness={k}", f"staleness.fixed_lag={'true' if k else 'false'}",
                             "algo.filter_mode=none", f"rollout.envs=[{{tag: Bandit, n_groups: {groups}}}]",
                             "rollout.group_size=2", "learner.num_ranks=1", "logging.console=false",
                             "weight_sync.verify_first=false"])  # the fake runtime serves no weights
    runtime, sink = LaggedRuntime(groups), MemorySink()
    run_dir = RunDir.create(cfg)
    trainer = Trainer(cfg, run_dir, sink, runtime)
    asyncio.run(trainer.run())
    trainer.close()

    val = [r for r in sink.records if "val/policy_version" in r]
    assert [r["learner/step"] for r in val] == [0, 2, 4, 6, 8]
    # The trained policy is validated: the learner's version at that step, not the k-older one the engines serve.
    assert all(r["val/policy_version"] == r["policy_version"] == r["learner/step"] for r in val), val
    train = [r for r in sink.records if "weight_sync/published_version" in r]
    assert [r["weight_sync/published_version"] for r in train] == [max(0, v - k) for v in range(1, steps + 1)]
    # Fixed lag stays exact: every token of every consumed group was sampled by version v - min(k, v), none by
    # the weights validation borrowed the engines for, and nothing was dropped for being off the lag.
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    assert [p["step"] for p in provenance] == list(range(1, steps + 1))
    for p in provenance:
        lag = min(k, p["learner_version"])
        assert all(p["learner_version"] - g["max_version"] == lag == p["learner_version"] - g["min_version"]
                   for g in p["groups"]), p
    assert trainer.buffer.dropped_total == 0
    assert runtime.served == max(0, steps - k)  # the engines are back on the lagged weights
