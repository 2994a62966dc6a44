"""Codec: bit-exact round trips, and every kind of bad input rejected with the right reason."""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter
from collections.abc import Callable

import msgpack
import numpy as np
import pytest

from ragen_async.protocol import (
    NO_VERSION,
    TOKEN_FRAME_BYTES,
    TRAJECTORY_ARRAYS,
    BatchShard,
    GroupMeta,
    InvalidTrajectory,
    TrajectoryGroup,
    token_arrays,
    validate_many,
)
from ragen_async.transport import CodecError, decode, encode, make_inproc_pair
from ragen_async.transport.codec import CODEC_VERSION, REJECT_REASONS, _check_schema_covers, _digest, sign
from tests.transport.conftest import header_maps, pack_header, random_trajectory

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


def test_frame_layout(msgs, secret):
    group = msgs.group(size=2)
    frames = encode(group, secret)
    assert len(frames[0]) == 32 and bytes(frames[0]) == sign(secret, frames[1])  # keyed BLAKE3 of the header
    raw = msgpack.unpackb(frames[1], raw=False)
    assert isinstance(raw["body"], list) and isinstance(raw["body"][-1][0], list)  # bodies travel as arrays
    header = header_maps(frames[1])
    assert header["v"] == CODEC_VERSION and header["kind"] == "group" and header["frames"] == 1
    assert len(frames) == 2 + 1  # one data frame: each trajectory's four arrays back to back, widest first
    parts = [b"".join(getattr(t, name).tobytes() for name in TRAJECTORY_ARRAYS) for t in group.trajectories]
    assert bytes(frames[2]) == b"".join(parts)
    traj = group.trajectories[1]
    assert header["body"]["trajectories"][1]["offset"] == len(parts[0])
    assert header["body"]["trajectories"][1]["num_tokens"] == traj.num_tokens
    assert header["body"]["trajectories"][1]["versions"] == [list(vc) for vc in traj.version_counts]


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

    three = msgs.group(size=3).trajectories
    last = three[-1]
    bad_versions = last.token_versions.copy()
    bad_versions[0] = 3  # a prompt token cannot have a policy version
    invalid = dataclasses.replace(group, trajectories=(*three[:-1], dataclasses.replace(last, token_versions=bad_versions)))
    with pytest.raises(CodecError) as err:
        encode(invalid, secret)
    assert err.value.reason == "malformed" and repr(last.traj_id) in str(err.value)  # names the one that fails

    with pytest.raises(CodecError):
        encode(dataclasses.replace(group, trajectories=()), secret)
    with pytest.raises(TypeError):
        encode("not a message", secret)  # type: ignore[arg-type]


def test_an_integer_where_a_float_belongs_arrives_as_a_float(msgs, secret):
    frames = resign([bytes(f) for f in encode(msgs.group(size=1), secret)], secret, _set_turn("reward", 1))
    reward = decode(frames, secret).trajectories[0].turns[0].reward
    assert reward == 1.0 and type(reward) is float


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


