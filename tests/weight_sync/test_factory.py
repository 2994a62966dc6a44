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
