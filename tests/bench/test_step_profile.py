"""``bench step``'s raw-engine baseline: the recorded rollout calls are replayed per episode, in order."""

from __future__ import annotations

import asyncio

from ragen_async.bench.step_profile import RecordingEngine, replay
from ragen_async.inference.base import SamplingConfig
from ragen_async.inference.fake_engine import FakeEngine


def test_replay_sends_each_episodes_calls_in_order_and_caps_replies_at_their_recorded_length():
    inner = FakeEngine(lambda prompt, rng: [7] * (3 + len(prompt) % 5))
    engine = RecordingEngine(inner)
    engine.recording = True

    async def episode(e: int) -> None:
        context = [e]
        for _turn in range(3):
            gen = await engine.generate(context, SamplingConfig(max_tokens=4, seed=e))
            context = context + gen.token_ids + [e]

    async def play() -> None:
        await asyncio.gather(*[episode(e) for e in range(5)])

    asyncio.run(play())
    assert len(engine.calls) == 15 and len({c.episode for c in engine.calls}) == 5
    recorded = sum(c.reply_tokens for c in engine.calls)
    assert recorded == sum(min(4, 3 + len(c.prompt_ids) % 5) for c in engine.calls)

    seen: list[list[int]] = []
    replayed = FakeEngine(lambda prompt, rng: seen.append(prompt) or [7] * 50)  # would run long if uncapped
    tokens, wall_s = asyncio.run(replay(replayed, engine.calls))
    assert tokens == recorded and wall_s >= 0
    assert sorted(map(tuple, seen)) == sorted(tuple(c.prompt_ids) for c in engine.calls)
    for e in range(5):  # each episode's prompts in its own order
        own = [p for p in seen if p[0] == e]
        assert own == [c.prompt_ids for c in engine.calls if c.prompt_ids[0] == e]


def test_replay_runs_the_steps_one_after_another_as_the_rollout_did():
    """The rollout plays one step's episodes, then trains: the baseline must not batch several steps'
    episodes together (that would give the raw engine bigger batches than the rollout ever had)."""
    engine = RecordingEngine(FakeEngine(lambda prompt, rng: [7, 7]))
    engine.recording = True

    async def play_step(step: int) -> None:
        engine.step = step
        await asyncio.gather(*[engine.generate([step, e], SamplingConfig(max_tokens=4)) for e in range(3)])

    for step in (1, 2):
        asyncio.run(play_step(step))
    assert [c.step for c in engine.calls] == [1, 1, 1, 2, 2, 2]

    in_flight: list[int] = []
    peak: list[int] = []

    class Probe(FakeEngine):
        async def generate(self, prompt_ids, sampling):
            in_flight.append(prompt_ids[0])
            peak.append(len(in_flight))
            await asyncio.sleep(0.01)
            in_flight.remove(prompt_ids[0])
            return await super().generate(prompt_ids, sampling)

    tokens, _ = asyncio.run(replay(Probe(lambda prompt, rng: [7, 7]), engine.calls))
    assert tokens == 12 and max(peak) == 3  # never more than one step's three episodes at once
