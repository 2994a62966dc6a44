"""Hostile traffic against a live ``ZmqReceiver`` on TCP loopback, interleaved with a legitimate sender.

Ten thousand hostile messages of twenty-eight kinds (garbage, truncated valid messages, messages over the
size cap, wrong signatures, validly signed messages with out-of-range values, wrong frame counts, and
replays of legitimate messages) go through one PUSH socket while a second PUSH socket delivers real
trajectory groups. The receiver must

* never raise (every ``receive`` call below would propagate it),
* count every hostile message exactly once, under the reason its kind calls for,
* deliver every legitimate group exactly once (a replayed copy is refused as ``replayed``),
* keep its resident memory flat: growth over the 10,000 messages, after a 1,000-message warm-up, stays
  under ``RSS_GROWTH_BOUND``. The bound: what the receiving process legitimately holds at any moment is
  its pipes (8 messages per pipe and side, under 100 KiB each: about 3 MiB) plus the replay window
  (at most 220 signatures here); a receiver that kept even 1.7 KiB per hostile message (they average
  about 8 KiB) would exceed it. Measured: under 1 MiB.

Besides these, a few single frames larger than the cap are sent from a third socket: libzmq's
``MAXMSGSIZE`` cuts that connection before any Python code sees the frame, so they are neither received
nor counted (the exact counts below would notice if they were).
"""

from __future__ import annotations

import gc
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from ragen_async.protocol import TrajectoryGroup
from ragen_async.transport.codec import encode, sign
from ragen_async.transport.zmq_transport import ZmqReceiver, ZmqSender
from tests.transport.conftest import header_maps, pack_header

CAP = 64 * 1024
"""The receiver's max_message_bytes (and so its per-frame MAXMSGSIZE) in this test."""
N_WARMUP, N_HOSTILE = 1_000, 10_000
LEGIT_EVERY = 50
"""One legitimate group after every this many hostile messages."""
N_OVERSIZED_FRAMES = 5
RSS_GROWTH_BOUND = 16 * 2**20

Frames = list[bytes]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# --------------------------------------------------------------------------------------------------
# Hostile message kinds: each takes (rng, a valid encoded group, the run's secret, legit messages sent
# so far) and returns the frames to send; KINDS pairs it with the reason the receiver must count.


def _header(frames: Frames) -> dict:
    return header_maps(frames[1])


def _resign(frames: Frames, secret: bytes, edit: Callable[[dict, list[bytearray]], None]) -> Frames:
    """Edit the header and/or array frames, then sign with the run's secret: a peer holding the key."""
    header = _header(frames)
    arrays = [bytearray(f) for f in frames[2:]]
    edit(header, arrays)
    arrays_b = [bytes(a) for a in arrays]
    packed = pack_header(header)
    return [sign(secret, packed), packed, *arrays_b]


def _traj(header: dict, rng: np.random.Generator) -> dict:
    trajs = header["body"]["trajectories"]
    return trajs[int(rng.integers(len(trajs)))]


def flipped_bit(rng, valid, secret, legit):
    """One bit flipped in the signature (the header stays parseable; a bit flipped in the data frame is the
    learner's check, test_codec.py::test_learner_rejects_bad_forwarded_shards)."""
    i = 0
    damaged = bytearray(valid[i])
    damaged[int(rng.integers(len(damaged)))] ^= 1 << int(rng.integers(8))
    return [*valid[:i], bytes(damaged), *valid[i + 1 :]]


def non_finite_reward(rng, valid, secret, legit):
    def edit(h, arrays):
        t = _traj(h, rng)
        value = [float("nan"), float("inf"), float("-inf")][int(rng.integers(3))]
        if rng.random() < 0.5:
            t["turns"][0]["reward"] = value
        else:
            t["format_penalty"] = value

    return _resign(valid, secret, edit)


