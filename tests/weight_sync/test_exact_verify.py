"""The byte-exact weight check (``weight_sync/verify.py``): an engine that computes with other values than
the learner published for the version it reports stops the run, named with the tensor and the version,
where the log-prob probe lets it pass (bf16 at lr 1e-6: one step moves a few bf16 values by one ulp)."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ragen_async.weight_sync.probe import check_probe
from ragen_async.weight_sync.verify import (
    WeightSyncMismatch,
    check_served,
    needed_digests,
    published_digests,
    served_entry,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # served_plants, imported by vLLM's worker too
from vllm_harness import get_harness  # noqa: E402  (shared session engine)

pytestmark = pytest.mark.clusters_lane

SEQ = [5, 17, 99, 300, 42, 7, 1, 2, 3, 400, 401, 77, 12, 13, 250, 251]


def _check(named, served, version):
    """What the loop does (orchestrator.verify_weights): the learner digests what the engines report."""
    return check_served(published_digests(named, needed_digests(e for _, e in served)), served, version=version)


# ---- the comparison itself ---------------------------------------------------------------------
def test_identical_tensors_pass_and_count():
    named = [("a.weight", torch.arange(6.0).view(2, 3)), ("b.bias", torch.ones(2))]
    served = [(4, [served_entry(n, n, t) for n, t in named])]
    assert _check(named, served, version=4) == 2


def test_one_ulp_in_one_tensor_is_named_with_engine_and_version():
    w = torch.randn(4, 4).bfloat16()
    moved = w.clone()
    moved.view(torch.int16)[1, 2] += 1  # one bf16 value, one unit in the last place
    named = [("x.weight", moved), ("y.weight", w)]
    healthy = [served_entry("x.weight", "x", moved), served_entry("y.weight", "y", w)]
    stale = [served_entry("x.weight", "x", w), served_entry("y.weight", "y", w)]
    with pytest.raises(WeightSyncMismatch) as info:
        _check(named, [(7, healthy), (7, stale)], version=7)
    msg = str(info.value)
    assert "version 7" in msg and "engine 1: 1 tensor(s) differ: x.weight" in msg and "engine 0" not in msg


def test_missing_extra_and_reshaped_tensors_and_a_wrong_version_are_named():
    named = [("a.weight", torch.zeros(2, 2)), ("b.weight", torch.zeros(3))]
    served = [(1, [served_entry("a.weight", "a", torch.zeros(4)), served_entry("c.weight", "c", torch.zeros(1))]),
              (0, [served_entry(n, n, t) for n, t in named])]
    with pytest.raises(WeightSyncMismatch) as info:
        _check(named, served, version=1)
    msg = str(info.value)
    assert "a.weight: shape [4] served, [2, 2] published" in msg
    assert "c.weight: the engine computes with it, the learner published no such tensor" in msg
    assert "b.weight: published, but the engine's forward reads no such tensor" in msg
    assert "engine 1 reports version 0" in msg


def test_a_kernel_kept_in_another_dtype_is_compared_after_an_exact_cast():
    bias = torch.randn(8).bfloat16()
    served = [(2, [served_entry("q.bias", "qkv_proj", bias.float())])]  # vLLM's small-GEMM kernel: fp32 bias
    assert _check([("q.bias", bias)], served, version=2) == 1
    with pytest.raises(WeightSyncMismatch, match="its float32 values differ"):
        _check([("q.bias", bias)], [(2, [served_entry("q.bias", "qkv_proj", bias.float() + 1e-3)])], version=2)


def test_the_hf_engine_reports_what_its_forward_reads(random_tiny_qwen2):
    import asyncio

    from ragen_async.inference import HFEngine

    engine = HFEngine(random_tiny_qwen2)
    named = [(n, t.clone()) for n, t in engine.model.state_dict().items()]
    assert _check(named, [asyncio.run(engine.served_weights())], version=0) == len(named)
    asyncio.run(engine.load_state_dict([("model.norm.weight", torch.zeros(64))], version=1))
    with pytest.raises(WeightSyncMismatch, match="model.norm.weight"):
        _check(named, [asyncio.run(engine.served_weights())], version=1)


# ---- a real vLLM engine in bf16 with planted faults --------------------------------------------------
def _step(masters: dict[str, torch.Tensor], seed: int, lr: float = 1e-6) -> dict[str, torch.Tensor]:
    """AdamW's first step is about -lr * sign(g): fp32 masters moved so, as the learner would."""
    g = torch.Generator().manual_seed(seed)
    return {n: t - lr * torch.sign(torch.randn(t.shape, generator=g)) for n, t in masters.items()}