def _flip_bit(frames: list, index: int, within: bytes = b"") -> list:
    """Flip one bit of frame ``index``: in its middle, or in the first occurrence of ``within`` (a header's
    string, so that it still parses)."""
    out = [bytes(f) for f in frames]
    damaged = bytearray(out[index])
    damaged[out[index].index(within) if within else len(damaged) // 2] ^= 0x10
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


def resign(frames: list, secret: bytes, edit: Callable[[dict], None]) -> list[bytes]:
    """Edit the header (its body as maps), re-pack it and sign again with the right secret (a
    trusted-but-buggy peer)."""
    header = header_maps(frames[1])
    edit(header)
    packed = pack_header(header)
    arrays = [bytes(f) for f in frames[2:]]
    return [sign(secret, packed), packed, *arrays]


def _resigned(edit: Callable[[dict], None]) -> Mutation:
    return lambda frames, secret: resign(frames, secret, edit)


def _edit_tokens(edit: Callable[[dict[str, np.ndarray]], None]) -> Mutation:
    """A key-holding peer that edits the first trajectory's arrays and gives them a matching digest: the
    header stays true to the bytes, the bytes break an invariant only ``Trajectory.validate`` can see."""

    def mutate(frames: list, secret: bytes) -> list:
        header = header_maps(frames[1])
        traj = header["body"]["trajectories"][0]  # its arrays open the data frame
        size = traj["num_tokens"] * TOKEN_FRAME_BYTES
        data = bytes(frames[2])
        arrays = {name: a.copy() for name, a in token_arrays(data[:size], traj["num_tokens"]).items()}
        edit(arrays)
        part = b"".join(arrays[name].tobytes() for name in TRAJECTORY_ARRAYS)
        data = part + data[size:]

        def digest(h: dict) -> None:
            h["body"]["trajectories"][0]["digest"] = _digest(part)

        return resign([frames[0], frames[1], data], secret, digest)

    return mutate


def _first_sampled(arrays: dict[str, np.ndarray]) -> int:
    return int(np.flatnonzero(arrays["loss_mask"] == 1)[0])


def _set_in_array(name: str, value: float, sampled: bool) -> Mutation:
    """Write ``value`` into the first sampled (or the first prompt) token of one array."""
    return _edit_tokens(lambda a: a[name].__setitem__(_first_sampled(a) if sampled else 0, value))


_corrupt_loss_mask = _set_in_array("loss_mask", 1, sampled=False)
"""Mark a prompt token as sampled."""


def _misdeclare_versions(frames: list, secret: bytes) -> list:
    """Claim every sampled token is one version newer than it is: the driver would judge staleness on a lie."""
    return resign(frames, secret, lambda h: h["body"]["trajectories"][0].update(
        versions=[[v + 1, c] for v, c in h["body"]["trajectories"][0]["versions"]]))


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
    "flipped_bit_in_header": (lambda f, s: _flip_bit(f, 1, within=b"g0000"), "bad_signature"),  # the group id
    "wrong_secret": (_other_secret, "bad_signature"),
    "unknown_version_unsigned": (lambda f, s: _flip_version(f), "unknown_version"),
    "unknown_version_signed": (_resigned(lambda h: h.update(v=CODEC_VERSION + 1)), "unknown_version"),
    "version_is_str": (_resigned(lambda h: h.update(v="1")), "wrong_type"),
    "unknown_kind": (_resigned(lambda h: h.update(kind="pickle")), "malformed"),
    "bare_source_kind": (_resigned(lambda h: h.update(kind="trajs")), "malformed"),
    "digest_too_short": (_resigned(_set_traj("digest", b"\x00" * 8)), "malformed"),
    "versions_not_pairs": (_resigned(_set_traj("versions", [[1, 2, 3]])), "wrong_type"),
    "versions_descending": (_resigned(_set_traj("versions", [[2, 1], [1, 1]])), "malformed"),
    "versions_zero_count": (_resigned(_set_traj("versions", [[1, 0]])), "malformed"),
    "unknown_header_key": (_resigned(lambda h: h.update(extra=1)), "malformed"),
    "seed_is_str": (_resigned(_set_traj("seed", "7")), "wrong_type"),
    "seed_is_float": (_resigned(_set_traj("seed", 7.0)), "wrong_type"),
    "success_is_int": (_resigned(_set_traj("success", 1)), "wrong_type"),
    "timings_value_is_str": (_resigned(_set_traj("timings", {"x": "1"})), "wrong_type"),
    "turns_is_str": (_resigned(_set_traj("turns", "turn")), "wrong_type"),
    "actions_hold_int": (_resigned(_set_turn("actions", ["up", 3])), "wrong_type"),
    "reward_is_ext_type": (_resigned(_set_turn("reward", msgpack.ExtType(1, b"x"))), "wrong_type"),
    "missing_field": (_resigned(lambda h: h["body"]["trajectories"][0].pop("digest")), "malformed"),
    "missing_middle_field": (_resigned(lambda h: h["body"]["trajectories"][0].pop("env_tag")), "malformed"),
    "body_as_a_map": (_resigned(lambda h: h.update(body=dict(h["body"]))), "wrong_type"),
    "unexpected_field": (_resigned(_set_traj("pickled", b"\x80\x04")), "malformed"),
    "num_tokens_too_many": (_resigned(_set_traj("num_tokens", 10**6)), "malformed"),
    "num_tokens_one_short": (_resigned(lambda h: h["body"]["trajectories"][0].update(
        num_tokens=h["body"]["trajectories"][0]["num_tokens"] - 1)), "malformed"),
    "num_tokens_negative": (_resigned(_set_traj("num_tokens", -3)), "malformed"),
    "num_tokens_is_str": (_resigned(_set_traj("num_tokens", "12")), "wrong_type"),
    "offset_past_the_data": (_resigned(_set_traj("offset", 10**6)), "malformed"),
    "offsets_overlap": (_resigned(lambda h: h["body"]["trajectories"][1].update(offset=0)), "malformed"),
    "data_frame_cut_short": (lambda f, s: [*f[:2], bytes(f[2])[:-1]], "malformed"),
    "data_frame_longer": (lambda f, s: [*f[:2], bytes(f[2]) + b"\x00"], "malformed"),
    "version_negative": (_resigned(_set_traj("versions", [[-1, 3]])), "malformed"),
    "reward_is_inf": (_resigned(_set_turn("reward", float("inf"))), "malformed"),
    "two_data_frames": (lambda f, s: resign([*f, f[2]], s, lambda h: h.update(frames=2)), "malformed"),
    "no_trajectories": (_resigned(lambda h: h["body"].update(trajectories=[])), "malformed"),
    "reward_is_nan": (_resigned(_set_turn("reward", float("nan"))), "malformed"),
    "format_penalty_is_inf": (_resigned(_set_traj("format_penalty", float("-inf"))), "malformed"),
}
"""What the driver refuses. It reads headers only: an altered data frame of the declared size passes it and
is the learner's to refuse (``SHARD_BAD`` below, and the test after it)."""


