"""GPU weight sync through vLLM 0.32's native NCCL weight-transfer API.

Engine side: each :class:`~ragen_async.inference.vllm_engine.VLLMEngine` is created with
``weight_transfer_backend="nccl"`` (``WeightTransferConfig(backend="nccl")``). Trainer side (learner
rank 0): ``WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(...), client=..., source=...)``
once, then ``send_weights()`` per version, which drives ``start_weight_update`` →
``update_weights`` (run concurrently with the trainer's packed NCCL broadcast) →
``finish_weight_update`` on the inference side through ``client``.

The *client* is anything with the four synchronous methods of vLLM's ``VLLMWeightSyncClient``
protocol (``init_weight_transfer_engine(init_info)``, ``start_weight_update()``,
``update_weights(update_info)``, ``finish_weight_update(weight_version=None)``) addressing *all*
engines. :class:`LocalEnginesClient` does it for in-process engines; a Ray deployment wraps its
rollout actors the same way (each actor forwarding to its engine's method of the same name).

Ranks: vLLM's trainer engine tells every worker ``rank_offset=1``, which is right for one vLLM
instance (its workers take ranks 1..W). With several independent engines each must get its own
offset; the client does that (engine i gets ``1 + workers of engines before i``), and
``world_size`` is 1 + the total number of inference workers.

This path needs CUDA and the GPU ``vllm==0.32.0`` wheel; it is not exercised on CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ragen_async.weight_sync.base import WeightPublisher, WeightSyncError


def _make_source() -> Any:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateSource(WeightSource):
        """A ``WeightSource`` over the tensors of the version being published (set per publish)."""

        def __init__(self) -> None:
            self.named: list[tuple[str, torch.Tensor]] = []

        def metadata(self) -> list[Any]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(list(self.named))

    return StateSource()


class _VersionedClient:
    """Wraps the user's client so ``finish_weight_update`` carries the version being published
    (vLLM's trainer engine calls it without one)."""

    def __init__(self, client: Any):
        self.client = client
        self.version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None and self.version is not None:
            weight_version = str(self.version)
        self.client.finish_weight_update(weight_version=weight_version)


class NcclPublisher(WeightPublisher):
    """Learner rank 0 → every engine, over vLLM's NCCL weight-transfer engine.

    Args:
        master_address, master_port: rendezvous (TCPStore) of the transfer group.
        num_receivers: total number of inference *workers* (engines × their TP size).
        client: see module docstring.
        packed: packed broadcast (vLLM default buffers: 1 GiB × 2); must match on both sides, which
            vLLM guarantees by shipping it in the init handshake.
        device: CUDA device the trainer broadcasts from (tensors are moved there if needed).
    """

    def __init__(self, master_address: str, master_port: int, num_receivers: int, client: Any, *,
                 packed: bool = True, device: str | torch.device | None = None):
        if not torch.cuda.is_available():
            raise WeightSyncError("NcclPublisher needs CUDA; on CPU use GlooBroadcastPublisher")
        self.master_address = master_address
        self.master_port = int(master_port)
        self.num_receivers = int(num_receivers)
        self.packed = packed
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda", torch.cuda.current_device())
        self._client = _VersionedClient(client)
        self._source = _make_source()
        self._engine: Any = None

    def connect(self) -> None:
        """Rendezvous with the engines (blocks until every worker joined). ``publish`` calls it."""
        if self._engine is not None:
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        torch.cuda.set_device(self.device)
        info = NCCLTrainerInitInfo(master_address=self.master_address,
                                   master_port=self.master_port,
                                   world_size=self.num_receivers + 1, packed=self.packed, rank=0)
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=self._client,
                                                                 source=self._source)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._source.named = [(n, t.detach().to(self.device).contiguous())
                              for n, t in named_tensors]
        self._client.version = int(version)
        try:
            self.connect()
            self._engine.send_weights()
        finally:
            self._source.named = []

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


class LocalEnginesClient:
    """``VLLMWeightSyncClient`` over in-process :class:`VLLMEngine` s living on ``loop`` (an event
    loop running in another thread; the publisher blocks, so it cannot share the engines' loop)."""

    def __init__(self, engines: Sequence[Any], loop: asyncio.AbstractEventLoop,
                 workers_per_engine: int = 1, timeout_s: float | None = None):
        self.engines = list(engines)
        self.loop = loop
        self.workers_per_engine = workers_per_engine
        self.timeout_s = timeout_s

    def _all(self, make) -> None:
        async def run() -> None:
            await asyncio.gather(*(make(i, e) for i, e in enumerate(self.engines)))

        asyncio.run_coroutine_threadsafe(run(), self.loop).result(self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        base = int(init_info.get("rank_offset", 1))
        self._all(lambda i, e: e.init_weight_transfer_engine(
            {**init_info, "rank_offset": base + i * self.workers_per_engine}))

    def start_weight_update(self) -> None:
        self._all(lambda i, e: e.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        self._all(lambda i, e: e.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda i, e: e.finish_weight_update(weight_version))


class RayActorsClient:
    """``VLLMWeightSyncClient`` over Ray actors that each own one engine and expose the four
    methods under the same names (``RolloutActor``). Calls block on ``ray.get`` (the publisher runs
    on learner rank 0, a synchronous actor)."""

    def __init__(self, actors: Sequence[Any], workers_per_engine: int = 1, timeout_s: float | None = None):
        self.actors = list(actors)
        self.workers_per_engine = workers_per_engine
        self.timeout_s = timeout_s

    def _all(self, make) -> None:
        import ray

        ray.get([make(i, a) for i, a in enumerate(self.actors)], timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        base = int(init_info.get("rank_offset", 1))
        self._all(lambda i, a: a.init_weight_transfer_engine.remote(
            {**init_info, "rank_offset": base + i * self.workers_per_engine}))

    def start_weight_update(self) -> None:
        self._all(lambda i, a: a.start_weight_update.remote())

    def update_weights(self, update_info: Any) -> None:
        self._all(lambda i, a: a.update_weights.remote(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda i, a: a.finish_weight_update.remote(weight_version))
