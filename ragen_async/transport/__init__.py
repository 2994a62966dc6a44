"""Data plane: signed, zero-copy delivery of trajectory groups and batch shards.

``codec`` turns protocol messages into ``[signature, header, *frames]`` and back (the driver reads group
headers only and forwards the bytes); ``base`` defines the ``MessageSender`` / ``MessageReceiver`` seam;
``zmq_transport`` (PUSH → PULL over TCP/IPC) and ``inproc`` (a bounded queue, for single-process runs and
tests) implement it. Build endpoints through :func:`make_sender` / :func:`make_receiver` so the kind is a
config value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

from ragen_async.transport.base import (
    DEFAULT_HWM,
    DEFAULT_REPLAY_WINDOW,
    DEFAULT_SEND_TIMEOUT_S,
    MessageReceiver,
    MessageSender,
    ReceiverStats,
    TransportClosed,
    TransportTimeout,
)
from ragen_async.transport.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    REJECT_REASONS,
    CodecError,
    Message,
    decode,
    encode,
)
from ragen_async.transport.inproc import InprocReceiver, InprocSender, make_inproc_pair

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_REPLAY_WINDOW",
    "REJECT_REASONS",
    "TRANSPORT_KINDS",
    "CodecError",
    "InprocReceiver",
    "InprocSender",
    "Message",
    "MessageReceiver",
    "MessageSender",
    "ReceiverStats",
    "TransportClosed",
    "TransportKind",
    "TransportTimeout",
    "WILDCARD_HOSTS",
    "bind_address",
    "decode",
    "encode",
    "make_inproc_pair",
    "make_receiver",
    "make_sender",
    "resolve_bind_host",
]

TransportKind = Literal["zmq", "inproc"]
TRANSPORT_KINDS: tuple[str, ...] = get_args(TransportKind)


WILDCARD_HOSTS: frozenset[str] = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
"""Hosts that make a TCP socket listen on every interface of the machine."""


def _ray_node_ip() -> str:
    import ray  # only the Ray runtime resolves "auto"

    return str(ray.util.get_node_ip_address())


def resolve_bind_host(host: str, node_ip: Callable[[], str] = _ray_node_ip) -> str:
    """The address a receiver binds on for the ``transport.host`` setting ``host``.

    ``auto`` (the default) is this node's IP as Ray reports it: the interface the cluster talks over, so
    the receiver is reachable from the other nodes and from nowhere else. Any other value is used as
    given; listening on every interface (``0.0.0.0``, ``*``, ``::``) happens only when asked for. An
    ``auto`` that would resolve to a wildcard is refused rather than silently exposing the socket.
    """
    if host != "auto":
        return host
    ip = node_ip()
    if ip in WILDCARD_HOSTS:
        raise RuntimeError(f"transport.host=auto resolved to the wildcard address {ip!r}; set transport.host "
                           "to this node's cluster IP (or to 0.0.0.0 to listen on every interface on purpose)")
    return ip


def bind_address(host: str, node_ip: Callable[[], str] = _ray_node_ip) -> str:
    """``tcp://HOST:*`` (a free port) for the ``transport.host`` setting ``host``; see :func:`resolve_bind_host`."""
    return f"tcp://{resolve_bind_host(host, node_ip)}:*"


def _check_kind(kind: str) -> None:
    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"unknown transport kind {kind!r}; valid kinds: {', '.join(TRANSPORT_KINDS)}")


def make_sender(
    kind: TransportKind,
    address: str,
    secret: bytes,
    *,
    hwm: int = DEFAULT_HWM,
    send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S,
) -> MessageSender:
    """A sender to the receiver at ``address`` (``tcp://host:port`` for zmq, ``inproc://name`` for inproc).

    For inproc the queue bound belongs to the receiver, so ``hwm`` is ignored.
    """
    _check_kind(kind)
    if kind == "zmq":
        from ragen_async.transport.zmq_transport import ZmqSender  # zmq is only needed for this kind

        return ZmqSender(address, secret, hwm=hwm, send_timeout_s=send_timeout_s)
    return InprocSender(address, secret, send_timeout_s=send_timeout_s)


def make_receiver(
    kind: TransportKind,
    address: str | None,
    secret: bytes,
    *,
    hwm: int = DEFAULT_HWM,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    expected: type | tuple[type, ...] | None = None,
    replay_window: int = DEFAULT_REPLAY_WINDOW,
) -> MessageReceiver:
    """A receiver bound at ``address``; its actual address (port picked, name generated) is ``.address``.

    zmq: ``address`` defaults to ``tcp://127.0.0.1:*`` (a free port). inproc: ``None`` generates a name.
    ``expected`` restricts the accepted message kinds (others are rejected as ``wrong_type``);
    ``replay_window`` is how many accepted signatures are remembered to refuse replays.
    """
    _check_kind(kind)
    if kind == "zmq":
        from ragen_async.transport.zmq_transport import ZmqReceiver

        return ZmqReceiver(
            secret,
            address or "tcp://127.0.0.1:*",
            hwm=hwm,
            max_message_bytes=max_message_bytes,
            expected=expected,
            replay_window=replay_window,
        )
    return InprocReceiver(secret, address, maxsize=hwm, max_message_bytes=max_message_bytes, expected=expected,
                          replay_window=replay_window)
