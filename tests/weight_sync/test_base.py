import asyncio
import copy

import pytest
import torch

from ragen_async.inference import FakeEngine
from ragen_async.weight_sync import InProcessPublisher, RingBuffer, WeightSyncError, make_manifest
from ragen_async.weight_sync.wire import check_header, make_header, pack_bucket, plan_buckets, unpack_bucket


def named_mixed():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(4, 3, generator=g)),
        ("b.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("c.bias", torch.randn(7, generator=g)),
        ("d.scalar", torch.tensor(3.5)),
        ("e.weight", torch.randn(2, 2, generator=g).to(torch.bfloat16)),
        ("f.big", torch.randn(100, generator=g)),
    ]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])
def test_pack_unpack_roundtrip_any_bucket_size(bucket_bytes):
    named = named_mixed()
    manifest = make_manifest(named)
    buckets = plan_buckets(manifest, bucket_bytes)
    assert sorted(i for b in buckets for i in b.indices) == list(range(len(named)))
    tensors = [t for _, t in named]
    got = {}
    for b in buckets:
        raw = pack_bucket(b, tensors).clone()  # what a receiver would get
        got.update(unpack_bucket(b, raw, manifest))
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    if bucket_bytes == 1 << 20:
        assert len(buckets) == 2  # one per dtype


def test_header_detects_manifest_or_version_mismatch():
    manifest = make_manifest(named_mixed())
    header = make_header(manifest, version=3, bucket_bytes=128)
    assert check_header(header, manifest, 3, "here") == 128
    with pytest.raises(WeightSyncError, match="expected version 4"):
        check_header(header, manifest, 4, "here")
    other = list(manifest)
    other[0] = ("a.weight", "float32", [3, 4])
    with pytest.raises(WeightSyncError, match="same manifest"):
        check_header(header, other, 3, "here")


def test_ring_buffer_keeps_recent_cpu_copies():
    rb = RingBuffer(2)
    w = torch.zeros(3)
    for v in range(4):
        w += 1
        rb.push(v, {"w": w})
    assert rb.versions() == [2, 3] and rb.latest() == 3 and len(rb) == 2
    assert torch.equal(rb.get(2)["w"], torch.full((3,), 3.0))  # a copy, not the live tensor
    assert 1 not in rb
    with pytest.raises(KeyError, match="holds \\[2, 3\\]"):
        rb.get(1)
    with pytest.raises(ValueError, match="increase"):
        rb.push(3, {"w": w})


def test_in_process_publisher_sync_and_async():
    engines = [FakeEngine(lambda p, rng: [1]), FakeEngine(lambda p, rng: [1])]
    pub = InProcessPublisher(engines)
    pub.publish([("w", torch.ones(2))], version=1)
    assert [e.policy_version for e in engines] == [1, 1]

    async def main():
        await pub.apublish([("w", torch.zeros(2))], version=2)
        with pytest.raises(RuntimeError, match="apublish"):
            pub.publish([("w", torch.zeros(2))], version=3)

    asyncio.run(main())
    assert [e.policy_version for e in engines] == [2, 2]
    assert torch.equal(engines[1].loaded[-1][1]["w"], torch.zeros(2))


def test_flatten_parameters_keeps_values_and_training_and_lays_them_back_to_back():
    from ragen_async.learner.learner import flatten_parameters
    from ragen_async.weight_sync.wire import adjacent_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))
    model[1].weight = model[0].weight  # tied, as a language model's head and embedding
    twin = copy.deepcopy(model)
    flatten_parameters(model)
    params = list(model.parameters())
    assert len(params) == 2 and model[1].weight is model[0].weight
    view = adjacent_bytes([p.data for p in params], torch.float32)
    assert view is not None and view.numel() == sum(p.numel() * 4 for p in params)
    # the same training step gives the same weights, and they stay in place
    for m in (model, twin):
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        m(torch.tensor([[1, 2, 3]])).sum().backward()
        opt.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert adjacent_bytes([p.data for p in model.parameters()], torch.float32).data_ptr() == view.data_ptr()
    # separate tensors, or a gap, or another dtype: not one range
    assert adjacent_bytes([p.data for p in twin.parameters()], torch.float32) is None
    assert adjacent_bytes([params[1].data, params[0].data], torch.float32) is None
    assert adjacent_bytes([p.data for p in params], torch.bfloat16) is None


def test_ring_buffer_copies_are_flat():
    from ragen_async.weight_sync.wire import adjacent_bytes

    ring = RingBuffer(2)
    state = [("a", torch.randn(3, 2)), ("b", torch.randn(4)), ("c", torch.randn(2).bfloat16())]
    ring.push(1, state)
    got = ring.get(1)
    assert all(torch.equal(got[n], t) and got[n].data_ptr() != t.data_ptr() for n, t in state)
    assert adjacent_bytes([got["a"], got["b"]], torch.float32) is not None


def test_only_a_flat_layout_has_a_header_slot_in_front():
    """The publisher writes the header into the bytes before the first buffer only where flat_layout left
    a marked slot; anywhere else those bytes may be another tensor's, so it packs a copy instead."""
    from ragen_async.weight_sync.wire import SLOT_BYTES, adjacent_bytes, flat_layout, header_slot

    tensors = [torch.randn(40), torch.randn(3, 5), torch.randn(6).bfloat16()]
    flat = flat_layout(tensors)
    for dtype, ts in ((torch.float32, flat[:2]), (torch.bfloat16, flat[2:])):
        data = adjacent_bytes(ts, dtype)
        slotted = header_slot(data)
        assert slotted is not None and slotted.numel() == SLOT_BYTES + data.numel()
        assert slotted.data_ptr() + SLOT_BYTES == data.data_ptr()
    # a later tensor of the flat buffer, a tensor of its own, a view into the middle of a plain tensor
    big = torch.zeros(1000)
    for t in (flat[1], tensors[0], big[100:200]):
        assert header_slot(adjacent_bytes([t], t.dtype)) is None
    # with slot=True a bucket of separate tensors is packed behind room for the header
    bucket = plan_buckets(make_manifest([("a", tensors[0]), ("b", tensors[1])]), 1 << 20)[0]
    packed = pack_bucket(bucket, tensors[:2], slot=True)
    assert packed.numel() == SLOT_BYTES + 55 * 4
    assert torch.equal(packed[SLOT_BYTES:].view(torch.float32)[:40], tensors[0])
    assert pack_bucket(bucket, flat[:2], slot=True).data_ptr() + SLOT_BYTES == flat[0].data_ptr()  # in place
