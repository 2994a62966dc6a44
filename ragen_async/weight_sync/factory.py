"""Matching publisher/receiver pairs from the config: the one place that knows every weight-sync backend.

``resolve_backend`` turns ``auto`` into a concrete backend once (the driver does it and hands the result to
every process); ``make_publisher`` builds learner rank 0's side, ``make_receiver`` an engine's side.
"""

from __future__ import annotations

from typing import Any, Literal

from ragen_async.weight_sync.base import WeightPublisher, WeightReceiver
from ragen_async.weight_sync.groups import group_layout

Backend = Literal["gloo", "nccl", "rpc"]


def resolve_backend(backend: str, gpus_per_worker: float) -> Backend:
    """``auto`` = NCCL when the rollout workers have GPUs, gloo otherwise."""
    if backend == "auto":
        return "nccl" if gpus_per_worker > 0 else "gloo"
    if backend not in ("gloo", "nccl", "rpc"):
        raise ValueError(f"unknown weight-sync backend {backend!r} (auto, gloo, nccl or rpc)")
    return backend  # type: ignore[return-value]


def make_publisher(backend: Backend, *, address: str, num_receivers: int, timeout_s: float,
                   client: Any = None, workers_per_engine: int = 1) -> WeightPublisher:
    """Learner rank 0's publisher to ``num_receivers`` engines of ``workers_per_engine`` workers each
    (``inference.tensor_parallel_size``: every worker of an engine joins the group, so the group holds
    1 + engines x workers ranks, :func:`~ragen_async.weight_sync.groups.group_layout`). NCCL needs ``client``
    (a :class:`~ragen_async.weight_sync.nccl.ReceiversClient` over the engines' receivers); it is told
    ``workers_per_engine`` here, so the engines' rank offsets and the group's world size agree."""
    if workers_per_engine < 1:
        raise ValueError(f"workers_per_engine must be >= 1 (got {workers_per_engine})")
    if backend == "gloo":
        from ragen_async.weight_sync.gloo import GlooBroadcastPublisher

        return GlooBroadcastPublisher(address, 0, num_receivers, timeout_s=timeout_s,
                                      workers_per_engine=workers_per_engine)
    if backend == "nccl":
        from ragen_async.weight_sync.nccl import NcclPublisher

        if client is None or client.num_engines != num_receivers:
            raise ValueError(f"the NCCL publisher needs a client over the {num_receivers} engines' receivers "
                             f"(got {'none' if client is None else f'one over {client.num_engines}'})")
        client.workers_per_engine = int(workers_per_engine)
        world_size, _ = group_layout(num_receivers, workers_per_engine)
        # Port 0: the publisher takes a port from the kernel and holds it until its rendezvous listens there.
        return NcclPublisher(address, 0, world_size - 1, client, timeout_s=timeout_s)
    from ragen_async.weight_sync.rpc import RpcPublisher

    return RpcPublisher()


def make_receiver(backend: Backend, engine: Any, timeout_s: float) -> WeightReceiver:
    """The receiver for ``engine``. Gloo receives inside the engine's workers when it has any (vLLM:
    ``worker_rpc``), else in this process."""
    if backend == "gloo":
        from ragen_async.weight_sync.gloo import GlooReceiver, LocalGlooReceiver

        return (GlooReceiver if hasattr(engine, "worker_rpc") else LocalGlooReceiver)(engine, timeout_s)
    if backend == "nccl":
        from ragen_async.weight_sync.nccl import NcclReceiver

        return NcclReceiver(engine, timeout_s)
    from ragen_async.weight_sync.rpc import RpcReceiver

    return RpcReceiver(engine, timeout_s)
