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
_THINK_ANSWER = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_ONLY = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
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
    match = (_THINK_ANSWER if enable_think else _ANSWER_ONLY).search(text)
    if match is None:
        return ParsedReply(actions=(), num_dropped=0, matched=False)
    think = _MARKUP.sub("", match.group(1)).strip() if enable_think else ""
    answer = _MARKUP.sub("", match.group(match.lastindex or 1))
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


def format_reply(actions: list[str], think: str = "") -> str:
    """The reply text a policy that knows the format would write (used by scripted policies and SFT).

    Starts *after* the forced ``<think>`` prefix, which the prompt already contains.
    """
    return f" {think} </think> <answer> {f' {ACTION_SEPARATOR} '.join(actions)} </answer>"