def _flip_version(frames: list) -> list:
    header = header_maps(frames[1])
    header["v"] = 99
    return [frames[0], pack_header(header), *frames[2:]]


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
    assert isinstance(decode(frames, secret, expected=(TrajectoryGroup, BatchShard)), GroupMeta)
    with pytest.raises(CodecError) as err:
        decode(b"".join(bytes(f) for f in frames), secret)  # type: ignore[arg-type]
    assert err.value.reason == "malformed"
    with pytest.raises(CodecError) as err:
        decode([b"\x00" * 32, frames[1], 12345], secret)
    assert err.value.reason == "malformed"


def _forward(frames: list, secret: bytes, take: tuple[int, ...] = (0, 1)) -> list:
    """What the driver does: decode a group to its metadata, then send some of its trajectories on in a shard."""
    meta = decode(frames, secret)
    trajs = tuple(meta.trajectories[i] for i in take)
    shard = BatchShard(step=3, learner_version=4, trajectories=trajs, scores=np.zeros(len(trajs), np.float32),
                       normalized_scores=np.ones(len(trajs), np.float32), batch_num_tokens=7, batch_num_seqs=9)
    return [bytes(f) for f in encode(shard, secret)]


def test_driver_forwards_the_received_frames_without_re_encoding(msgs, secret):
    group = msgs.group(size=3)
    frames = [bytes(f) for f in encode(group, secret)]
    meta = decode(frames, secret)
    for real, seen in zip(group.trajectories, meta.trajectories, strict=True):  # the facts the driver decides on
        assert (seen.score, seen.num_tokens, seen.num_response_tokens, seen.oldest_version, seen.version_counts) == (
            real.score, real.num_tokens, real.num_response_tokens, real.oldest_version, real.version_counts)
    shard_frames = encode(BatchShard(step=3, learner_version=4, trajectories=(meta.trajectories[0], meta.trajectories[2]),
                                     scores=np.zeros(2, np.float32), normalized_scores=np.ones(2, np.float32),
                                     batch_num_tokens=7, batch_num_seqs=9), secret)
    # The group's own signature, header and the taken trajectories' arrays go out as the very same buffers.
    assert shard_frames[2] is meta.trajectories[0].source[0] and shard_frames[3] is meta.trajectories[0].source[1]
    assert shard_frames[4] is meta.trajectories[0].frame and shard_frames[5] is meta.trajectories[2].frame
    shard = decode([bytes(f) for f in shard_frames], secret)
    msgs.assert_same(group.trajectories[0], shard.trajectories[0])
    msgs.assert_same(group.trajectories[2], shard.trajectories[1])


