"""The worker side of vLLM's NCCL weight update on a CPU engine (the broadcast handed over by a stand-in), on a
model whose head is tied to its embedding: vLLM's start / receive / finish, then the re-tie. Nothing here waits
on a few-second timeout (the ``alone`` tests of ``test_nccl.py`` do), so it runs in the clusters lane beside the
other in-process engines."""

import json
import sys
from pathlib import Path

import pytest
import torch

from ragen_async.weight_sync import NcclReceiver, check_probe

pytestmark = [pytest.mark.clusters_lane, pytest.mark.vllm]


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
