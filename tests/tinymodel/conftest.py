"""Fixtures for the tiny-model builder tests: one built model per session.

The shipped ``artifacts/tiny-model`` is used when it holds a complete build of the default config (it is only
read); otherwise (a change to the config or the envs' text not yet rebuilt, which test_shipped.py reports), or
with ``RAGEN_TINYMODEL_FRESH_BUILD=1``, a quick build (few SFT steps, few episodes) goes into a temporary
directory. The builder's own tests (test_build.py) build small models of their own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ragen_async.tinymodel.build import TinyModelConfig, build_tiny_model, cache_key, is_complete_build

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / "artifacts" / "tiny-model"

QUICK = dict(tokenizer_episodes_per_tag=40, sft_steps=12, sft_episodes_per_tag=12, sft_batch_tokens=2048)
"""A quick build with the default architecture (what the session fixture builds when no artifact exists)."""

SMALL = TinyModelConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                        intermediate_size=128, vocab_size=600, tokenizer_episodes_per_tag=20, sft_steps=3,
                        sft_episodes_per_tag=4, sft_batch_tokens=1024, sft_warmup_steps=1)
"""A very small build config for determinism and cache tests."""


def is_default_build(path: Path) -> bool:
    """``path`` holds what ``ragen-async make-model`` builds by default (not an older or quick build)."""
    return is_complete_build(path, cache_key(TinyModelConfig(), 0))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    if os.environ.get("RAGEN_TINYMODEL_FRESH_BUILD") != "1" and is_default_build(ARTIFACT):
        return ARTIFACT
    return build_tiny_model(tmp_path_factory.mktemp("tinymodel") / "tiny-model", seed=0, **QUICK)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
