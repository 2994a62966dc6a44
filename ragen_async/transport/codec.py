"""Wire codec of the data plane: groups travel once, the driver reads only their metadata.

A message is a list of frames (a ZeroMQ multipart message, or the same list of byte strings in process).
Two kinds travel, a **group** from a rollout actor to the driver and a **shard** from the driver to one
learner rank::

    group    [signature, header, data]
             signature  keyed BLAKE3 of the header (a MAC; the key is derived from the run's secret)
             header     msgpack {"v": 4, "kind": "group", "frames": 1, "body": [group fields...,
                        [[scalar fields..., [turn, ...], [[v, count], ...], num_tokens, offset,
                          BLAKE3(this trajectory's part of data)], ...]]}
             data       every trajectory's four per-token arrays back to back (widest first, little-endian),
                        the trajectories one after another

    shard    [signature, header, *sources]
             header     msgpack {"v": 4, "kind": "shard", "frames": n, "body": [shard fields..., [score, ...],
                        [normalized score, ...], [[signature, [i, ...]], ...]]}
             sources    per source: its own signature and header, then the part of its data of each
                        trajectory it takes, one frame each, in order. A source is a forwarded group message
                        or, for a shard built from real trajectories, a "trajs" message made by the encoder.

A body is a msgspec struct written as an array (``array_like``): its fields in declaration order, without
their names (a Sokoban group's header is 2.4 KB this way, 8.1 KB as maps; both ends run the same code).

The header's signature covers the scalars, the token summary (``versions``: sampled tokens per policy
version) and the per-trajectory digests; the digests cover the bytes, and the trajectories' declared sizes
must fill the data frame exactly. **Bytes are checked where they are read.** The driver reads only headers:
it authenticates a group with one MAC of its small header, reads every fact it decides on from it
(:class:`~ragen_async.protocol.GroupMeta`), and forwards the trajectories a rank trains on as zero-copy
slices of the frame it received, never reading, hashing, decoding or re-encoding token data. A learner
checks each forwarded source's signature (listed in the signed shard header, so sources cannot be
swapped), each taken trajectory's digest, :meth:`Trajectory.validate`, and that the arrays match the
summary the driver decided on. Headers are msgspec structs, decoded and type-checked in C, value ranges
included (finite rewards, versions >= 0, 32-byte digests).

Guarantees:

* **Nothing is pickled.** msgpack is a data-only format (extension types are rejected), and the dtypes
  are fixed by the layout (:data:`~ragen_async.protocol.TRAJECTORY_ARRAYS`), never read from the wire.
* **Authenticated.** Every byte a learner trains on is covered by a signature, directly or by a digest
  inside a signed header; frames can be neither altered nor re-split nor dropped. The driver authenticates
  what it decides on (the header); an altered data frame passes it and is refused by the learner it is
  forwarded to, as ``bad_signature`` naming the source and trajectory.
* **Validated where it is read.** :func:`decode` either returns a message whose every field has the
  declared type (for groups: finite rewards, a well-formed version summary, sizes that fill the data frame;
  for shards, also trajectories that pass :meth:`Trajectory.validate` and match their summary) or raises
  :class:`CodecError` whose ``reason`` is one of :data:`REJECT_REASONS` (receivers count rejects by reason
  and keep running).
* **Zero-copy on receipt.** :func:`decode` and forwarding use views of the received buffers, and the
  arrays it returns are read-only. :func:`encode` copies each trajectory's arrays once, into the data frame.

Checks run from cheapest and secret-free to most expensive: frame count and total size, header parse,
version, signature, frame count against the header, then the body.

Its length (over the project's ~600 lines per module): encoder and decoder of one wire format, kept side by side
so the format is defined once.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Sequence
from dataclasses import fields
from itertools import groupby
from typing import Annotated, Any, Literal, TypeAlias, get_args

import blake3
import msgspec
import numpy as np

from ragen_async.protocol import (
    TOKEN_FRAME_BYTES,
    TRAJECTORY_ARRAYS,
    BatchShard,
    Finite,
    GroupMeta,
    InvalidTrajectory,
    Trajectory,
    TrajectoryGroup,
    TrajectoryMeta,
    TurnRecord,
    token_arrays,
    validate_many,
)

__all__ = [
    "CODEC_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "REJECT_REASONS",
    "CodecError",
    "Frame",
    "Message",
    "RejectReason",
    "Received",
    "check_secret",
    "decode",
    "encode",
    "sign",
]

CODEC_VERSION = 4
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest accepted message (all frames together); a group of 16 × 32k-token episodes is ~7 MiB."""

