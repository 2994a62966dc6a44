"""Wire codec of the data plane: ``TrajectoryGroup`` / ``BatchShard`` <-> signed multipart frames.

One message is a list of frames (a ZeroMQ multipart message, or the same list of byte strings when the
in-process transport is used)::

    frame 0    signature   HMAC-SHA256(secret, u64 n ‖ u64 len(f1) ‖ f1 ‖ … ‖ u64 len(fn) ‖ fn)
    frame 1    header      msgpack map {"v": 1, "kind": "group" | "shard", "frames": <arrays>, "body": {...}}
    frame 2..  arrays      raw C-contiguous little-endian bytes of every numpy array

The body mirrors the dataclass: every scalar field (``TurnRecord`` fields included) is a msgpack value,
every numpy field is a descriptor ``{"dtype": "<i4", "shape": [T], "frame": i}`` pointing at array frame
``i`` (0-based, counted after the header).

Guarantees:

* **Nothing is pickled.** msgpack is a data-only format (extension types are rejected), and dtype strings
  from the wire go through an allow-list before numpy ever sees them, so an ``"O"`` (object) dtype can
  never be requested.
* **Authenticated.** The signature covers the header and every array frame, each length-prefixed and
  preceded by the frame count, so frames can be neither altered nor re-split nor dropped.
* **Fully validated.** :func:`decode` either returns a message whose every field has the declared type and
  whose trajectories pass :meth:`Trajectory.validate`, or raises :class:`CodecError` whose ``reason`` is
  one of :data:`REJECT_REASONS` (receivers count rejects by reason and keep running).
* **Zero-copy.** :func:`encode` returns ``memoryview``\\ s of the message's own arrays; :func:`decode`
  wraps the received buffers with ``np.frombuffer`` and marks the arrays read-only. Consequently a sender
  must not mutate the arrays of a message it has handed to a zero-copy transport.

Checks run from cheapest and secret-free to most expensive: frame count and total size, header parse,
version, frame count against the header, signature, then the body. Only the first three happen before
the signature is verified, and they only read the outer header map.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Literal, TypeAlias, get_args

import msgpack
import numpy as np

from ragen_async.protocol import BatchShard, Trajectory, TrajectoryGroup, TurnRecord

__all__ = [
    "ALLOWED_DTYPES",
    "CODEC_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "REJECT_REASONS",
    "CodecError",
    "Frame",
    "Message",
    "RejectReason",
    "check_secret",
    "decode",
    "encode",
    "sign",
]

CODEC_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest accepted message (all frames together); a group of 16 × 32k-token episodes is ~7 MiB."""

Message: TypeAlias = TrajectoryGroup | BatchShard
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
# Schema: the wire form of each protocol dataclass. Scalar fields map to a kind, numpy fields to the one
# dtype the protocol declares for them (which doubles as the dtype allow-list).

_ScalarKind = Literal["int", "float", "bool", "str", "str_tuple", "float_map"]

_TURN_SCALARS: dict[str, _ScalarKind] = {
    "reward": "float",
    "actions": "str_tuple",
    "num_dropped_actions": "int",
    "format_ok": "bool",
    "policy_version": "int",
    "end_policy_version": "int",
    "response_tokens": "int",
    "generate_s": "float",
    "env_step_s": "float",
}
_TRAJ_SCALARS: dict[str, _ScalarKind] = {
    "traj_id": "str",
    "env_tag": "str",
    "seed": "int",
    "group_id": "str",
    "format_penalty": "float",
    "success": "bool",
    "truncated_by_context": "bool",
    "timings": "float_map",
}
_TRAJ_ARRAYS: dict[str, str] = {
    "token_ids": "<i4",
    "loss_mask": "|i1",
    "behaviour_logprobs": "<f4",
    "token_versions": "<i4",
}
_GROUP_SCALARS: dict[str, _ScalarKind] = {
    "group_id": "str",
    "index": "int",
    "env_tag": "str",
    "seed": "int",
    "worker_id": "str",
    "created_at": "float",
    "finished_at": "float",
}
_SHARD_SCALARS: dict[str, _ScalarKind] = {
    "step": "int",
    "learner_version": "int",
    "batch_num_tokens": "int",
    "batch_num_seqs": "int",
    "rank": "int",
    "world_size": "int",
}
_SHARD_ARRAYS: dict[str, str] = {"scores": "<f4", "normalized_scores": "<f4"}

