"""The admission gate (staleness/gate.py) and the rollout loop that asks it: several indices per call, a blocked
request waits at the gate until a change frees a slot (no polling), the accounting stays the controller's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from ragen_async.rollout.worker import RolloutWorker
from ragen_async.staleness.gate import AdmissionGate

pytestmark = pytest.mark.alone


def test_admit_gives_up_to_n_in_order_then_waits_for_a_published_version():
    async def main():
        gate = AdmissionGate(0, 4)  # k = 0: 4 groups may start per published version
        assert await gate.admit("a", 3) == [0, 1, 2]
        assert await gate.admit("b", 3) == [3]  # what is left
        waiting = asyncio.create_task(gate.admit("c", 2, wait_s=30))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # blocked: the call waits at the gate instead of answering none
        t0 = asyncio.get_running_loop().time()
        await gate.set_published_version(1)
        assert await waiting == [4, 5]
        assert asyncio.get_running_loop().time() - t0 < 0.5  # woken by the publish, not by its wait running out
        state = await gate.state()
        assert state["next_index"] == 6 and state["refusals"] >= 1
        assert state["outstanding"] == [0, 1, 2, 3, 4, 5]

    asyncio.run(main())


def test_a_blocked_request_answers_none_when_its_wait_ends_and_a_drop_frees_a_slot():
    async def main():
        gate = AdmissionGate(0, 2)
        assert await gate.admit("a", 2) == [0, 1]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await gate.admit("a", 1, wait_s=0.1) == []  # nothing changed: none, after the wait
        assert loop.time() - t0 >= 0.1
        assert await gate.admit("a", 1) == []  # wait_s = 0: at once
        waiting = asyncio.create_task(gate.admit("b", 2, wait_s=30))
        await asyncio.sleep(0.02)
        await gate.resolve([0], [1])  # group 1 dropped: its slot comes back, one new group may start
        assert await waiting == [2]
        assert (await gate.state())["refusals"] >= 3

    asyncio.run(main())


def test_abandoned_indices_are_handed_out_again_to_a_waiting_request():
    async def main():
        gate = AdmissionGate(0, 2)
        assert await gate.admit("dead", 2) == [0, 1]
        waiting = asyncio.create_task(gate.admit("alive", 4, wait_s=30))
        await asyncio.sleep(0.02)
        assert await gate.abandon("dead") == [0, 1]
        assert await waiting == [0, 1]  # replayed under their own indices, no new slot

    asyncio.run(main())


def test_a_request_the_dead_producer_left_waiting_takes_nothing_when_it_is_abandoned():
    """A producer dies with a request waiting at the gate (its process is gone, the call is not): abandoning it
    wakes that call, which must not take the replays (nobody would play them, and an in-order learner would wait
    for them for ever); its replacement, under the same name, gets them."""
    async def main():
        gate = AdmissionGate(0, 2)
        assert await gate.admit("w3", 2) == [0, 1]
        orphan = asyncio.create_task(gate.admit("w3", 2, wait_s=30))  # the call the dead producer left behind
        await asyncio.sleep(0.02)
        assert await gate.abandon("w3") == [0, 1]
        assert await orphan == []
        assert await gate.admit("w3", 2) == [0, 1]  # the replacement, asking after the abandon
        assert (await gate.state())["outstanding"] == [0, 1]

    asyncio.run(main())


class StubWorker(RolloutWorker):
    """The real rollout loop (``RolloutWorker.run``); a group takes 10 ms and is its index."""

    def __init__(self, limit: int):
        self.cfg = SimpleNamespace(rollout=SimpleNamespace(max_concurrent_groups=limit))
        self.busy_s = self.admission_wait_s = 0.0

    async def play_group(self, index: int) -> int:
        await asyncio.sleep(0.01)
        return index


def test_the_rollout_loop_plays_what_the_gate_admits_under_the_bound_with_one_request_out():
    async def main():
        gate = AdmissionGate(0, 4)  # k = 0: (v + 1) x 4 groups may start at version v
        worker, sent, calls = StubWorker(limit=3), [], []
        version = 0

        async def admit(n: int) -> list[int]:
            calls.append(n)
            got = await gate.admit("w0", n, wait_s=1.0)
            state = await gate.state()
            assert state["next_index"] <= (version + 1) * 4  # never past the bound
            return got

        async def send(index: int) -> None:
            nonlocal version
            sent.append(index)
            if len(sent) % 4 == 0:  # the learner consumed a batch: the next version is published
                await gate.resolve(sent[-4:], [])
                version += 1
                await gate.set_published_version(version)

        await asyncio.wait_for(worker.run(admit, send, lambda: len(sent) >= 16), timeout=20)
        assert sorted(sent) == list(range(len(sent))) and len(sent) >= 16
        assert all(1 <= n <= 3 for n in calls)  # asked for its free slots, never more
        assert len(calls) < 2 * len(sent)  # several groups per call; blocked requests wait instead of polling
        assert (await gate.state())["refusals"] > 0  # the bound was binding
        assert worker.busy_s > 0

    asyncio.run(main())


def test_an_admit_that_answers_none_at_once_is_asked_again_a_tick_later_not_in_a_spin():
    async def main():
        worker, calls = StubWorker(limit=2), []

        async def admit(n: int) -> list[int]:
            calls.append(n)
            return []

        async def send(group) -> None:  # noqa: ANN001
            raise AssertionError("nothing was admitted")

        loop = asyncio.get_running_loop()
        end = loop.time() + 0.5
        await worker.run(admit, send, lambda: loop.time() > end, wait_s=0.05)
        assert 5 <= len(calls) <= 12  # one call per 50 ms tick
        assert worker.admission_wait_s > 0.4 and worker.busy_s == 0

    asyncio.run(main())
