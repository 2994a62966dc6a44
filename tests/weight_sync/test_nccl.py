"""NCCL weight sync through vLLM's native weight-transfer engine. The end-to-end test needs CUDA
and the GPU vllm wheel; the client plumbing is checked everywhere, and the worker side of an update (vLLM's
start / receive / finish, then the re-tie) on a CPU vLLM engine."""

import asyncio
import json
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch

from ragen_async.weight_sync import (
    LocalReceiversClient,
    NcclPublisher,
    NcclReceiver,
    WeightSyncError,
    check_probe,
)

pytestmark = pytest.mark.alone


class RecordingReceiver:
    def __init__(self):
        self.calls = []

    async def join(self, info):
        self.calls.append(("join", info))

    async def receive(self, ticket):
        self.calls.append(("receive", ticket))


def test_local_client_gives_each_engine_its_rank_offset_and_one_receive_with_the_version():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        receivers = [RecordingReceiver(), RecordingReceiver(), RecordingReceiver()]
        client = LocalReceiversClient(receivers, loop, workers_per_engine=2)
        client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 7})
        client.version = 12
        client.start_weight_update()  # vLLM's trainer calls these three in order
        client.update_weights({"names": ["a"]})
        client.finish_weight_update()
        assert [r.calls[0][1]["rank_offset"] for r in receivers] == [1, 3, 5]
        for r in receivers:
            assert r.calls[1:] == [("receive", {"version": 12, "update_info": {"names": ["a"]}})]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_nccl_publisher_refuses_to_start_without_cuda():
    with pytest.raises(WeightSyncError, match="needs CUDA"):
        NcclPublisher("127.0.0.1", 29500, 1, client=None)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs: an NCCL group cannot hold two ranks on the same device")
def test_nccl_publish_then_engine_logprobs_match(random_tiny_qwen2):
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
    import vllm_harness

    vllm_harness._close_all()  # one engine at a time
    torch.backends.cuda.matmul.allow_tf32 = False
    h = vllm_harness.Harness(random_tiny_qwen2, dtype="float32", max_model_len=512,
                             gpu_memory_utilization=0.2, stop_at_model_eos=False,
                             weight_transfer_backend="nccl")
    try:
        # the engine's worker is on cuda:0; the publisher sends from cuda:1
        new = AutoModelForCausalLM.from_pretrained(random_tiny_qwen2, dtype=torch.float32).to("cuda:1")
        torch.manual_seed(3)
        with torch.no_grad():
            for p in new.parameters():
                p.normal_(0.0, 0.2)
        client = LocalReceiversClient([NcclReceiver(h.engine, 120)], h.loop, timeout_s=120)
        pub = NcclPublisher("127.0.0.1", _free_port(), num_receivers=1, client=client, timeout_s=120,
                            device="cuda:1")
        pub.publish(new.state_dict().items(), version=1)
        assert h.engine.policy_version == 1
        seq = [5, 17, 99, 300, 42, 7, 1, 2, 3, 400]
        got = h.run(h.engine.prompt_logprobs(seq))
        with torch.no_grad():
            logits = new(input_ids=torch.tensor([seq], device="cuda:1")).logits[0, :-1].double()
        ref = [0.0] + torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(seq[1:], device="cuda:1")[:, None])[:, 0].tolist()
        assert got == pytest.approx(ref, abs=1e-3)  # float32 GPU kernels, no TF32
        pub.publish(new.state_dict().items(), version=2)  # a second round on the same group
        assert h.engine.policy_version == 2
        pub.close()
    finally:
        h.close()


def moved_storage(h, before: dict) -> dict:
    """The parameters and buffers of the engine's model whose ``[data_ptr, numel]`` differ from ``before``."""
    (now,) = h.run(h.engine.worker_rpc("_ragen_storage", what="reading the model's storage"))
    return {name: now.get(name) for name in before.keys() | now.keys() if before.get(name) != now.get(name)}


