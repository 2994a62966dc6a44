"""In-process transport: same interface and codec as ZeroMQ, over a bounded queue."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ragen_async.transport import (
    InprocReceiver,
    InprocSender,
    TransportClosed,
    TransportTimeout,
    make_inproc_pair,
)

pytestmark = pytest.mark.alone


def test_round_trip_copies_like_a_network(msgs, secret):
    sender, receiver = make_inproc_pair(secret, maxsize=2)
    group = msgs.group(size=2)
    sender.send(group)
    original = int(group.trajectories[0].token_ids[0])
    group.trajectories[0].token_ids[0] += 1  # mutating after send must not reach the receiver
    out = receiver.receive(timeout_s=1)
    assert int(out.trajectories[0].token_ids[0]) == original
    assert not out.trajectories[0].token_ids.flags.writeable
    assert not np.shares_memory(out.trajectories[0].token_ids, group.trajectories[0].token_ids)
    sender.close()
    receiver.close()


def test_full_queue_times_out(msgs, secret):
    sender, receiver = make_inproc_pair(secret, maxsize=2)
    group = msgs.group(size=1)
    sender.send(group)
    sender.send(group)
    start = time.monotonic()
    with pytest.raises(TransportTimeout):
        sender.send(group, timeout_s=0.05)
    assert time.monotonic() - start < 1.0
    assert receiver.receive(timeout_s=0) is not None
    sender.send(group, timeout_s=0)  # room again
    receiver.close()


def test_fan_in_by_address(msgs, secret):
    receiver = InprocReceiver(secret, "inproc://learner-buffer", maxsize=8)
    senders = [InprocSender("inproc://learner-buffer", secret) for _ in range(3)]
    for i, sender in enumerate(senders):
        sender.send(msgs.group(index=i, size=1))
    assert sorted(receiver.receive(timeout_s=1).group_id for _ in senders) == ["g00000000", "g00000001", "g00000002"]
    with pytest.raises(ValueError, match="already bound"):
        InprocReceiver(secret, "inproc://learner-buffer")
    receiver.close()
    with pytest.raises(TransportClosed):
        senders[0].send(msgs.group(size=1))
    with pytest.raises(ValueError, match="no in-process receiver"):
        InprocSender("inproc://learner-buffer", secret)
    InprocReceiver(secret, "inproc://learner-buffer").close()  # the address is free again


def test_closed_endpoints_refuse_use_and_close_is_idempotent(msgs, secret):
    with make_inproc_pair(secret)[1] as receiver:
        pass
    assert receiver.closed
    receiver.close()
    with pytest.raises(TransportClosed):
        receiver.receive(timeout_s=0)
    sender, receiver = make_inproc_pair(secret)
    sender.close()
    with pytest.raises(TransportClosed):
        sender.send(msgs.group(size=1))
    receiver.close()


def test_invalid_queue_size(secret):
    with pytest.raises(ValueError):
        make_inproc_pair(secret, maxsize=0)
