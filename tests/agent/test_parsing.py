"""Reply parsing: well-formed, malformed and hostile replies (RAGEN's rules, see agent/parsing.py)."""

import pytest

from ragen_async.agent.parsing import format_reply, parse_reply

SOKOBAN = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}


def test_well_formed_multiple_actions():
    p = parse_reply("<think> push it </think> <answer> Up || left || RIGHT </answer>", SOKOBAN, 5)
    assert p.actions == ("Up", "Left", "Right")  # canonical spelling, order kept
    assert p.num_dropped == 0 and p.format_ok and p.think == "push it"


def test_unknown_actions_are_dropped_and_penalised():
    p = parse_reply("<think>x</think><answer>Up || Jump || || Down</answer>", SOKOBAN, 5)
    assert p.actions == ("Up", "Down")
    assert p.num_dropped == 1  # empty pieces are ignored, unknown ones dropped
    assert not p.format_ok


def test_cap_on_actions_per_turn():
    p = parse_reply("<think>x</think><answer>Up || Up || Up</answer>", SOKOBAN, 2)
    assert p.actions == ("Up", "Up") and p.num_dropped == 1


@pytest.mark.parametrize("text", [
    "",
    "no tags at all",
    "<think>thinking but no answer</think>",
    "<answer>Up</answer>",  # think is required when enable_think
    "<think>a</think> some text <answer>Up</answer>",  # only whitespace may separate them
    "<think>unterminated <answer>Up</answer>",
])
def test_malformed_replies_match_nothing(text):
    p = parse_reply(text, SOKOBAN, 5)
    assert p.actions == () and not p.matched and not p.format_ok


def test_answer_only_mode():
    p = parse_reply("<answer> Down </answer>", SOKOBAN, 5, enable_think=False)
    assert p.actions == ("Down",) and p.format_ok


def test_first_match_wins_on_repeated_tags():
    p = parse_reply("<think>a</think><answer>Up</answer><think>b</think><answer>Down</answer>", SOKOBAN, 5)
    assert p.actions == ("Up",)


def test_nested_tags_take_the_shortest_first_match():
    p = parse_reply("<think><think>a</think></think><answer>Left</answer>", SOKOBAN, 5)
    # The first "</think>" closes the think block; what follows it is not "<answer>", so the regex
    # moves on to the next "</think>" that is followed by an answer.
    assert p.actions == ("Left",)


def test_chat_markup_never_leaks_into_actions():
    p = parse_reply("<think>x</think><answer>Up<|im_end|> || <|im_start|>Down</answer>", SOKOBAN, 5)
    assert p.actions == ("Up", "Down")


def test_unicode_and_huge_replies():
    p = parse_reply("<think>🧊 ♞ √</think><answer>Ｕｐ || Up</answer>", SOKOBAN, 5)
    assert p.actions == ("Up",) and p.num_dropped == 1  # full-width letters are not the action
    huge = "<think>" + "a" * 100_000 + "</think><answer>Down</answer>"
    assert parse_reply(huge, SOKOBAN, 5).actions == ("Down",)
    junk = "<think>" * 20_000  # pathological: many openers, no closer
    assert parse_reply(junk, SOKOBAN, 5).actions == ()


def test_free_form_actions_pass_through_trimmed():
    p = parse_reply("<think>x</think><answer>  (3 + 5) * 2  </answer>", None, 1)
    assert p.actions == ("(3 + 5) * 2",) and p.format_ok


def test_format_reply_round_trips():
    text = "<think>" + format_reply(["Up", "Left"], think="plan")
    p = parse_reply(text, SOKOBAN, 5)
    assert p.actions == ("Up", "Left") and p.think == "plan" and p.format_ok


def test_linear_matcher_agrees_with_the_reference_regex():
    """The hand-written matcher must find exactly what RAGEN's regex finds."""
    import random
    import re

    from ragen_async.agent.parsing import _find_think_answer

    regex = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "Up", "x", "||"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        m = regex.search(text)
        assert _find_think_answer(text) == (m.groups() if m else None), text
