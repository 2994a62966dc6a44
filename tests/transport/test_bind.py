"""Which interface the receivers listen on: the cluster's (``transport.host: auto``) unless told otherwise."""

from __future__ import annotations

import ipaddress
import re

import pytest
import zmq

from ragen_async.config import TransportConfig
from ragen_async.transport import WILDCARD_HOSTS, bind_address, resolve_bind_host
from ragen_async.transport.zmq_transport import ZmqReceiver


def _never_called() -> str:
    raise AssertionError("an explicit host must not ask Ray for the node IP")


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def _bound_host(receiver: ZmqReceiver) -> str:
    m = re.fullmatch(r"tcp://(.+):(\d+)", receiver.address)
    assert m, receiver.address
    return m.group(1)


def test_default_is_auto_and_resolves_to_the_node_ip_not_a_wildcard(secret, ctx):
    host = TransportConfig().host
    assert host == "auto"
    assert resolve_bind_host(host, node_ip=lambda: "10.3.4.5") == "10.3.4.5"
    assert bind_address(host, node_ip=lambda: "10.3.4.5") == "tcp://10.3.4.5:*"
    # With Ray's own resolver (no cluster needed): a concrete address of this machine, and the receiver
    # bound there listens on that interface only.
    address = bind_address(host)
    with ZmqReceiver(secret, address, context=ctx) as receiver:
        bound = _bound_host(receiver)
    assert bound not in WILDCARD_HOSTS and not ipaddress.ip_address(bound).is_unspecified, bound


def test_auto_resolving_to_a_wildcard_is_refused():
    for wildcard in ("0.0.0.0", "*", "::"):
        with pytest.raises(RuntimeError, match="wildcard"):
            resolve_bind_host("auto", node_ip=lambda w=wildcard: w)


@pytest.mark.parametrize("host", ["0.0.0.0", "*"])
def test_an_explicit_wildcard_is_honoured(host, secret, ctx):
    assert resolve_bind_host(host, node_ip=_never_called) == host
    with ZmqReceiver(secret, bind_address(host, node_ip=_never_called), context=ctx) as receiver:
        assert _bound_host(receiver) == "0.0.0.0"  # every interface, because it was asked for


def test_an_explicit_address_is_used_as_given(secret, ctx):
    with ZmqReceiver(secret, bind_address("127.0.0.1", node_ip=_never_called), context=ctx) as receiver:
        assert _bound_host(receiver) == "127.0.0.1"