class BroadcastStandIn:
    """A vLLM engine whose NCCL broadcast is replaced by handing the tensors over: the receiver's
    ``update_weights`` becomes the stand-in extension's ``standin_receive`` (``model.load_weights`` on them,
    as vLLM's ``NCCLWeightTransferEngine.receive_weights`` does); every other call reaches vLLM as is."""

    def __init__(self, engine, named):
        from ragen_async.inference.vllm_engine import _tensor_item

        self.engine, self.items = engine, [_tensor_item(n, t) for n, t in named]
        self.model_path, self.num_workers = engine.model_path, engine.num_workers
        self.calls: list[str] = []

    async def worker_rpc(self, method, *args, what, kwargs=None):
        self.calls.append(method)
        if method == "update_weights":
            return await self.engine.worker_rpc("standin_receive", self.items, what=what)
        return await self.engine.worker_rpc(method, *args, what=what, kwargs=kwargs)

    def updating(self, version):
        return self.engine.updating(version)


def _logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return [0.0] + torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.mark.vllm
def test_an_nccl_update_of_a_tied_model_serves_the_new_embedding_as_its_output_head(tiny_model_path, monkeypatch):
    """Qwen2.5 ties lm_head to embed_tokens, and the learner publishes only the embedding. vLLM's update
    (start_weight_update, load_weights, finish_weight_update) loads it into the embedding's layer and puts the
    head's old kernel tensors back; on CPU the head's GEMM still holds version 0's weights until the re-tie
    rebuilds it. The NCCL receiver ends in the same re-tie as the gloo path, so the engine's log-probs are the
    learner's (the weight-sync probe's check, at 1e-3)."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    assert json.loads((Path(tiny_model_path) / "config.json").read_text())["tie_word_embeddings"]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
    import nccl_standin
    import vllm_harness

    vllm_harness._close_all()  # one engine at a time
    h = vllm_harness.Harness(tiny_model_path, dtype="float32", max_model_len=512, seed=0, stop_at_model_eos=False,
                             kv_cache_space_gib=0.1, weight_transfer_backend="nccl",
                             engine_kwargs={"worker_extension_cls": nccl_standin.QUALNAME})
    try:
        learner = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        assert learner.lm_head.weight is learner.model.embed_tokens.weight
        probe = np.random.default_rng(0).integers(0, learner.config.vocab_size, size=48).tolist()
        check_probe(_logprobs(learner, probe), [h.run(h.engine.prompt_logprobs(probe))], version=0, tolerance=1e-3)
        torch.manual_seed(0)
        with torch.no_grad():  # a training step's worth of change, large enough to see in the head
            emb = learner.model.embed_tokens.weight
            emb.add_(torch.randn_like(emb) * emb.std())
        named = list(learner.named_parameters())  # what the learner publishes: the tied head is not there
        assert "lm_head.weight" not in dict(named) and "model.embed_tokens.weight" in dict(named)
        storage = moved_storage(h, {})  # every tensor, as {name: [data_ptr, numel]}
        engine = BroadcastStandIn(h.engine, named)
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)  # the receiver's CUDA check
            receiver = NcclReceiver(engine, 60)
        ticket = {"version": 1, "update_info": {"names": [n for n, _ in named]}}
        assert h.run(receiver.receive(ticket)) == {"version": 1} and h.engine.policy_version == 1
        assert engine.calls[:3] == ["start_weight_update", "update_weights", "finish_weight_update"]
        learner_lp, engine_lp = _logprobs(learner, probe), h.run(h.engine.prompt_logprobs(probe))
        assert check_probe(learner_lp, [engine_lp], version=1, tolerance=1e-3) < 1e-3
        # The update and its re-tie left every parameter and buffer in its storage (captured CUDA graphs stay
        # valid; tests/weight_sync/test_gloo_vllm.py checks the gloo path and vLLM's reload on an untied model),
        # and so does vLLM's reload (the gloo path's load) with the re-tie on this tied model.
        assert not moved_storage(h, storage), "the NCCL update"
        with torch.no_grad():
            emb.add_(torch.randn_like(emb) * emb.std())  # `named` holds these tensors
        h.run(h.engine.load_state_dict(named, version=2))
        assert not moved_storage(h, storage), "vLLM's reload"
        learner_lp, engine_lp = _logprobs(learner, probe), h.run(h.engine.prompt_logprobs(probe))
        assert check_probe(learner_lp, [engine_lp], version=2, tolerance=1e-3) < 1e-3
    finally:
        h.close()
