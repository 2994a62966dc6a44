"""Determinism of builds, the ensure_tiny_model cache, and the SFT data."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from safetensors.torch import load_file

from ragen_async.tinymodel import build as build_mod
from ragen_async.tinymodel.build import (
    BUILD_INFO,
    build_tiny_model,
    cache_key,
    ensure_tiny_model,
    is_complete_build,
    make_sft_examples,
)

from .conftest import SMALL


def _state(path):
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("small") / "a", seed=7, config=SMALL, log=lambda m: None)


def test_same_seed_gives_identical_builds(small_build, tmp_path):
    again = build_tiny_model(tmp_path / "b", seed=7, config=SMALL, log=lambda m: None)
    a, b = _state(small_build), _state(again)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), name
    assert (small_build / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
    info_a, info_b = (json.loads((p / BUILD_INFO).read_text()) for p in (small_build, again))
    assert info_a["sft_loss"] == info_b["sft_loss"]


def test_other_seed_gives_other_weights(small_build, tmp_path):
    other = build_tiny_model(tmp_path / "c", seed=8, config=SMALL, log=lambda m: None)
    a, b = _state(small_build), _state(other)
    assert any(not a[name].equal(b[name]) for name in a)


def test_ensure_reuses_a_complete_build_and_rebuilds_otherwise(small_build, tmp_path, monkeypatch):
    messages: list[str] = []
    target = tmp_path / "m"
    ensure_tiny_model(target, seed=7, config=SMALL, log=messages.append)
    assert is_complete_build(target, cache_key(SMALL, 7))
    assert _state(target)["model.embed_tokens.weight"].equal(_state(small_build)["model.embed_tokens.weight"])

    calls: list[dict] = []
    real_build = build_mod.build_tiny_model

    def counting_build(*args, **kwargs):
        calls.append(kwargs)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(build_mod, "build_tiny_model", counting_build)
    messages.clear()
    assert ensure_tiny_model(target, seed=7, config=SMALL, log=messages.append) == target
    assert calls == [] and "not rebuilding" in messages[-1]

    # a different build config (or seed) rebuilds
    other = dataclasses.replace(SMALL, sft_steps=2)
    ensure_tiny_model(target, seed=7, config=other, log=messages.append)
    assert len(calls) == 1 and is_complete_build(target, cache_key(other, 7))
    info = json.loads((target / BUILD_INFO).read_text())
    assert info["config"]["sft_steps"] == 2
    # the build names its weights: the digest of the safetensors file it wrote
    assert info["weights_sha256"] == hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest()
    ensure_tiny_model(target, seed=8, config=other, log=messages.append)
    assert len(calls) == 2

    # an incomplete build rebuilds
    (target / "model.safetensors").unlink()
    ensure_tiny_model(target, seed=8, config=other, log=messages.append)
    assert len(calls) == 3 and is_complete_build(target, cache_key(other, 8))
    assert "incomplete" in " ".join(messages)


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        ensure_tiny_model(tmp_path, seed=0, config=SMALL, log=lambda m: None)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_config_rejects_small_heads():
    with pytest.raises(ValueError, match=">= 32"):
        dataclasses.replace(SMALL, hidden_size=64, num_attention_heads=4)


def test_sft_examples_mask_exactly_the_valid_replies(tiny_tokenizer):
    from ragen_async.agent.chat import ChatFormat
    from ragen_async.agent.parsing import parse_reply

    chat = ChatFormat(tiny_tokenizer)
    config = dataclasses.replace(SMALL, sft_episodes_per_tag=6, sft_invalid_turn_prob=0.3)
    examples = make_sft_examples(chat, config, seed=0)
    assert {e.tag for e in examples} == set(config.env_tags)
    n_spans = 0
    for e in examples:
        assert len(e.token_ids) == len(e.loss_mask) and any(e.loss_mask)
        # every trained span is one whole well-formed reply ending with the end-of-turn token
        for start, end in build_mod._reply_spans(e.loss_mask):
            n_spans += 1
            assert e.token_ids[end - 1] == chat.end_of_turn_id
            assert e.token_ids[start - 1] == chat.reply_prefix_ids[-1]
            text = chat.reply_prefix + chat.decode(e.token_ids[start:end], skip_special_tokens=False)
            assert parse_reply(text, None, 10).format_ok, text
    assert n_spans > len(examples)


def test_bandit_episodes_come_in_arm_pairs_and_grid_loss_covers_only_feedback_cells(tiny_tokenizer):
    """No lean by construction: every bandit prompt is trained once per arm, in one batch group; the
    perception loss sees only grid cells of the env's feedback, never reply or instruction text."""
    from ragen_async.agent.chat import ChatFormat
    from ragen_async.envs.bandit import BanditEnv
    from ragen_async.tinymodel.tokenizer import GRID_SYMBOLS

    chat = ChatFormat(tiny_tokenizer)
    config = dataclasses.replace(SMALL, sft_episodes_per_tag=6, sft_bandit_episode_factor=2)
    examples = make_sft_examples(chat, config, seed=0)
    groups: dict[int, list] = {}
    for e in examples:
        groups.setdefault(e.group, []).append(e)
    bandit_groups = [g for g in groups.values() if g[0].tag in ("Bandit", "BanditTest")]
    assert len(bandit_groups) == 2 * 6 * 2
    for g in bandit_groups:
        assert len(g) == 2
        prompts = [e.token_ids[:e.loss_mask.index(1)] for e in g]
        assert prompts[0] == prompts[1]
        answers = {chat.decode([t for t, m in zip(e.token_ids, e.loss_mask, strict=True) if m]) for e in g}
        arms = BanditEnv().valid_actions() if g[0].tag == "Bandit" else None
        assert len(answers) == 2, answers
        if arms:  # the default names or renamed ones: each arm exactly once
            assert all(sum(a in ans for ans in answers) <= 1 for a in arms)
    assert all(len(g) == 1 for g in groups.values() if g[0].tag not in ("Bandit", "BanditTest"))
    grid_cells = 0
    for e in examples:
        first = e.loss_mask.index(1)
        for i, (t, g) in enumerate(zip(e.token_ids, e.grid_mask, strict=True)):
            if g:
                grid_cells += 1
                assert i > first and not e.loss_mask[i] and chat.decode([t]) in GRID_SYMBOLS
        if e.tag in ("Bandit", "BanditTest", "Countdown"):
            assert not any(e.grid_mask)
    assert grid_cells > 100


def test_batches_keep_groups_together():
    import random

    examples = [build_mod.SFTExample("t", [0] * (5 + i % 7), [1] * (5 + i % 7), [0] * (5 + i % 7), i // 2)
                for i in range(40)]
    seen = 0
    for batch in build_mod._batches(examples, batch_tokens=60, steps=30, rng=random.Random(0)):
        ids = [e.group for e in batch]
        assert all(ids.count(g) == 2 for g in ids)
        seen += len(batch)
    assert seen > len(examples)
