"""NCCL weight sync through vLLM's native weight-transfer engine. The end-to-end test needs CUDA
and the GPU vllm wheel; the client plumbing is checked everywhere. The worker side of an update (vLLM's
start / receive / finish, then the re-tie) on a CPU vLLM engine is in ``test_nccl_tied.py``."""

import asyncio
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
