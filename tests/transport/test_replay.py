"""A valid message delivered twice is accepted once: the second copy is counted as ``replayed``."""

from __future__ import annotations

import pytest

from ragen_async.transport import InprocReceiver, encode, make_inproc_pair

pytestmark = pytest.mark.alone


def test_a_replayed_message_is_refused_and_counted(msgs, secret):
    sender, receiver = make_inproc_pair(secret, maxsize=8)
    a, b = msgs.group(index=1, size=2), msgs.group(index=2, size=2)
    frames_a = encode(a, secret)
    sender.send_frames(frames_a)
    sender.send_frames(frames_a)  # byte-identical copy
    sender.send(b)
    sender.send(a)  # encoded again: the same bytes, the same signature
    assert receiver.receive(timeout_s=1).index == 1
    assert receiver.receive(timeout_s=1).index == 2
    assert receiver.receive(timeout_s=0.1) is None
    stats = receiver.stats
    assert stats.received == 2 and stats.rejected["replayed"] == 2 and stats.rejected_total == 2


def test_the_replay_window_is_bounded(msgs, secret):
    sender, receiver = make_inproc_pair(secret, maxsize=8)
    receiver.replay_window = 2
    groups = [msgs.group(index=i, size=1) for i in range(3)]
    for g in groups:
        sender.send(g)
    assert [receiver.receive(timeout_s=1).index for _ in groups] == [0, 1, 2]
    assert len(receiver._seen) == len(receiver._seen_order) == 2  # memory stays at the window
    sender.send(groups[2])  # still remembered
    sender.send(groups[0])  # forgotten: past the window (the trainer's index check refuses it later)
    assert receiver.receive(timeout_s=1).index == 0
    assert receiver.stats.rejected["replayed"] == 1


def test_invalid_replay_window(secret):
    with pytest.raises(ValueError, match="replay_window"):
        InprocReceiver(secret, replay_window=0)
