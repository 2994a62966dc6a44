"""The weight plane's wire format, shared by the publisher and the receiving side (the vLLM worker extension
imports it): a *manifest* describing the tensors, a deterministic plan that packs them into few flat buffers, and
a header that lets the receiver detect a publisher/receiver disagreement instead of loading garbage. Pure torch
(no distributed).
"""

from __future__ import annotations

import functools
import json
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ragen_async.weight_sync.base import WeightSyncError

ManifestEntry = tuple[str, str, list[int]]
"""``(name, dtype, shape)``, dtype as ``"float32"``/``"bfloat16"``/…; plain types so it travels
through msgpack/msgspec (vLLM ``collective_rpc``) and Ray unchanged."""
Manifest = list[ManifestEntry]
ManifestKey = tuple[tuple[str, str, tuple[int, ...]], ...]
"""A manifest as nested tuples (:func:`manifest_key`)."""

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
"""Upper bound of one packed buffer (a tensor larger than this travels alone)."""

HEADER_MAGIC = 0x52414745  # "RAGE"
HEADER_LEN = 6
HEADER_BYTES = HEADER_LEN * 8

SLOT_BYTES = 64
"""Room for the header in front of the first buffer when the plan is announced (a multiple of every
dtype's size, and keeps what follows 64-byte aligned). Its last 8 bytes hold :data:`SLOT_MAGIC`."""
SLOT_MAGIC = 0x544F4C5345474152  # "RAGESLOT", little-endian


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def make_manifest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
    """The manifest of ``named_tensors``, in order."""
    return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in named_tensors]


def manifest_key(manifest: Sequence[ManifestEntry]) -> ManifestKey:
    """The manifest as nested tuples: hashable, so the checksum and plan of a manifest that every sync
    repeats are cached. The functions below take either form; a sync converts once and passes the key."""
    if isinstance(manifest, tuple):
        return manifest  # already a key
    return tuple((n, d, tuple(s)) for n, d, s in manifest)


def manifest_crc(manifest: Sequence[ManifestEntry]) -> int:
    """A checksum of the manifest, so both sides can confirm they planned the same transfer."""
    return _crc(manifest_key(manifest))


@functools.lru_cache(maxsize=16)
def _crc(key: tuple) -> int:
    canon = json.dumps([[n, d, [int(x) for x in s]] for n, d, s in key], separators=(",", ":"))
    return zlib.crc32(canon.encode())


