"""Prompt text for the multi-turn agent protocol (the structure follows RAGEN; the wording is ours).

First user message: the environment's instructions, the symbol legend, the action vocabulary and
budget with the ``||`` separator, then the turn-1 header. Every later turn is one user message
carrying the previous turn's reward and the next turn header. The assistant reply is forced to
start with ``<think>``.
"""

from __future__ import annotations

from ragen_async.agent.parsing import ACTION_SEPARATOR
from ragen_async.envs.base import TextEnv

SYSTEM_PROMPT = "You are a helpful assistant."
THINK_PREFIX = "<think>"


def _turn_header(turn: int, state: str, actions_left: int, max_tokens: int) -> str:
    return (
        f"\nTurn {turn}:\nState:\n{state}\n"
        f"Actions left: {actions_left}. Reply exactly as <think> your reasoning </think> "
        f"<answer> your answer </answer> and nothing else. Keep the reply under {max_tokens} tokens.\n"
    )


def first_user_message(env: TextEnv, state: str, actions_left: int, max_actions_per_episode: int,
                       max_tokens: int) -> str:
    parts = [env.instructions]
    if env.grid_vocab:
        legend = ", ".join(f"{symbol}: {meaning}" for symbol, meaning in env.grid_vocab.items())
        parts.append(f"\nSymbols in the state:\n{legend}")
    if env.action_lookup:
        names = ", ".join(env.action_lookup.values())
        parts.append(
            f"\nActions you can take:\n{names}\n"
            f"You may take up to {max_actions_per_episode} actions in total; separate several actions "
            f"in one answer with \" {ACTION_SEPARATOR} \".\n"
        )
    parts.append(_turn_header(1, state, actions_left, max_tokens))
    return "".join(parts)


def feedback_user_message(reward: float, turn: int, state: str, actions_left: int, max_tokens: int) -> str:
    return f"Reward:\n{reward:g}\n" + _turn_header(turn, state, actions_left, max_tokens)
