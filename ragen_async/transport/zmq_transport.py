"""ZeroMQ transport: rollout actors PUSH signed trajectory messages to one PULL consumer.

Topology: every producer connects a PUSH socket to the consumer's bound PULL socket (fan-in; PULL queues
fairly across producers). PUSH never drops: when the pipe is full the sender is *mute*, which is exactly
the backpressure we want from a slow learner (see ``reference/ecosystem.md`` §4).

Invariants and choices:

* **Bounded memory.** ``SNDHWM``/``RCVHWM`` default to 8 messages per pipe (ZeroMQ's default is 1000, far
  too many for multi-megabyte groups). In flight per producer: about ``2 × hwm`` messages plus the kernel's
  TCP buffers.
* **No unbounded blocking.** ``send`` polls ``POLLOUT`` with a deadline and then sends ``NOBLOCK``; if the
  consumer does not make room in time it raises :class:`~ragen_async.transport.base.TransportTimeout` and
  nothing was sent (multipart delivery is atomic).
* **Zero copy.** Array frames go out with ``copy=False`` and come in as ``zmq.Frame`` buffers that the
  decoded numpy arrays keep alive.
* **Size limit.** ``MAXMSGSIZE`` on the receiver makes libzmq disconnect a peer that sends a single frame
  larger than ``max_message_bytes`` (libzmq applies it per frame, before we ever see the message, so such
  a peer is not counted); the codec rejects and counts messages whose frames *together* exceed it.
* **Prompt close.** ``LINGER`` is short, so neither ``close`` nor interpreter exit waits on a dead peer.
* **One socket per thread.** ZeroMQ sockets are not thread-safe: use each sender / receiver from one
  thread at a time (create one sender per producing thread). The shared ``zmq.Context`` is thread-safe.
* Producers may start before the consumer binds: PUSH queues up to ``hwm`` messages for the pending
  connection and delivers them once it is up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import zmq

from ragen_async.transport.base import (
    DEFAULT_HWM,
    DEFAULT_REPLAY_WINDOW,
    DEFAULT_SEND_TIMEOUT_S,
    MessageReceiver,
    MessageSender,
    TransportTimeout,
)
from ragen_async.transport.codec import DEFAULT_MAX_MESSAGE_BYTES, Frame

__all__ = ["ZmqReceiver", "ZmqSender", "DEFAULT_LINGER_MS"]

DEFAULT_LINGER_MS = 500
"""How long a closed sender keeps trying to deliver its queued messages in the background."""


def _to_ms(seconds: float | None) -> int | None:
    """Poll timeout in ms (``None`` = forever); rounded up so we never spin on a sub-millisecond rest."""
    return None if seconds is None else max(0, math.ceil(seconds * 1000))


class ZmqSender(MessageSender):
    """PUSH socket connected to a :class:`ZmqReceiver`'s address."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        *,
        hwm: int = DEFAULT_HWM,
        send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S,
        linger_ms: int = DEFAULT_LINGER_MS,
        context: zmq.Context | None = None,
    ) -> None:
        super().__init__(secret, send_timeout_s)
        self.address = address
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        # Options first: the HWM of a pipe is fixed when the pipe is created by connect().
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.connect(address)

    def _send_frames(self, frames: Sequence[Frame], timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._sock.poll(_to_ms(remaining), zmq.POLLOUT):
                try:
                    self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    pass  # the pipe filled up between poll and send: wait again
            if remaining == 0.0:
                raise TransportTimeout(f"send to {self.address} did not complete within {timeout_s} s")

    def _close(self) -> None:
        self._sock.close()


class ZmqReceiver(MessageReceiver):
    """PULL socket bound to ``address``; many :class:`ZmqSender`\\ s may connect to it.

    ``address`` accepts ``tcp://host:*`` (a free port is picked) and ``ipc://path``; the actual endpoint
    is :attr:`address`. :meth:`bind` is the usual way to make one on TCP.
    """

    def __init__(
        self,
        secret: bytes,
        address: str = "tcp://127.0.0.1:*",
        *,
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        expected: type | tuple[type, ...] | None = None,
        replay_window: int = DEFAULT_REPLAY_WINDOW,
        context: zmq.Context | None = None,
    ) -> None:
        super().__init__(secret, max_message_bytes, expected, replay_window)
        self._sock = (context or zmq.Context.instance()).socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.LINGER, 0)  # a PULL socket has nothing of ours to deliver
        self._sock.bind(address)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound endpoint, e.g. ``tcp://127.0.0.1:5555`` (senders connect here)."""

    @classmethod
    def bind(cls, secret: bytes, host: str = "127.0.0.1", port: int = 0, **kwargs: object) -> ZmqReceiver:
        """Bind on TCP ``host:port``; ``port=0`` picks a free port (read it back from :attr:`address`)."""
        return cls(secret, f"tcp://{host}:{port if port else '*'}", **kwargs)  # type: ignore[arg-type]

    def _recv_frames(self, timeout_s: float | None) -> Sequence[object] | None:
        try:  # under load a message is waiting: take it without a poll first
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if not self._sock.poll(_to_ms(timeout_s), zmq.POLLIN):
                return None
            # POLLIN guarantees a whole multipart message is ready (delivery is atomic).
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        return [frame.buffer for frame in frames]

    def _close(self) -> None:
        self._sock.close()