def _bf16(masters):
    return {n: t.bfloat16() for n, t in masters.items()}


def _learner_logprobs(path, weights):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQ])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [0.0] + lp.gather(-1, torch.tensor(SEQ[1:])[:, None])[:, 0].tolist()


@pytest.mark.vllm
def test_planted_sync_faults_pass_the_probe_and_are_caught_byte_for_byte(random_tied_qwen2, request):
    h = get_harness(random_tied_qwen2, request, dtype="bfloat16", max_logprobs=20,
                    engine_kwargs={"worker_extension_cls": "served_plants.PlantedExtension"})
    masters = {n: t.float() for n, t in AutoModelForCausalLM.from_pretrained(random_tied_qwen2).state_dict().items()
               if n != "lm_head.weight"}  # the tied head is published as the embedding

    def served():
        return [h.run(h.engine.served_weights())]

    def plant(mode):
        h.run(h.engine.worker_rpc("_plant", mode, what="arming a planted fault"))

    # As loaded from disk (float32 cast to bf16 by vLLM), the engine serves exactly the learner's cast.
    assert _check(_bf16(masters).items(), served(), version=0) == len(masters) + 1  # + the head's read

    # 1. a load that skips one tensor: its layer keeps the previous values
    skipped = "model.layers.0.self_attn.o_proj.weight"
    v1 = _step(masters, seed=1)
    assert (_bf16(v1)[skipped] != _bf16(masters)[skipped]).any(), "the step must move a bf16 value of it"
    plant(f"skip:{skipped}")
    h.restore(_bf16(v1), version=1)
    engine_lp = h.run(h.engine.prompt_logprobs(SEQ))
    check_probe(_learner_logprobs(random_tied_qwen2, _bf16(v1)), [engine_lp], version=1, dtype="bfloat16")  # passes
    with pytest.raises(WeightSyncMismatch) as info:
        _check(_bf16(v1).items(), served(), version=1)
    assert f"engine 0: 1 tensor(s) differ: {skipped}: its bfloat16 values differ" in str(info.value)
    assert "version 1" in str(info.value)

    # 2. a tied head left at old values: the reload lands in the embedding, the head's kernel keeps its own copy
    plant("no_retie")
    v2 = _step(v1, seed=2)
    h.restore(_bf16(v2), version=2)
    engine_lp = h.run(h.engine.prompt_logprobs(SEQ))
    check_probe(_learner_logprobs(random_tied_qwen2, _bf16(v2)), [engine_lp], version=2, dtype="bfloat16")  # passes
    if h.run(h.engine.worker_rpc("_head_packs_its_weight", what="asking how the head computes"))[0]:
        with pytest.raises(WeightSyncMismatch) as info:
            _check(_bf16(v2).items(), served(), version=2)
        assert "model.embed_tokens.weight (as read by lm_head)" in str(info.value)
        assert "1 tensor(s) differ" in str(info.value)  # the embedding itself (the lookup) is right
    else:  # this CPU's head reads the shared Parameter, which the reload wrote: no stale copy exists to catch
        assert _check(_bf16(v2).items(), served(), version=2) == len(masters) + 1

    # healthy again: the same loads without a fault pass
    plant("")
    v3 = _step(v2, seed=3)
    h.restore(_bf16(v3), version=3)
    assert _check(_bf16(v3).items(), served(), version=3) == len(masters) + 1
