"""The built model: loads with transformers, small, vLLM-compatible head size, complete build info."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from ragen_async.tinymodel.build import BUILD_INFO, REQUIRED_FILES, is_complete_build


def test_model_loads_and_is_small(tiny_model_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    cfg = model.config
    assert cfg.model_type == "qwen2"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head_dim >= 32
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 10_000_000
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.vocab_size == len(tiny_tokenizer)
    assert cfg.max_position_embeddings >= 4096
    assert next(model.parameters()).dtype == torch.float32
    logits = model(torch.tensor([tiny_tokenizer.encode("<|im_start|>user\nhi")])).logits
    assert logits.shape[-1] == cfg.vocab_size and torch.isfinite(logits).all()


def test_generation_config_and_build_info(tiny_model_dir, tiny_tokenizer):
    gen = GenerationConfig.from_pretrained(str(tiny_model_dir))
    assert gen.eos_token_id == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert gen.pad_token_id == tiny_tokenizer.pad_token_id
    assert is_complete_build(tiny_model_dir)
    assert all((tiny_model_dir / name).is_file() for name in REQUIRED_FILES)
    info = json.loads((tiny_model_dir / BUILD_INFO).read_text())
    for key in ("seed", "config", "parameter_count", "sft_loss", "build_wall_time_s", "cache_key", "format_version"):
        assert key in info
    assert info["sft_loss"]["final"] < info["sft_loss"]["first"]


def test_default_build_has_no_bandit_lean(tiny_model_dir):
    """The default build's exact probability of the high-risk arm is 0.5 +- 0.05 (measured from the
    model's probabilities over its reply forms). A quick test build is not trained enough to say."""
    import pytest

    from ragen_async.tinymodel.report import arm_probabilities
    from tests.tinymodel.conftest import is_default_build

    if not is_default_build(tiny_model_dir):
        pytest.skip("the session's model is a quick build: RAGEN_TINYMODEL_FRESH_BUILD=1, or the shipped one is not "
                    "the current default build (test_shipped.py then fails and says how to rebuild it)")
    arms = arm_probabilities(tiny_model_dir)
    assert 0.45 <= arms["p_best_arm"] <= 0.55, arms
    assert arms["scored_mass"] > 0.8, arms
