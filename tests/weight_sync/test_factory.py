"""The factory builds matching pairs; ``auto`` resolves once; the rpc pair loads through the ticket."""

import asyncio

import pytest
import torch

from ragen_async.config import load_config
from ragen_async.inference.fake_engine import FakeEngine
from ragen_async.weight_sync import (
    GlooReceiver,
    LocalGlooReceiver,
    make_publisher,
    make_receiver,
    resolve_backend,
)
from ragen_async.weight_sync.rpc import RpcPublisher, RpcReceiver


def test_auto_resolves_to_nccl_only_when_rollout_workers_have_gpus():
    assert resolve_backend("auto", 0.0) == "gloo" and resolve_backend("auto", 0.5) == "nccl"
    assert resolve_backend("rpc", 1.0) == "rpc"
    with pytest.raises(ValueError, match="unknown weight-sync backend"):
        resolve_backend("carrier-pigeon", 0.0)


def test_gloo_receives_in_the_workers_when_the_engine_has_them():
    class WorkerEngine(FakeEngine):
        async def worker_rpc(self, method, *args, what, kwargs=None):
            return [None]

    assert type(make_receiver("gloo", WorkerEngine(lambda p, r: [1]), 5)) is GlooReceiver
    assert type(make_receiver("gloo", FakeEngine(lambda p, r: [1]), 5)) is LocalGlooReceiver


def test_the_rpc_pair_loads_the_ticket_s_copy_of_the_weights():
    pub = make_publisher("rpc", address="127.0.0.1", num_receivers=1, timeout_s=5)
    assert isinstance(pub, RpcPublisher) and pub.ticket_carries_tensors
    engine = FakeEngine(lambda p, r: [1])
    receiver = make_receiver("rpc", engine, 5)
    assert isinstance(receiver, RpcReceiver)
    w = torch.ones(4)
    ticket = pub.ticket([("w", w)], 3)
    w.add_(1)  # the ticket holds a copy: later training steps do not leak into it
    pub.publish([("w", w)], 3)
    stats = asyncio.run(receiver.receive(ticket))
    assert stats["version"] == 3 and engine.policy_version == 3
    assert torch.equal(engine.loaded[-1][1]["w"], torch.ones(4))


def test_rpc_refuses_a_sharded_learner(tmp_path):
    with pytest.raises(ValueError, match="cannot publish a sharded"):
        load_config(None, ["weight_sync.backend=rpc", "learner.strategy=fsdp", "learner.num_ranks=2",
                           "runtime=ray"])


def test_the_nccl_rendezvous_port_is_held_until_vllm_s_rendezvous_listens_on_it(monkeypatch):
    """The NCCL publisher's port, sent to the engines before vLLM's rendezvous binds it: a port found free and
    let go could be taken by another process in between (the learner group's old race), leaving the engines
    knocking on that process's socket. The factory's publisher holds its port from the start: no other socket
    gets it, vLLM's rendezvous (binding it as vLLM does) listens there, and the hold ends once it does."""
    import errno
    import socket
    import types

    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from ragen_async.weight_sync import LocalReceiversClient

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA checks; nothing runs on a GPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    rendezvous = []

    def trainer_init(info, *, client, source):  # vLLM's rank 0 opens the group's store at the port it is given
        rendezvous.append(StatelessProcessGroup.create(info.master_address, info.master_port, rank=0, world_size=1))
        return types.SimpleNamespace(shutdown=lambda: None)

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
    client = LocalReceiversClient([object()], loop=None)
    pub = make_publisher("nccl", address="127.0.0.1", num_receivers=1, timeout_s=5, client=client)
    try:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", pub.master_port))
        assert taken.value.errno == errno.EADDRINUSE
        pub.connect()
        assert pub._reserved is None  # handed over: the store listens there now
        rendezvous[0].store.set("engines-reach", b"the publisher's store")
        engine_side = torch.distributed.TCPStore("127.0.0.1", pub.master_port, is_master=False)
        assert engine_side.get("engines-reach") == b"the publisher's store"
    finally:
        pub.close()
