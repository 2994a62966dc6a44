"""Transport seam of the data plane: move protocol messages from producers to one consumer.

Two small ABCs, each a template method over a frame-level primitive that implementations supply:

* :class:`MessageSender` — ``send(msg)`` encodes with :mod:`~ragen_async.transport.codec` and hands the
  frames to ``send_frames``, which either completes within its timeout or raises :class:`TransportTimeout`.
  Bounded queues make a slow consumer push back on producers instead of growing memory.
* :class:`MessageReceiver` — ``receive(timeout_s)`` pulls frames with ``_recv_frames``, decodes them, and
  returns the first valid message or ``None`` when the time is up. A message that fails to decode is
  counted in :attr:`MessageReceiver.stats` under its reject reason and skipped: one bad peer never stops
  the consumer. A valid message whose exact bytes were already accepted (same signature) is a replay:
  it is counted as ``replayed`` and skipped, so a captured frame sent again is delivered at most once.

Both ends run the same codec whatever the medium, so the bytes tested in process are the bytes that cross
the network. Implementations are not thread-safe: use each endpoint from one thread at a time.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from ragen_async.transport.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    REJECT_REASONS,
    CodecError,
    Frame,
    Message,
    Received,
    RejectReason,
    check_secret,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_REPLAY_WINDOW",
    "DEFAULT_SEND_TIMEOUT_S",
    "MessageReceiver",
    "MessageSender",
    "ReceiverStats",
    "TransportClosed",
    "TransportTimeout",
]

DEFAULT_HWM = 8
"""Messages a queue holds before the sender blocks. Trajectory groups are large, so keep this small."""
DEFAULT_REPLAY_WINDOW = 16384
"""Signatures of accepted messages a receiver remembers to refuse replays (about 2 MiB at most). A run
consumes a few groups per second, so this covers the last hours; older replays of trajectory groups are
still refused by the trainer, which never takes the same group index twice."""
DEFAULT_SEND_TIMEOUT_S = 60.0
"""How long ``send`` waits for queue space when the caller gives no timeout. Long enough to ride out a
learner step; short enough that a consumer that died turns into an error instead of a silent hang."""


class TransportTimeout(TimeoutError):
    """A send could not be queued within its timeout (the consumer is not keeping up, or is gone)."""


class TransportClosed(RuntimeError):
    """The endpoint was used after ``close()``."""


@dataclass
class ReceiverStats:
    """Counters of one receiver since it was created."""

    received: int = 0
    """Messages accepted (decoded and validated)."""
    bytes: int = 0
    """Bytes of all frames of the accepted messages."""
    rejected: dict[RejectReason, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    """Messages dropped by the codec or as replays, by reason."""

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def copy(self) -> ReceiverStats:
        return ReceiverStats(self.received, self.bytes, dict(self.rejected))

    def as_metrics(self, prefix: str = "transport") -> dict[str, float]:
        out = {f"{prefix}/received": float(self.received), f"{prefix}/bytes": float(self.bytes)}
        out.update({f"{prefix}/rejected/{reason}": float(n) for reason, n in self.rejected.items()})
        return out


class _Endpoint(ABC):
    """Closing, context-manager support and the closed check shared by both ends."""

    _closed: bool = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the endpoint. Idempotent and prompt (never waits for a peer)."""
        if not self._closed:
            self._closed = True
            self._close()

    @abstractmethod
    def _close(self) -> None: ...

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{type(self).__name__} is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class MessageSender(_Endpoint):
    """Producer end: sends signed protocol messages, blocking at most ``timeout_s`` for queue space."""

    def __init__(self, secret: bytes, send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        check_secret(secret)
        self._secret = secret
        self.send_timeout_s = send_timeout_s
        """Default timeout of :meth:`send`; ``None`` waits forever (only for callers that supervise)."""

    def send(self, msg: Message, timeout_s: float | None = None) -> None:
        """Encode and send ``msg``.

        Args:
            msg: a ``TrajectoryGroup`` or ``BatchShard``; its arrays must not be mutated afterwards (the
                frames may be sent zero-copy after this call returns).
            timeout_s: seconds to wait for queue space; ``None`` uses :attr:`send_timeout_s`.

        Raises:
            TransportTimeout: the consumer did not make room in time; nothing was sent.
            CodecError: ``msg`` cannot be encoded (wrong field types or dtypes).
            TransportClosed: the sender was closed.
        """
        self.send_frames(encode(msg, self._secret), timeout_s)

    def send_frames(self, frames: Sequence[Frame], timeout_s: float | None = None) -> None:
        """Send already-encoded frames as one message (for forwarding proxies and transport tests)."""
        self._check_open()
        self._send_frames(frames, self.send_timeout_s if timeout_s is None else timeout_s)

    @abstractmethod
    def _send_frames(self, frames: Sequence[Frame], timeout_s: float | None) -> None:
        """Queue ``frames`` atomically within ``timeout_s`` (None: forever) or raise TransportTimeout."""


class MessageReceiver(_Endpoint):
    """Consumer end: returns valid messages, counts and skips invalid ones."""

    def __init__(
        self,
        secret: bytes,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        expected: type | tuple[type, ...] | None = None,
        replay_window: int = DEFAULT_REPLAY_WINDOW,
    ) -> None:
        """
        Args:
            secret: the per-run secret (the codec derives its MAC key from it).
            max_message_bytes: larger messages (all frames together) are rejected as ``oversized``.
            expected: the message kinds accepted; others are rejected as ``wrong_type``.
            replay_window: how many accepted messages' signatures are remembered; a valid message whose
                signature is among them is rejected as ``replayed``. Bounded, so memory stays constant
                however long the run (32-byte signatures, about 130 bytes each with the set and queue).
        """
        check_secret(secret)
        if replay_window < 1:
            raise ValueError(f"replay_window must be >= 1, got {replay_window}")
        self._secret = secret
        self.max_message_bytes = max_message_bytes
        self._expected = expected
        self._stats = ReceiverStats()
        self.replay_window = replay_window
        self._seen: set[bytes] = set()
        self._seen_order: deque[bytes] = deque()

    @property
    def stats(self) -> ReceiverStats:
        """A snapshot of the counters."""
        return self._stats.copy()

    def receive(self, timeout_s: float | None = None, *, raise_rejects: bool = False) -> Received | None:
        """The next valid message, or ``None`` if none arrived within ``timeout_s`` (``None``: wait forever).

        Invalid messages are counted and skipped without returning, so ``None`` always means "timed out";
        with ``raise_rejects`` one is counted and its :class:`CodecError` raised instead (a consumer fed by
        one trusted producer, like a learner rank by the driver, cannot go on without the message).
        """
        self._check_open()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            frames = self._recv_frames(remaining)
            if frames is None:
                return None
            msg = self._decode_counted(frames, raise_rejects)
            if msg is not None:
                return msg
            if remaining == 0.0:
                return None

    def _decode_counted(self, frames: Sequence[object], raise_rejects: bool = False) -> Received | None:
        try:
            msg = decode(frames, self._secret, self.max_message_bytes, self._expected)
        except CodecError as exc:
            self._stats.rejected[exc.reason] += 1
            if raise_rejects:
                raise
            return None
        # The signature is a MAC of the header, which names every other byte (by digest), so equal
        # signatures mean the same message, and
        # only messages that passed verification are remembered (nobody can fill the window without the key).
        signature = bytes(memoryview(frames[0]))  # type: ignore[arg-type]
        if signature in self._seen:
            self._stats.rejected["replayed"] += 1
            return None
        self._seen.add(signature)
        self._seen_order.append(signature)
        if len(self._seen_order) > self.replay_window:
            self._seen.discard(self._seen_order.popleft())
        self._stats.received += 1
        self._stats.bytes += sum(memoryview(f).nbytes for f in frames)  # type: ignore[arg-type]
        return msg

    @abstractmethod
    def _recv_frames(self, timeout_s: float | None) -> Sequence[object] | None:
        """One raw message (buffer-protocol frames) within ``timeout_s`` (None: forever), else ``None``."""