def wrong_array_length(rng, valid, secret, legit):
    def edit(h, arrays):
        t = _traj(h, rng)
        t["num_tokens"] += int(rng.choice([-1, 1]) * rng.integers(1, 1000))

    return _resign(valid, secret, edit)


def frame_cut_short(rng, valid, secret, legit):
    def edit(h, arrays):  # the data frame loses its last bytes, the header re-signed
        arrays[0] = arrays[0][: -int(rng.integers(1, 13))]

    return _resign(valid, secret, edit)


def negative_length(rng, valid, secret, legit):
    def edit(h, arrays):
        _traj(h, rng)["num_tokens"] = -int(rng.integers(1, 2**31))

    return _resign(valid, secret, edit)


def offset_out_of_range(rng, valid, secret, legit):
    def edit(h, arrays):
        _traj(h, rng)["offset"] = int(rng.integers(len(arrays[0]), 2**40))

    return _resign(valid, secret, edit)


def unknown_version_signed(rng, valid, secret, legit):
    return _resign(valid, secret, lambda h, a: h.update(v=int(rng.integers(2, 2**31))))


def index_is_float(rng, valid, secret, legit):
    return _resign(valid, secret, lambda h, a: h["body"].update(index=float(rng.random())))


def reward_is_nested_map(rng, valid, secret, legit):
    def edit(h, arrays):
        _traj(h, rng)["turns"][0]["reward"] = {"pickle": b"\x80\x04"}

    return _resign(valid, secret, edit)


def no_trajectories(rng, valid, secret, legit):
    def edit(h, arrays):
        h["body"]["trajectories"] = []
        arrays.clear()
        h["frames"] = 0

    return _resign(valid, secret, edit)