def test_shard_mixes_forwarded_and_local_trajectories_in_order(msgs, secret):
    a, b = msgs.group(index=1, size=2), msgs.group(index=2, size=2)
    meta = decode([bytes(f) for f in encode(a, secret)], secret)
    trajs = (meta.trajectories[1], *b.trajectories, meta.trajectories[0])
    shard = BatchShard(step=1, learner_version=1, trajectories=trajs, scores=np.arange(4, dtype=np.float32),
                       normalized_scores=-np.arange(4, dtype=np.float32), batch_num_tokens=1, batch_num_seqs=4)
    out = decode(encode(shard, secret), secret)
    for want, got in zip((a.trajectories[1], *b.trajectories, a.trajectories[0]), out.trajectories, strict=True):
        msgs.assert_same(want, got)
    np.testing.assert_array_equal(out.normalized_scores, shard.normalized_scores)


def _swap_source(frames: list, secret: bytes, other: TrajectoryGroup) -> list:
    """Put another validly signed group where the shard header names the first: sources cannot be swapped."""
    replacement = [bytes(f) for f in encode(other, secret)]
    return [*frames[:2], replacement[0], replacement[1], *frames[4:]]


SHARD_BAD: dict[str, tuple[Callable[..., list], str]] = {
    "inconsistent_arrays": (lambda f, s: _forward(_corrupt_loss_mask(f, s), s), "malformed"),
    "versions_misdeclared": (lambda f, s: _forward(_misdeclare_versions(f, s), s), "malformed"),
    "loss_mask_not_binary": (lambda f, s: _forward(_set_in_array("loss_mask", 2, True)(f, s), s), "malformed"),
    "logprob_on_prompt_token": (lambda f, s: _forward(_set_in_array("behaviour_logprobs", -0.5, False)(f, s), s),
                                "malformed"),
    "logprob_nan": (lambda f, s: _forward(_set_in_array("behaviour_logprobs", np.nan, True)(f, s), s), "malformed"),
    "logprob_positive": (lambda f, s: _forward(_set_in_array("behaviour_logprobs", 0.5, True)(f, s), s), "malformed"),
    "negative_token_version": (lambda f, s: _forward(_set_in_array("token_versions", -7, True)(f, s), s),
                               "malformed"),
    "flipped_bit_in_forwarded_array": (lambda f, s: _flip_bit(_forward(f, s), 5), "bad_signature"),
    "flipped_bit_before_the_driver": (lambda f, s: _forward(_flip_bit(f, 2), s), "bad_signature"),
    "swapped_source": (lambda f, s, other: _swap_source(_forward(f, s), s, other), "bad_signature"),
    "take_out_of_range": (lambda f, s: resign(_forward(f, s, (0,)), s, lambda h: h["body"]["sources"][0].update(
        take=[5])), "malformed"),
    "take_not_ascending": (lambda f, s: resign(_forward(f, s), s, lambda h: h["body"]["sources"][0].update(
        take=[1, 0])), "malformed"),
    "missing_forwarded_array": (lambda f, s: resign(_forward(f, s), s, lambda h: h.update(frames=h["frames"] - 1))[:-1],
                                "truncated"),
    "scores_too_few": (lambda f, s: resign(_forward(f, s), s, lambda h: h["body"].update(scores=[0.0])), "malformed"),
    "scores_not_finite": (lambda f, s: resign(_forward(f, s), s, lambda h: h["body"].update(
        scores=[float("nan"), 0.0])), "malformed"),
}


@pytest.mark.parametrize("case", sorted(SHARD_BAD))
def test_learner_rejects_bad_forwarded_shards(case, msgs, secret):
    """What the driver cannot see (it reads headers only) the learner catches before training on it."""
    mutate, reason = SHARD_BAD[case]
    frames = [bytes(f) for f in encode(msgs.group(size=2), secret)]
    args = (msgs.group(index=9, size=2),) if case == "swapped_source" else ()
    with pytest.raises(CodecError) as err:
        decode(mutate(frames, secret, *args), secret)
    assert err.value.reason == reason, err.value


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


