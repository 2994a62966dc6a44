"""Gloo broadcast path without vLLM: receivers are threads of this process using the same
receive code the vLLM worker extension runs."""

import threading
import time

import pytest
import torch

from ragen_async.weight_sync import GlooBroadcastPublisher, WeightSyncError, WeightSyncTimeout
from ragen_async.weight_sync.gloo import UNBOUNDED_BUCKET, open_group, receive_weights

pytestmark = pytest.mark.alone


def named_state():
    g = torch.Generator().manual_seed(1)
    return [("x.weight", torch.randn(64, 32, generator=g)),
            ("y.weight", torch.randn(300, generator=g).to(torch.bfloat16)),
            ("z.bias", torch.randn(5, generator=g))]


class Receiver(threading.Thread):
    def __init__(self, pub, rank, manifest=None, version=None, timeout_s=10.0, versions=None, plans=None):
        super().__init__(daemon=True)
        self.args = (pub.master_address, pub.master_port, pub.world_size, rank, timeout_s)
        self.manifest, self.timeout_s = manifest, timeout_s
        self.versions = [version] if versions is None else versions
        self.plans = {} if plans is None else plans
        """version -> the bucket size its ticket announced (a dict filled in as tickets are made)."""
        self.result = self.error = None
        self.joined = threading.Event()

    def run(self):
        try:
            pg = open_group(*self.args)
            self.joined.set()
            if self.manifest is not None:
                for v in self.versions:
                    while v not in self.plans and len(self.versions) > 1:  # the driver's ticket comes first
                        time.sleep(0.01)
                    self.result = receive_weights(pg, self.manifest, v, self.timeout_s,
                                                  f"receiver rank {self.args[3]}", bucket_bytes=self.plans.get(v))
            else:
                time.sleep(self.timeout_s + 3)  # joined but never receives
        except Exception as err:  # noqa: BLE001
            self.error = err
            self.joined.set()


def test_broadcast_reaches_every_receiver_in_few_collectives():
    named = named_state()
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=2, timeout_s=10, bucket_bytes=4096)
    manifest = pub.manifest(named)
    receivers = [Receiver(pub, r, manifest, version=5) for r in (1, 2)]
    for r in receivers:
        r.start()
    pub.publish(named, version=5)
    for r in receivers:
        r.join(20)
        assert r.error is None
        got = dict(r.result)
        assert [n for n, _ in r.result] == [n for n, _ in named]
        for n, t in named:
            assert got[n].dtype == t.dtype and torch.equal(got[n], t)
    pub.close()


@pytest.mark.slow
def test_receiver_with_wrong_version_gets_a_clear_error():
    named = named_state()
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=3)
    r = Receiver(pub, 1, pub.manifest(named), version=6, timeout_s=3)
    r.start()
    with pytest.raises(WeightSyncError):  # the receiver hangs up after the header
        pub.publish(named, version=5)
    r.join(10)
    assert isinstance(r.error, WeightSyncError) and "expected version 6" in str(r.error)


def test_publisher_errors_when_receivers_never_join():
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=f"tcp://127.0.0.1:{pub.master_port}"):
        pub.publish(named_state(), version=1)
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_publisher_errors_when_a_joined_receiver_never_receives():
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=2)
    r = Receiver(pub, 1, manifest=None, timeout_s=2)
    r.start()
    pub.connect()
    # The header fits the socket buffer; a large buffer cannot be sent without a reader.
    big = [("w", torch.zeros(8 * 1024 * 1024))]
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="weight broadcast from learner rank 0 at tcp://"):
        pub.publish(big, version=1)
    assert time.monotonic() - t0 < 10
    r.join(10)


def test_receiver_errors_when_publisher_never_broadcasts():
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=2)
    r = Receiver(pub, 1, pub.manifest(named_state()), version=1, timeout_s=2)
    r.start()
    pub.connect()  # joined, but never publishes
    t0 = time.monotonic()
    r.join(15)
    assert isinstance(r.error, WeightSyncTimeout), r.error
    assert "timed out after 2 s" in str(r.error) and "header of version 1" in str(r.error)
    assert time.monotonic() - t0 < 10
    pub.close()


