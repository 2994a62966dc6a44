"""Admission control (AReaL's rule), per-token staleness and the per-step staleness statistics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from ragen_async.protocol import NO_VERSION, Trajectory, TrajectoryGroup, TurnRecord
from ragen_async.staleness.admission import AdmissionController
from ragen_async.staleness.ages import StalenessStats, group_staleness, trajectory_staleness
from ragen_async.staleness.ids import format_group_id, parse_group_id


def _turn(version: int, end: int | None = None) -> TurnRecord:
    return TurnRecord(0.0, ("up",), 0, True, version, version if end is None else end, 2, 0.1, 0.1)


def _traj(versions: list[int], turns: tuple[TurnRecord, ...] = ()) -> Trajectory:
    """Tokens: one prompt token, then one sampled token per entry of ``versions``."""
    v = np.array([NO_VERSION, *versions], np.int32)
    mask = (v != NO_VERSION).astype(np.int8)
    return Trajectory(
        traj_id="t",
        env_tag="e",
        seed=0,
        group_id="g00000000",
        token_ids=np.arange(len(v), dtype=np.int32),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
        token_versions=v,
        turns=turns,
        format_penalty=0.0,
        success=False,
    )


# ----------------------------------------------------------------------------------------------------
# Group ids


def test_group_id_round_trip():
    assert format_group_id(42) == "g00000042"
    assert parse_group_id("g00000042") == 42
    assert parse_group_id("g00000042-sokoban") == 42
    assert parse_group_id(format_group_id(123_456_789_012)) == 123_456_789_012
    for bad in ("x00000042", "g", "group7", ""):
        with pytest.raises(ValueError):
            parse_group_id(bad)
    with pytest.raises(ValueError):
        format_group_id(-1)


# ----------------------------------------------------------------------------------------------------
# Admission: the rule itself


@pytest.mark.parametrize("k", [0, 1, 2])
def test_admits_exactly_k_plus_v_plus_one_batches(k):
    B = 3
    ctrl = AdmissionController(max_staleness=k, groups_per_step=B)
    indices = []
    for v in range(4):
        ctrl.set_published_version(v)
        assert ctrl.limit() == (k + v + 1) * B
        while (i := ctrl.try_admit()) is not None:
            indices.append(i)
        assert ctrl.groups_started == (k + v + 1) * B and ctrl.capacity() == 0
    assert indices == list(range(len(indices)))  # global sequence, no gaps, no reuse


def test_unbounded_admits_everything():
    ctrl = AdmissionController(max_staleness=None, groups_per_step=4)
    assert [ctrl.try_admit() for _ in range(1000)] == list(range(1000))
    assert ctrl.capacity() is None and ctrl.limit() is None


def test_dropped_groups_return_capacity_but_not_their_index():
    ctrl = AdmissionController(max_staleness=0, groups_per_step=2)
    assert [ctrl.try_admit(), ctrl.try_admit(), ctrl.try_admit()] == [0, 1, None]
    assert ctrl.refusals == 1
    ctrl.on_dropped([1])
    assert ctrl.capacity() == 1 and ctrl.groups_dropped == 1
    assert ctrl.try_admit() == 2  # a replacement, under a fresh index
    assert ctrl.try_admit() is None
    assert ctrl.groups_admitted == 3 and ctrl.groups_started == 2


def test_invalid_use_is_refused():
    with pytest.raises(ValueError):
        AdmissionController(-1, 4)
    with pytest.raises(ValueError):
        AdmissionController(1, 0)
    ctrl = AdmissionController(1, 4)
    ctrl.set_published_version(3)
    with pytest.raises(ValueError, match="backwards"):
        ctrl.set_published_version(2)
    with pytest.raises(ValueError, match="not outstanding"):
        ctrl.on_dropped([0])  # nothing admitted
    assert ctrl.try_admit() == 0
    ctrl.on_dropped([0])
    with pytest.raises(ValueError, match="not outstanding"):
        ctrl.on_dropped([0])  # a drop returns its slot once, however it is reported
    with pytest.raises(ValueError, match="not outstanding"):
        ctrl.on_consumed([0])
    assert ctrl.groups_started == 0 and ctrl.groups_dropped == 1


def test_abandoned_groups_are_replayed_under_their_own_index():
    ctrl = AdmissionController(max_staleness=0, groups_per_step=4)
    assert [ctrl.try_admit("w0"), ctrl.try_admit("w1"), ctrl.try_admit("w1"), ctrl.try_admit("w0")] == [0, 1, 2, 3]
    ctrl.on_consumed([1])  # w1 delivered group 1 before it died
    assert ctrl.abandon("w1") == [2]
    assert ctrl.try_admit("w0") == 2 and ctrl.try_admit("w0") is None  # replayed, no new slot taken
    assert ctrl.abandon("w9") == []
    ctrl.abandon("w0")  # 0, 2, 3 queued again; 3's group then arrives after all
    ctrl.on_consumed([3])
    assert [ctrl.try_admit("w2"), ctrl.try_admit("w2"), ctrl.try_admit("w2")] == [0, 2, None]
    assert ctrl.groups_started == 4


def test_state_round_trip_replays_outstanding_indices_first():
    ctrl = AdmissionController(max_staleness=1, groups_per_step=2)
    got = [ctrl.try_admit() for _ in range(5)]
    assert got == [0, 1, 2, 3, None]
    ctrl.on_consumed([0, 1])
    ctrl.set_published_version(1)
    assert ctrl.try_admit() == 4 and ctrl.try_admit() == 5 and ctrl.try_admit() is None
    ctrl.on_dropped([3])
    restored = AdmissionController(1, 2)
    restored.restore(json.loads(json.dumps(ctrl.state())))
    # 2, 4, 5 were in flight or waiting when the state was taken: they come back, lowest first, with
    # their own index (so their own seed), before any new index and without taking a new slot.
    assert [restored.try_admit() for _ in range(5)] == [2, 4, 5, 6, None]
    assert restored.groups_started == ctrl.groups_started + 1 == restored.limit()
    with pytest.raises(ValueError, match="inconsistent"):
        AdmissionController(1, 2).restore({**ctrl.state(), "consumed": 0})


# ----------------------------------------------------------------------------------------------------
# Admission: a simulated system with random speeds


@dataclass
class _Episode:
    index: int
    engine: int
    turns: int
    versions: list[int] = field(default_factory=list)
    ticks_left: int = 0


def simulate(k: int | None, seed: int, groups_per_step: int = 3, steps: int = 10) -> list[int]:
    """Tick-based model of rollout slots, engines and an in-order learner; returns consumed staleness.

    Slots admit groups through the controller and play multi-turn episodes at random speeds, each turn
    tagged with the version its engine serves when the turn starts. The learner trains on batch u =
    groups [u·B, (u+1)·B) (admission order) for a random time, then publishes u+1; each engine loads it
    after its own random delay, and the published version is the minimum over engines.
    """
    rng = np.random.default_rng(seed)
    B, num_engines, num_slots = groups_per_step, 2, 7
    ctrl = AdmissionController(k, B)
    engine_version = [0] * num_engines
    pending: list[list[tuple[int, int]]] = [[] for _ in range(num_engines)]  # (load at tick, version)
    slot_speed = rng.integers(1, 6, num_slots)
    slots: list[_Episode | None] = [None] * num_slots
    finished: dict[int, list[int]] = {}
    learner_version, learner_done_at = 0, None
    staleness: list[int] = []

    for tick in range(20_000):
        for e in range(num_engines):
            while pending[e] and pending[e][0][0] <= tick:
                engine_version[e] = pending[e].pop(0)[1]
        ctrl.set_published_version(min(engine_version))

        for s in range(num_slots):
            ep = slots[s]
            if ep is None:
                limit, started = ctrl.limit(), ctrl.groups_started
                index = ctrl.try_admit()
                assert (index is not None) == (limit is None or started < limit)  # the rule, every time
                if index is None:
                    continue
                ep = slots[s] = _Episode(index, s % num_engines, int(rng.integers(1, 4)))
            if ep.ticks_left == 0:
                if len(ep.versions) == ep.turns:
                    finished[ep.index] = ep.versions
                    slots[s] = None
                    continue
                ep.versions.append(engine_version[ep.engine])
                ep.ticks_left = int(rng.integers(1, 3 * slot_speed[s] + 1))
            ep.ticks_left -= 1

        if learner_done_at is not None and tick >= learner_done_at:
            learner_version += 1
            learner_done_at = None
            for e in range(num_engines):
                pending[e].append((tick + int(rng.integers(0, 8)), learner_version))
            if learner_version == steps:
                return staleness
        batch = range(learner_version * B, (learner_version + 1) * B)
        if learner_done_at is None and all(i in finished for i in batch):
            staleness += [learner_version - min(finished.pop(i)) for i in batch]
            learner_done_at = tick + int(rng.integers(1, 15))
    raise AssertionError("the simulated learner starved")


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_simulated_training_never_exceeds_k(k, seed):
    staleness = simulate(k, seed)
    assert len(staleness) == 10 * 3
    assert max(staleness) <= k
    if k == 0:
        assert set(staleness) == {0}  # synchronous on-policy


def test_simulated_unbounded_runs_and_goes_stale():
    worst = max(max(simulate(None, seed)) for seed in range(3))
    assert worst > 2  # without a bound, producers race ahead


# ----------------------------------------------------------------------------------------------------
# Token / trajectory staleness


def test_trajectory_and_group_staleness():
    traj = _traj([3, 3, 4, 5])
    assert trajectory_staleness(traj, 6) == 3  # as stale as its oldest token
    assert trajectory_staleness(_traj([]), 6) == 0  # nothing sampled, nothing stale
    group = TrajectoryGroup("g00000000", 0, "e", 0, (traj, _traj([5, 5])))
    assert group_staleness(group, 6) == 3


# ----------------------------------------------------------------------------------------------------
# Statistics


def test_stats_summary_and_reset():
    stats = StalenessStats(hist_max=2)
    a = _traj([1, 1, 2], turns=(_turn(1), _turn(2)))
    b = _traj([3], turns=(_turn(3),))
    stats.record_group(TrajectoryGroup("g00000000", 0, "e", 0, (a, b), created_at=10.0, finished_at=14.0), 4, 20.0)
    stats.record_group(TrajectoryGroup("g00000001", 1, "e", 0, (_traj([4]),), created_at=12.0, finished_at=13.0), 4, 21.0)
    stats.record_dropped(2)
    out = stats.summary()
    # token staleness: 3, 3, 2, 1, 0
    assert out["staleness/tokens"] == 5
    assert out["staleness/mean"] == pytest.approx(9 / 5)
    assert out["staleness/max"] == 3 and out["staleness/min"] == 0
    assert [out[f"staleness/token_hist/{i}"] for i in range(3)] == pytest.approx([0.2, 0.2, 0.2])
    assert out["staleness/token_hist/overflow"] == pytest.approx(0.4)
    assert out["staleness/traj_mean"] == pytest.approx((3 + 1 + 0) / 3) and out["staleness/traj_max"] == 3
    assert out["staleness/turn_mean"] == pytest.approx((3 + 2 + 1) / 3) and out["staleness/turn_max"] == 3
    assert out["staleness/age_in_flight_s"] == pytest.approx(2.5)
    assert out["staleness/age_queued_s"] == pytest.approx(7.0) and out["staleness/age_queued_max_s"] == 8.0
    assert out["staleness/groups"] == 2 and out["staleness/dropped_groups"] == 2

    empty = stats.summary()  # reset: same keys, all zero
    assert empty.keys() == out.keys()
    assert all(v == 0.0 for v in empty.values())
