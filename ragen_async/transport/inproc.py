"""In-process transport: the ZeroMQ transport's interface over a bounded ``queue.Queue``.

For single-process pipelines and tests. It still runs the full codec (sign, encode, copy the frames to
``bytes`` as a network would, verify, decode), so what passes here is byte-for-byte what would cross
ZeroMQ; only the medium differs. The queue's ``maxsize`` plays the role of the high-water mark: a full
queue makes ``send`` wait, then raise :class:`~ragen_async.transport.base.TransportTimeout`.

Receivers register under an ``inproc://name`` address in a process-wide table, so senders can be made
from an address alone (like ZeroMQ's ``inproc://``) and several senders can feed one receiver. Queue
operations are thread-safe, but as with ZeroMQ, use each endpoint from one thread at a time.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Sequence

from ragen_async.transport.base import (
    DEFAULT_HWM,
    DEFAULT_REPLAY_WINDOW,
    DEFAULT_SEND_TIMEOUT_S,
    MessageReceiver,
    MessageSender,
    TransportClosed,
    TransportTimeout,
)
from ragen_async.transport.codec import DEFAULT_MAX_MESSAGE_BYTES, Frame

__all__ = ["InprocReceiver", "InprocSender", "make_inproc_pair"]

_RawMessage = list[bytes]

_registry: dict[str, queue.Queue[_RawMessage]] = {}
_registry_lock = threading.Lock()


class InprocReceiver(MessageReceiver):
    """Owns a bounded queue registered under :attr:`address` until closed."""

    def __init__(
        self,
        secret: bytes,
        address: str | None = None,
        *,
        maxsize: int = DEFAULT_HWM,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        expected: type | tuple[type, ...] | None = None,
        replay_window: int = DEFAULT_REPLAY_WINDOW,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1 (a bounded queue), got {maxsize}")
        super().__init__(secret, max_message_bytes, expected, replay_window)
        self.address = address or f"inproc://{uuid.uuid4().hex}"
        self._queue: queue.Queue[_RawMessage] = queue.Queue(maxsize)
        with _registry_lock:
            if self.address in _registry:
                raise ValueError(f"address {self.address!r} is already bound in this process")
            _registry[self.address] = self._queue

    def _recv_frames(self, timeout_s: float | None) -> Sequence[object] | None:
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _close(self) -> None:
        with _registry_lock:
            _registry.pop(self.address, None)


class InprocSender(MessageSender):
    """Puts copies of the encoded frames on the queue of the receiver bound at ``address``."""

    def __init__(self, address: str, secret: bytes, *, send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        super().__init__(secret, send_timeout_s)
        self.address = address
        with _registry_lock:
            if address not in _registry:
                raise ValueError(f"no in-process receiver is bound at {address!r}")
            self._queue = _registry[address]

    def _send_frames(self, frames: Sequence[Frame], timeout_s: float | None) -> None:
        with _registry_lock:
            if _registry.get(self.address) is not self._queue:
                raise TransportClosed(f"the receiver at {self.address} is closed")
        # Copy, as a network would: the receiver must not alias the sender's arrays.
        raw = [bytes(memoryview(f)) for f in frames]
        try:
            self._queue.put(raw, timeout=timeout_s)
        except queue.Full:
            raise TransportTimeout(f"send to {self.address} did not complete within {timeout_s} s") from None

    def _close(self) -> None:
        pass  # nothing to release: the queue belongs to the receiver


def make_inproc_pair(
    secret: bytes,
    maxsize: int = DEFAULT_HWM,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S,
) -> tuple[InprocSender, InprocReceiver]:
    """A connected ``(sender, receiver)``; more senders: ``InprocSender(receiver.address, secret)``."""
    receiver = InprocReceiver(secret, maxsize=maxsize, max_message_bytes=max_message_bytes)
    return InprocSender(receiver.address, secret, send_timeout_s=send_timeout_s), receiver