def test_flat_tensors_go_in_place_one_broadcast_per_dtype(monkeypatch):
    """Tensors laid out as the learner holds them (flat_layout) are sent as they are: one broadcast per
    dtype of the flat buffer's own memory, whatever bucket_bytes says; receivers get the same values."""
    import ragen_async.weight_sync.gloo as gloo
    from ragen_async.weight_sync.wire import flat_layout

    named = named_state()
    flat = list(zip([n for n, _ in named], flat_layout([t for _, t in named]), strict=True))
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=10, bucket_bytes=4096)
    sent = []
    real = gloo.start_broadcast

    def spy(pg, t, *a):  # what the publisher (this thread; the receiver is another) hands to gloo
        if threading.current_thread() is threading.main_thread():
            sent.append(t)
        return real(pg, t, *a)

    monkeypatch.setattr(gloo, "start_broadcast", spy)
    receiver = Receiver(pub, 1, pub.manifest(flat), version=2)
    receiver.start()
    pub.publish(flat, version=2)
    receiver.join(20)
    assert receiver.error is None
    for (n, t), (m, got) in zip(named, receiver.result, strict=True):
        assert n == m and torch.equal(got, t)
    # the float32 tensors (8 KiB + 20 B) exceed bucket_bytes, yet travel as one buffer: the flat one itself
    assert [b.numel() for b in sent] == [6, 64 * 32 * 4 + 5 * 4, 300 * 2]  # header, float32, bfloat16
    sent.pop(0)
    assert sent[0].data_ptr() == flat[0][1].data_ptr() and sent[1].data_ptr() == flat[1][1].data_ptr()
    # separate tensors are packed into buckets of at most bucket_bytes (a larger tensor alone)
    pub.close()
    sent.clear()
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=10, bucket_bytes=4096)
    receiver = Receiver(pub, 1, pub.manifest(named), version=3)
    receiver.start()
    pub.publish(named, version=3)
    receiver.join(20)
    assert receiver.error is None and len(sent) == 1 + 3
    assert all(torch.equal(got, t) for (_, t), (_, got) in zip(named, receiver.result, strict=True))
    pub.close()


def _flat(named):
    from ragen_async.weight_sync.wire import flat_layout

    return list(zip([n for n, _ in named], flat_layout([t for _, t in named]), strict=True))


def test_the_ticket_announces_the_plan_so_the_header_rides_in_the_first_buffer(monkeypatch):
    """From the second sync on, the ticket carries the bucket size of the publisher's last publish; the
    header then travels in the slot flat_layout leaves in front of the first flat buffer (sent in place,
    one broadcast per dtype, like a raw broadcast of the same bytes), and the receiver starts every
    buffer's receive before waiting on any, checking the header when they are done."""
    import ragen_async.weight_sync.gloo as gloo
    from ragen_async.weight_sync.wire import SLOT_BYTES

    named = _flat(named_state())
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=10)
    calls, sent = [], []
    real_start, real_wait = gloo.start_broadcast, gloo.wait

    def start(pg, t, *a):
        if threading.current_thread() is not threading.main_thread():
            calls.append("start")
        else:
            sent.append(t)
        return real_start(pg, t, *a)

    def wait(work, *a):
        if threading.current_thread() is not threading.main_thread():
            calls.append("wait")
        return real_wait(work, *a)

    monkeypatch.setattr(gloo, "start_broadcast", start)
    monkeypatch.setattr(gloo, "wait", wait)
    plans = {}
    receiver = Receiver(pub, 1, pub.manifest(named), versions=[1, 2], plans=plans)
    receiver.start()
    ticket = pub.ticket(named, 1)
    assert ticket["bucket_bytes"] is None  # nothing published yet: the receiver reads the header first
    plans[1] = ticket["bucket_bytes"]
    pub.publish(named, version=1)
    assert [b.numel() for b in sent] == [6, 64 * 32 * 4 + 5 * 4, 300 * 2]  # header, float32, bfloat16
    sent.clear()
    ticket = pub.ticket(named, 2)
    assert ticket["bucket_bytes"] == UNBOUNDED_BUCKET
    plans[2] = ticket["bucket_bytes"]
    pub.publish(named, version=2)
    receiver.join(20)
    assert receiver.error is None
    assert all(torch.equal(got, t) for (_, t), (_, got) in zip(named, receiver.result, strict=True))
    # version 1: the header's round first, then the float32 and bfloat16 buffers; version 2: both at once
    assert calls == ["start", "wait", "start", "start", "wait", "wait"] + ["start"] * 2 + ["wait"] * 2
    # version 2: two broadcasts, the first the flat float32 buffer itself with its header slot in front
    assert [b.numel() for b in sent] == [SLOT_BYTES + 64 * 32 * 4 + 5 * 4, 300 * 2]
    assert sent[0].data_ptr() + SLOT_BYTES == named[0][1].data_ptr()
    assert sent[0][:48].view(torch.int64)[:2].tolist() == [0x52414745, 2]  # magic, version
    pub.close()


