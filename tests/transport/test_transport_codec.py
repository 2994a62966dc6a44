"""Codec: bit-exact round trips, and every kind of bad input rejected with the right reason."""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter
from collections.abc import Callable

import msgpack
import numpy as np
import pytest

from ragen_async.protocol import BatchShard, TrajectoryGroup
from ragen_async.transport import CodecError, decode, encode, make_inproc_pair
from ragen_async.transport.codec import CODEC_VERSION, REJECT_REASONS, _check_schema_covers, sign

# ----------------------------------------------------------------------------------------------------
# Round trips


def test_group_round_trip_is_bit_exact(msgs, secret):
    group = msgs.group(size=5)
    out = decode(encode(group, secret), secret)
    msgs.assert_same(group, out)
    assert out.trajectories[0].turns[0].actions.__class__ is tuple


def test_shard_round_trip_is_bit_exact(msgs, secret):
    shard = msgs.shard()
    msgs.assert_same(shard, decode(encode(shard, secret), secret))


def test_frame_layout_and_zero_copy(msgs, secret):
    group = msgs.group(size=2)
    frames = encode(group, secret)
    assert len(frames[0]) == 32  # HMAC-SHA256
    header = msgpack.unpackb(frames[1], raw=False)
    assert header["v"] == CODEC_VERSION and header["kind"] == "group" and header["frames"] == 8
    assert len(frames) == 2 + 8
    # Array frames are views of the trajectory's own memory, not copies.
    token_ids = group.trajectories[0].token_ids
    assert np.frombuffer(frames[2], np.uint8).ctypes.data == token_ids.ctypes.data


def test_decoded_arrays_are_read_only_views(msgs, secret):
    frames = [bytes(f) for f in encode(msgs.group(), secret)]
    traj = decode(frames, secret).trajectories[0]
    assert not traj.token_ids.flags.writeable
    with pytest.raises(ValueError):
        traj.token_ids[0] = 1


def test_encode_normalises_numpy_scalars_and_byte_order(msgs, secret):
    group = msgs.group(size=1)
    traj = group.trajectories[0]
    traj = dataclasses.replace(
        traj,
        seed=np.int64(traj.seed),
        format_penalty=np.float32(-0.5),
        token_ids=traj.token_ids.astype(">i4"),
    )
    out = decode(encode(dataclasses.replace(group, trajectories=(traj,)), secret), secret).trajectories[0]
    assert type(out.seed) is int and type(out.format_penalty) is float
    assert out.token_ids.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out.token_ids, traj.token_ids)


def test_encode_refuses_wrong_dtype_and_invalid_trajectories(msgs, secret):
    group = msgs.group(size=1)
    traj = group.trajectories[0]
    wide = dataclasses.replace(
        group, trajectories=(dataclasses.replace(traj, token_ids=traj.token_ids.astype(np.int64)),)
    )
    with pytest.raises(CodecError) as err:
        encode(wide, secret)
    assert err.value.reason == "wrong_type" and "token_ids" in str(err.value)

    bad_versions = traj.token_versions.copy()
    bad_versions[0] = 3  # a prompt token cannot have a policy version
    invalid = dataclasses.replace(group, trajectories=(dataclasses.replace(traj, token_versions=bad_versions),))
    with pytest.raises(CodecError) as err:
        encode(invalid, secret)
    assert err.value.reason == "malformed"

    with pytest.raises(CodecError):
        encode(dataclasses.replace(group, trajectories=()), secret)
    with pytest.raises(TypeError):
        encode("not a message", secret)  # type: ignore[arg-type]


def test_schema_guard_catches_protocol_drift():
    @dataclasses.dataclass
    class Drifted:
        a: int
        b: int

    _check_schema_covers(Drifted, {"a"}, {"b"})
    with pytest.raises(RuntimeError, match="missing"):
        _check_schema_covers(Drifted, {"a"})


# ----------------------------------------------------------------------------------------------------
# Rejections

Mutation = Callable[[list, bytes], list]


