import asyncio

import pytest
import torch

from ragen_async.inference import FakeEngine, Generation, SamplingConfig, token_versions_or_default


def echo_random(prompt, rng):
    return [prompt[-1]] + [rng.randrange(100) for _ in range(6)]


def run(coro):
    return asyncio.run(coro)


def test_reply_logprobs_versions_and_finish():
    eng = FakeEngine(echo_random, logprob=-0.5, initial_version=3)
    g = run(eng.generate([1, 2, 9], SamplingConfig(max_tokens=4, seed=1)))
    assert len(g.token_ids) == 4 and g.token_ids[0] == 9
    assert g.logprobs == [-0.5] * 4
    assert (g.start_version, g.end_version, g.finish_reason) == (3, 3, "length")
    assert g.token_versions == [3] * 4
    g = run(eng.generate([1, 2, 9], SamplingConfig(max_tokens=50, seed=1)))
    assert len(g.token_ids) == 7 and g.finish_reason == "stop"


def test_stop_token_cuts_reply_and_is_included():
    eng = FakeEngine(lambda p, rng: [5, 6, 7, 8])
    g = run(eng.generate([1], SamplingConfig(max_tokens=10, stop_token_ids=(7,))))
    assert g.token_ids == [5, 6, 7] and g.finish_reason == "stop"


def test_seeded_requests_are_reproducible_unseeded_draw_from_engine_rng():
    eng = FakeEngine(echo_random, seed=0)
    a = run(eng.generate([1], SamplingConfig(seed=42)))
    b = run(eng.generate([1], SamplingConfig(seed=42)))
    assert a.token_ids == b.token_ids
    c = run(eng.generate([1], SamplingConfig()))
    d = run(eng.generate([1], SamplingConfig()))
    assert c.token_ids != d.token_ids
    e = run(FakeEngine(echo_random, seed=0).generate([1], SamplingConfig()))
    assert e.token_ids == c.token_ids


def test_load_state_dict_bumps_version_and_prompt_logprobs_are_zero():
    eng = FakeEngine(echo_random)
    run(eng.load_state_dict([("w", torch.ones(2))], version=7))
    assert eng.policy_version == 7 and eng.loaded[0][0] == 7
    assert torch.equal(eng.loaded[0][1]["w"], torch.ones(2))
    assert run(eng.prompt_logprobs([1, 2, 3])) == [0.0, 0.0, 0.0]


def test_pause_holds_generation_until_resume_and_it_ends_on_new_version():
    async def main():
        eng = FakeEngine(echo_random, delay_s=0.05)
        await eng.pause()
        task = asyncio.create_task(eng.generate([1], SamplingConfig(seed=0)))
        await asyncio.sleep(0.1)
        assert not task.done()
        await eng.load_state_dict([], version=1)
        await eng.resume()
        return await task

    g = run(main())
    assert g.end_version == 1


def test_sampling_config_and_generation_validation():
    with pytest.raises(ValueError):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError):
        SamplingConfig(top_k=0)
    with pytest.raises(ValueError):
        Generation(token_ids=[1, 2], logprobs=[0.0], start_version=0, end_version=0,
                   finish_reason="stop")
    g = Generation(token_ids=[1, 2], logprobs=[0.0, 0.0], start_version=4, end_version=5,
                   finish_reason="stop")
    assert token_versions_or_default(g) == [4, 4]
