"""The weight group's rank layout: learner rank 0, then every inference worker of every engine."""

from __future__ import annotations

from typing import Any

from ragen_async.weight_sync.base import WeightSyncError


def group_layout(num_engines: int, workers_per_engine: int = 1, first_rank: int = 1) -> tuple[int, list[int]]:
    """The weight group's world size and each engine's first rank. Learner rank 0 publishes; engine ``i``'s
    workers (``workers_per_engine`` of them: its tensor-parallel size) take ranks ``offset_i .. offset_i +
    workers_per_engine - 1``, each at its first rank + its rank inside the engine (as vLLM's NCCL engine and
    the gloo worker extension join)."""
    if num_engines < 1 or workers_per_engine < 1:
        raise ValueError(f"a weight group needs >= 1 engine of >= 1 worker (got {num_engines} engine(s) of "
                         f"{workers_per_engine} worker(s))")
    offsets = [first_rank + i * workers_per_engine for i in range(num_engines)]
    return first_rank + num_engines * workers_per_engine, offsets


def engine_workers(engine: Any) -> int:
    """How many worker processes of ``engine`` join a weight group (its tensor-parallel size; 1 for engines
    without workers)."""
    return int(getattr(engine, "num_workers", 1))


def check_room(first_rank: int, workers: int, world_size: int, where: str) -> None:
    """Refuse to join a group that has no rank for one of this engine's workers (the publisher counted
    fewer workers than the engines have): a clear error instead of a rendezvous that never completes."""
    if first_rank + workers > world_size:
        raise WeightSyncError(
            f"{where}: this engine's {workers} worker(s) would take ranks {first_rank}..{first_rank + workers - 1} "
            f"but the group has world size {world_size}; the publisher must count every engine's "
            "tensor-parallel workers (make_publisher(workers_per_engine=inference.tensor_parallel_size))")
