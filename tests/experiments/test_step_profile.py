"""``bench step``'s raw-engine baseline: the recorded rollout calls are replayed per episode, in order."""

from __future__ import annotations

import asyncio

from ragen_async.experiments.step_profile import RecordingEngine, replay
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
