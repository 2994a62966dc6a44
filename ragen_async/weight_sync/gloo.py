"""Weight broadcast over a dedicated gloo process group (CPU, or any machine without NCCL).

Group: learner rank 0 (the publisher, which also hosts the ``TCPStore``) plus every inference worker:
``num_receivers`` engines of ``workers_per_engine`` workers each (their tensor-parallel size), engine ``i``'s
workers at ranks ``1 + i * workers_per_engine`` onwards (:func:`~ragen_async.weight_sync.groups.group_layout`).
It is a *separate* ``ProcessGroupGloo`` built from its own store, never
the learner's default group nor vLLM's, so it cannot interfere with either.

Protocol of one sync (both sides derive everything from the same manifest)::

    driver:       ticket = publisher.ticket(named_tensors, v)  # {"version", "manifest", "bucket_bytes"}
    concurrently: publisher.publish(named_tensors, v)          # learner rank 0
                  receiver.receive(ticket)                     # next to every engine
    wire:         header (int64[6]: magic, version, #tensors, bucket bytes, manifest crc, #buckets)
                  and one broadcast per buffer (per dtype, <= bucket bytes, as raw bytes): the
                  learner's flat parameter buffers as they are (bucket bytes unbounded), or the
                  tensors packed into buckets when they are not laid out that way

The ticket announces the bucket size the publisher used last (``None`` before its first publish), and
the publish of that version follows it. With the plan known in advance, the header travels inside the
first buffer's broadcast, in a slot of :data:`~ragen_async.weight_sync.wire.SLOT_BYTES` in front of the
data (the learner's flat buffers have one: ``flat_layout``), so a sync is exactly one broadcast per
buffer; a receiver posts every receive at once and checks the header when they are done. Without a plan
(the first sync) the header is broadcast first, alone, and the receiver plans from it.

Every collective has a timeout; a timeout or a dead peer raises :class:`WeightSyncError` /
:class:`WeightSyncTimeout` naming the group. After an error the group is unusable: close it and
build a new one (``connect``/``join`` again, on a fresh port).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ragen_async.weight_sync.base import Ticket, WeightPublisher, WeightReceiver, WeightSyncError, WeightSyncTimeout
from ragen_async.weight_sync.groups import check_room, engine_workers, group_layout
from ragen_async.weight_sync.wire import (
    DEFAULT_BUCKET_BYTES,
    HEADER_BYTES,
    HEADER_LEN,
    SLOT_BYTES,
    Bucket,
    Manifest,
    ManifestEntry,
    ManifestKey,
    adjacent_bytes,
    bucket_nbytes,
    check_header,
    dtype_from_name,
    header_slot,
    make_header,
    make_manifest,
    manifest_key,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)

log = logging.getLogger(__name__)

STORE_PREFIX = "ragen_async/weight_sync"
UNBOUNDED_BUCKET = 1 << 62
"""The bucket size announced when every dtype's tensors lie in one flat buffer: one broadcast per dtype."""


def group_name(master_address: str, master_port: int) -> str:
    return f"tcp://{master_address}:{master_port}"


def _is_timeout(err: BaseException) -> bool:
    msg = str(err).lower()
    return "timed out" in msg or "timeout" in msg


def _wrap(err: BaseException, what: str, timeout_s: float) -> WeightSyncError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if _is_timeout(err):
        return WeightSyncTimeout(f"{what}: timed out after {timeout_s:g} s ({first_line})")
    return WeightSyncError(f"{what}: failed ({first_line})")