Message: TypeAlias = TrajectoryGroup | BatchShard
"""What :func:`encode` takes."""
Received: TypeAlias = GroupMeta | BatchShard
"""What :func:`decode` returns: a group as its metadata (the driver's view), a shard with real trajectories."""
Frame: TypeAlias = bytes | bytearray | memoryview
"""Anything exposing the buffer protocol works on input; :func:`encode` produces bytes and memoryviews."""

RejectReason = Literal[
    "bad_signature", "unknown_version", "malformed", "truncated", "oversized", "wrong_type", "replayed"
]
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)


class CodecError(ValueError):
    """A message that cannot be encoded or must not be accepted; ``reason`` is one of :data:`REJECT_REASONS`.

    :func:`decode` never raises ``replayed``: a valid message seen a second time is refused by the
    receiver (``MessageReceiver``), which remembers the signatures it has accepted.
    """

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: RejectReason = reason
        self.detail = detail


# --------------------------------------------------------------------------------------------------
# Schema: the wire form of every header, as msgspec structs. msgspec decodes and type-checks them in C
# (missing, unknown and wrongly typed fields are all refused, and values out of their range); what types
# cannot say (versions in ascending order, sizes against the frames) is checked after. None can be part
# of a reference cycle, so none is tracked by the cycle collector (``gc=False``, see protocol.TurnRecord).
# Bodies travel as arrays (``array_like``): a missing or extra element is refused like a missing or unknown
# field. The outer header stays a map, so a peer of another version is told so by name (``v``).

_DIGEST_BYTES = 32
_Size = Annotated[int, msgspec.Meta(ge=0)]
_Digest = Annotated[bytes, msgspec.Meta(min_length=_DIGEST_BYTES, max_length=_DIGEST_BYTES)]
_VersionCount = tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=1)]]