@dataclass(frozen=True)
class Bucket:
    """One packed buffer: the manifest indices it holds (in order) and its total element count."""

    dtype: str
    indices: tuple[int, ...]
    numel: int


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def plan_buckets(manifest: Sequence[ManifestEntry], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> list[Bucket]:
    """Group the manifest into per-dtype buffers of at most ``bucket_bytes`` (deterministic: both
    sides compute the same plan from the same manifest). Buckets are emitted when they fill, then
    the partly filled ones in order of their dtype's first appearance."""
    return list(_plan(manifest_key(manifest), int(bucket_bytes)))


@functools.lru_cache(maxsize=16)
def _plan(manifest: tuple, bucket_bytes: int) -> tuple[Bucket, ...]:
    out: list[Bucket] = []
    open_: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
    for i, (_, dt, shape) in enumerate(manifest):
        n = _numel(shape)
        size = n * dtype_from_name(dt).itemsize
        idx, numel = open_.get(dt, ([], 0))
        if idx and (numel * dtype_from_name(dt).itemsize + size) > bucket_bytes:
            out.append(Bucket(dt, tuple(idx), numel))
            idx, numel = [], 0
        idx.append(i)
        open_[dt] = (idx, numel + n)
    for dt, (idx, numel) in open_.items():
        if idx:
            out.append(Bucket(dt, tuple(idx), numel))
    return tuple(out)


def adjacent_bytes(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """A uint8 view of the memory that ``tensors`` fill when they are contiguous CPU tensors of ``dtype``
    lying back to back, in order, in one storage (as :func:`flat_layout` places them); ``None`` otherwise."""
    first = tensors[0]
    if first.device.type != "cpu":
        return None
    end = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != end or t.dtype != dtype or not t.is_contiguous():
            return None
        end += t.nbytes
    storage = first.untyped_storage()
    start = first.data_ptr() - storage.data_ptr()
    if start + end - first.data_ptr() > storage.nbytes():
        return None  # adjacent in memory, but not all inside the first tensor's storage
    # the byte range [first.data_ptr(), end) of that storage, as one tensor (no copy)
    return torch.empty(0, dtype=torch.uint8).set_(storage)[start: start + end - first.data_ptr()]


def flat_layout(tensors: Sequence[torch.Tensor], device: str | torch.device | None = None) -> list[torch.Tensor]:
    """Copies of ``tensors`` laid out in one flat buffer per dtype, in order, on ``device`` (default: each
    tensor's own).
    Whatever is published from such copies is sent without packing: every bucket of
    :func:`plan_buckets` is then one contiguous range (:func:`adjacent_bytes`)."""
    totals: dict[tuple[torch.dtype, torch.device], int] = {}
    where = [torch.device(device) if device is not None else t.device for t in tensors]
    for t, d in zip(tensors, where, strict=True):
        key = (t.dtype, d)
        totals[key] = totals.get(key, 0) + t.numel()
    flats, offsets = {}, {}
    for key, n in totals.items():  # each flat buffer starts with a header slot (see header_slot)
        slot = SLOT_BYTES // key[0].itemsize
        flats[key] = torch.empty(slot + n, dtype=key[0], device=key[1])
        flats[key][:slot].view(torch.int64).copy_(_empty_slot(key[1]))
        offsets[key] = slot
    out = []
    for t, d in zip(tensors, where, strict=True):
        key, n = (t.dtype, d), t.numel()
        view = flats[key][offsets[key]: offsets[key] + n].view(t.shape)
        view.copy_(t.detach())
        offsets[key] += n
        out.append(view)
    return out


def _empty_slot(device: torch.device) -> torch.Tensor:
    slot = torch.zeros(SLOT_BYTES // 8, dtype=torch.int64, device=device)
    slot[-1] = SLOT_MAGIC
    return slot


def header_slot(data: torch.Tensor) -> torch.Tensor | None:
    """``data`` (a uint8 view, as :func:`adjacent_bytes` returns) extended back over the header slot that
    :func:`flat_layout` leaves in front of each flat buffer, so the header can be written there and sent
    with the data in one broadcast; ``None`` when the bytes before ``data`` are not such a slot."""
    storage = data.untyped_storage()
    start = data.data_ptr() - storage.data_ptr() - SLOT_BYTES
    if data.device.type != "cpu" or start < 0 or start % 8:
        return None
    out = torch.empty(0, dtype=torch.uint8).set_(storage)[start: start + SLOT_BYTES + data.numel()]
    return out if int(out[:SLOT_BYTES].view(torch.int64)[-1]) == SLOT_MAGIC else None


def pack_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None,
                slot: bool = False) -> torch.Tensor:
    """Concatenate the bucket's tensors (indexed like the manifest) into one flat CPU buffer,
    returned as raw bytes (uint8) so any dtype travels through any backend. Tensors that already lie
    back to back in one storage (one contiguous tensor, or a :func:`flat_layout`) are returned as a
    byte view of that memory (no copy); otherwise ``out`` (a previous result for the same bucket) is
    reused when given. With ``slot`` the result starts with :data:`SLOT_BYTES` of room for the header:
    a flat layout's own slot (:func:`header_slot`), or the first bytes of the packed copy."""
    dtype = dtype_from_name(bucket.dtype)
    view = adjacent_bytes([tensors[i].detach() for i in bucket.indices], dtype)
    if view is not None and slot:
        view = header_slot(view)
    if view is not None:
        return view
    room = SLOT_BYTES if slot else 0
    nbytes = room + bucket.numel * dtype.itemsize
    reuse = out is not None and out.numel() == nbytes and out.dtype == torch.uint8
    raw = out if reuse else torch.empty(nbytes, dtype=torch.uint8)
    flat = raw[room:].view(dtype)
    off = 0
    for i in bucket.indices:
        t = tensors[i].detach()
        if t.dtype != dtype:
            raise WeightSyncError(f"tensor {i} has dtype {t.dtype}, manifest says {bucket.dtype}")
        n = t.numel()
        flat[off: off + n].copy_(t.reshape(-1))
        off += n
    return raw


def unpack_bucket(bucket: Bucket, raw: torch.Tensor, manifest: Sequence[ManifestEntry]
                  ) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack_bucket`: views into ``raw`` (no copy), named as in the manifest."""
    flat = raw.view(dtype_from_name(bucket.dtype))
    entries = [manifest[i] for i in bucket.indices]
    parts = flat.split([_numel(shape) for _, _, shape in entries])
    return [(name, part.view(tuple(shape))) for (name, _, shape), part in zip(entries, parts, strict=True)]


def bucket_nbytes(bucket: Bucket) -> int:
    return bucket.numel * dtype_from_name(bucket.dtype).itemsize


def make_header(manifest: Sequence[ManifestEntry], version: int, bucket_bytes: int) -> torch.Tensor:
    return torch.tensor([HEADER_MAGIC, version, len(manifest), bucket_bytes, manifest_crc(manifest),
                         len(plan_buckets(manifest, bucket_bytes))], dtype=torch.int64)


def check_header(header: torch.Tensor, manifest: Sequence[ManifestEntry], version: int,
                 where: str) -> int:
    """Validate a received header against what this side expects; returns the bucket size."""
    magic, h_version, n, bucket_bytes, crc, _ = (int(x) for x in header.tolist())
    if magic != HEADER_MAGIC:
        raise WeightSyncError(f"{where}: bad header (magic {magic:#x}); is the peer a "
                              "GlooBroadcastPublisher of this version?")
    if h_version != version or n != len(manifest) or crc != manifest_crc(manifest):
        raise WeightSyncError(
            f"{where}: publisher sends version {h_version} with {n} tensors (manifest crc {crc:#x}) "
            f"but this receiver expected version {version} with {len(manifest)} tensors "
            f"(crc {manifest_crc(manifest):#x}); publisher and receivers must use the same manifest")
    return bucket_bytes