ALLOWED_DTYPES: frozenset[str] = frozenset({*_TRAJ_ARRAYS.values(), *_SHARD_ARRAYS.values()})
"""Every dtype string the wire may carry. Checked before ``np.dtype`` is called on anything received."""

_KINDS: dict[type, str] = {TrajectoryGroup: "group", BatchShard: "shard"}


def _check_schema_covers(cls: type, *parts: Mapping[str, object] | set[str]) -> None:
    # A field added to protocol.py but not here would silently vanish on the wire: fail at import instead.
    known = set().union(*parts)
    actual = {f.name for f in fields(cls)}
    if known != actual:
        raise RuntimeError(
            f"codec schema for {cls.__name__} is out of date: missing {sorted(actual - known)}, "
            f"extra {sorted(known - actual)}"
        )


_check_schema_covers(TurnRecord, _TURN_SCALARS)
_check_schema_covers(Trajectory, _TRAJ_SCALARS, _TRAJ_ARRAYS, {"turns"})
_check_schema_covers(TrajectoryGroup, _GROUP_SCALARS, {"trajectories"})
_check_schema_covers(BatchShard, _SHARD_SCALARS, _SHARD_ARRAYS, {"trajectories"})


# --------------------------------------------------------------------------------------------------
# Signature

_U64 = struct.Struct(">Q")
_SIGNATURE_BYTES = hashlib.sha256().digest_size


