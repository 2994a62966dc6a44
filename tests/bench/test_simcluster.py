"""The simulated cluster (``ragen-async bench cluster``): its engine stand-in stamps versions like vLLM, its
groups are valid protocol messages, and a short run really goes through the real runtime, the production admission
gate actor, buffer and transport (groups consumed, admission refusing, the staleness bound reached and held, every
index accounted for, every gate call timed)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from ragen_async.bench.simcluster import (
    ClusterSpec,
    SimEngine,
    SimRolloutWorker,
    VersionClock,
    cluster_config,
    episode_templates,
    knee,
    linear_ratios,
    run_cluster,
)
from ragen_async.bench.simprofile import load_profile
from ragen_async.inference.base import SamplingConfig

pytestmark = pytest.mark.clusters_lane

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "configs" / "sim" / "sokoban_tiny_profile.json"


def test_profile_is_a_real_engine_measurement():
    profile = load_profile(PROFILE)
    assert profile.provenance["engine"] == "vllm" and "command" in profile.provenance
    s = profile.summary()
    assert s["groups"] >= 16 and 1 <= s["turns_mean"] <= 5
    assert 1e-4 < s["token_latency_ms_p50"] / 1e3 < 1.0


def test_clock_and_engine_stamp_each_token_with_the_version_it_was_due_under():
    clock = VersionClock(0)
    clock.switch(1, 10.0)
    clock.switch(3, 20.0)
    assert clock.at(np.array([5.0, 10.0, 15.0, 25.0])).tolist() == [0, 1, 1, 3]
    with pytest.raises(ValueError):
        clock.switch(2, 30.0)

    engine = SimEngine(load_profile(PROFILE), VersionClock(4), seed=0)

    async def main():
        task = asyncio.create_task(engine.generate([1, 2], SamplingConfig(max_tokens=64, seed=7)))
        await asyncio.sleep(0.02)
        await engine.load_state_dict([], 5)
        return await task

    gen = asyncio.run(main())
    assert gen.token_versions[0] == 4 and gen.end_version in (4, 5)
    assert gen.token_versions == sorted(gen.token_versions)


def test_simulated_groups_are_valid_and_carry_their_index_seed_and_versions(tmp_path):
    profile = load_profile(PROFILE)
    spec = ClusterSpec(actors=2, profile=PROFILE)
    cfg = cluster_config(spec, 2, tmp_path, len(profile.groups[0]))
    clock = VersionClock(2)
    worker = SimRolloutWorker(cfg, SimEngine(profile, clock), episode_templates(profile), worker_id="w1")
    t0 = time.monotonic()
    group = asyncio.run(worker.play_group(11))
    assert group.index == 11 and group.seed == cfg.rollout.seed + 11 and group.worker_id == "w1"
    assert len(group.trajectories) == cfg.rollout.group_size
    for traj in group.trajectories:
        traj.validate()
        assert traj.oldest_version == 2
    # The group took as long as its slowest recorded episode's token timeline.
    assert time.monotonic() - t0 >= 0.9 * max(t.timings["episode_s"] for t in group.trajectories) - 0.05


@pytest.mark.slow
@pytest.mark.parametrize("admission", ["wait", "poll"])
def test_a_short_simulated_run_goes_through_the_real_gate_buffer_and_transport(admission):
    # 4 actors playing 4 groups each at once, 8 groups per step, k = 1: the gate allows (k + v + 1) x 8
    # started groups, fewer than the 16 slots the actors have, so it must refuse, and groups started
    # under version v are trained on at v + 1 (staleness 1). Both admission protocols keep the bound exactly.
    spec = ClusterSpec(actors=4, groups_per_actor=2, concurrent_groups=4, max_staleness=1, learner_step_s=0.1,
                       actors_per_rank=2, profile=PROFILE, admission=admission)
    row = run_cluster(spec, steps=4, warmup=1)
    assert row.consumed == 5 * spec.groups_per_step  # the loop took 5 full batches from the buffer
    received = row.records[-1]["transport/received"]
    assert received >= row.consumed  # every consumed group crossed ZeroMQ and was decoded
    assert row.refusals > 0  # the admission gate said wait
    stale = [r["staleness/max"] for r in row.records]
    assert max(stale) == spec.max_staleness  # the bound was reached ...
    assert all(s <= spec.max_staleness for s in stale)  # ... and held
    assert row.admitted >= row.consumed + row.dropped
    assert row.groups_per_s > 0 and 0 < row.driver_cpu < 2 and row.buffer_mb_max > 0
    assert row.ranks == 2 and row.records[-1]["transport/shard_bytes"] > 0
    # The control plane measured is the production gate actor's: every index it handed out went to an admission
    # call of a simulated actor (the hosts' own count), and a call that came back empty was a refusal there.
    assert row.calls_admitted == row.admitted and row.calls_empty <= row.refusals
    if admission == "poll":  # one index per call, every refusal an empty answer
        assert row.calls_empty == row.refusals
    assert row.admissions_per_s > 0 and row.gate_calls_per_s > 0
    assert 0 < row.gate_p50_ms <= row.gate_p99_ms and 0 < row.gate_cpu < 2


def test_an_unknown_admission_protocol_is_refused():
    with pytest.raises(ValueError, match="admission must be one of"):
        ClusterSpec(actors=2, admission="lease")


def test_ratios_and_knee():
    from dataclasses import fields

    from ragen_async.bench.simcluster import ClusterRow

    def row(n: int, gps: float) -> ClusterRow:
        zeros = {f.name: 0 for f in fields(ClusterRow) if f.name != "records"}
        return ClusterRow(**{**zeros, "actors": n, "groups_per_step": 4 * n, "groups_per_s": gps})

    rows = [row(2, 10.0), row(8, 38.0), row(32, 140.0), row(128, 200.0)]
    assert [round(r, 2) for r in linear_ratios(rows)] == [1.0, 0.95, 0.88, 0.31]
    assert knee(rows) == (32, 128)
    assert knee(rows[:3]) == (32, None)
