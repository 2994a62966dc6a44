"""A rollout actor's sends: a full receiver holds a send at most until the actor stops (then the group is
dropped: the run is over) or until the transport's send timeout, never the whole timeout after a stop."""

import asyncio
import time

import pytest

from ragen_async.rollout.actor import send_unless_stopped
from ragen_async.transport import TransportTimeout


class FullReceiver:
    """A ``send(timeout)`` whose receiver has no room until ``room_at`` (seconds from its creation):
    each attempt waits out its timeout and fails, as ``MessageSender.send`` does on a full pipe."""

    def __init__(self, room_at: float = float("inf")):
        self.start, self.room_at = time.monotonic(), room_at
        self.timeouts: list[float] = []
        self.queued = 0

    async def send(self, timeout_s: float) -> None:
        self.timeouts.append(timeout_s)
        if time.monotonic() - self.start >= self.room_at:
            self.queued += 1
            return
        await asyncio.sleep(timeout_s)
        raise TransportTimeout(f"no room within {timeout_s} s")


def _run(receiver: FullReceiver, timeout_s: float, stop_at: float = float("inf")) -> tuple[bool, float]:
    t0 = time.monotonic()
    result = asyncio.run(send_unless_stopped(receiver.send, timeout_s, lambda: time.monotonic() - t0 >= stop_at,
                                             slice_s=0.1))
    return result, time.monotonic() - t0


def test_a_stopping_actor_gives_up_a_blocked_send_within_a_slice_not_the_send_timeout():
    receiver = FullReceiver()
    sent, elapsed = _run(receiver, timeout_s=600.0, stop_at=0.25)
    assert sent is False and receiver.queued == 0
    assert elapsed < 2.0  # the stop seen at the next slice (0.1 s), not after 600 s
    assert len(receiver.timeouts) >= 3 and max(receiver.timeouts) == pytest.approx(0.1)


def test_a_running_actor_keeps_trying_until_the_send_timeout_and_then_fails_as_one_send_would():
    receiver = FullReceiver()
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        _run(receiver, timeout_s=0.35)
    assert time.monotonic() - t0 >= 0.35
    # The attempts ask for no more than the timeout in all: the last one only for what is left of it.
    assert len(receiver.timeouts) >= 4 and sum(receiver.timeouts) <= 0.35 + 1e-6
    assert 0.0 <= receiver.timeouts[-1] < 0.1


def test_room_made_while_the_actor_runs_queues_the_group_once():
    receiver = FullReceiver(room_at=0.25)
    sent, _ = _run(receiver, timeout_s=600.0)
    assert sent is True and receiver.queued == 1 and len(receiver.timeouts) >= 3