def test_a_receiver_fed_by_one_trusted_producer_raises_a_reject(msgs, secret):
    """A learner's receiver: the shard whose forwarded bytes were altered stops the step with its reason
    and the trajectory it names, counted like any reject; the next good message is received."""
    sender, receiver = make_inproc_pair(secret)
    group = msgs.group(size=2)
    frames = [bytes(f) for f in encode(group, secret)]
    data = bytearray(frames[2])
    data[-1] ^= 1  # the last byte: the second trajectory's
    sender.send_frames(_forward([*frames[:2], bytes(data)], secret))
    sender.send_frames(_forward(frames, secret))
    with pytest.raises(CodecError) as err:
        receiver.receive(timeout_s=1, raise_rejects=True)
    assert err.value.reason == "bad_signature" and repr(group.trajectories[1].traj_id) in str(err.value)
    assert receiver.stats.rejected["bad_signature"] == 1
    assert receiver.receive(timeout_s=1, raise_rejects=True).step == 3
    sender.close()
    receiver.close()


# ----------------------------------------------------------------------------------------------------
# validate_many: what the codec runs on a whole group or shard at once


def _brute_counts(traj) -> tuple:
    sampled = traj.token_versions[traj.loss_mask.astype(bool)]
    found, counts = np.unique(sampled, return_counts=True)
    return tuple(zip(found.tolist(), counts.tolist(), strict=True))


def _with(traj, **arrays):
    return dataclasses.replace(traj, **arrays)


def test_validate_many_counts_versions_as_each_trajectory_alone():

    rng = np.random.default_rng(5)
    trajs = [random_trajectory(rng, "g", i, num_turns=int(rng.integers(1, 6))) for i in range(40)]
    assert sum(len(_brute_counts(t)) > 1 for t in trajs) >= 5  # several versions in one episode occur
    far = trajs[3].token_versions.copy()
    far[far >= 0] = np.where(np.arange((far >= 0).sum()) % 2, 7, 90_000)  # far apart: the unique path
    none = np.full(4, NO_VERSION, np.int32)  # nothing sampled
    trajs += [_with(trajs[3], token_versions=far),
              _with(trajs[0], token_ids=np.zeros(4, np.int32), loss_mask=np.zeros(4, np.int8),
                    behaviour_logprobs=np.zeros(4, np.float32), token_versions=none)]
    assert validate_many(trajs) == [_brute_counts(t) for t in trajs] == [t.version_counts for t in trajs]
    empty = _with(trajs[0], token_ids=np.zeros(0, np.int32), loss_mask=np.zeros(0, np.int8),
                  behaviour_logprobs=np.zeros(0, np.float32), token_versions=np.zeros(0, np.int32))
    assert validate_many([trajs[1], empty, trajs[2]]) == [_brute_counts(trajs[1]), (), _brute_counts(trajs[2])]
    assert validate_many([]) == []


@pytest.mark.parametrize("corrupt", ["mask_2", "version_on_prompt", "logprob_on_prompt", "logprob_nan",
                                     "short_mask", "reward_inf"])
def test_validate_many_raises_what_the_failing_trajectory_raises(corrupt):

    rng = np.random.default_rng(6)
    trajs = [random_trajectory(rng, "g", i) for i in range(5)]
    t = trajs[3]
    prompt = int(np.flatnonzero(t.loss_mask)[0]) - 1  # the last prompt token
    mask, versions, lp = t.loss_mask.copy(), t.token_versions.copy(), t.behaviour_logprobs.copy()
    if corrupt == "mask_2":
        mask[prompt] = 2
    elif corrupt == "version_on_prompt":
        versions[prompt] = 0
    elif corrupt == "logprob_on_prompt":
        lp[prompt] = -0.5
    elif corrupt == "logprob_nan":
        lp[prompt + 1] = np.nan
    elif corrupt == "short_mask":
        mask = mask[:-1]
    bad = _with(t, loss_mask=mask, token_versions=versions, behaviour_logprobs=lp)
    if corrupt == "reward_inf":
        bad = _with(t, format_penalty=float("-inf"))
    trajs[3] = bad
    with pytest.raises(ValueError) as own:
        bad.validate()
    with pytest.raises(InvalidTrajectory) as many:
        validate_many(trajs)
    assert str(many.value) == str(own.value) and many.value.index == 3
    validate_many(trajs[:3] + trajs[4:])  # the others pass
