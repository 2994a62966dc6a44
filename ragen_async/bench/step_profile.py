"""``ragen-async bench step``: where one learner step's time goes, on the local (synchronous) runtime.

Trains a config for a few steps (validation off) and reports the median of every phase: the rollout
(engine generation plus env steps, chat templating and parsing, which the agent interleaves), the
learner's collation, no-grad recomputation (old log-probs / values), advantages and update (forward,
backward, optimizer), and the weight publish to the engine.

The rollout is then compared with the *same engine's raw rate on the same prompts*: every generate
call of the measured steps is recorded (prompt ids, reply length, which step and episode made it) and
replayed straight into the engine with the same concurrency (step by step; within a step its episodes
in parallel, each episode's calls in order) and no agent or env code in between. The ratio rollout tok/s / raw tok/s is the share of the
engine's speed the rollout path keeps. A benchmark measures; nothing here asserts a speed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ragen_async.config import RunConfig
from ragen_async.inference.base import Generation, InferenceEngine, SamplingConfig


@dataclass
class Call:
    step: int
    """The learner step whose rollout made the call."""
    episode: int
    """Identity of the asyncio task (one per episode) that made the call."""
    prompt_ids: list[int]
    sampling: SamplingConfig
    reply_tokens: int


class RecordingEngine(InferenceEngine):
    """Forwards everything to ``inner`` and records every generate call while ``recording``."""

    def __init__(self, inner: InferenceEngine):
        self.inner = inner
        self.recording = False
        self.step = 0
        """The learner step being rolled out (set by the caller)."""
        self.calls: list[Call] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        gen = await self.inner.generate(prompt_ids, sampling)
        if self.recording:
            self.calls.append(Call(self.step, id(asyncio.current_task()), list(prompt_ids), sampling,
                                   len(gen.token_ids)))
        return gen

    async def prompt_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        return await self.inner.prompt_logprobs(token_ids, temperature)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def load_state_dict(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.inner.load_state_dict(named_tensors, version)

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    def shutdown(self) -> None:
        self.inner.shutdown()


async def replay(engine: InferenceEngine, calls: list[Call]) -> tuple[int, float]:
    """Replay ``calls`` into ``engine`` step by step, as the rollout made them: within a step its episodes
    concurrently, each episode's calls in order, each capped at its recorded reply length; the next
    step's episodes start when the last of the previous step ended. Returns (generated tokens, wall
    seconds, summed over the steps)."""
    steps: dict[int, dict[int, list[Call]]] = defaultdict(lambda: defaultdict(list))
    for call in calls:
        steps[call.step][call.episode].append(call)

    async def episode(own: list[Call]) -> int:
        n = 0
        for call in own:
            sampling = SamplingConfig(temperature=call.sampling.temperature, top_p=call.sampling.top_p,
                                      top_k=call.sampling.top_k, max_tokens=call.reply_tokens,
                                      stop_token_ids=call.sampling.stop_token_ids, seed=call.sampling.seed)
            n += len((await engine.generate(call.prompt_ids, sampling)).token_ids)
        return n

    t0 = time.perf_counter()
    tokens = 0
    for step in sorted(steps):
        tokens += sum(await asyncio.gather(*[episode(own) for own in steps[step].values()]))
    return tokens, time.perf_counter() - t0


@dataclass
class StepProfile:
    steps: int
    phases: dict[str, float] = field(default_factory=dict)
    """Median seconds per step of each phase."""
    rollout_tokens_per_s: float = 0.0
    raw_tokens_per_s: float = 0.0
    raw_tokens: int = 0
    rollout_tokens: int = 0


PHASES = (
    ("step", "timing/step_s"),
    ("rollout (engine + env + agent)", "timing/wait_batch_s"),
    ("learner: collate", "timing/learner_collate_s"),
    ("learner: recompute (no grad)", "timing/learner_recompute_s"),
    ("learner: advantages", "timing/learner_advantages_s"),
    ("learner: update (fwd + bwd + optim)", "timing/learner_update_s"),
    ("weight publish", "weight_sync/time_s"),
)


def profile_steps(cfg: RunConfig, steps: int, warmup: int) -> StepProfile:
    """Train ``cfg`` (runtime local) for ``warmup + steps`` steps; profile the last ``steps``."""
    from ragen_async.orchestrator import Trainer
    from ragen_async.records.metrics import MetricsSink
    from ragen_async.records.rundir import RunDir
    from ragen_async.rollout.engines import make_engine
    from ragen_async.runtime import LocalRuntime

    data = cfg.model_dump()
    data.update(runtime="local", total_steps=warmup + steps, time_budget_minutes=None)
    data["validation"]["every"] = 0
    data["logging"]["console"] = False
    data["logging"]["wandb_mode"] = "disabled"
    cfg = RunConfig.model_validate(data)
    torch.set_num_threads(max(1, os.cpu_count() or 1))  # as make_runtime does for the local runtime
    engine = RecordingEngine(make_engine(cfg, seed=cfg.seed))
    records: list[dict[str, float]] = []
    rollout_tokens = 0

    class Sink(MetricsSink):
        def log(self, record) -> None:
            nonlocal rollout_tokens
            if "timing/step_s" not in record:
                return
            step = int(record["learner/step"])
            engine.step = step + 1  # the next rollout is for the next step
            if step == warmup:  # the rollouts of the following steps are recorded and measured
                engine.recording = True
            if step > warmup:
                records.append(dict(record))
                rollout_tokens += int(record.get("rollout/generated_tokens", 0))

    engine.recording = warmup == 0
    runtime = LocalRuntime(cfg, engine=engine)
    trainer = Trainer(cfg, RunDir.create(cfg), Sink(), runtime)

    async def main() -> tuple[int, float]:
        await trainer.run()
        engine.recording = False
        # In the same event loop: the vLLM engine's output handler lives in it.
        return await replay(engine.inner, engine.calls)

    try:
        raw_tokens, raw_s = asyncio.run(main())
    finally:
        trainer.close()
        runtime.close()
    rollout_s = sum(r["timing/wait_batch_s"] for r in records)
    return StepProfile(
        steps=len(records),
        phases={name: statistics.median(r.get(key, 0.0) for r in records) for name, key in PHASES},
        rollout_tokens_per_s=rollout_tokens / max(rollout_s, 1e-9),
        raw_tokens_per_s=raw_tokens / max(raw_s, 1e-9),
        raw_tokens=raw_tokens,
        rollout_tokens=rollout_tokens,
    )


def format_profile(p: StepProfile) -> str:
    step = p.phases["step"]
    lines = ["| phase | median s per step | share of the step |", "|---|---|---|"]
    for name, _ in PHASES:
        lines.append(f"| {name} | {p.phases[name]:.3f} | {p.phases[name] / max(step, 1e-9):.0%} |")
    lines += ["", "| rollout generated tok/s | raw engine tok/s, same prompts | rollout / raw |", "|---|---|---|",
              f"| {p.rollout_tokens_per_s:.0f} ({p.rollout_tokens} tokens) | {p.raw_tokens_per_s:.0f} "
              f"({p.raw_tokens} tokens) | {p.rollout_tokens_per_s / max(p.raw_tokens_per_s, 1e-9):.2f} |"]
    return "\n".join(lines)
