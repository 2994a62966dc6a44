"""In-order consumption (``staleness.consume: in_order``): a batch takes the lowest outstanding admitted
indices and waits for them, so under a fixed bound the admission rule leaves nothing to drop, the StarPO-S
filter and the replays after a dead producer included; ``ragen-async audit`` checks that an in-order run
dropped nothing. Arrival order (today's default) on the same simulated producers drops slow groups."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from ragen_async.cli import app
from ragen_async.config import load_config
from ragen_async.orchestrator import Trainer
from ragen_async.records.metrics import MemorySink
from ragen_async.records.provenance import audit_in_order, audit_staleness, bounds_from_metrics, read_provenance
from ragen_async.records.rundir import RunDir
from ragen_async.staleness.admission import AdmissionController
from ragen_async.staleness.bound import StalenessBound
from ragen_async.staleness.buffer import BufferNotReady
from ragen_async.staleness.controllers import AdaptiveBound
from tests.fakes import TickRuntime, make_group, plain_buffer

K, B = 2, 4


# ----------------------------------------------------------------------------------------------------
# The buffer


def test_in_order_waits_for_the_lowest_index_that_arrival_order_overtakes():
    arrival, in_order = plain_buffer(2, max_staleness=K), plain_buffer(2, max_staleness=K, consume="in_order")
    for buf in (arrival, in_order):
        for i in (1, 2, 3):
            buf.add(make_group(i, version=0), learner_version=0, now=0.0)
    assert arrival.ready(0) and arrival.next_batch(0, step=1, now=0.0).indices == [1, 2]
    assert not in_order.ready(0)
    with pytest.raises(BufferNotReady):
        in_order.next_batch(0, step=1, now=0.0)
    assert len(in_order) == 3  # nothing lost waiting
    in_order.add(make_group(0, version=0), learner_version=0, now=1.0)
    assert in_order.ready(0) and in_order.next_batch(0, step=1, now=1.0).indices == [0, 1]
    assert in_order.next_batch(1, step=2, now=2.0).indices == [2, 3]
    with pytest.raises(ValueError, match="already consumed"):
        in_order.add(make_group(1, version=0), learner_version=2, now=3.0)  # a copy of a consumed group


def test_in_order_steps_over_a_dropped_index_and_waits_behind_the_head_only():
    """A group that turns out stale is dropped (a tightened bound), its index resolved: the line moves past it."""
    buf = plain_buffer(2, max_staleness=1, consume="in_order")
    buf.add(make_group(1, version=0), learner_version=3, now=0.0)  # stale on arrival: dropped, index 1 resolved
    buf.add(make_group(2, version=3), learner_version=3, now=0.0)
    assert not buf.ready(3)  # index 0 is the head of the line
    buf.add(make_group(0, version=2), learner_version=3, now=0.0)
    assert buf.ready(3) and buf.next_batch(3, step=4, now=0.0).indices == [0, 2]
    (drop,) = buf.drain_drops()
    assert (drop.index, drop.where, drop.bound, drop.past_bound) == (1, "add", 1, 2)


def test_a_resumed_in_order_buffer_starts_at_the_lowest_outstanding_index():
    buf = plain_buffer(2, max_staleness=K, consume="in_order")
    buf.restore(next_index=10, outstanding=[6, 8, 9])  # 7 was consumed or dropped before the checkpoint
    buf.add(make_group(8, version=3), learner_version=3, now=0.0)
    assert not buf.ready(3)
    buf.add(make_group(6, version=3), learner_version=3, now=0.0)
    assert buf.ready(3) and buf.next_batch(3, step=4, now=0.0).indices == [6, 8]
    with pytest.raises(ValueError, match="already consumed"):
        buf.add(make_group(7, version=3), learner_version=4, now=0.0)


# ----------------------------------------------------------------------------------------------------
# The loop, on simulated producers that finish out of order and die


class DyingProducers(TickRuntime):
    """TickRuntime's producers (random finishing order, a fifth of the groups very slow, replayed frames),
    grouped into four actors of three slots; at the ticks in ``deaths`` actor w1 dies: its groups in play are
    lost and the gate hands every index it held and that is not yet resolved (waiting in the buffer
    included) to the next free slot, as the Ray runtime does (``AdmissionController.abandon``)."""

    def __init__(self, *args, deaths: tuple[int, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.deaths, self.abandoned = set(deaths), 0

    def _admit(self) -> None:
        ctrl = self.admission.controller
        while len(self.in_flight) < self.producers:
            owner = f"w{len(self.in_flight) % 4}"
            if (i := ctrl.try_admit(owner)) is None:
                break
            limit = ctrl.limit()
            assert limit is None or ctrl.groups_started <= limit, (ctrl.groups_started, limit)
            slow = self.rng.random() < 0.2
            self.in_flight.append({"index": i, "versions": [], "turns": int(self.rng.integers(1, 4)), "left": 0,
                                   "slow": slow, "owner": owner})

    async def receive(self, timeout_s: float):
        if self.tick > 200_000:
            raise AssertionError("the learner starved")
        if self.tick in self.deaths:
            self.in_flight = [g for g in self.in_flight if g["owner"] != "w1"]
            self.abandoned += len(self.admission.controller.abandon("w1"))
        return await super().receive(timeout_s)


def run_sim(tmp_path, consume: str, *, steps: int = 40, deaths: tuple[int, ...] = (), seed: int = 5):
    cfg = load_config(None, [f"run_root={tmp_path}", "runtime=ray", f"total_steps={steps}", "validation.every=0",
                             f"staleness.max_staleness={K}", f"staleness.consume={consume}", "algo.filter_mode=std",
                             "algo.filter_ratio=0.5", f"rollout.envs=[{{tag: Bandit, n_groups: {B}}}]",
                             "rollout.group_size=2", "learner.num_ranks=1", "logging.console=false"])
    runtime = DyingProducers(K, groups_per_step=B, producers=12, seed=seed, deaths=deaths)
    run_dir = RunDir.create(cfg)
    trainer = Trainer(cfg, run_dir, MemorySink(), runtime)
    asyncio.run(trainer.run())
    trainer.close()
    return run_dir, runtime, trainer


DEATHS = (120, 400, 900)


def test_in_order_drops_nothing_and_consumes_in_order_where_arrival_order_drops(tmp_path):
    run_dir, runtime, trainer = run_sim(tmp_path / "in_order", "in_order", deaths=DEATHS)
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    ctrl = runtime.admission.controller
    assert ctrl.groups_dropped == trainer.buffer.dropped_total == 0
    assert not any(p["dropped"] for p in provenance)
    # Step s trains on exactly indices (s - 1)·B .. s·B - 1: the lowest, in order, whatever finished first.
    assert [[g["index"] for g in p["groups"]] for p in provenance] == [list(range(s * B, (s + 1) * B))
                                                                       for s in range(40)]
    staleness = [p["learner_version"] - g["min_version"] for p in provenance for g in p["groups"]]
    assert max(staleness) == K  # the bound was reached, never passed
    # The paths the guarantee must survive were taken: the filter trained on part of each batch, a dead
    # actor's groups were replayed (some already waiting in the buffer: their copies were refused).
    assert any(not g["kept"] for p in provenance for g in p["groups"])
    assert runtime.abandoned > 0 and trainer.duplicates > 0

    run_dir, runtime, trainer = run_sim(tmp_path / "arrival", "arrival", deaths=DEATHS)
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    assert runtime.admission.controller.groups_dropped == trainer.buffer.dropped_total > 0
    assert {d["reason"] for p in provenance for d in p["dropped"]} == {"stale"}
    consumed = [g["index"] for p in provenance for g in p["groups"]]
    assert consumed != sorted(consumed)  # slow groups were overtaken


def test_drops_in_provenance_carry_what_a_comparison_needs(tmp_path):
    """Each drop: the level, how late (the bound and versions past it, seconds waited), the episodes'
    turns, tokens, success and scores; each consumed group the same episode statistics."""
    run_dir, *_ = run_sim(tmp_path, "arrival", steps=20)
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    drops = [d for p in provenance for d in p["dropped"]]
    assert drops
    for d in drops:
        assert d["bound"] == K and d["past_bound"] == d["staleness"] - K >= 1
        assert d["seed"] == d["index"] and d["env_tag"] == "sim" and d["group_id"] == f"g{d['index']:08d}"
        assert d["waited_s"] >= 0 and len(d["scores"]) == 2
        assert d["tokens"] > 0 and {"turns", "success", "in_flight_s"} <= set(d)
    group = provenance[0]["groups"][0]
    assert {"turns", "tokens", "success", "in_flight_s"} <= set(group) and group["tokens"] > 0


def test_a_drop_record_holds_the_groups_episode_statistics():
    buf = plain_buffer(2, max_staleness=1)
    group = make_group(5, version=0, rewards=(0.0, 1.0), replies=(3, 4), created_at=10.0, finished_at=12.5)
    buf.add(group, learner_version=0, now=13.0)
    assert not buf.ready(3, now=20.0)  # three versions old now: dropped from the buffer after 7 s
    (drop,) = buf.drain_drops()
    record = drop.as_record()
    assert record == {"index": 5, "reason": "stale", "where": "consume", "staleness": 3, "group_id": "g00000005",
                      "learner_version": 3, "bound": 1, "past_bound": 2, "waited_s": 7.0, "env_tag": "sokoban",
                      "seed": 5, "worker": "w0", "turns": 2.0, "tokens": 2 * 3 + 2 * 4, "success": 0.5,
                      "in_flight_s": 2.5, "scores": [0.0, 1.0]}


def test_a_resumed_in_order_run_continues_in_order_without_drops(tmp_path):
    """The checkpoint's outstanding indices are replayed first; the resumed buffer's head of the line is the
    lowest of them (without it the run would wait for index 0 for ever)."""
    run_dir, runtime, trainer = run_sim(tmp_path, "in_order", steps=10)
    checkpoint = run_dir.latest_checkpoint()

    class Resumed(DyingProducers):
        async def load(self, path):
            return json.loads((path / "driver_state.json").read_text())["version"]

    cfg = load_config(run_dir.config_path, ["total_steps=20"])
    resumed = Resumed(K, groups_per_step=B, producers=12, seed=9)
    trainer = Trainer(cfg, run_dir, MemorySink(), resumed)

    async def go():
        await trainer.resume(checkpoint)
        await trainer.run()

    asyncio.run(go())
    trainer.close()
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    assert [[g["index"] for g in p["groups"]] for p in provenance] == [list(range(s * B, (s + 1) * B))
                                                                       for s in range(20)]
    assert resumed.admission.controller.groups_dropped == 0


# ----------------------------------------------------------------------------------------------------
# The audit


def test_the_audit_passes_a_clean_in_order_run_and_flags_drops_in_one(tmp_path):
    run_dir, *_ = run_sim(tmp_path / "in_order", "in_order", steps=20)
    result = CliRunner().invoke(app, ["audit", str(run_dir.path)])
    assert result.exit_code == 0, result.output
    assert "in-order consumption" in result.output
    assert json.loads(result.output.strip().splitlines()[-1])["in_order"] == {"drops": [], "out_of_order": []}

    # A run that dropped: clean as the arrival-order run it was, flagged once its config says in order.
    run_dir, runtime, _ = run_sim(tmp_path / "arrival", "arrival", steps=20)
    result = CliRunner().invoke(app, ["audit", str(run_dir.path)])
    assert result.exit_code == 0 and runtime.admission.controller.groups_dropped > 0, result.output
    config = run_dir.config_path.read_text()
    assert "consume: arrival" in config
    run_dir.config_path.write_text(config.replace("consume: arrival", "consume: in_order"))
    result = CliRunner().invoke(app, ["audit", str(run_dir.path)])
    assert result.exit_code == 1 and "(in_order_drop)" in result.output, result.output
    found = next(json.loads(line) for line in result.output.splitlines() if line.startswith("{"))["in_order"]
    assert len(found["drops"]) == runtime.admission.controller.groups_dropped


def _step(step: int, indices: list[int], dropped: list[int] = ()) -> dict:
    return {"step": step, "learner_version": step - 1, "groups": [{"index": i} for i in indices],
            "dropped": [{"index": i, "reason": "stale", "where": "add", "staleness": 3} for i in dropped]}


def test_under_the_adaptive_bound_only_a_tightening_explains_a_drop():
    records = [_step(1, [0, 1]), _step(2, [2, 3], dropped=[4]), _step(3, [5, 6], dropped=[7]), _step(4, [8, 9])]
    # The bound fell from 4 to 2 at step 2: the drop then is explained; at step 3 it had not fallen further.
    found = audit_in_order(records, 4, adaptive=True, bounds={1: 4, 2: 2, 3: 2, 4: 2})
    assert found == {"drops": [], "out_of_order": []}  # 2 < 4, which was in force before: both explained
    found = audit_in_order(records, 2, adaptive=True, bounds={1: 2, 2: 2, 3: 1, 4: 1})
    assert [d["index"] for d in found["drops"]] == [4]  # step 2: no tightening yet; step 3's is explained
    assert [d["index"] for d in audit_in_order(records, 2)["drops"]] == [4, 7]  # a fixed bound explains none
    found = audit_in_order([_step(1, [0, 2]), _step(2, [1, 3])], 2)
    assert found["out_of_order"] == [{"step": 2, "lowest": 1, "previous_highest": 2}]


# ----------------------------------------------------------------------------------------------------
# Admission + in-order buffer on a tick clock, the bound moving


def _tick_run(k: int, tighten_to: int | None = None, at_version: int = 8, steps: int = 24, seed: int = 0):
    """Six slots (slot 0 pathologically slow) play groups the controller admits, each turn at the version its
    engine serves; the learner takes in-order batches. With ``tighten_to`` the bound drops from k to it when
    the learner reaches ``at_version`` (at admission, then in the buffer from the first index admitted under it,
    as the loop does). Returns the drops, the consumed indices per step, each consumed group's staleness against
    the bound it was admitted under, the first index admitted under the tightened bound, and the staleness of
    the groups admitted before it that were trained after it."""
    from ragen_async.staleness.buffer import TrajectoryBuffer
    from tests.fakes import advance_slots

    rng = np.random.default_rng(seed)
    ctrl = AdmissionController(k, 2)
    buf = TrajectoryBuffer(2, k, filter_mode="none", filter_ratio=1.0, norm_mode="mean_std", consume="in_order")
    engine, publish_at, slots = 0, None, [None] * 6
    learner, done_at, batches, over, drops, first_tight, late = 0, None, [], [], [], None, []
    for tick in range(50_000):
        if publish_at is not None and tick >= publish_at:
            engine, publish_at = learner, None
            ctrl.set_published_version(engine)
        advance_slots(slots, ctrl, buf, rng, engine, learner, tick)
        if done_at is not None and tick >= done_at:
            learner, done_at = learner + 1, None
            publish_at = tick + int(rng.integers(0, 4))
            if tighten_to is not None and learner == at_version:
                first_tight = ctrl.set_max_staleness(tighten_to)
                buf.bound.moved(tighten_to, first_tight)
            if learner == steps:
                break
        if done_at is None and buf.ready(learner, now=float(tick)):
            batch = buf.next_batch(learner, learner, now=float(tick))
            batches.append(batch.indices)
            over += [learner - t.oldest_version - buf.bound.of(g.index) for g in batch.groups for t in g.trajectories]
            late += [learner - t.oldest_version for g in batch.groups if g.index < (first_tight or 0)
                     for t in g.trajectories if learner > at_version]
            ctrl.on_consumed(batch.indices)
            done_at = tick + int(rng.integers(1, 6))
        new = buf.drain_drops()
        drops += new
        ctrl.on_dropped([d.index for d in new])
    else:
        raise AssertionError("the learner starved")
    return drops, batches, over, first_tight, late


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_fixed_bound_drops_nothing_even_behind_a_pathologically_slow_slot(seed):
    drops, batches, over, *_ = _tick_run(K, seed=seed)
    assert drops == [] and max(over) <= 0
    flat = [i for b in batches for i in b]
    assert flat == list(range(len(flat)))  # every index, in order


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tightening_drops_nothing_each_group_keeps_the_bound_it_was_admitted_under(seed):
    drops, batches, over, first_tight, late = _tick_run(4, tighten_to=1, seed=seed)
    assert drops == [] and max(over) <= 0  # every consumed group within the bound it was admitted under
    assert max(late) > 1  # groups admitted under 4 were trained after the bound fell to 1, older than 1
    flat = [i for b in batches for i in b]
    assert flat == list(range(len(flat)))  # every index, in order


# ----------------------------------------------------------------------------------------------------
# A moving bound: in order, each group keeps the bound it was admitted under


def test_a_tightened_bound_holds_only_groups_admitted_after_it():
    bound = StalenessBound(4, per_group=True)
    buf = plain_buffer(2, None, consume="in_order", bound=bound)
    bound.moved(1, first_index=4)  # indices 0-3 were admitted under 4
    assert [bound.of(i) for i in (0, 3, 4, 9)] == [4, 4, 1, 1] and buf.max_staleness == 1
    for i in range(4):
        buf.add(make_group(i, version=0), learner_version=3, now=0.0)  # 3 versions old: within its own bound
    assert buf.ready(3) and buf.next_batch(3, step=4, now=0.0).indices == [0, 1]
    buf.add(make_group(4, version=0), learner_version=3, now=0.0)  # admitted under 1: too old
    assert [(d.index, d.bound) for d in buf.drain_drops()] == [(4, 1)]
    assert bound.state()["bounds"] == [[0, 4], [4, 1]]
    arrival = StalenessBound(4, per_group=False)
    arrival.moved(1, first_index=4)  # arrival order does not know what a group was admitted under
    assert arrival.of(0) == 1


def test_a_restored_bound_keeps_each_replayed_groups_own_bound():
    """A checkpoint's bounds come back as they were (replayed groups keep the bound they were admitted under),
    the controller where it was, and admission at the restored bound."""
    bound = StalenessBound(4, per_group=True, controller=AdaptiveBound(start=4))
    bound.controller.update(True)  # a warning: 4 -> 2
    bound.moved(2, first_index=6)
    state = bound.state()
    copy = StalenessBound(4, per_group=True, controller=AdaptiveBound(start=4))
    admission = AdmissionController(4, 2)

    class Handle:
        async def set_max_staleness(self, k):
            return admission.set_max_staleness(k)

    asyncio.run(copy.restore(state, Handle()))
    assert (copy.current, copy.of(5), copy.of(6), admission.max_staleness) == (2, 4, 2, 2)
    assert copy.controller.state() == bound.controller.state()


class ScriptedBound(AdaptiveBound):
    """The adaptive bound, moved by a script instead of by warnings: ``script[n]`` after the n-th step."""

    def __init__(self, script: dict[int, int]):
        super().__init__(start=4)
        self.script, self.steps = script, 0

    def update(self, warned: bool) -> int | None:
        self.steps += 1
        before = self.max_staleness
        self.max_staleness = self.script.get(self.steps, before)
        self.reason = "scripted" if self.max_staleness != before else ""
        return self.max_staleness


def test_in_order_drops_nothing_while_the_bound_moves_and_the_audit_checks_each_groups_own_bound(tmp_path):
    """Tightenings from 4 to 1 and back: nothing dropped (a group admitted under 4 may still be trained at age
    4 after the bound fell to 1), each group's recorded bound is the one it was admitted under, and the audit
    checks staleness against it; a record that claims a looser bound than any in force is caught."""
    cfg = load_config(None, [f"run_root={tmp_path}", "runtime=ray", "total_steps=40", "validation.every=0",
                             "staleness.max_staleness=4", "staleness.adaptive=true", "staleness.consume=in_order",
                             "algo.filter_mode=std", "algo.filter_ratio=0.5",
                             f"rollout.envs=[{{tag: Bandit, n_groups: {B}}}]", "rollout.group_size=2",
                             "learner.num_ranks=1", "logging.console=false"])
    runtime = DyingProducers(4, groups_per_step=B, producers=12, seed=3, deaths=(300,))
    run_dir, sink = RunDir.create(cfg), MemorySink()
    trainer = Trainer(cfg, run_dir, sink, runtime)
    trainer.bound.controller = ScriptedBound({8: 1, 20: 3, 26: 1})
    asyncio.run(trainer.run())
    trainer.close()
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    assert runtime.admission.controller.groups_dropped == trainer.buffer.dropped_total == 0
    groups = [(p["learner_version"] - g["min_version"], g["bound"], p["step"]) for p in provenance for g in p["groups"]]
    assert all(age <= bound for age, bound, _ in groups)
    assert any(age > 1 and step > 9 and bound == 4 for age, bound, step in groups)  # drained under its own bound
    changes = [r["staleness/bound_change"] for r in sink.records if "staleness/bound_change" in r]
    assert changes.count(-1.0) == 2 and changes.count(1.0) == 1
    # each step logs the loosest bound its groups were admitted under (what the controller measures against)
    consumed = {r["learner/step"]: r["staleness/consumed_bound"] for r in sink.records if "staleness/consumed_bound" in r}
    assert consumed == {p["step"]: max(g["bound"] for g in p["groups"]) for p in provenance}
    assert any(r["staleness/consumed_bound"] > r["staleness/max_staleness"]
               for r in sink.records if "staleness/consumed_bound" in r)
    bounds = bounds_from_metrics(sink.records)
    assert audit_staleness(provenance, 4, adaptive=True, bounds=bounds)["violations"] == []
    assert audit_in_order(provenance, 4, adaptive=True, bounds=bounds)["drops"] == []
    forged = json.loads(json.dumps(provenance))
    forged[-1]["groups"][0]["bound"] = 9  # looser than any bound in force
    (violation,) = audit_staleness(forged, 4, adaptive=True, bounds=bounds)["violations"]
    assert violation["rule"] == "admitted_bound"
    # A step whose bound the metrics lack (e.g. a step lost with a failed weight sync) still holds each group to the
    # bound it was admitted under, where provenance records it.
    aged = json.loads(json.dumps(provenance))
    record = next(p for p in aged if any(g["bound"] == 1 for g in p["groups"]))
    group = next(g for g in record["groups"] if g["bound"] == 1)
    group["min_version"] = record["learner_version"] - 3  # 3 <= the top bound 4, but above its own 1
    without = {s: b for s, b in bounds.items() if s != record["step"]}
    result = audit_staleness(aged, 4, adaptive=True, bounds=without)
    assert record["step"] in result["bound_unknown_steps"]
    assert [(v["index"], v["bound"], v["rule"]) for v in result["violations"]] == [(group["index"], 1, "admitted_bound")]
