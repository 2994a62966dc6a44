"""Build the configured inference engine (one place that knows every engine's constructor)."""

from __future__ import annotations

from ragen_async.config import RunConfig
from ragen_async.inference.base import InferenceEngine


def make_engine(cfg: RunConfig, *, seed: int = 0, weight_transfer_backend: str | None = None) -> InferenceEngine:
    inf = cfg.inference
    if inf.engine == "vllm":
        from ragen_async.inference.vllm_engine import VLLMEngine

        return VLLMEngine(
            cfg.model.path, dtype=cfg.model.dtype, max_model_len=inf.max_model_len, seed=seed,
            kv_cache_space_gib=inf.kv_cache_gib, gpu_memory_utilization=inf.gpu_memory_utilization,
            kv_on_update=inf.kv_on_update, tensor_parallel_size=inf.tensor_parallel_size,
            enforce_eager=inf.enforce_eager, weight_transfer_backend=weight_transfer_backend)
    if inf.engine == "hf":
        from ragen_async.inference.hf_engine import HFEngine

        return HFEngine(cfg.model.path, dtype=cfg.model.dtype, seed=seed)
    raise ValueError(f"inference.engine={inf.engine!r} cannot be built from a config; "
                     "the fake engine is for tests, which construct it directly")