KINDS: dict[str, tuple[Callable[..., Frames], str]] = {
    # garbage bytes
    "garbage_one_frame": (lambda rng, v, s, sent: [rng.bytes(int(rng.integers(1, 4000)))], "truncated"),
    "garbage_frames": (
        lambda rng, v, s, sent: [rng.bytes(int(rng.choice([rng.integers(0, 32), rng.integers(33, 300)])))]
        + [rng.bytes(int(rng.integers(0, 3000))) for _ in range(int(rng.integers(1, 6)))],
        "malformed",  # the signature frame has the wrong length
    ),
    "garbage_header": (  # 0xc1 is the one byte msgpack never uses: the header can never parse
        lambda rng, v, s, sent: [rng.bytes(32), b"\xc1" + rng.bytes(int(rng.integers(0, 2000))), *v[2:]],
        "malformed",
    ),
    # truncated valid messages
    "missing_array_frames": (lambda rng, v, s, sent: v[: int(rng.integers(2, len(v)))], "truncated"),
    "cut_header": (lambda rng, v, s, sent: [v[0], v[1][: int(rng.integers(1, len(v[1])))], *v[2:]], "malformed"),
    "cut_array_frame": (
        lambda rng, v, s, sent: (lambda i: [*v[:i], v[i][: int(rng.integers(0, len(v[i])))], *v[i + 1 :]])(
            int(rng.integers(2, len(v)))
        ),
        "malformed",  # the trajectories' declared sizes no longer fill it
    ),
    # over the receiver's size cap (every frame under it, the message as a whole over it)
    "oversized_total": (
        lambda rng, v, s, sent: [*v, *(rng.bytes(CAP // 2 + 1) for _ in range(int(rng.integers(2, 4))))],
        "oversized",
    ),
    # wrong signatures
    "wrong_secret": (lambda rng, v, s, sent: _resign(v, secrets.token_bytes(32), lambda h, a: None), "bad_signature"),
    "random_signature": (lambda rng, v, s, sent: [rng.bytes(32), *v[1:]], "bad_signature"),
    "flipped_bit": (flipped_bit, "bad_signature"),
    "unknown_version_unsigned": (
        lambda rng, v, s, sent: [v[0], pack_header({**_header(v), "v": 99}), *v[2:]],
        "unknown_version",
    ),
    # validly signed, values out of range (what only the arrays show is the learner's check: see
    # test_codec.py::test_learner_rejects_bad_forwarded_shards)
    "non_finite_reward": (non_finite_reward, "malformed"),
    "wrong_array_length": (wrong_array_length, "malformed"),
    "frame_cut_short": (frame_cut_short, "malformed"),
    "negative_length": (negative_length, "malformed"),
    "offset_out_of_range": (offset_out_of_range, "malformed"),
    "unknown_version_signed": (unknown_version_signed, "unknown_version"),
    "index_is_float": (index_is_float, "wrong_type"),
    "reward_is_nested_map": (reward_is_nested_map, "wrong_type"),
    "no_trajectories": (no_trajectories, "malformed"),
    # wrong number of multipart parts
    "extra_frame": (lambda rng, v, s, sent: [*v, rng.bytes(int(rng.integers(0, 64)))], "malformed"),
    "signature_only": (lambda rng, v, s, sent: [v[0]], "truncated"),
    # a legitimate message sent again
    "replay": (lambda rng, v, s, sent: list(sent[int(rng.integers(len(sent)))]), "replayed"),
}


class Traffic:
    """One thread, three PUSH sockets: hostile, legitimate, and one for single frames over the cap."""

    def __init__(self, address: str, secret: bytes, ctx: zmq.Context, msgs) -> None:
        self.secret = secret
        self.hostile = ZmqSender(address, secret, linger_ms=0, context=ctx)
        self.legit = ZmqSender(address, secret, linger_ms=0, context=ctx)
        self.big = ctx.socket(zmq.PUSH)
        self.big.setsockopt(zmq.LINGER, 0)
        self.big.connect(address)
        self.rng = np.random.default_rng(13)
        # Templates the hostile kinds start from: valid groups whose indices no legitimate group uses.
        self.templates = [[bytes(f) for f in encode(msgs.group(index=10**6 + i, size=2), secret)] for i in range(16)]
        self.shard = [bytes(f) for f in encode(msgs.shard(), secret)]  # a valid message of the wrong kind
        self.kinds = sorted(KINDS) + ["shard_for_a_group_receiver"]
        self.sent_legit: list[Frames] = []
        self.bytes_sent = 0
        self.errors: list[BaseException] = []

    def hostile_message(self) -> tuple[Frames, str]:
        kind = self.kinds[int(self.rng.integers(len(self.kinds)))]
        if kind == "shard_for_a_group_receiver":
            return self.shard, "wrong_type"
        if kind == "replay" and not self.sent_legit:
            kind = "garbage_one_frame"
        make, reason = KINDS[kind]
        valid = self.templates[int(self.rng.integers(len(self.templates)))]
        return make(self.rng, valid, self.secret, self.sent_legit), reason

    def run(self, n_hostile: int, legit: list[Frames], expected: Counter, big_frames: int = 0) -> None:
        """Send ``n_hostile`` hostile messages with a legitimate group after every LEGIT_EVERY; the
        reason each hostile message must be counted under goes into ``expected``."""
        try:
            for _ in range(big_frames):
                self.big.send(self.rng.bytes(CAP + 1 + int(self.rng.integers(CAP))))
            todo = list(legit)
            for i in range(n_hostile):
                frames, reason = self.hostile_message()
                self.hostile.send_frames(frames, timeout_s=30)
                self.bytes_sent += sum(len(f) for f in frames)
                expected[reason] += 1
                if (i + 1) % LEGIT_EVERY == 0 and todo:
                    self.legit.send_frames(todo[0], timeout_s=30)
                    self.sent_legit.append(todo.pop(0))
            for frames in todo:
                self.legit.send_frames(frames, timeout_s=30)
                self.sent_legit.append(frames)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            self.errors.append(exc)

    def close(self) -> None:
        self.hostile.close()
        self.legit.close()
        self.big.close()


def drive(receiver: ZmqReceiver, traffic: Traffic, n_hostile: int, legit: list[Frames], big_frames: int = 0):
    """Run one phase; returns (indices received, hostile counts expected by reason, the phase's stats)."""
    before = receiver.stats
    expected: Counter = Counter()
    producer = threading.Thread(target=traffic.run, args=(n_hostile, legit, expected, big_frames), daemon=True)
    producer.start()
    received: list[int] = []
    deadline = time.monotonic() + 120
    while True:
        done = not producer.is_alive()
        # Any exception here fails the test. Once everything is sent, half a second without a valid
        # message means the pipes are empty (loopback delivers in microseconds).
        msg = receiver.receive(timeout_s=0.5 if done else 0.2)
        if msg is not None:
            received.append(msg.index)
            del msg
        elif done:
            break
        assert time.monotonic() < deadline, f"stuck: {receiver.stats}, producer alive: {producer.is_alive()}"
    assert not traffic.errors, traffic.errors
    after = receiver.stats
    counted = Counter({r: after.rejected[r] - before.rejected[r] for r in after.rejected})
    return received, expected, counted, after.received - before.received


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def test_ten_thousand_hostile_messages_are_counted_and_legit_groups_arrive_once(msgs, secret, ctx):
    receiver = ZmqReceiver(secret, max_message_bytes=CAP, context=ctx, expected=TrajectoryGroup)
    traffic = Traffic(receiver.address, secret, ctx, msgs)
    legit = [[bytes(f) for f in encode(msgs.group(index=i, size=2), secret)] for i in range(220)]
    try:
        # Warm-up: the allocator, the codec's paths and the pipes reach their working size.
        got, expected, counted, accepted = drive(receiver, traffic, N_WARMUP, legit[:20])
        assert sorted(got) == list(range(20)) and accepted == 20
        assert +counted == +expected, (counted, expected)

        gc.collect()
        rss0 = rss_bytes()
        start = time.monotonic()
        got, expected, counted, accepted = drive(receiver, traffic, N_HOSTILE, legit[20:], N_OVERSIZED_FRAMES)
        elapsed = time.monotonic() - start
        gc.collect()
        growth = rss_bytes() - rss0

        # Every legitimate group exactly once, every hostile message counted once under its reason.
        assert sorted(got) == list(range(20, 220)) and accepted == 200
        assert sum(expected.values()) == N_HOSTILE
        assert +counted == +expected, (counted, expected)
        assert expected["replayed"] > 0 and len(expected) == 7  # every reason was exercised
        assert growth < RSS_GROWTH_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB over {N_HOSTILE} hostile messages"
        print(f"\nhostile: {N_HOSTILE} messages ({traffic.bytes_sent / 2**20:.1f} MiB sent in all), "
              f"rejected {dict(sorted(counted.items()))}, legit groups received 200/200, "
              f"{N_OVERSIZED_FRAMES} single frames over the cap cut by MAXMSGSIZE (uncounted), "
              f"RSS growth {growth / 2**20:.2f} MiB, {elapsed:.1f} s, pid {os.getpid()}")
    finally:
        traffic.close()
        receiver.close()


def test_receiver_sockets_are_bounded(secret, ctx):
    """The receive pipe holds at most ``hwm`` messages and no frame over the cap is ever buffered."""
    receiver = ZmqReceiver(secret, hwm=8, max_message_bytes=CAP, context=ctx)
    sender = ZmqSender(receiver.address, secret, hwm=8, context=ctx)
    try:
        assert receiver._sock.getsockopt(zmq.RCVHWM) == 8
        assert receiver._sock.getsockopt(zmq.MAXMSGSIZE) == CAP
        assert sender._sock.getsockopt(zmq.SNDHWM) == 8
    finally:
        sender.close()
        receiver.close()
