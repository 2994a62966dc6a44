"""Decode throughput of one vLLM engine, with or without CUDA graphs (``ragen-async bench decode``).

One :class:`~ragen_async.inference.vllm_engine.VLLMEngine` (the project's, as rollout actors build it, with
``engine_kwargs={"enforce_eager": ...}``) serves ``requests`` concurrent requests of a ``prompt_tokens``-token
random prompt each, sampling exactly ``max_tokens`` tokens (no stop tokens), after a short warm-up; the
figure is sampled tokens per second of wall time. One mode per process: an engine's GPU memory is only
given back when its process ends. The model is a local checkpoint or ``qwen0.5b``: Qwen2.5-0.5B's shape with
random weights (``bench.learner.random_qwen``), written to a temporary directory.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path


def bench_decode(model: str, *, enforce_eager: bool, requests: int = 64, max_tokens: int = 256,
                 prompt_tokens: int = 64, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.5) -> dict:
    import numpy as np

    from ragen_async.inference.base import SamplingConfig
    from ragen_async.inference.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        if model == "qwen0.5b":
            from ragen_async.bench.learner import random_qwen

            model_path = str(random_qwen(Path(tmp) / "qwen", dtype))
        else:
            model_path = model
        rng = np.random.default_rng(0)

        async def run() -> tuple[float, int, float]:
            # Built inside the loop that uses it (VLLMEngine: one event loop).
            t0 = time.perf_counter()
            engine = VLLMEngine(model_path, dtype=dtype, max_model_len=prompt_tokens + max_tokens + 64,
                                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False,
                                stop_at_model_eos=False, engine_kwargs={"enforce_eager": enforce_eager})
            start_s = time.perf_counter() - t0
            try:
                prompts = [rng.integers(0, engine.vocab_size, prompt_tokens).tolist() for _ in range(requests)]
                warm = SamplingConfig(max_tokens=16, seed=0)
                await asyncio.gather(*[engine.generate(p, warm) for p in prompts[:8]])
                t = time.perf_counter()
                gens = await asyncio.gather(*[engine.generate(p, SamplingConfig(max_tokens=max_tokens, seed=i))
                                              for i, p in enumerate(prompts)])
                return start_s, sum(len(g.token_ids) for g in gens), time.perf_counter() - t
            finally:
                engine.shutdown()

        start_s, tokens, seconds = asyncio.run(run())
    return {"model": model, "enforce_eager": enforce_eager, "dtype": dtype, "requests": requests,
            "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "engine_start_s": start_s}
