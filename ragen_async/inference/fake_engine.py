"""A deterministic scripted engine for unit tests: no model, replies come from a function."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable

import torch

from ragen_async.inference.base import Generation, InferenceEngine, SamplingConfig

ReplyFn = Callable[[list[int], random.Random], list[int]]


class FakeEngine(InferenceEngine):
    """Replies ``reply_fn(prompt_ids, rng)`` truncated to ``max_tokens`` (and cut after the first stop
    token), every token with log-prob ``logprob``.

    ``rng`` is seeded from the request's seed when it has one (so the reply is reproducible per
    request), else drawn from the engine's own generator seeded with ``seed``. ``load_state_dict``
    records what it got (``loaded``) and bumps the version; ``delay_s`` makes each generate yield
    to the event loop for that long, to exercise concurrency.
    """

    def __init__(self, reply_fn: ReplyFn, logprob: float = -1.0, seed: int = 0,
                 initial_version: int = 0, delay_s: float = 0.0):
        self.reply_fn = reply_fn
        self.logprob = float(logprob)
        self.delay_s = delay_s
        self._rng = random.Random(seed)
        self._version = initial_version
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.loaded: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.num_generate_calls = 0
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self._closed:
            raise RuntimeError("FakeEngine is shut down")
        await self._resumed.wait()
        if self.failure is not None:
            raise RuntimeError(f"FakeEngine serves no more requests: {self.failure}")
        start = self._version
        self.num_generate_calls += 1
        rng = random.Random(sampling.seed) if sampling.seed is not None else random.Random(
            self._rng.getrandbits(64))
        reply = [int(t) for t in self.reply_fn(list(prompt_ids), rng)]
        finish = "length"
        for i, tok in enumerate(reply[: sampling.max_tokens]):
            if tok in sampling.stop_token_ids:
                reply, finish = reply[: i + 1], "stop"
                break
        else:
            if len(reply) < sampling.max_tokens:
                finish = "stop"  # the script ended its reply on its own
            reply = reply[: sampling.max_tokens]
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        await self._resumed.wait()
        end = self._version
        return Generation(token_ids=reply, logprobs=[self.logprob] * len(reply), start_version=start,
                          end_version=end, finish_reason=finish,
                          token_versions=[start] * len(reply))

    async def prompt_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        return [0.0] * len(token_ids)

    async def load_state_dict(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                              version: int) -> None:
        self.loaded.append((version, {n: t.detach().clone() for n, t in named_tensors}))
        self._version = version

    async def served_weights(self) -> tuple[int, list]:
        """For the byte-exact weight check: a fake engine computes with nothing, so it reports exactly the
        tensors of its last load (``loaded``), under the version it serves."""
        from ragen_async.weight_sync.verify import served_entry

        named = self.loaded[-1][1] if self.loaded else {}
        return self._version, [served_entry(n, n.rsplit(".", 1)[0], t) for n, t in named.items()]

    async def pause(self) -> None:
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    def shutdown(self) -> None:
        self._closed = True