def _flip_bit(frames: list, index: int) -> list:
    out = [bytes(f) for f in frames]
    damaged = bytearray(out[index])
    damaged[len(damaged) // 2] ^= 0x10
    out[index] = bytes(damaged)
    return out


def _set_traj(field: str, value: object) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        header["body"]["trajectories"][0][field] = value

    return edit


def _set_turn(field: str, value: object) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        header["body"]["trajectories"][0]["turns"][0][field] = value

    return edit


def _set_array(field: str, key: str, value: object) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        header["body"]["trajectories"][0][field][key] = value

    return edit


def resign(frames: list, secret: bytes, edit: Callable[[dict], None]) -> list[bytes]:
    """Edit the header map, re-pack it and sign again with the right secret (a trusted-but-buggy peer)."""
    header = msgpack.unpackb(bytes(frames[1]), raw=False)
    edit(header)
    packed = msgpack.packb(header, use_bin_type=True)
    arrays = [bytes(f) for f in frames[2:]]
    return [sign(secret, packed, arrays), packed, *arrays]


def _resigned(edit: Callable[[dict], None]) -> Mutation:
    return lambda frames, secret: resign(frames, secret, edit)


def _corrupt_loss_mask(frames: list, secret: bytes) -> list:
    """Mark a prompt token as sampled and re-sign: only Trajectory.validate() can catch it."""

    header = msgpack.unpackb(bytes(frames[1]), raw=False)
    index = 2 + header["body"]["trajectories"][0]["loss_mask"]["frame"]
    out = [bytes(f) for f in frames]
    mask = bytearray(out[index])
    mask[0] = 1
    out[index] = bytes(mask)
    return resign(out, secret, lambda h: None)


def _other_secret(frames: list, secret: bytes) -> list:
    return resign(frames, secrets.token_bytes(32), lambda h: None)


BAD: dict[str, tuple[Mutation, str]] = {
    "empty": (lambda f, s: [], "truncated"),
    "garbage_single_frame": (lambda f, s: [b"\x00\xffgarbage"], "truncated"),
    "garbage_header": (lambda f, s: [b"\x00" * 32, b"\xc1\xc1\xc1garbage"], "malformed"),
    "header_not_a_map": (lambda f, s: [b"\x00" * 32, msgpack.packb([1, 2, 3])], "malformed"),
    "short_signature": (lambda f, s: [b"sig", *f[1:]], "malformed"),
    "missing_last_frame": (lambda f, s: f[:-1], "truncated"),
    "header_only": (lambda f, s: f[:2], "truncated"),
    "extra_frame": (lambda f, s: [*f, b"\x00" * 8], "malformed"),
    "flipped_bit_in_array": (lambda f, s: _flip_bit(f, 3), "bad_signature"),
    "swapped_array_frames": (lambda f, s: [*f[:2], f[3], f[2], *f[4:]], "bad_signature"),
    "wrong_secret": (_other_secret, "bad_signature"),
    "unknown_version_unsigned": (lambda f, s: _flip_version(f), "unknown_version"),
    "unknown_version_signed": (_resigned(lambda h: h.update(v=2)), "unknown_version"),
    "version_is_str": (_resigned(lambda h: h.update(v="1")), "wrong_type"),
    "unknown_kind": (_resigned(lambda h: h.update(kind="pickle")), "malformed"),
    "unknown_header_key": (_resigned(lambda h: h.update(extra=1)), "malformed"),
    "seed_is_str": (_resigned(_set_traj("seed", "7")), "wrong_type"),
    "seed_is_float": (_resigned(_set_traj("seed", 7.0)), "wrong_type"),
    "success_is_int": (_resigned(_set_traj("success", 1)), "wrong_type"),
    "timings_value_is_str": (_resigned(_set_traj("timings", {"x": "1"})), "wrong_type"),
    "turns_is_str": (_resigned(_set_traj("turns", "turn")), "wrong_type"),
    "reward_is_int": (_resigned(_set_turn("reward", 1)), "wrong_type"),
    "actions_hold_int": (_resigned(_set_turn("actions", ["up", 3])), "wrong_type"),
    "reward_is_ext_type": (_resigned(_set_turn("reward", msgpack.ExtType(1, b"x"))), "wrong_type"),
    "missing_field": (_resigned(lambda h: h["body"]["trajectories"][0].pop("env_tag")), "malformed"),
    "unexpected_field": (_resigned(_set_traj("pickled", b"\x80\x04")), "malformed"),
    "dtype_not_allowed": (_resigned(_set_array("token_ids", "dtype", "|O")), "wrong_type"),
    "dtype_of_other_field": (_resigned(_set_array("token_ids", "dtype", "<f4")), "wrong_type"),
    "shape_too_long": (_resigned(_set_array("token_ids", "shape", [10**6])), "malformed"),
    "shape_2d": (_resigned(_set_array("token_ids", "shape", [1, 2])), "malformed"),
    "frame_index_out_of_range": (_resigned(_set_array("token_ids", "frame", 99)), "malformed"),
    "frame_referenced_twice": (_resigned(_set_array("loss_mask", "frame", 0)), "malformed"),
    "inconsistent_arrays": (_corrupt_loss_mask, "malformed"),
    "no_trajectories": (_resigned(lambda h: h["body"].update(trajectories=[])), "malformed"),
}


def _flip_version(frames: list) -> list:
    header = msgpack.unpackb(bytes(frames[1]), raw=False)
    header["v"] = 99
    return [frames[0], msgpack.packb(header, use_bin_type=True), *frames[2:]]


@pytest.mark.parametrize("case", sorted(BAD))
def test_decode_rejects_with_reason(case, msgs, secret):
    mutate, reason = BAD[case]
    frames = [bytes(f) for f in encode(msgs.group(size=2), secret)]
    with pytest.raises(CodecError) as err:
        decode(mutate(frames, secret), secret)
    assert err.value.reason == reason, err.value


def test_decode_rejects_oversized_unexpected_and_non_sequences(msgs, secret):
    frames = encode(msgs.group(), secret)
    total = sum(memoryview(f).nbytes for f in frames)
    assert decode(frames, secret, max_message_bytes=total) is not None
    with pytest.raises(CodecError) as err:
        decode(frames, secret, max_message_bytes=total - 1)
    assert err.value.reason == "oversized"
    with pytest.raises(CodecError) as err:
        decode(frames, secret, expected=BatchShard)
    assert err.value.reason == "wrong_type"
    assert isinstance(decode(frames, secret, expected=(TrajectoryGroup, BatchShard)), TrajectoryGroup)
    with pytest.raises(CodecError) as err:
        decode(b"".join(bytes(f) for f in frames), secret)  # type: ignore[arg-type]
    assert err.value.reason == "malformed"
    with pytest.raises(CodecError) as err:
        decode([b"\x00" * 32, frames[1], 12345], secret)
    assert err.value.reason == "malformed"


def test_codec_error_reasons_are_a_fixed_set():
    assert set(REJECT_REASONS) == {
        "bad_signature",
        "unknown_version",
        "malformed",
        "truncated",
        "oversized",
        "wrong_type",
        "replayed",
    }
    with pytest.raises(ValueError):
        CodecError("because")  # type: ignore[arg-type]


def test_receiver_counts_every_reject_and_keeps_receiving(msgs, secret):
    """All the bad messages above, between two good ones, through a real receiver."""
    sender, receiver = make_inproc_pair(secret, maxsize=len(BAD) + 4)
    good = msgs.group(index=1, size=2)
    frames = [bytes(f) for f in encode(good, secret)]
    sender.send(good)
    expected = Counter()
    for mutate, reason in BAD.values():
        bad = mutate(frames, secret)
        if not bad:
            continue  # an empty message cannot be put on any wire
        sender.send_frames(bad)
        expected[reason] += 1
    sender.send(msgs.group(index=2, size=2))

    first, second = receiver.receive(timeout_s=1), receiver.receive(timeout_s=1)
    assert (first.group_id, second.group_id) == ("g00000001", "g00000002")
    msgs.assert_same(good, first)
    assert receiver.receive(timeout_s=0) is None
    stats = receiver.stats
    assert stats.received == 2 and stats.bytes > 0
    assert {r: n for r, n in stats.rejected.items() if n} == dict(expected)
    assert stats.rejected_total == sum(expected.values())
    metrics = stats.as_metrics()
    assert metrics["transport/received"] == 2.0 and "transport/rejected/bad_signature" in metrics
    sender.close()
    receiver.close()
