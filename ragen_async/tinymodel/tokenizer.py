"""The tiny model's tokenizer: byte-level BPE trained on text the environments generate.

* Pre-tokenisation follows Qwen2 (its split regex — single digits, letters runs, punctuation runs —
  then byte-level mapping), so any text round-trips and numbers are spelled digit by digit.
* Grid cells are single tokens: every character of a line made only of grid symbols (Sokoban's and
  FrozenLake's renders) is split off on its own first, so ``##PX_#`` is six tokens and a cell's
  neighbours sit at fixed token offsets (one row = width + 1 tokens) instead of hiding in BPE merges.
* Special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos, the end of a turn).
* ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` are added *single* tokens that are **not**
  special: they survive ``decode(..., skip_special_tokens=True)``.
* Wrapped as a ``transformers.PreTrainedTokenizerFast`` with a ChatML chat template like Qwen2.5's, so
  ``agent.chat.ChatFormat`` works on it exactly as on a real Qwen2.5 checkpoint.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
TAG_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<answer>", "</answer>")

# Qwen2's pre-tokenisation regex (digits are split one by one).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GRID_SYMBOLS = "#_OX√PSG"
"""Every symbol the grid envs render (Sokoban: ``# _ O X √ P S``; FrozenLake: ``P _ O G X √``)."""
# One grid character, when the rest of its line is grid characters too (lines of text never are).
_GRID_CELL = rf"[{GRID_SYMBOLS}](?=[{GRID_SYMBOLS}]*\n)"
_MARKERS = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TAG_TOKENS))

# ChatML, as Qwen2's template renders it (with Qwen2's default system message when none is given);
# tools are not supported.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def _marker_free_pieces(texts: Iterable[str]) -> Iterator[str]:
    """Training text with the special and tag tokens cut out (they become their own tokens anyway,
    and BPE must not learn merges across them)."""
    for text in texts:
        for piece in _MARKERS.split(text):
            if piece:
                yield piece


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1536, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it for transformers (deterministic for a given corpus)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_GRID_CELL), behavior="isolated", invert=False),
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_fixed = len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Every grid symbol a single token, even a multi-byte one (√) that the corpus's grids might not show.
    grid_lines = [GRID_SYMBOLS + "\n"] * max(2, min_frequency)
    tok.train_from_iterator(_marker_free_pieces(itertools.chain(texts, grid_lines)), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False, lstrip=False, rstrip=False)
                    for t in TAG_TOKENS])
    assert tok.get_vocab_size() <= vocab_size + n_fixed
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="left",
        errors="replace",
        split_special_tokens=False,
    )


def check_tokenizer(tokenizer) -> None:
    """Raise ``AssertionError`` unless ``tokenizer`` has the properties the agent code relies on."""
    for token in SPECIAL_TOKENS + TAG_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, f"{token!r} is not a single token: {ids}"
    for token in TAG_TOKENS:
        ids = tokenizer.encode(f"a {token} b", add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=True) == f"a {token} b", f"{token!r} does not survive decode"
    line = GRID_SYMBOLS + "\n"
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(line, add_special_tokens=False)]
    assert pieces == list(line), f"a grid line is not one token per cell: {pieces}"
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == PAD_TOKEN
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), text