def open_group(master_address: str, master_port: int, world_size: int, rank: int, timeout_s: float,
               store: Any = None) -> Any:
    """Join (rank > 0) or create (rank 0, with its master ``store``) the gloo weight group.
    Blocks until all ``world_size`` ranks joined or ``timeout_s`` passed."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = dt.timedelta(seconds=timeout_s)
    where = f"weight group {group_name(master_address, master_port)} (rank {rank}/{world_size})"
    try:
        if store is None:
            store = TCPStore(master_address, master_port, world_size, False, timeout=timeout)
        return ProcessGroupGloo(PrefixStore(STORE_PREFIX, store), rank, world_size, timeout)
    except Exception as err:  # noqa: BLE001 - torch raises several types here
        who = "the publisher (learner rank 0)" if rank else "the engines"
        raise _wrap(err, f"{where}: waiting for {who} to join", timeout_s) from err


def broadcast(pg: Any, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
    """``pg.broadcast(tensor, root=0)`` with a timeout; errors name ``what``."""
    wait(start_broadcast(pg, tensor, timeout_s, what), timeout_s, what)


def start_broadcast(pg: Any, tensor: torch.Tensor, timeout_s: float, what: str) -> Any:
    """Start ``pg.broadcast(tensor, root=0)`` and return its work handle (gloo sends on its own threads)."""
    try:
        return pg.broadcast(tensor, 0)
    except Exception as err:  # noqa: BLE001
        raise _wrap(err, what, timeout_s) from err


def wait(work: Any, timeout_s: float, what: str) -> None:
    """Wait for a started collective; errors name ``what``."""
    try:
        work.wait(dt.timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001
        raise _wrap(err, what, timeout_s) from err


@dataclass
class ReceiveBuffers:
    """What a receiver keeps between syncs: its receive buffers and the named views into them. A sync with
    the same plan reuses both (no model's worth of fresh memory, no re-slicing); the views returned by a
    receive are then only valid until the next one."""

    raws: list[torch.Tensor] = field(default_factory=list)
    named: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    plan: tuple = ()
    """(manifest key, bucket size, slot) the buffers and views were made for."""

    def prepare(self, key: ManifestKey, bucket_bytes: int, slot: bool) -> None:
        """Buffers and views for ``key`` (a :func:`manifest_key`) packed in buckets of ``bucket_bytes``; with
        ``slot`` the first buffer has :data:`SLOT_BYTES` in front, where the header arrives."""
        plan = (key, bucket_bytes, slot)
        if plan == self.plan:
            return
        buckets = plan_buckets(key, bucket_bytes)
        room = [SLOT_BYTES if slot and i == 0 else 0 for i in range(len(buckets))]
        self.raws = [torch.empty(r + bucket_nbytes(b), dtype=torch.uint8) for r, b in zip(room, buckets, strict=True)]
        named: list[Any] = [None] * len(key)
        for bucket, raw, r in zip(buckets, self.raws, room, strict=True):
            for j, item in zip(bucket.indices, unpack_bucket(bucket, raw[r:], key), strict=True):
                named[j] = item
        self.named, self.plan = named, plan

    @property
    def header(self) -> torch.Tensor:
        """The header as it arrived in the first buffer's slot."""
        return self.raws[0][:HEADER_BYTES].view(torch.int64)


def receive_weights(pg: Any, manifest: Sequence[ManifestEntry], version: int, timeout_s: float,
                    where: str, buffers: ReceiveBuffers | None = None,
                    bucket_bytes: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """Receiver side of one sync; returns ``(name, tensor)`` in manifest order (views into the received
    buffers), reusing ``buffers`` (kept by the caller between syncs) when given. ``bucket_bytes`` is the
    ticket's announced plan: every buffer's receive is then started at once and the header, which arrives
    in the first buffer's slot, checked when they are done. Without it, the header comes first, alone."""
    buffers = ReceiveBuffers() if buffers is None else buffers
    key = manifest_key(manifest)
    announced = bucket_bytes is not None
    if bucket_bytes is None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        broadcast(pg, header, timeout_s, f"{where}: header of version {version}")
        bucket_bytes = check_header(header, key, version, where)
    buffers.prepare(key, bucket_bytes, slot=announced)
    works = []
    for i, raw in enumerate(buffers.raws):
        what = f"{where}: buffer {i} of version {version}"
        works.append((start_broadcast(pg, raw, timeout_s, what), what))
    for work, what in works:
        wait(work, timeout_s, what)
    if announced and check_header(buffers.header, key, version, where) != bucket_bytes:
        raise WeightSyncError(f"{where}: the publisher sends buckets of {int(buffers.header[3])} bytes but the "
                              f"ticket announced {bucket_bytes}; the ticket came from another publisher")
    return list(buffers.named)


class GlooBroadcastPublisher(WeightPublisher):
    """Learner rank 0: hosts the group's ``TCPStore`` and broadcasts packed weights.

    ``master_port=0`` picks a free port (read it back from :attr:`master_port`). The group forms in
    :meth:`connect`, which blocks until every receiver joined (so run both concurrently, e.g.
    :func:`connect_engines`); :meth:`publish` connects first if needed.
    """

    def __init__(self, master_address: str, master_port: int, num_receivers: int,
                 timeout_s: float = 60.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, workers_per_engine: int = 1):
        from torch.distributed import TCPStore

        if num_receivers < 1:
            raise ValueError(f"num_receivers must be >= 1 (got {num_receivers})")
        self.master_address = master_address
        self.num_receivers = num_receivers
        """Engines (receivers); each has ``workers_per_engine`` workers in the group."""
        self.workers_per_engine = int(workers_per_engine)
        self.world_size, self._offsets = group_layout(num_receivers, self.workers_per_engine)
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        self._store = TCPStore(master_address, master_port, self.world_size, True,
                               timeout=dt.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self.master_port = int(self._store.port)
        self._pg: Any = None
        self._plan: list[Bucket] | None = None
        self._buffers: list[torch.Tensor | None] = []
        """Packed buffers of the last publish, reused by the next one with the same plan."""
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._slotted: torch.Tensor | None = None
        """The first buffer with the header's slot in front, when it had to be packed (kept for reuse)."""
        self._last_bucket_bytes: int | None = None
        """The bucket size of the last publish: what the next ticket announces."""
        self._announced: tuple[int, int | None, Manifest] | None = None
        """The last ticket's version, and the bucket size and manifest it announced (``publish`` follows them)."""
        self.last_publish_s: float | None = None

    @property
    def name(self) -> str:
        return group_name(self.master_address, self.master_port)

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def connect(self) -> None:
        if self._store is None:
            raise WeightSyncError(f"weight group {self.name}: publisher is closed")
        if self._pg is None:
            self._pg = open_group(self.master_address, self.master_port, self.world_size, 0,
                                  self.timeout_s, store=self._store)

    @staticmethod
    def manifest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """What the receivers must be told (it is in every :meth:`ticket`)."""
        return make_manifest(named_tensors)

    def receiver_info(self, i: int) -> dict:
        return {"address": self.master_address, "port": self.master_port, "world_size": self.world_size,
                "rank": self._offsets[i]}

    def ticket(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: int) -> Ticket:
        manifest = make_manifest(named_tensors)
        self._announced = (int(version), self._last_bucket_bytes, manifest)
        return {"version": int(version), "manifest": manifest, "bucket_bytes": self._last_bucket_bytes}

    @torch.no_grad()  # the tensors may be parameters: packing them must not record autograd history
    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = [(n, t if t.is_cpu else t.to("cpu")) for n, t in named_tensors]
        manifest = make_manifest(named)
        self.connect()
        where = (f"weight broadcast from learner rank 0 at {self.name} to "
                 f"{self.num_receivers} receiver(s)")
        t0 = time.perf_counter()
        tensors = [t for _, t in named]
        # Tensors that lie in one flat buffer per dtype (the learner's layout) go as one broadcast per
        # dtype, sent in place; others are packed into buckets of at most bucket_bytes. The header
        # tells the receivers which plan to follow, unless this version's ticket announced one: then
        # that one is followed (packing into one bucket per dtype if need be), and the header travels in
        # the slot in front of the first buffer (flat_layout leaves one; otherwise that buffer is packed).
        if not manifest:
            raise WeightSyncError(f"{where}: no tensors to publish")
        key = manifest_key(manifest)
        plan = plan_buckets(key, UNBOUNDED_BUCKET)
        in_place = [adjacent_bytes([tensors[i] for i in b.indices], dtype_from_name(b.dtype)) for b in plan]
        natural = UNBOUNDED_BUCKET if all(view is not None for view in in_place) else self.bucket_bytes
        announced, announced_manifest = None, manifest
        if self._announced is not None and self._announced[0] == int(version):
            _, announced, announced_manifest = self._announced
            self._announced = None
        if announced is not None and announced_manifest != manifest:
            # Receivers that know the plan post buffers of the announced sizes before they read the header;
            # gloo aborts the process on a size mismatch, so nothing may be sent that differs from it.
            raise WeightSyncError(f"{where}: the tensors of version {version} do not match the manifest its "
                                  "ticket announced; nothing was sent")
        bucket_bytes = natural if announced is None else announced
        if bucket_bytes != natural or natural != UNBOUNDED_BUCKET:
            plan = plan_buckets(key, bucket_bytes)
            if self._plan != plan:
                self._plan, self._buffers = plan, [None] * len(plan)
        self._header.copy_(make_header(key, version, bucket_bytes))
        in_flight: tuple[Any, str] | None = None
        if announced is None:  # the receivers read the header first, alone
            header_what = f"{where}: header of version {version}"
            in_flight = (start_broadcast(self._pg, self._header, self.timeout_s, header_what), header_what)
        for i, bucket in enumerate(plan):
            slotted = announced is not None and i == 0  # the header travels in the first buffer's slot
            buf = in_place[i] if bucket_bytes == natural == UNBOUNDED_BUCKET else None
            if slotted:
                buf = header_slot(buf) if buf is not None else None
                if buf is None:  # not the learner's flat layout: packed behind room for the header
                    buf = self._slotted = pack_bucket(bucket, tensors, out=self._slotted, slot=True)
                buf[:HEADER_BYTES].view(torch.int64).copy_(self._header)
            elif buf is None:  # pack the next buffer while the previous one is on the wire; buffers are reused
                buf = self._buffers[i] = pack_bucket(bucket, tensors, out=self._buffers[i])
            what = f"{where}: buffer {i} of version {version}"
            work = start_broadcast(self._pg, buf, self.timeout_s, what)
            if in_flight is not None:
                wait(in_flight[0], self.timeout_s, in_flight[1])
            in_flight = (work, what)
        if in_flight is not None:
            wait(in_flight[0], self.timeout_s, in_flight[1])
        self._last_bucket_bytes = natural
        self.last_publish_s = time.perf_counter() - t0

    def close(self) -> None:
        self._pg = None  # gloo pairs close when the group is garbage collected
        self._store = None


class GlooReceiver(WeightReceiver):
    """Receives in the engine's own workers: an engine with worker processes (vLLM) runs the receive in
    its worker extension, which joins the group at ``rank + worker rank`` and loads in place. The engine
    provides ``worker_rpc(method, *args, what=...)`` and ``updating(version)`` (pause, load, stamp the
    version, resume; resumed on failure too)."""

    async def join(self, info: dict | None) -> None:
        assert info is not None
        check_room(int(info["rank"]), engine_workers(self.engine), int(info["world_size"]),
                   f"engine {getattr(self.engine, 'model_path', '?')}: joining the weight group")
        await self.engine.worker_rpc("init_weight_group", info["address"], int(info["port"]),
                                     int(info["world_size"]), int(info["rank"]), self.timeout_s,
                                     what="joining the weight group")

    async def receive(self, ticket: Ticket) -> dict:
        version = int(ticket["version"])
        manifest = [(str(n), str(d), [int(x) for x in s]) for n, d, s in ticket["manifest"]]
        async with self.engine.updating(version):
            stats = await self.engine.worker_rpc("receive_broadcast", manifest, version, ticket.get("bucket_bytes"),
                                                 what=f"receiving version {version}")
        return stats[0]

    async def close(self) -> None:
        await self.engine.worker_rpc("close_weight_group", what="leaving the weight group")


class LocalGlooReceiver(WeightReceiver):
    """Receives in this process (engines without worker processes: transformers, the fake), then
    ``load_state_dict``. Generation goes on during the transfer; the engine swaps weights at the load."""

    def __init__(self, engine: Any, timeout_s: float):
        super().__init__(engine, timeout_s)
        self._pg: Any = None
        self._where = ""

    async def join(self, info: dict | None) -> None:
        assert info is not None
        self._where = (f"weight broadcast from learner rank 0 at {group_name(info['address'], int(info['port']))} "
                       f"(receiver rank {info['rank']})")
        self._pg = await asyncio.to_thread(open_group, info["address"], int(info["port"]), int(info["world_size"]),
                                           int(info["rank"]), self.timeout_s)

    async def receive(self, ticket: Ticket) -> dict:
        if self._pg is None:
            raise WeightSyncError("receive: no weight group; join it first")
        version = int(ticket["version"])
        t0 = time.perf_counter()
        try:
            named = await asyncio.to_thread(receive_weights, self._pg, ticket["manifest"], version,
                                            self.timeout_s, self._where, None, ticket.get("bucket_bytes"))
        except WeightSyncError:
            self._pg = None  # the group is unusable after a failed collective
            raise
        recv_s = time.perf_counter() - t0
        await self.engine.load_state_dict(named, version)
        return {"num_tensors": len(named), "recv_s": recv_s, "version": version}

    async def close(self) -> None:
        self._pg = None


async def connect_engines(publisher: WeightPublisher, receivers: Sequence[WeightReceiver]) -> None:
    """Form the group between ``publisher`` and in-process ``receivers`` (receiver i at its
    :meth:`~GlooBroadcastPublisher.receiver_info` rank)."""
    await asyncio.gather(asyncio.to_thread(publisher.connect),
                         *(r.join(publisher.receiver_info(i)) for i, r in enumerate(receivers)))


async def broadcast_to_engines(publisher: WeightPublisher, receivers: Sequence[WeightReceiver],
                               named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> list[dict]:
    """One sync to in-process receivers: publish and receive concurrently; each receiver's stats."""
    named = list(named_tensors)
    ticket = publisher.ticket(named, version)
    _, *stats = await asyncio.gather(asyncio.to_thread(publisher.publish, named, version),
                                     *(r.receive(ticket) for r in receivers))
    return stats