def _as_bytes_view(frame: object) -> memoryview:
    """A flat unsigned-byte view of any buffer (numpy arrays, zmq frames' ``.buffer``, bytes)."""
    view = frame if isinstance(frame, memoryview) else memoryview(frame)  # type: ignore[arg-type]
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def sign(secret: bytes, header: Frame, arrays: Sequence[Frame]) -> bytes:
    """HMAC-SHA256 over the frame count and every frame after the signature, each length-prefixed."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    mac.update(_U64.pack(1 + len(arrays)))
    for frame in (header, *arrays):
        view = _as_bytes_view(frame)
        mac.update(_U64.pack(view.nbytes))
        mac.update(view)
    return mac.digest()


def check_secret(secret: bytes) -> None:
    """Refuse anything but a non-empty ``bytes`` key (a ``str`` would silently be a different key)."""
    if not isinstance(secret, bytes) or not secret:
        raise TypeError("the per-run secret must be a non-empty bytes object")


# --------------------------------------------------------------------------------------------------
# Encode


class _Encoder:
    """Builds the header body while collecting the array frames it references."""

    def __init__(self) -> None:
        self.arrays: list[memoryview] = []

    def scalar(self, name: str, kind: _ScalarKind, value: Any) -> Any:
        try:
            if kind == "int":
                return int(value.__index__())  # accepts numpy ints, refuses floats
            if kind == "float":
                return float(value)
            if kind == "bool":
                if not isinstance(value, (bool, np.bool_)):
                    raise TypeError(type(value).__name__)
                return bool(value)
            if kind == "str":
                if not isinstance(value, str):
                    raise TypeError(type(value).__name__)
                return value
            if kind == "str_tuple":
                if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                    raise TypeError("non-str item")
                return list(value)
            # float_map
            if not all(isinstance(k, str) for k in value):
                raise TypeError("non-str key")
            return {k: float(v) for k, v in value.items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise CodecError("wrong_type", f"field {name!r} is not a valid {kind}: {exc}") from exc

    def array(self, name: str, want: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, np.ndarray):
            raise CodecError("wrong_type", f"field {name!r} must be a numpy array, got {type(value).__name__}")
        if value.ndim != 1:
            raise CodecError("malformed", f"field {name!r} must be 1-D, got shape {value.shape}")
        dtype = np.dtype(want)
        if value.dtype != dtype:
            if value.dtype.newbyteorder("<") != dtype:
                raise CodecError("wrong_type", f"field {name!r} must have dtype {dtype}, got {value.dtype}")
            value = value.astype(dtype)  # only the byte order differs: normalise to little-endian
        value = np.ascontiguousarray(value)  # no copy when already contiguous (the normal case)
        self.arrays.append(_as_bytes_view(value))
        return {"dtype": want, "shape": list(value.shape), "frame": len(self.arrays) - 1}

    def fields(self, obj: Any, scalars: Mapping[str, _ScalarKind], arrays: Mapping[str, str]) -> dict[str, Any]:
        out = {name: self.scalar(name, kind, getattr(obj, name)) for name, kind in scalars.items()}
        out.update({name: self.array(name, want, getattr(obj, name)) for name, want in arrays.items()})
        return out

    def trajectory(self, traj: Trajectory) -> dict[str, Any]:
        body = self.fields(traj, _TRAJ_SCALARS, _TRAJ_ARRAYS)
        body["turns"] = [self.fields(turn, _TURN_SCALARS, {}) for turn in traj.turns]
        try:
            traj.validate()  # fail at the producer, where the bug is, rather than at the consumer
        except ValueError as exc:
            raise CodecError("malformed", f"trajectory {traj.traj_id!r}: {exc}") from exc
        return body

    def message(self, msg: Message) -> dict[str, Any]:
        n = len(msg.trajectories)
        if n == 0:
            raise CodecError("malformed", "a message must carry at least one trajectory")
        if isinstance(msg, TrajectoryGroup):
            body = self.fields(msg, _GROUP_SCALARS, {})
        else:
            body = self.fields(msg, _SHARD_SCALARS, _SHARD_ARRAYS)
            if len(msg.scores) != n or len(msg.normalized_scores) != n:
                raise CodecError("malformed", f"shard scores do not match its {n} trajectories")
        body["trajectories"] = [self.trajectory(t) for t in msg.trajectories]
        return body


def encode(msg: Message, secret: bytes) -> list[Frame]:
    """Serialise ``msg`` into ``[signature, header, *array_frames]``.

    Array frames are zero-copy ``memoryview``\\ s of the message's arrays (pass them to
    ``send_multipart(..., copy=False)``); do not mutate those arrays until the send has completed.

    Raises:
        CodecError: a field has the wrong type or dtype (reason ``wrong_type``), a trajectory fails
            :meth:`Trajectory.validate`, or a value cannot be represented (``malformed``, e.g. a 2-D array
            or an integer beyond 64 bits).
        TypeError: ``msg`` is not a protocol message, or the secret is not non-empty bytes.
    """
    check_secret(secret)
    kind = _KINDS.get(type(msg))
    if kind is None:
        raise TypeError(f"cannot encode {type(msg).__name__}; expected TrajectoryGroup or BatchShard")
    encoder = _Encoder()
    body = encoder.message(msg)
    header_map = {"v": CODEC_VERSION, "kind": kind, "frames": len(encoder.arrays), "body": body}
    try:
        header = msgpack.packb(header_map, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise CodecError("malformed", f"header cannot be packed: {exc}") from exc
    return [sign(secret, header, encoder.arrays), header, *encoder.arrays]


# --------------------------------------------------------------------------------------------------
# Decode


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _decode_scalar(name: str, kind: _ScalarKind, value: Any) -> Any:
    ok: bool
    if kind == "int":
        ok = _is_int(value)
    elif kind == "float":
        ok = isinstance(value, float)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "str_tuple":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:  # float_map
        ok = isinstance(value, dict) and all(isinstance(v, float) for v in value.values())
        value = dict(value) if ok else value
    if not ok:
        raise CodecError("wrong_type", f"field {name!r} should be {kind}, got {type(value).__name__}")
    return value


class _Decoder:
    """Rebuilds dataclasses from a verified header body, checking every field and frame reference."""

    def __init__(self, arrays: Sequence[memoryview]) -> None:
        self.arrays = arrays
        self.used = [False] * len(arrays)

    @staticmethod
    def mapping(where: str, value: Any, keys: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise CodecError("wrong_type", f"{where} should be a map, got {type(value).__name__}")
        if set(value) != keys:
            missing, extra = sorted(keys - set(value)), sorted(map(repr, set(value) - keys))
            problems = [f"missing fields {missing}"] * bool(missing) + [f"unexpected fields {extra}"] * bool(extra)
            raise CodecError("malformed", f"{where}: {', '.join(problems)}")
        return value

    @staticmethod
    def sequence(where: str, value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise CodecError("wrong_type", f"{where} should be a list, got {type(value).__name__}")
        return value

    def array(self, name: str, want: str, desc: Any) -> np.ndarray:
        desc = self.mapping(f"array {name!r}", desc, {"dtype", "shape", "frame"})
        dtype_str, shape, index = desc["dtype"], desc["shape"], desc["frame"]
        if not isinstance(dtype_str, str) or dtype_str not in ALLOWED_DTYPES or dtype_str != want:
            raise CodecError("wrong_type", f"array {name!r} has dtype {dtype_str!r}, expected {want!r}")
        if not (isinstance(shape, list) and len(shape) == 1 and all(_is_int(n) and n >= 0 for n in shape)):
            raise CodecError("malformed", f"array {name!r} has invalid shape {shape!r}")
        if not _is_int(index) or not 0 <= index < len(self.arrays):
            raise CodecError("malformed", f"array {name!r} points at frame {index!r} of {len(self.arrays)}")
        if self.used[index]:
            raise CodecError("malformed", f"array frame {index} is referenced twice")
        self.used[index] = True
        dtype = np.dtype(dtype_str)
        buf = self.arrays[index]
        if shape[0] * dtype.itemsize != buf.nbytes:
            raise CodecError(
                "malformed", f"array {name!r}: shape {shape} × {dtype.itemsize} B != frame of {buf.nbytes} B"
            )
        arr = np.frombuffer(buf, dtype=dtype) if buf.nbytes else np.empty(0, dtype=dtype)
        arr.flags.writeable = False  # shares memory with the received frame
        return arr

    def fields(
        self, where: str, raw: Any, scalars: Mapping[str, _ScalarKind], arrays: Mapping[str, str], nested: set[str]
    ) -> dict[str, Any]:
        raw = self.mapping(where, raw, {*scalars, *arrays, *nested})
        out = {name: _decode_scalar(f"{where}.{name}", kind, raw[name]) for name, kind in scalars.items()}
        out.update({name: self.array(f"{where}.{name}", want, raw[name]) for name, want in arrays.items()})
        return out

    def trajectory(self, where: str, raw: Any) -> Trajectory:
        values = self.fields(where, raw, _TRAJ_SCALARS, _TRAJ_ARRAYS, {"turns"})
        turns = self.sequence(f"{where}.turns", raw["turns"])
        values["turns"] = tuple(
            TurnRecord(**self.fields(f"{where}.turns[{i}]", t, _TURN_SCALARS, {}, set())) for i, t in enumerate(turns)
        )
        traj = Trajectory(**values)
        try:
            traj.validate()
        except ValueError as exc:
            raise CodecError("malformed", f"{where}: {exc}") from exc
        return traj

    def trajectories(self, raw: Any) -> tuple[Trajectory, ...]:
        items = self.sequence("trajectories", raw)
        if not items:
            raise CodecError("malformed", "a message must carry at least one trajectory")
        return tuple(self.trajectory(f"trajectories[{i}]", t) for i, t in enumerate(items))

    def message(self, kind: str, body: Any) -> Message:
        msg: Message
        if kind == "group":
            values = self.fields("group", body, _GROUP_SCALARS, {}, {"trajectories"})
            msg = TrajectoryGroup(trajectories=self.trajectories(body["trajectories"]), **values)
        else:
            values = self.fields("shard", body, _SHARD_SCALARS, _SHARD_ARRAYS, {"trajectories"})
            msg = BatchShard(trajectories=self.trajectories(body["trajectories"]), **values)
            n = len(msg.trajectories)
            if msg.scores.shape[0] != n or msg.normalized_scores.shape[0] != n:
                raise CodecError("malformed", f"shard scores do not match its {n} trajectories")
            if not (np.all(np.isfinite(msg.scores)) and np.all(np.isfinite(msg.normalized_scores))):
                raise CodecError("malformed", "shard scores must be finite")
        if not all(self.used):
            raise CodecError("malformed", "an array frame is not referenced by the header")
        return msg


_KIND_NAMES: dict[str, type] = {name: cls for cls, name in _KINDS.items()}


def _unpack_header(header: memoryview) -> dict[str, Any]:
    try:
        # raw=False: strings must be valid UTF-8; strict_map_key: only str/bytes keys; ext types (incl.
        # timestamps) come back as objects that the type checks then reject.
        value = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of exception types on garbage input
        raise CodecError("malformed", f"header is not msgpack: {type(exc).__name__}") from exc
    if not isinstance(value, dict):
        raise CodecError("malformed", f"header should be a map, got {type(value).__name__}")
    return value


def decode(
    frames: Sequence[object],
    secret: bytes,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    expected: type | tuple[type, ...] | None = None,
) -> Message:
    """Verify and deserialise ``[signature, header, *array_frames]``.

    Args:
        frames: the received frames; any buffer-protocol objects (bytes, memoryviews, ``zmq.Frame.buffer``).
            The returned arrays are read-only views of these buffers.
        secret: the per-run HMAC key the sender used.
        max_message_bytes: reject messages whose frames total more than this (reason ``oversized``).
        expected: if given, the message kinds this receiver accepts; any other is ``wrong_type``.

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
    signature, header, arrays = views[0], views[1], views[2:]
    if signature.nbytes != _SIGNATURE_BYTES:
        raise CodecError("malformed", f"signature frame has {signature.nbytes} bytes, expected {_SIGNATURE_BYTES}")

    outer = _unpack_header(header)
    # The version is read before the signature: a newer sender may sign differently, and "unknown version"
    # tells the operator what is wrong where "bad signature" would not. Rejecting early costs nothing.
    if "v" not in outer:
        raise CodecError("malformed", "header has no version")
    if not _is_int(outer["v"]):
        raise CodecError("wrong_type", f"version should be int, got {type(outer['v']).__name__}")
    if outer["v"] != CODEC_VERSION:
        raise CodecError("unknown_version", f"version {outer['v']} (this codec speaks {CODEC_VERSION})")
    outer = _Decoder.mapping("header", outer, {"v", "kind", "frames", "body"})
    declared = outer["frames"]
    if not _is_int(declared):
        raise CodecError("wrong_type", f"frame count should be int, got {type(declared).__name__}")
    if len(arrays) < declared:
        raise CodecError("truncated", f"{len(arrays)} array frame(s) of {declared}")
    if len(arrays) > declared:
        raise CodecError("malformed", f"{len(arrays) - declared} extra frame(s) after {declared} array frame(s)")

    if not hmac.compare_digest(signature, sign(secret, header, arrays)):
        raise CodecError("bad_signature")

    kind = outer["kind"]
    if not isinstance(kind, str) or kind not in _KIND_NAMES:
        raise CodecError("malformed", f"unknown message kind {kind!r}")
    if expected is not None and not issubclass(_KIND_NAMES[kind], expected):
        raise CodecError("wrong_type", f"got a {kind} message where {expected} was expected")
    return _Decoder(arrays).message(kind, outer["body"])
