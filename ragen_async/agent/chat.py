"""Chat formatting in token space.

The context of an episode is built once and only ever appended to: the first prompt is rendered by
the tokenizer's own chat template, each reply is appended as the exact token ids the engine sampled,
and each environment message is rendered by the same template *as a continuation* and tokenised on
its own. Earlier text is never re-tokenised, so the token ids the learner trains on are exactly the
ids the engine conditioned on and produced.

The continuation is derived from the template itself (render a conversation with a placeholder
assistant turn and cut after the placeholder), so the same code serves our tiny model's ChatML
template and real Qwen2.5 checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen_async.agent.prompts import SYSTEM_PROMPT, THINK_PREFIX

_PLACEHOLDER = "\u2063PLACEHOLDER\u2063"


@dataclass
class ChatFormat:
    """Turns chat messages into token ids for one tokenizer (a transformers tokenizer)."""

    tokenizer: Any
    enable_think: bool = True

    def __post_init__(self) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; ragen_async needs a ChatML-style template")
        rendered = self.tokenizer.apply_chat_template(
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": _PLACEHOLDER},
                {"role": "user", "content": _PLACEHOLDER},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        after_reply = rendered.split(_PLACEHOLDER)[1]
        # after_reply = <end of assistant turn> + <user turn opening>; the user turn closes after the
        # second placeholder and the generation prompt follows.
        self.end_of_turn_text, self._user_open = self._split_end_of_turn(after_reply)
        self._user_close_and_generation = rendered.split(_PLACEHOLDER)[2]
        eot_ids = self.encode(self.end_of_turn_text)
        if len(eot_ids) != 1:
            raise ValueError(f"end-of-turn marker {self.end_of_turn_text!r} must be a single token, got {eot_ids}")
        self.end_of_turn_id = eot_ids[0]
        self.reply_prefix = THINK_PREFIX if self.enable_think else "<answer>"
        self.reply_prefix_ids = self.encode(self.reply_prefix)

    def _split_end_of_turn(self, after_reply: str) -> tuple[str, str]:
        eos = self.tokenizer.eos_token
        candidates = [t for t in ("<|im_end|>", eos) if t and after_reply.startswith(t)]
        if not candidates:
            raise ValueError(f"cannot find the end-of-turn token at the start of {after_reply[:40]!r}")
        return candidates[0], after_reply[len(candidates[0]) :]

    @classmethod
    def from_pretrained(cls, path: str | Path, enable_think: bool = True) -> ChatFormat:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), enable_think=enable_think)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def initial_prompt_ids(self, user_message: str) -> list[int]:
        """System + first user message + generation prompt + the forced reply prefix."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_message}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return self.encode(text) + self.reply_prefix_ids

    def continuation_ids(self, user_message: str) -> list[int]:
        """Tokens that follow a finished assistant reply (which ends with the end-of-turn token):
        the next user message, the generation prompt and the forced reply prefix."""
        return self.encode(self._user_open + user_message + self._user_close_and_generation) + self.reply_prefix_ids
