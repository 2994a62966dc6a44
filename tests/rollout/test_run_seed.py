"""The run's ``seed`` reaches every training request's sampling seed (runs of a sweep's seed axis differ)."""

from __future__ import annotations

import asyncio

from ragen_async.agent.chat import ChatFormat
from ragen_async.config import load_config
from ragen_async.inference.base import SamplingConfig
from ragen_async.inference.fake_engine import FakeEngine
from ragen_async.rollout.worker import RolloutWorker


class SeedRecordingEngine(FakeEngine):
    def __init__(self, reply_ids: list[int]):
        super().__init__(lambda prompt, rng: list(reply_ids))
        self.seeds: list[int | None] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig):
        self.seeds.append(sampling.seed)
        return await super().generate(prompt_ids, sampling)


def request_seeds(model_path: str, run_seed: int, index: int = 3) -> tuple[int, list[int | None]]:
    cfg = load_config(None, [f"model.path={model_path}", f"seed={run_seed}", "rollout.group_size=4",
                             "agent.max_turns=1", "rollout.envs=[{tag: Bandit, n_groups: 4}]"])
    chat = ChatFormat.from_pretrained(model_path)
    reply = chat.tokenizer.encode("<think> x </think> <answer> A </answer>") + [chat.end_of_turn_id]
    engine = SeedRecordingEngine(reply)
    group = asyncio.run(RolloutWorker(cfg, engine, chat).play_group(index))
    return group.seed, engine.seeds


def test_run_seed_changes_sampling_not_levels(tiny_model_path):
    level0, seeds0 = request_seeds(tiny_model_path, 0)
    level0_again, seeds0_again = request_seeds(tiny_model_path, 0)
    level1, seeds1 = request_seeds(tiny_model_path, 1)
    assert len(seeds0) == 4 and None not in seeds0 and len(set(seeds0)) == 4  # one request per episode, distinct
    assert seeds0 == seeds0_again  # reproducible
    assert level0 == level0_again == level1  # the same level (rollout.seed + index) ...
    assert not set(seeds0) & set(seeds1)  # ... sampled with other seeds
