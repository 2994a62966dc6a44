"""One vLLM engine per test session, shared by the vLLM test modules of tests/inference and
tests/weight_sync (an engine start costs 20-80 s on a 2-core machine).

The engine lives on an event loop running in a background thread, so tests (plain sync functions)
submit coroutines with :meth:`Harness.run`, and blocking publishers can run on the test thread
while the engine receives. Modules that change the weights restore them (``restore``) first.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Any

import pytest
import torch

_HARNESSES: dict[str, Harness] = {}


class Harness:
    def __init__(self, model_path: str, **engine_kwargs: Any):
        from ragen_async.inference.vllm_engine import VLLMEngine

        self.model_path = model_path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="vllm-test-loop")
        self.thread.start()

        async def make():
            return VLLMEngine(model_path, **engine_kwargs)

        self.engine = self.run(make(), timeout=600)

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def restore(self, state: dict[str, torch.Tensor], version: int = 0) -> None:
        self.run(self.engine.load_state_dict(state.items(), version))

    def close(self) -> None:
        async def shutdown():
            self.engine.shutdown()

        self.run(shutdown(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def get_harness(model_path: str, request: pytest.FixtureRequest | None = None, **overrides: Any) -> Harness:
    """The session's engine on ``model_path`` (float32, full-vocabulary prompt log-probs, no stop at
    the model's EOS so that reply lengths are exactly ``max_tokens``; ``overrides``: other engine arguments)."""
    pytest.importorskip("vllm")
    key = f"{model_path} {sorted(overrides.items())}"
    if key not in _HARNESSES:
        for other in list(_HARNESSES.values()):  # never more than one engine at a time
            other.close()
        _HARNESSES.clear()
        kwargs = dict(dtype="float32", max_model_len=512, seed=0, max_logprobs=-1, stop_at_model_eos=False,
                      kv_cache_space_gib=0.1)
        _HARNESSES[key] = Harness(model_path, **{**kwargs, **overrides})
        if request is not None:  # shut down at session end, while pytest's streams are open
            request.session.addfinalizer(_close_all)
    return _HARNESSES[key]


@atexit.register
def _close_all() -> None:
    for h in _HARNESSES.values():
        h.close()
    _HARNESSES.clear()
