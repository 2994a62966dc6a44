"""Tensor parallelism > 1: every worker of every engine has its own rank in the weight group.

An engine with ``inference.tensor_parallel_size`` = W has W workers, and each joins the group (vLLM's NCCL
engine at ``rank_offset`` + its rank in the engine, the gloo worker extension at ``rank`` + its rank), so the
group holds 1 + engines x W ranks and engine i starts at 1 + i * W. CPU stand-ins: the arithmetic, the
publishers the factory builds, and the receivers' refusal to join a group counted for fewer workers.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from ragen_async.inference.fake_engine import FakeEngine
from ragen_async.weight_sync import (
    GlooReceiver,
    LocalReceiversClient,
    NcclReceiver,
    WeightSyncError,
    group_layout,
    make_publisher,
)


def worker_ranks(num_engines: int, tp: int) -> tuple[int, list[list[int]]]:
    """World size and each engine's workers' ranks, as the workers compute them from their offset."""
    world_size, offsets = group_layout(num_engines, tp)
    return world_size, [[offset + r for r in range(tp)] for offset in offsets]


@pytest.mark.parametrize(("engines", "tp"), [(1, 1), (4, 1), (1, 2), (2, 2), (3, 4)])
def test_every_worker_of_every_engine_has_its_own_rank_and_the_world_counts_them_all(engines, tp):
    world_size, ranks = worker_ranks(engines, tp)
    assert world_size == 1 + engines * tp
    flat = [r for engine in ranks for r in engine]
    assert sorted(flat) == list(range(1, world_size))  # learner rank 0, then each worker once


def test_group_layout_numbers():
    assert group_layout(3, 2) == (7, [1, 3, 5])
    assert group_layout(2) == (3, [1, 2])
    with pytest.raises(ValueError):
        group_layout(2, 0)


class Recording:
    def __init__(self):
        self.infos = []

    async def join(self, info):
        self.infos.append(info)

    async def receive(self, ticket):
        return {}


@pytest.fixture()
def loop():
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_the_nccl_publisher_the_factory_builds_counts_engines_times_tp(monkeypatch, loop):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA checks; nothing runs on a GPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    receivers = [Recording(), Recording()]
    client = LocalReceiversClient(receivers, loop)  # built as the learner builds it: no TP given
    pub = make_publisher("nccl", address="127.0.0.1", num_receivers=2, timeout_s=5, client=client,
                         workers_per_engine=2)
    world_size = pub.num_receivers + 1  # what NcclPublisher.connect hands vLLM's trainer_init
    assert world_size == 5
    # vLLM's trainer tells the workers rank_offset=1 and the world size; the client gives each engine its own
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": world_size})
    assert [r.infos[0]["rank_offset"] for r in receivers] == [1, 3]
    assert all(r.infos[0]["world_size"] == 5 for r in receivers)


def test_a_client_counting_fewer_workers_than_the_group_says_so(loop):
    client = LocalReceiversClient([Recording(), Recording()], loop, workers_per_engine=1)
    with pytest.raises(WeightSyncError, match="world size 5 but 2 engine.*x 1 worker.*need 3"):
        client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 5})


def test_the_gloo_publisher_the_factory_builds_counts_engines_times_tp():
    pub = make_publisher("gloo", address="127.0.0.1", num_receivers=2, timeout_s=5, workers_per_engine=2)
    try:
        assert pub.world_size == 5
        assert [pub.receiver_info(i)["rank"] for i in range(2)] == [1, 3]
        assert all(pub.receiver_info(i)["world_size"] == 5 for i in range(2))
    finally:
        pub.close()


class TPEngine(FakeEngine):
    """An engine with ``num_workers`` worker processes (a vLLM engine's tensor-parallel size)."""

    model_path = "tp-stand-in"

    def __init__(self, num_workers: int):
        super().__init__(lambda p, r: [1])
        self.num_workers = num_workers
        self.rpcs: list[str] = []

    async def worker_rpc(self, method, *args, what, kwargs=None):
        self.rpcs.append(method)
        return [None] * self.num_workers


def test_receivers_refuse_a_group_without_room_for_all_their_workers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = TPEngine(num_workers=2)
    # counted as one worker per engine: engine 1 (of 2) at rank 2 of a world of 3 has no rank for its 2nd worker
    with pytest.raises(WeightSyncError, match="tensor-parallel"):
        asyncio.run(GlooReceiver(engine, 5).join({"address": "127.0.0.1", "port": 1, "world_size": 3, "rank": 2}))
    with pytest.raises(WeightSyncError, match="tensor-parallel"):
        asyncio.run(NcclReceiver(engine, 5).join({"rank_offset": 2, "world_size": 3}))
    assert engine.rpcs == []  # refused before any worker waits in a rendezvous
    # counted right: they join
    asyncio.run(GlooReceiver(engine, 5).join({"address": "127.0.0.1", "port": 1, "world_size": 5, "rank": 3}))
    asyncio.run(NcclReceiver(engine, 5).join({"rank_offset": 3, "world_size": 5}))
    assert engine.rpcs == ["init_weight_group", "init_weight_transfer_engine"]
