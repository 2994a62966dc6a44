"""Gloo broadcast into a real vLLM engine (its worker extension receives)."""

import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ragen_async.weight_sync import (
    GlooBroadcastPublisher,
    GlooReceiver,
    WeightSyncError,
    WeightSyncTimeout,
    make_receiver,
)
from ragen_async.weight_sync.gloo import broadcast_to_engines, connect_engines

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from vllm_harness import get_harness  # noqa: E402  (shared session engine)

pytestmark = [pytest.mark.alone, pytest.mark.vllm]
SEQ = [5, 17, 99, 300, 42, 7, 1, 2, 3, 400, 401, 77]
ATOL = 1e-4  # float32 both sides; see tests/inference/test_vllm_engine.py


def forward_logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [0.0] + lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def models(random_tiny_qwen2):
    base = AutoModelForCausalLM.from_pretrained(random_tiny_qwen2, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(random_tiny_qwen2, dtype=torch.float32).eval()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.normal_(0.0, 0.2)
    return base, new


@pytest.fixture(scope="module")
def h(random_tiny_qwen2, models, request):
    harness = get_harness(random_tiny_qwen2, request)
    harness.restore(models[0].state_dict(), version=0)
    yield harness
    harness.run(GlooReceiver(harness.engine, 5).close())


@pytest.fixture()
def rcv(h):
    receiver = make_receiver("gloo", h.engine, timeout_s=30)
    assert isinstance(receiver, GlooReceiver)  # vLLM receives in its worker
    return receiver


def test_broadcast_sync_then_logprobs_match(h, rcv, models):
    base, new = models
    eng = h.engine
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=30,
                                 bucket_bytes=64 * 1024)  # several buffers per dtype
    h.run(connect_engines(pub, [rcv]))
    v = eng.policy_version + 1
    (first,) = h.run(broadcast_to_engines(pub, [rcv], new.state_dict().items(), v))
    assert eng.policy_version == v and pub.last_publish_s is not None
    assert h.run(eng.prompt_logprobs(SEQ)) == pytest.approx(forward_logprobs(new, SEQ), abs=ATOL)
    # a second version over the same group, received into the same buffers: vLLM copied the first
    # version out of them (no parameter points into them), so overwriting them changes nothing served
    (second,) = h.run(broadcast_to_engines(pub, [rcv], base.state_dict().items(), v + 1))
    assert first["buffers_reused"] and second["buffers_reused"]
    assert eng.policy_version == v + 1
    assert h.run(eng.prompt_logprobs(SEQ)) == pytest.approx(forward_logprobs(base, SEQ), abs=ATOL)
    pub.close()


def storage(h) -> dict[str, list[int]]:
    """``{name: [data_ptr, numel]}`` of every parameter and buffer of the engine's model."""
    (entries,) = h.run(h.engine.worker_rpc("_ragen_storage", what="reading the model's storage"))
    return entries


def assert_same_storage(before: dict[str, list[int]], after: dict[str, list[int]], what: str) -> None:
    assert sorted(after) == sorted(before), what
    moved = {name: (before[name], after[name]) for name in before if after[name] != before[name]}
    assert not moved, f"{what} moved {len(moved)} tensors to new storage: {moved}"


def test_weight_updates_keep_every_tensor_in_its_storage(h, rcv, models):
    """The condition for captured CUDA graphs to stay valid across weight updates (a graph reads the addresses
    it was captured with): every update copies into the storage the engine started with. Checked for the gloo
    broadcast (``receive_broadcast``) and for vLLM's own reload (``load_state_dict``: ``load_weights_from_bytes``,
    ``reload_weights``), each ending in the re-tie: every parameter and buffer keeps its ``data_ptr`` and size,
    while the log-probs served move to the new weights. On CPU the linear layers' ``weight`` is an empty
    placeholder (vLLM packs their weights into its GEMM handle, rebuilt at every load); the embedding, head,
    norms, q/k/v biases and the rotary cache are the model's own tensors."""
    base, new = models
    eng = h.engine
    before = storage(h)
    held = {name for name, (_, numel) in before.items() if numel}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.self_attn.qkv_proj.bias"} <= held
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=30, bucket_bytes=64 * 1024)
    h.run(connect_engines(pub, [rcv]))
    v = eng.policy_version + 1
    h.run(broadcast_to_engines(pub, [rcv], new.state_dict().items(), v))
    pub.close()
    assert h.run(eng.prompt_logprobs(SEQ)) == pytest.approx(forward_logprobs(new, SEQ), abs=ATOL)
    assert_same_storage(before, storage(h), "the gloo broadcast")
    h.run(eng.load_state_dict(base.state_dict().items(), v + 1))
    assert h.run(eng.prompt_logprobs(SEQ)) == pytest.approx(forward_logprobs(base, SEQ), abs=ATOL)
    assert_same_storage(before, storage(h), "vLLM's reload (load_state_dict)")


def test_engine_waiting_on_a_silent_publisher_errors_within_the_timeout(h, models):
    base, new = models
    eng = h.engine
    rcv = make_receiver("gloo", eng, timeout_s=5)
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=5)
    h.run(connect_engines(pub, [rcv]))
    version_before = eng.policy_version
    ticket = pub.ticket(list(new.state_dict().items()), version_before + 1)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout) as info:
        h.run(rcv.receive(ticket))  # publisher never publishes
    elapsed = time.monotonic() - t0
    assert 4 < elapsed < 15, elapsed
    msg = str(info.value)
    assert f"tcp://127.0.0.1:{pub.master_port}" in msg and "timed out after 5 s" in msg
    assert eng.policy_version == version_before
    pub.close()
    # the engine survives: it still generates, and a fresh group syncs fine
    assert h.run(eng.prompt_logprobs(SEQ)) == pytest.approx(forward_logprobs(base, SEQ), abs=ATOL)
    pub2 = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=30)
    h.run(connect_engines(pub2, [rcv]))
    h.run(broadcast_to_engines(pub2, [rcv], new.state_dict().items(), version_before + 1))
    assert h.run(eng.prompt_logprobs(SEQ)) == pytest.approx(forward_logprobs(new, SEQ), abs=ATOL)
    pub2.close()


def test_engine_joining_a_group_whose_publisher_is_gone_errors(h):
    rcv = make_receiver("gloo", h.engine, timeout_s=3)
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=3)
    info = pub.receiver_info(0)
    port = pub.master_port
    pub.close()  # store gone before anyone joins
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"tcp://127.0.0.1:{port}"):
        h.run(rcv.join(info))
    assert time.monotonic() - t0 < 20


def test_publisher_whose_receiver_never_receives_errors(h, rcv, models):
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=3)
    h.run(connect_engines(pub, [rcv]))  # joined, but the engine is never told to receive
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="weight broadcast from learner rank 0"):
        pub.publish([("w", torch.zeros(8 * 1024 * 1024))], version=99)
    assert time.monotonic() - t0 < 15
    pub.close()
    h.run(rcv.close())