class _TrajectoryWire(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    traj_id: str
    env_tag: str
    seed: int
    group_id: str
    format_penalty: Finite
    success: bool
    truncated_by_context: bool
    timings: dict[str, float]
    turns: tuple[TurnRecord, ...]
    versions: list[_VersionCount]
    """Sampled tokens per policy version, ascending (the driver's staleness facts)."""
    num_tokens: _Size
    """Tokens of the episode: its arrays take :data:`TOKEN_FRAME_BYTES` per token."""
    offset: _Size
    """Where its arrays start in the message's data frame (each trajectory's follow the previous one's)."""
    digest: _Digest
    """BLAKE3 of its arrays (what a learner checks on the part forwarded to it)."""


class _TrajsBody(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A shard's source made from real trajectories."""

    trajectories: list[_TrajectoryWire]


class _GroupBody(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    group_id: str
    index: int
    env_tag: str
    seed: int
    worker_id: str
    created_at: float
    finished_at: float
    trajectories: list[_TrajectoryWire]


class _Source(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    signature: bytes
    """The source message's signature (so a learner knows it got the source the driver chose)."""
    take: list[int]
    """Positions of the trajectories taken from it, ascending; their arrays follow its header."""


class _ShardBody(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    step: int
    learner_version: int
    batch_num_tokens: int
    batch_num_seqs: int
    rank: int
    world_size: int
    scores: list[Finite]
    normalized_scores: list[Finite]
    sources: list[_Source]


class _Header(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    v: int
    kind: str
    frames: int
    body: msgspec.Raw
    """Decoded, by kind, only once the signature has been checked."""


_TRAJ_ARRAYS = TRAJECTORY_ARRAYS
_BODIES: dict[str, type] = {"group": _GroupBody, "shard": _ShardBody, "trajs": _TrajsBody}
_SOURCE_KINDS = ("group", "trajs")
"""Header kinds a shard's sources may have."""
_TRAJ_SCALARS = ("traj_id", "env_tag", "seed", "group_id", "format_penalty", "success", "truncated_by_context",
                 "timings")
_GROUP_SCALARS = ("group_id", "index", "env_tag", "seed", "worker_id", "created_at", "finished_at")
_SHARD_SCALARS = ("step", "learner_version", "batch_num_tokens", "batch_num_seqs", "rank", "world_size")


def _field_names(cls: type) -> set[str]:
    return set(cls.__struct_fields__) if hasattr(cls, "__struct_fields__") else {f.name for f in fields(cls)}


def _check_schema_covers(cls: type, *parts: Sequence[str] | set[str]) -> None:
    # A field added to protocol.py but not here would silently vanish on the wire: fail at import instead.
    known = set().union(*parts)
    actual = _field_names(cls)
    if known != actual:
        raise RuntimeError(
            f"codec schema for {cls.__name__} is out of date: missing {sorted(actual - known)}, "
            f"extra {sorted(known - actual)}"
        )


_check_schema_covers(Trajectory, _TRAJ_SCALARS, _TRAJ_ARRAYS, {"turns"})
_check_schema_covers(_TrajectoryWire, _TRAJ_SCALARS, {"turns", "versions", "digest", "num_tokens", "offset"})
_check_schema_covers(TrajectoryGroup, _GROUP_SCALARS, {"trajectories"})
_check_schema_covers(_GroupBody, _GROUP_SCALARS, {"trajectories"})
_check_schema_covers(BatchShard, _SHARD_SCALARS, {"trajectories", "scores", "normalized_scores"})
_check_schema_covers(TrajectoryMeta, _TRAJ_SCALARS, {"turns", "num_tokens", "version_counts", "source", "position",
                                                     "frame"})
_check_schema_covers(_TrajsBody, {"trajectories"})
_check_schema_covers(GroupMeta, _GROUP_SCALARS, {"trajectories"})


# --------------------------------------------------------------------------------------------------
# Signature and digests

_SIGNATURE_BYTES = 32
_MAC_CONTEXT = "ragen_async codec v4 header MAC"
"""BLAKE3's key-derivation context: the MAC key is derived from the run's secret for this one use."""


def _as_bytes_view(frame: object) -> memoryview:
    """A flat unsigned-byte view of any buffer (numpy arrays, zmq frames' ``.buffer``, bytes)."""
    view = frame if isinstance(frame, memoryview) else memoryview(frame)  # type: ignore[arg-type]
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@functools.lru_cache(maxsize=16)
def _mac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key of a secret of any length (derived once per secret)."""
    return blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()


def sign(secret: bytes, header: Frame) -> bytes:
    """The header's MAC, BLAKE3 in keyed mode (the header carries the digests of its arrays): 1.6-2.3 times
    as fast as HMAC-SHA256 on the same 2-9 KB header on a CPU with SHA extensions (docs/changelog.md)."""
    return blake3.blake3(header, key=_mac_key(secret)).digest()


def _digest(data: Frame) -> bytes:
    """BLAKE3 of one trajectory's arrays (about 4 GB/s on one core here, plus a few µs per call)."""
    return blake3.blake3(data).digest()


def check_secret(secret: bytes) -> None:
    """Refuse anything but a non-empty ``bytes`` key (a ``str`` would silently be a different key)."""
    if not isinstance(secret, bytes) or not secret:
        raise TypeError("the per-run secret must be a non-empty bytes object")


# --------------------------------------------------------------------------------------------------
# Encode


def _plain(value: Any) -> Any:
    """msgspec's hook for what it cannot encode itself: numpy scalars become Python ones, nothing else."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode a {type(value).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)


def _pack(header: _Header | dict[str, Any]) -> bytes:
    try:
        return _ENCODER.encode(header)
    except (OverflowError, TypeError, ValueError) as exc:
        raise CodecError("wrong_type", f"header cannot be packed: {exc}") from exc


_DTYPES = {name: np.dtype(dtype) for name, dtype in _TRAJ_ARRAYS.items()}


def _array(name: str, value: Any) -> np.ndarray:
    if type(value) is np.ndarray and value.dtype == _DTYPES[name] and value.ndim == 1 and value.flags.c_contiguous:
        return value  # the normal case, checked in one line
    if not isinstance(value, np.ndarray):
        raise CodecError("wrong_type", f"field {name!r} must be a numpy array, got {type(value).__name__}")
    if value.ndim != 1:
        raise CodecError("malformed", f"field {name!r} must be 1-D, got shape {value.shape}")
    dtype = _DTYPES[name]
    if value.dtype != dtype:
        if value.dtype.newbyteorder("<") != dtype:
            raise CodecError("wrong_type", f"field {name!r} must have dtype {dtype}, got {value.dtype}")
        value = value.astype(dtype)  # only the byte order differs: normalise to little-endian
    return np.ascontiguousarray(value)  # no copy when already contiguous (the normal case)


def _encode_trajectories(trajs: Sequence[Trajectory]) -> tuple[list[_TrajectoryWire], bytes]:
    """Header entries of ``trajs`` and the one data frame holding all their arrays (each trajectory's
    back to back, widest first), in order. Validated together (:func:`validate_many`), copied once."""
    if not trajs:
        raise CodecError("malformed", "a message must carry at least one trajectory")
    for traj in trajs:
        if not isinstance(traj, Trajectory):
            raise CodecError("wrong_type", f"expected a Trajectory, got {type(traj).__name__}")
    arrays = [_array(name, getattr(traj, name)) for traj in trajs for name in _TRAJ_ARRAYS]
    try:
        counts = validate_many(trajs)  # fail at the producer, where the bug is, rather than at the consumer
    except InvalidTrajectory as exc:
        raise CodecError("malformed", f"trajectory {trajs[exc.index].traj_id!r}: {exc}") from exc
    data = b"".join(arrays)
    view, wires, offset = memoryview(data), [], 0
    for traj, versions in zip(trajs, counts, strict=True):
        end = offset + traj.num_tokens * TOKEN_FRAME_BYTES
        wires.append(_TrajectoryWire(**{name: getattr(traj, name) for name in _TRAJ_SCALARS}, turns=tuple(traj.turns),
                                     versions=list(versions), num_tokens=traj.num_tokens, offset=offset,
                                     digest=_digest(view[offset:end])))
        offset = end
    return wires, data


def _signed(kind: str, body: msgspec.Struct, frames: list[Frame], secret: bytes) -> list[Frame]:
    header = _pack({"v": CODEC_VERSION, "kind": kind, "frames": len(frames), "body": body})
    return [sign(secret, header), header, *frames]


def _encode_group(group: TrajectoryGroup, secret: bytes) -> list[Frame]:
    wires, data = _encode_trajectories(group.trajectories)
    body = _GroupBody(**{name: getattr(group, name) for name in _GROUP_SCALARS}, trajectories=wires)
    return _signed("group", body, [data], secret)


def _source_blocks(trajs: Sequence[Any], secret: bytes) -> tuple[list[_Source], list[Frame]]:
    """The shard's sources: runs of forwarded trajectories from one message reuse that message's signature
    and header; runs of real trajectories become one new "trajs" message each."""
    sources: list[_Source] = []
    frames: list[Frame] = []
    for key, run in groupby(trajs, key=lambda t: id(t.source[0]) if isinstance(t, TrajectoryMeta) else None):
        items = list(run)
        if key is None:  # real trajectories, encoded here; the shard carries each one's part of the data
            wires, data = _encode_trajectories(items)
            signature, header, _ = _signed("trajs", _TrajsBody(wires), [data], secret)
            view = memoryview(data)
            block = [signature, header, *(view[w.offset:w.offset + w.num_tokens * TOKEN_FRAME_BYTES] for w in wires)]
            take = list(range(len(items)))
        else:
            signature, header = items[0].source
            take = [t.position for t in items]
            if any(b <= a for a, b in zip(take, take[1:], strict=False)):
                raise CodecError("malformed", f"forwarded trajectories out of order: positions {take}")
            block = [signature, header, *(t.frame for t in items)]
        sources.append(_Source(bytes(_as_bytes_view(block[0])), take))
        frames += block
    return sources, frames


def _encode_shard(shard: BatchShard, secret: bytes) -> list[Frame]:
    n = len(shard.trajectories)
    if n == 0:
        raise CodecError("malformed", "a message must carry at least one trajectory")
    scores, normalized = np.asarray(shard.scores), np.asarray(shard.normalized_scores)
    if scores.shape != (n,) or normalized.shape != (n,):
        raise CodecError("malformed", f"shard scores do not match its {n} trajectories")
    sources, frames = _source_blocks(shard.trajectories, secret)
    body = _ShardBody(**{name: getattr(shard, name) for name in _SHARD_SCALARS},
                      scores=scores.astype(np.float32).tolist(), normalized_scores=normalized.astype(np.float32).tolist(),
                      sources=sources)
    header = _pack({"v": CODEC_VERSION, "kind": "shard", "frames": len(frames), "body": body})
    return [sign(secret, header), header, *frames]


def encode(msg: Message, secret: bytes) -> list[Frame]:
    """Serialise ``msg`` into ``[signature, header, *frames]``.

    A :class:`BatchShard` may hold real trajectories (encoded here) or, on the driver, the
    :class:`TrajectoryMeta` of received ones, whose bytes are forwarded as zero-copy views of the received
    frames: keep those frames alive and unchanged until the send has completed. Real trajectories' arrays
    are copied once, into the message's data frame.

    Raises:
        CodecError: a field has the wrong type or dtype (reason ``wrong_type``), a trajectory fails
            :meth:`Trajectory.validate`, or a value cannot be represented (``malformed``, e.g. a 2-D array).
        TypeError: ``msg`` is not a protocol message, or the secret is not non-empty bytes.
    """
    check_secret(secret)
    if isinstance(msg, TrajectoryGroup):
        return _encode_group(msg, secret)
    if isinstance(msg, BatchShard):
        return _encode_shard(msg, secret)
    raise TypeError(f"cannot encode {type(msg).__name__}; expected TrajectoryGroup or BatchShard")


# --------------------------------------------------------------------------------------------------
# Decode


def _invalid(exc: msgspec.ValidationError) -> RejectReason:
    """The reason for what msgspec refused: a value of the wrong type ("Expected `int`, got `str`"), or
    anything else (a value out of its range, a missing or unknown field, a body array of the wrong length:
    "Expected `array` of at least length 13, got 12") malformed."""
    text = str(exc)
    return "wrong_type" if text.startswith("Expected") and ", got " in text and " of at " not in text else "malformed"


def _typed(data: Any, cls: type, what: str) -> Any:
    """msgspec decode into ``cls``; its errors become reasons (:func:`_invalid`)."""
    try:
        return msgspec.msgpack.decode(data, type=cls)
    except msgspec.ValidationError as exc:
        raise CodecError(_invalid(exc), f"{what}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise CodecError("malformed", f"{what} is not msgpack: {exc}") from exc


def _ascending(values: Sequence[int]) -> bool:
    return all(b > a for a, b in zip(values, values[1:], strict=False))


def _check_wire(where: str, wire: _TrajectoryWire) -> None:
    """What the types cannot say about one trajectory entry of a verified header (its value ranges, finite
    rewards included, were checked as it was decoded)."""
    versions = wire.versions
    if len(versions) > 1 and not _ascending([v for v, _ in versions]):
        raise CodecError("malformed", f"{where}.versions must be in ascending order of version")


class _TrajectoryDecoder:
    """A learner's check and rebuild of one forwarded trajectory."""

    def __init__(self, where: str, wire: _TrajectoryWire) -> None:
        _check_wire(where, wire)
        self.where, self.wire = where, wire

    def check_frame(self, frame: memoryview) -> None:
        """The frame has the signed digest and the declared size."""
        if not hmac.compare_digest(_digest(frame), self.wire.digest):
            raise CodecError("bad_signature", f"{self.where}: array bytes do not match the signed digest")
        if frame.nbytes != self.wire.num_tokens * TOKEN_FRAME_BYTES:
            raise CodecError("malformed", f"{self.where}: {self.wire.num_tokens} tokens do not fill a frame of "
                                          f"{frame.nbytes} B")

    def scalars(self) -> dict[str, Any]:
        return {name: getattr(self.wire, name) for name in _TRAJ_SCALARS}

    def trajectory(self, frame: memoryview) -> Trajectory:
        """The trajectory on its frame, not yet validated (:func:`_validated` does a shard's at once)."""
        return Trajectory(**self.scalars(), **token_arrays(frame, self.wire.num_tokens), turns=self.wire.turns)


def _validated(decoders: Sequence[_TrajectoryDecoder], trajs: Sequence[Trajectory]) -> None:
    """Every trajectory passes :meth:`Trajectory.validate` and its arrays hold the version summary that was
    signed (what the driver decided on); one :func:`validate_many` over them all."""
    try:
        counts = validate_many(trajs)
    except InvalidTrajectory as exc:
        raise CodecError("malformed", f"{decoders[exc.index].where}: {exc}") from exc
    for dec, versions in zip(decoders, counts, strict=True):
        if versions != tuple(dec.wire.versions):
            raise CodecError("malformed", f"{dec.where}: token versions do not match the signed summary")


def _open(signature: memoryview, header: memoryview, secret: bytes, kinds: Sequence[str]) -> tuple[str, int, Any]:
    """Parse and verify a ``[signature, header]`` pair; returns the header's kind, frame count and typed body."""
    if signature.nbytes != _SIGNATURE_BYTES:
        raise CodecError("malformed", f"signature frame has {signature.nbytes} bytes, expected {_SIGNATURE_BYTES}")
    # The version is judged before the signature: a newer sender may sign differently, and "unknown
    # version" tells the operator what is wrong where "bad signature" would not. Rejecting early costs nothing.
    try:
        typed: _Header = msgspec.msgpack.decode(header, type=_Header)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        _version_problem(header)
        raise CodecError(_invalid(exc) if isinstance(exc, msgspec.ValidationError) else "malformed",
                         f"header: {exc}") from exc
    if typed.v != CODEC_VERSION:
        raise CodecError("unknown_version", f"version {typed.v} (this codec speaks {CODEC_VERSION})")
    if typed.frames < 0:
        raise CodecError("malformed", f"negative frame count {typed.frames}")
    if not hmac.compare_digest(signature, sign(secret, header)):
        raise CodecError("bad_signature")
    if typed.kind not in kinds:
        raise CodecError("malformed", f"message kind {typed.kind!r} where {' or '.join(kinds)} was expected")
    return typed.kind, typed.frames, _typed(typed.body, _BODIES[typed.kind], f"{typed.kind} body")


def _version_problem(header: memoryview) -> None:
    """Raise the reason an unreadable header is refused for, if it is its shape or its version."""
    try:
        outer = msgspec.msgpack.decode(header)
    except msgspec.DecodeError:
        return
    if not isinstance(outer, dict):
        raise CodecError("malformed", f"header should be a map, got {type(outer).__name__}")
    if "v" in outer:
        if not _is_int(outer["v"]):
            raise CodecError("wrong_type", f"version should be int, got {type(outer['v']).__name__}")
        if outer["v"] != CODEC_VERSION:
            raise CodecError("unknown_version", f"version {outer['v']} (this codec speaks {CODEC_VERSION})")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(arrays: Sequence[object], declared: int) -> None:
    if len(arrays) < declared:
        raise CodecError("truncated", f"{len(arrays)} frame(s) of {declared}")
    if len(arrays) > declared:
        raise CodecError("malformed", f"{len(arrays) - declared} extra frame(s) after {declared} frame(s)")


def _decode_group(views: list[memoryview], body: _GroupBody) -> GroupMeta:
    """The driver's view of a verified group: metadata, and the data frame cut into each trajectory's part
    (zero-copy, never read) for forwarding. Sizes must fill the frame; its bytes are the learner's check."""
    (data,) = views[2:]
    if not body.trajectories:
        raise CodecError("malformed", "a message must carry at least one trajectory")
    metas, offset, source = [], 0, (views[0], views[1])
    for i, w in enumerate(body.trajectories):
        _check_wire(f"trajectories[{i}]", w)
        end = offset + w.num_tokens * TOKEN_FRAME_BYTES
        if w.offset != offset or end > data.nbytes:
            raise CodecError("malformed", f"trajectories[{i}]: arrays at {w.offset} of {w.num_tokens} tokens "
                                          f"do not follow the previous trajectory's within {data.nbytes} B")
        metas.append(TrajectoryMeta(
            traj_id=w.traj_id, env_tag=w.env_tag, seed=w.seed, group_id=w.group_id, turns=w.turns,
            format_penalty=w.format_penalty, success=w.success, truncated_by_context=w.truncated_by_context,
            timings=w.timings, num_tokens=w.num_tokens, version_counts=tuple(w.versions), source=source,
            position=i, frame=data[offset:end]))
        offset = end
    if offset != data.nbytes:
        raise CodecError("malformed", f"{data.nbytes - offset} B of the data frame belong to no trajectory")
    return GroupMeta(**{name: getattr(body, name) for name in _GROUP_SCALARS}, trajectories=tuple(metas))


def _decode_shard(views: list[memoryview], body: _ShardBody, secret: bytes) -> BatchShard:
    """A learner's shard: every source verified, every taken trajectory rebuilt and validated."""
    frames, pos, trajs, decoders = views[2:], 0, [], []
    if not body.sources:
        raise CodecError("malformed", "a message must carry at least one trajectory")
    for s, source in enumerate(body.sources):
        if not source.take or not _ascending(source.take):
            raise CodecError("malformed", f"sources[{s}].take must be ascending positions")
        if len(frames) < pos + 2 + len(source.take):
            raise CodecError("truncated", f"source {s} or its trajectories are missing")
        if bytes(frames[pos]) != source.signature:
            raise CodecError("bad_signature", f"source {s} is not the one the shard header names")
        _, _, src = _open(frames[pos], frames[pos + 1], secret, _SOURCE_KINDS)
        pos += 2
        for p in source.take:
            if not 0 <= p < len(src.trajectories):
                raise CodecError("malformed", f"sources[{s}] takes trajectory {p} of {len(src.trajectories)}")
            wire = src.trajectories[p]
            dec = _TrajectoryDecoder(f"sources[{s}].trajectories[{p}] ({wire.traj_id!r})", wire)
            dec.check_frame(frames[pos])
            trajs.append(dec.trajectory(frames[pos]))
            decoders.append(dec)
            pos += 1
    if pos != len(frames):
        raise CodecError("malformed", f"{len(frames) - pos} frame(s) after the last source")
    _validated(decoders, trajs)
    n = len(trajs)
    if len(body.scores) != n or len(body.normalized_scores) != n:
        raise CodecError("malformed", f"shard scores must be {n} floats")
    return BatchShard(**{name: getattr(body, name) for name in _SHARD_SCALARS}, trajectories=tuple(trajs),
                      scores=np.asarray(body.scores, np.float32),
                      normalized_scores=np.asarray(body.normalized_scores, np.float32))


_KIND_NAMES: dict[str, type] = {"group": TrajectoryGroup, "shard": BatchShard}
"""Top-level message kinds, by the protocol type they carry (what ``expected`` names)."""


def decode(
    frames: Sequence[object],
    secret: bytes,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    expected: type | tuple[type, ...] | None = None,
) -> Received:
    """Verify and deserialise ``[signature, header, *frames]``.

    A group comes back as a :class:`GroupMeta` (metadata; the arrays stay the received frames, their digests
    checked); a shard as a :class:`BatchShard` of validated :class:`Trajectory` objects.

    Args:
        frames: the received frames; any buffer-protocol objects (bytes, memoryviews, ``zmq.Frame.buffer``).
            The returned arrays are read-only views of these buffers.
        secret: the per-run secret the sender signed with.
        max_message_bytes: reject messages whose frames total more than this (reason ``oversized``).
        expected: if given, the message kinds this receiver accepts (``TrajectoryGroup``, ``BatchShard``);
            any other is ``wrong_type``.

    Raises:
        CodecError: with ``reason`` in :data:`REJECT_REASONS`.
    """
    check_secret(secret)
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or not isinstance(frames, Sequence):
        raise CodecError("malformed", f"expected a sequence of frames, got {type(frames).__name__}")
    if len(frames) < 2:
        raise CodecError("truncated", f"{len(frames)} frame(s); need at least a signature and a header")
    try:
        views = [_as_bytes_view(f) for f in frames]
    except (TypeError, ValueError) as exc:
        raise CodecError("malformed", f"a frame is not a buffer: {exc}") from exc
    total = sum(v.nbytes for v in views)
    if total > max_message_bytes:
        raise CodecError("oversized", f"{total} bytes > limit {max_message_bytes}")
    kind, declared, body = _open(views[0], views[1], secret, tuple(_KIND_NAMES))
    _check_count(views[2:], declared)
    if kind == "group" and declared != 1:
        raise CodecError("malformed", f"a group has one data frame, this header declares {declared}")
    if expected is not None and not issubclass(_KIND_NAMES[kind], expected):
        raise CodecError("wrong_type", f"got a {kind} message where {expected} was expected")
    return _decode_group(views, body) if kind == "group" else _decode_shard(views, body, secret)
