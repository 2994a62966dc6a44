"""Reply parsing: from a model's text reply to the actions sent to the environment.

RAGEN's rules: the reply must contain ``<think>…</think>`` followed by ``<answer>…</answer>`` (first
match wins); the answer is split on ``||``; each piece is trimmed and looked up case-insensitively in
the environment's action vocabulary; unknown pieces are dropped; at most ``max_actions`` are kept.
A turn with a dropped action or no action at all earns the format penalty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ACTION_SEPARATOR = "||"
_LEADING_WS = re.compile(r"\s*")
# Markup that must never leak into an action or a thought (chat-template tokens and our own tags).
_MARKUP = re.compile(r"</?think>|</?answer>|<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>")


@dataclass(frozen=True, slots=True)
class ParsedReply:
    actions: tuple[str, ...]
    """Valid actions in canonical spelling, in reply order, capped at ``max_actions``."""
    num_dropped: int
    """Pieces of the answer that were unknown, empty-after-markup or beyond the cap."""
    matched: bool
    """The reply had the required tag structure."""
    think: str = ""

    @property
    def format_ok(self) -> bool:
        return self.matched and self.num_dropped == 0 and len(self.actions) > 0


def parse_reply(
    text: str,
    action_lookup: dict[int, str] | None,
    max_actions: int,
    *,
    enable_think: bool = True,
) -> ParsedReply:
    """Parse ``text`` (the full reply, including the forced ``<think>`` prefix) into actions.

    ``action_lookup`` maps ids to canonical names; ``None`` means free-form actions (Countdown),
    which pass through trimmed. ``max_actions`` caps the actions kept (the rest count as dropped).
    """
    found = _find_think_answer(text) if enable_think else _find_answer(text, 0)
    if found is None:
        return ParsedReply(actions=(), num_dropped=0, matched=False)
    think, answer = found
    think = _MARKUP.sub("", think).strip()
    answer = _MARKUP.sub("", answer)
    pieces = [p.strip() for p in answer.split(ACTION_SEPARATOR)]
    pieces = [p for p in pieces if p]

    canonical = {name.lower(): name for name in action_lookup.values()} if action_lookup else None
    actions: list[str] = []
    dropped = 0
    for piece in pieces:
        action = piece if canonical is None else canonical.get(piece.lower())
        if action is None or len(actions) >= max_actions:
            dropped += 1
        else:
            actions.append(action)
    return ParsedReply(actions=tuple(actions), num_dropped=dropped, matched=True, think=think)


def _find_answer(text: str, start: int) -> tuple[str, str] | None:
    """``<answer>(.*?)</answer>`` searched from ``start``: ("", answer) or None."""
    a = text.find("<answer>", start)
    if a < 0:
        return None
    b = text.find("</answer>", a + len("<answer>"))
    return None if b < 0 else ("", text[a + len("<answer>") : b])


def _find_think_answer(text: str) -> tuple[str, str] | None:
    """The first match of ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (DOTALL), found in linear
    time: the equivalent regex backtracks quadratically on hostile input (thousands of ``<think>``).

    Only the first ``<think>`` can start the first match: any match starting later also matches from
    it. The lazy think group ends at the first ``</think>`` that is followed (after whitespace) by
    ``<answer>`` with a ``</answer>`` somewhere after it.
    """
    start = text.find("<think>")
    if start < 0:
        return None
    body = start + len("<think>")
    end = text.find("</think>", body)
    while end >= 0:
        after = _LEADING_WS.match(text, end + len("</think>")).end()
        if text.startswith("<answer>", after):
            close = text.find("</answer>", after + len("<answer>"))
            if close < 0:
                return None  # no later </think> can have a closed answer either
            return text[body:end], text[after + len("<answer>") : close]
        end = text.find("</think>", end + 1)
    return None


def format_reply(actions: list[str], think: str = "") -> str:
    """The reply text a policy that knows the format would write (used by scripted policies and SFT).

    Starts *after* the forced ``<think>`` prefix, which the prompt already contains.
    """
    return f" {think} </think> <answer> {f' {ACTION_SEPARATOR} '.join(actions)} </answer>"
