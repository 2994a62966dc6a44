"""ZeroMQ transport over TCP loopback: round trip, fan-in, backpressure, size limits, prompt close."""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from ragen_async.protocol import TrajectoryGroup
from ragen_async.transport import TransportTimeout, make_receiver, make_sender
from ragen_async.transport.codec import encode
from ragen_async.transport.zmq_transport import ZmqReceiver, ZmqSender

pytestmark = pytest.mark.alone


@pytest.fixture
def ctx():
    """A private context per test, terminated at the end: a hang here means a socket lingered."""
    context = zmq.Context()
    yield context
    start = time.monotonic()
    context.term()
    assert time.monotonic() - start < 2.0


def _big_group(msgs, tokens: int) -> TrajectoryGroup:
    """A one-trajectory group of about ``13 × tokens`` bytes (all tokens sampled at version 0)."""
    base = msgs.group(size=1)
    traj = dataclasses.replace(
        base.trajectories[0],
        token_ids=np.arange(tokens, dtype=np.int32),
        loss_mask=np.ones(tokens, np.int8),
        behaviour_logprobs=np.full(tokens, -1.0, np.float32),
        token_versions=np.zeros(tokens, np.int32),
    )
    return dataclasses.replace(base, trajectories=(traj,))


def test_bind_picks_a_free_port_and_round_trips(msgs, secret, ctx):
    receiver = ZmqReceiver.bind(secret, host="127.0.0.1", port=0, context=ctx)
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", receiver.address)
    sender = ZmqSender(receiver.address, secret, context=ctx)
    group, shard = msgs.group(size=4), msgs.shard()
    sender.send(group, timeout_s=5)
    sender.send(shard, timeout_s=5)
    msgs.assert_same(group, receiver.receive(timeout_s=5))
    msgs.assert_same(shard, receiver.receive(timeout_s=5))
    stats = receiver.stats
    assert stats.received == 2 and stats.rejected_total == 0 and stats.bytes > 0
    sender.close()
    receiver.close()


def test_receive_times_out_with_none(secret, ctx):
    with ZmqReceiver(secret, context=ctx) as receiver:
        start = time.monotonic()
        assert receiver.receive(timeout_s=0.05) is None
        assert receiver.receive(timeout_s=0) is None
        assert time.monotonic() - start < 1.0


def test_two_senders_fan_in(msgs, secret, ctx):
    receiver = ZmqReceiver(secret, context=ctx)
    groups = {w: [msgs.group(index=10 * w + i, size=2) for i in range(5)] for w in (1, 2)}

    def produce(worker: int) -> None:
        # One socket per thread: each producer thread creates and closes its own sender.
        with ZmqSender(receiver.address, secret, context=ctx) as sender:
            for group in groups[worker]:
                sender.send(group, timeout_s=5)

    threads = [threading.Thread(target=produce, args=(w,)) for w in groups]
    for t in threads:
        t.start()
    received = [receiver.receive(timeout_s=5) for _ in range(10)]
    for t in threads:
        t.join(timeout=5)
    assert sorted(m.group_id for m in received) == sorted(g.group_id for gs in groups.values() for g in gs)
    for worker_groups in groups.values():  # each producer's messages arrive in its own order
        ids = [g.group_id for g in worker_groups]
        assert [m.group_id for m in received if m.group_id in ids] == ids
    receiver.close()


def test_backpressure_times_out_instead_of_blocking(msgs, secret, ctx):
    """A bound receiver that does not read: the pipes and TCP buffers fill, then send raises."""
    receiver = ZmqReceiver(secret, hwm=1, context=ctx)
    sender = ZmqSender(receiver.address, secret, hwm=1, linger_ms=0, context=ctx)
    group = _big_group(msgs, 256 * 1024)  # ~3.3 MB per message
    start = time.monotonic()
    sent = 0
    with pytest.raises(TransportTimeout):
        for _ in range(200):  # kernel buffers hold a handful of these at most
            sender.send(group, timeout_s=0.2)
            sent += 1
    assert sent >= 1
    assert time.monotonic() - start < 10
    # The consumer catching up makes room again.
    assert receiver.receive(timeout_s=5) is not None
    start = time.monotonic()
    sender.close()
    receiver.close()
    assert time.monotonic() - start < 0.5


def test_send_without_any_peer_times_out_and_close_is_prompt(msgs, secret, ctx):
    """Messages queue for a not-yet-bound receiver up to the HWM; then send times out."""
    # A port bound but never listening: connections are refused, and nothing else can take the port
    # (a port that was merely freed can be taken, even by the sender's own reconnects: a TCP self-connect).
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    sender = ZmqSender(f"tcp://127.0.0.1:{port}", secret, hwm=2, linger_ms=100, context=ctx)
    group = msgs.group(size=1)
    try:
        with pytest.raises(TransportTimeout):
            for _ in range(10):
                sender.send(group, timeout_s=0.05)
    finally:
        start = time.monotonic()
        sender.close()
        holder.close()
    assert time.monotonic() - start < 0.5  # and the ctx fixture checks that term() does not hang


def test_bad_messages_are_counted_and_the_receiver_keeps_going(msgs, secret, ctx):
    receiver = ZmqReceiver(secret, max_message_bytes=64 * 1024, context=ctx)
    sender = ZmqSender(receiver.address, secret, context=ctx)
    sender.send_frames([b"garbage"], timeout_s=5)
    sender.send_frames(encode(msgs.group(size=1), b"not the run's secret"), timeout_s=5)
    # Every frame under the limit, the message as a whole over it: the codec counts it.
    sender.send_frames([*encode(msgs.group(size=1), secret), b"x" * 40_000, b"y" * 40_000], timeout_s=5)
    good = msgs.group(index=3, size=2)
    sender.send(good, timeout_s=5)
    msgs.assert_same(good, receiver.receive(timeout_s=5))
    assert {r: n for r, n in receiver.stats.rejected.items() if n} == {
        "truncated": 1,
        "bad_signature": 1,
        "oversized": 1,
    }

    # A single frame over MAXMSGSIZE makes libzmq drop the connection (uncounted); the sender reconnects
    # and later messages get through.
    sender.send(_big_group(msgs, 20_000), timeout_s=5)
    for attempt in range(20):
        sender.send(dataclasses.replace(good, group_id=f"g{100 + attempt:08d}"), timeout_s=5)
        msg = receiver.receive(timeout_s=0.3)
        if msg is not None:
            break
    assert msg is not None and msg.group_id.startswith("g00000")
    assert receiver.stats.rejected["oversized"] == 1  # libzmq dropped it before the codec saw it
    sender.close()
    receiver.close()


@pytest.mark.parametrize("kind", ["zmq", "inproc"])
def test_factory_builds_both_kinds(kind, msgs, secret):
    receiver = make_receiver(kind, None, secret, hwm=4)
    sender = make_sender(kind, receiver.address, secret, send_timeout_s=5)
    group = msgs.group(size=2)
    sender.send(group)
    msgs.assert_same(group, receiver.receive(timeout_s=5))
    sender.close()
    receiver.close()


def test_factory_rejects_unknown_kind(secret):
    with pytest.raises(ValueError, match="unknown transport kind"):
        make_sender("carrier-pigeon", "x", secret)  # type: ignore[arg-type]
