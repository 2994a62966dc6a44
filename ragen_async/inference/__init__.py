"""Inference seam: token ids in, token ids + sampling log-probs + policy versions out.

``FakeEngine`` (scripted, tests), ``HFEngine`` (transformers, slow, exact) and ``VLLMEngine``
(vLLM ``AsyncLLM``) implement :class:`InferenceEngine`. The heavy ones are imported lazily so that
importing this package never pulls in transformers or vLLM.
"""

from ragen_async.inference.base import (
    Generation,
    InferenceEngine,
    SamplingConfig,
    token_versions_or_default,
)
from ragen_async.inference.fake_engine import FakeEngine

__all__ = ["FakeEngine", "Generation", "HFEngine", "InferenceEngine", "SamplingConfig",
           "VLLMEngine", "token_versions_or_default"]


def __getattr__(name: str):
    if name == "HFEngine":
        from ragen_async.inference.hf_engine import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from ragen_async.inference.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
