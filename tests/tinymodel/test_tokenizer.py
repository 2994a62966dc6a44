"""The tiny tokenizer: special and tag tokens, ChatML template, ChatFormat, round trips."""

from __future__ import annotations

import asyncio
import random

import pytest

from ragen_async.agent.chat import ChatFormat
from ragen_async.agent.episode import AgentLimits, ScriptedPolicy, play_episode
from ragen_async.agent.parsing import parse_reply
from ragen_async.envs.registry import make_env_from_tag
from ragen_async.tinymodel.corpus import ENV_TAGS, random_conversation, render_chatml
from ragen_async.tinymodel.tokenizer import SPECIAL_TOKENS, TAG_TOKENS, check_tokenizer, train_tokenizer


def test_special_tokens_are_single_special_ids(tiny_tokenizer):
    for token in SPECIAL_TOKENS:
        ids = tiny_tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
        assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == ""
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    assert tiny_tokenizer.eos_token_id != tiny_tokenizer.pad_token_id


def test_tags_are_single_non_special_tokens_that_survive_decode(tiny_tokenizer):
    for token in TAG_TOKENS:
        ids = tiny_tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
        assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == token
    reply = "<think> Let me try. </think> <answer> Up || Left </answer><|im_end|>"
    ids = tiny_tokenizer.encode(reply, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == reply.replace("<|im_end|>", "")
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == reply


def test_chat_template_renders_chatml(tiny_tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                    "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nV<|im_end|>\n<|im_start|>assistant\n")
    assert text == render_chatml(messages, add_generation_prompt=True)
    no_system = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False)
    assert no_system.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_chat_format_works(tiny_tokenizer):
    chat = ChatFormat(tiny_tokenizer)
    assert chat.end_of_turn_id == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat.reply_prefix_ids == [tiny_tokenizer.convert_tokens_to_ids("<think>")]
    ids = chat.initial_prompt_ids("hello")
    assert chat.decode(ids, skip_special_tokens=False).endswith("hello<|im_end|>\n<|im_start|>assistant\n<think>")
    cont = chat.continuation_ids("Reward:\n1\n")
    assert chat.decode(cont, skip_special_tokens=False) == (
        "\n<|im_start|>user\nReward:\n1\n<|im_end|>\n<|im_start|>assistant\n<think>")


@pytest.mark.parametrize("tag", ENV_TAGS)
def test_episode_tokens_round_trip(tiny_tokenizer, tag):
    """Token ids built incrementally by ChatFormat are exactly the ids of the whole decoded text, and
    replies decode to text the parser accepts."""
    chat = ChatFormat(tiny_tokenizer)
    policy = ScriptedPolicy(chat, "random", actions_per_turn=2, seed=1)
    traj = asyncio.run(play_episode(policy, chat, make_env_from_tag(tag), tag, 3, AgentLimits()))
    text = chat.decode(traj.token_ids.tolist(), skip_special_tokens=False)
    assert chat.encode(text) == traj.token_ids.tolist()
    assert all(turn.format_ok for turn in traj.turns)


@pytest.mark.parametrize("tag", ENV_TAGS)
def test_rendered_conversations_round_trip(tiny_tokenizer, tag):
    messages = random_conversation(make_env_from_tag(tag), 5, random.Random(0), AgentLimits())
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == render_chatml(messages)
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text
    for message in messages[2::2]:  # assistant turns parse
        assert parse_reply(message["content"], None, 5).matched


def test_train_tokenizer_is_deterministic_and_checked():
    texts = [f"<|im_start|>user\nState {i}: ##P_X## √ Up || Down<|im_end|>\n<think> a </think>" for i in range(50)]
    a, b = train_tokenizer(texts, vocab_size=400), train_tokenizer(texts, vocab_size=400)
    assert a.get_vocab() == b.get_vocab()
    check_tokenizer(a)
    assert a.decode(a.encode("Target: 12, nums: [3, 4] √ é", add_special_tokens=False)) == "Target: 12, nums: [3, 4] √ é"


def test_grid_cells_are_one_token_each(tiny_tokenizer):
    """A rendered grid is read cell by cell: one token per cell, one newline token per row, so a cell's
    neighbour above is always width + 1 tokens back."""
    from ragen_async.envs.frozen_lake import FrozenLakeEnv
    from ragen_async.envs.sokoban import SokobanEnv

    for env in (SokobanEnv(), FrozenLakeEnv()):
        env.reset(seed=3)
        grid = env.render() + "\n"
        pieces = [tiny_tokenizer.decode([i]) for i in tiny_tokenizer.encode(grid, add_special_tokens=False)]
        assert pieces == list(grid), pieces
    # Letters of ordinary words are not split.
    assert len(tiny_tokenizer.encode("Put every box on a target", add_special_tokens=False)) < 10