def test_a_publish_follows_its_ticket_even_when_the_layout_changed_since():
    """The ticket announced one buffer per dtype (the last publish was flat); the tensors of this version
    are separate ones: the publisher packs them into one bucket per dtype, as announced."""
    named = named_state()
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=10, bucket_bytes=64)
    plans = {}
    receiver = Receiver(pub, 1, pub.manifest(named), versions=[1, 2, 3], plans=plans)
    receiver.start()
    plans[1] = pub.ticket(named, 1)["bucket_bytes"]
    pub.publish(_flat(named), version=1)
    plans[2] = pub.ticket(named, 2)["bucket_bytes"]
    pub.publish(named, version=2)  # announced unbounded, laid out apart
    plans[3] = pub.ticket(named, 3)["bucket_bytes"]
    assert (plans[2], plans[3]) == (UNBOUNDED_BUCKET, 64)
    pub.publish(_flat(named), version=3)  # announced 64-byte buckets, laid out flat
    receiver.join(20)
    assert receiver.error is None
    assert all(torch.equal(got, t) for (_, t), (_, got) in zip(named, receiver.result, strict=True))
    pub.close()


def test_a_header_in_the_slot_that_does_not_match_the_ticket_is_an_error():
    """The receiver got the bytes of another version than its ticket's (the sizes match): the header in
    the first buffer's slot says so, and nothing is returned to load."""
    named = _flat(named_state())
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=5)
    plans = {1: None}
    receiver = Receiver(pub, 1, pub.manifest(named), versions=[1, 3], plans=plans, timeout_s=5)
    receiver.start()
    pub.publish(named, version=1)
    plans[3] = pub.ticket(named, 2)["bucket_bytes"]  # the receiver holds the plan, with the wrong version
    pub.publish(named, version=2)
    receiver.join(15)
    assert isinstance(receiver.error, WeightSyncError) and "expected version 3" in str(receiver.error)
    pub.close()


@pytest.mark.slow
def test_a_publish_that_does_not_match_its_ticket_sends_nothing():
    """Receivers that know the plan post their buffers before the header arrives (gloo aborts on a size
    mismatch), so the publisher refuses tensors that differ from the manifest the ticket announced."""
    named = _flat(named_state())
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=3)
    plans = {1: None}
    receiver = Receiver(pub, 1, pub.manifest(named), versions=[1, 2], plans=plans, timeout_s=3)
    receiver.start()
    pub.publish(named, version=1)
    plans[2] = pub.ticket(named, 2)["bucket_bytes"]
    with pytest.raises(WeightSyncError, match="do not match the manifest its ticket announced; nothing was sent"):
        pub.publish(named[:2], version=2)
    receiver.join(15)
    assert isinstance(receiver.error, WeightSyncTimeout) and "buffer 0 of version 2" in str(receiver.error)
    pub.close()
