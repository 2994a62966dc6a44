"""Build the project's tiny causal LM: tokenizer + Qwen2 model + a short format-only SFT warm start.

``build_tiny_model(out_dir, seed)`` does, on CPU, in a few minutes and deterministically under ``seed``:

1. trains the byte-level BPE tokenizer (:mod:`.tokenizer`) on ChatML conversations rendered from
   every env tag (:mod:`.corpus`);
2. initialises a small ``Qwen2ForCausalLM`` (head size >= 32 for vLLM's CPU kernels, tied embeddings,
   float32);
3. plays episodes of every env tag with uniformly random valid actions through the real agent code
   path (``agent.episode.play_episode`` + ``ChatFormat``), so the SFT sequences are token-exact with
   rollouts, and trains cross-entropy on the reply tokens (the loss mask), plus auxiliary next-token
   losses on the first prompt and on the env's feedback (``sft_prompt_loss_weight``,
   ``sft_feedback_loss_weight``). The replies teach the format; predicting the next state after random
   moves teaches *perception* (where the player, boxes and holes are, what a move does to the grid).
   No action is chosen by a solver and no data is selected by reward, so the policy stays uniformly
   random: bandit episodes come in pairs, one per arm, with the same prompt and thought, so the base
   model has no lean;
4. saves model, tokenizer, generation config (eos = ``<|im_end|>``) and ``build_info.json``.

``ensure_tiny_model(out_dir, seed)`` builds only when ``out_dir`` lacks a complete build with the same
cache key (a hash of the build config, the format version and a fingerprint of the env/prompt text).

Its length (over the project's ~600 lines per module): tokenizer, corpus, model and SFT are one deterministic
build under one cache key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ragen_async.modeldir import weights_sha256
from ragen_async.tinymodel import corpus, inputs
from ragen_async.tinymodel.inputs import machine_info
from ragen_async.tinymodel.tokenizer import GRID_SYMBOLS

FORMAT_VERSION = 2
"""Bump when the build procedure changes in a way the config does not capture (forces rebuilds)."""

BUILD_INFO = "build_info.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", BUILD_INFO)
DEFAULT_OUT_DIR = Path("artifacts/tiny-model")

Log = Callable[[str], None]


def print_log(msg: str) -> None:
    print(f"[make-model] {msg}", flush=True)


@dataclass(frozen=True)
class TinyModelConfig:
    """Everything that determines a build (together with the seed). Part of the cache key."""

    env_tags: tuple[str, ...] = corpus.ENV_TAGS
    # tokenizer
    vocab_size: int = 1536
    """Target vocabulary size (BPE stops earlier when the corpus has no more frequent pairs)."""
    tokenizer_episodes_per_tag: int = 300
    # model (Qwen2)
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    initializer_range: float = 0.06
    """Std of the initial weights. Larger than transformers' 0.02: with it the model learns to copy an
    arm name from the prompt several times sooner (a phase change the SFT budget must reach)."""
    # SFT warm start
    sft_steps: int = 900
    sft_batch_tokens: int = 4096
    """Padded tokens per SFT batch (short episodes pack many per batch)."""
    sft_lr: float = 3e-3
    sft_warmup_steps: int = 20
    sft_weight_decay: float = 0.01
    sft_episodes_per_tag: int = 600
    sft_invalid_turn_prob: float = 0.1
    """Share of warm-start turns that are invalid replies kept out of the loss (context after a mistake)."""
    sft_prompt_loss_weight: float = 0.5
    """Weight of an auxiliary next-token loss on the *first* prompt (instructions, legend, initial
    state). It teaches the model to read and copy from the prompt (arm names, numbers) far sooner than
    the reply loss alone; 0 turns it off."""
    sft_feedback_loss_weight: float = 0.5
    """Weight of an auxiliary next-token loss on the grid cells of the env's feedback (the next state
    after the reply's random actions): a world-model loss that makes the model read the grid (to
    predict the next one it must locate the player and what is next to it); 0 turns it off. The rest
    of the feedback text stays out of the loss: learning it taught the model to write user text into
    its replies."""
    bandit_rename_prob: float = 0.5
    """Share of bandit episodes (tokenizer corpus and warm start) whose arm names are drawn from the
    tags' names and ``corpus.ARM_NAMES``: the model must learn to copy an arm name from the prompt."""
    max_turns: int = 5
    """Turns per SFT episode (the agent default)."""
    max_actions_per_turn: int = 5
    """The agent's per-turn cap during warm-start episodes (the agent default)."""
    sft_max_actions_per_turn: int = 3
    """Warm-start replies carry 1..min(this, actions left) actions, uniformly. Kept below the agent's
    cap so that a slightly miscounted reply is still valid."""
    sft_bandit_episode_factor: int = 3
    """Bandit tags get this many times ``sft_episodes_per_tag`` episodes: they are short, and naming an
    arm means copying it from the prompt, which takes the tiny model many examples to learn."""
    max_tokens_per_turn: int = 400
    """Only appears in the prompt text ("Keep the reply under N tokens")."""
    num_threads: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "env_tags", tuple(self.env_tags))
        head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_size % self.num_attention_heads or head_dim < 32:
            raise ValueError(f"hidden_size / num_attention_heads must be an integer >= 32 (vLLM CPU kernels); "
                             f"got {self.hidden_size} / {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.sft_steps < 0 or self.sft_batch_tokens < 1 or self.sft_episodes_per_tag < 1:
            raise ValueError("sft_steps must be >= 0, sft_batch_tokens and sft_episodes_per_tag >= 1")
        if not self.env_tags:
            raise ValueError("env_tags must not be empty")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["env_tags"] = list(self.env_tags)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TinyModelConfig:
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# cache key


def env_fingerprint(tags: tuple[str, ...]) -> str:
    """Hash of the text the environments and prompts produce (two random episodes per tag): a change
    in env or prompt wording changes the cache key, so a stale model is never reused silently."""
    h = hashlib.sha256()
    rng = random.Random(0)
    from ragen_async.agent.episode import AgentLimits

    for tag in tags:
        env = corpus.make_env(tag)
        for seed in range(2):
            h.update(corpus.render_chatml(corpus.random_conversation(env, seed, rng, AgentLimits())).encode())
    return h.hexdigest()[:16]


def cache_key(config: TinyModelConfig, seed: int) -> str:
    payload = json.dumps({"format_version": FORMAT_VERSION, "seed": seed, "config": config.to_dict(),
                          "env_fingerprint": env_fingerprint(config.env_tags)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def read_build_info(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out_dir) / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None


def is_complete_build(out_dir: Path, key: str | None = None) -> bool:
    """``out_dir`` holds every file of a finished build (and, if given, one with cache key ``key``)."""
    out_dir = Path(out_dir)
    if not all((out_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    info = read_build_info(out_dir)
    return info is not None and info.get("complete") is True and (key is None or info.get("cache_key") == key)


# ---------------------------------------------------------------------------------------------
# determinism


@contextlib.contextmanager
def deterministic(seed: int, num_threads: int) -> Iterator[None]:
    """Seed every generator and pin torch to ``num_threads`` deterministic threads; restore after."""
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)


# ---------------------------------------------------------------------------------------------
# pieces


def make_model_config(config: TinyModelConfig, tokenizer) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True,
        initializer_range=config.initializer_range,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


class SFTSettings(Protocol):
    """What :func:`sft` reads: :class:`TinyModelConfig` (the base build) and
    ``warmstart.WarmStartConfig`` (a solver-derived warm start) both provide it."""

    sft_steps: int
    sft_batch_tokens: int
    sft_lr: float
    sft_warmup_steps: int
    sft_weight_decay: float
    sft_prompt_loss_weight: float
    sft_feedback_loss_weight: float


@dataclass
class SFTExample:
    tag: str
    token_ids: list[int]
    loss_mask: list[int]
    """1 on reply tokens."""
    grid_mask: list[int]
    """1 on grid-cell tokens of the env's feedback (after the first reply)."""
    group: int
    """Examples of one group always share a batch (a bandit pair: the same prompt, each arm once)."""


def _reply_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of 1s in the loss mask: one per reply, in turn order."""
    spans, start = [], None
    for i, m in enumerate(loss_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def grid_token_ids(chat) -> set[int]:
    """The token ids of the grid symbols (one token each), whose prediction the feedback loss trains."""
    ids = {symbol: chat.encode(symbol) for symbol in GRID_SYMBOLS}
    assert all(len(v) == 1 for v in ids.values()), "every grid symbol must be one token"
    return {v[0] for v in ids.values()}


def trajectory_example(traj, group: int, grid_ids: set[int], invalid_turns: list[bool] | None = None) -> SFTExample | None:
    """The SFT example of one played episode (``agent.episode.play_episode``, so token-exact with
    rollouts): the reply tokens are the loss mask, less the replies flagged in ``invalid_turns`` (context
    after a mistake, not a target); the grid cells of the env's feedback after the first reply are the
    feedback mask. ``None`` when no reply is left to learn from."""
    mask = traj.loss_mask.tolist()
    spans = _reply_spans(mask)
    assert len(spans) == len(traj.turns), (len(spans), len(traj.turns))
    if invalid_turns is not None:
        assert len(invalid_turns) == len(spans), (len(invalid_turns), len(spans))
        for (start, end), invalid, turn in zip(spans, invalid_turns, traj.turns, strict=True):
            assert turn.format_ok != invalid, f"{traj.env_tag}: scripted reply validity mismatch"
            if invalid:
                mask[start:end] = [0] * (end - start)
    if not any(mask):
        return None
    ids = traj.token_ids.tolist()
    first = mask.index(1)
    grid = [int(i >= first and not m and t in grid_ids)
            for i, (t, m) in enumerate(zip(ids, traj.loss_mask.tolist(), strict=True))]
    return SFTExample(traj.env_tag, ids, mask, grid, group)


def make_sft_examples(chat, config: TinyModelConfig, seed: int) -> list[SFTExample]:
    """Episodes of every tag played with random well-formed replies through ``play_episode``.

    Some turns are deliberately invalid replies (``sft_invalid_turn_prob``) whose tokens are taken out
    of the loss mask: they only provide the context of a turn after a mistake. A share of bandit
    episodes (``bandit_rename_prob``) use other arm names; every bandit episode is played once per arm
    with the same thought (one group), so each prompt's target is exactly uniform over the arms.
    """
    from ragen_async.agent.episode import AgentLimits, play_episode
    from ragen_async.envs.bandit import BanditEnv

    limits = AgentLimits(max_turns=config.max_turns, max_actions_per_turn=config.max_actions_per_turn,
                         max_tokens_per_turn=config.max_tokens_per_turn,
                         context_budget_tokens=config.max_position_embeddings)
    envs = {tag: corpus.make_env(tag) for tag in config.env_tags}
    grid_ids = grid_token_ids(chat)
    foreign = tuple(sorted({a for env in envs.values() for a in env.valid_actions()}))
    arm_names = tuple(sorted({name for env in envs.values() if isinstance(env, BanditEnv)
                              for name in (env.config.lo_arm_name, env.config.hi_arm_name)})) + corpus.ARM_NAMES

    async def play_all() -> list[SFTExample]:
        examples = []
        for t, tag in enumerate(config.env_tags):
            rng = random.Random(seed * 1_000 + t)
            policy = corpus.RandomFormatPolicy(chat, config.sft_max_actions_per_turn, seed=seed * 1_000 + t,
                                               invalid_turn_prob=config.sft_invalid_turn_prob,
                                               foreign_actions=foreign,
                                               agent_max_actions_per_turn=config.max_actions_per_turn)
            n_episodes = config.sft_episodes_per_tag * (
                config.sft_bandit_episode_factor if isinstance(envs[tag], BanditEnv) else 1)
            for i in range(n_episodes):
                env = envs[tag]
                scripts: list[tuple[str, list[str]] | None] = [None]
                if isinstance(env, BanditEnv):
                    if rng.random() < config.bandit_rename_prob:
                        env = corpus.renamed_bandit(env, rng, arm_names)
                    thought = rng.choice(corpus.GENERIC_THOUGHTS)
                    scripts = [(thought, [arm]) for arm in env.valid_actions()]
                group = len(examples)
                for script in scripts:
                    policy.forced = script
                    policy.start_episode()
                    # Seeds far from the small ones evaluations use.
                    traj = await play_episode(policy, chat, env, tag, 1_000_000 + seed * 100_000 + i, limits)
                    example = trajectory_example(traj, group, grid_ids, invalid_turns=policy.history)
                    if example is not None:
                        examples.append(example)
                policy.forced = None
        return examples

    return asyncio.run(play_all())


def _batches(examples: list[SFTExample], batch_tokens: int, steps: int, rng: random.Random) -> Iterator[list[SFTExample]]:
    """``steps`` batches of at most ``batch_tokens`` padded tokens (a group longer than that goes
    alone): epochs of shuffled groups (see :attr:`SFTExample.group`), bucketed by length so short
    episodes pack many per batch."""
    groups: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(e.group, []).append(i)
    members = list(groups.values())

    def longest(g: int) -> int:
        return max(len(examples[i].token_ids) for i in members[g])

    produced = 0
    while True:
        order = list(range(len(members)))
        rng.shuffle(order)
        batches: list[list[int]] = []
        chunk = 256
        for start in range(0, len(order), chunk):
            part = sorted(order[start:start + chunk], key=longest)
            current: list[int] = []
            for g in part:  # sorted ascending: the newest group is the longest
                if current and (len(current) + len(members[g])) * longest(g) > batch_tokens:
                    batches.append(current)
                    current = []
                current.extend(members[g])
            batches.append(current)
        rng.shuffle(batches)
        for b in batches:
            if produced == steps:
                return
            yield [examples[i] for i in b]
            produced += 1


def _collate(batch: list[SFTExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids and three masks: replies (the loss mask), the first prompt (tokens before the
    first reply) and the grid cells of the env's feedback."""
    length = max(len(e.token_ids) for e in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    reply = torch.zeros((len(batch), length), dtype=torch.bool)
    prompt = torch.zeros((len(batch), length), dtype=torch.bool)
    feedback = torch.zeros((len(batch), length), dtype=torch.bool)
    for row, e in enumerate(batch):
        n, first = len(e.token_ids), e.loss_mask.index(1)
        ids[row, :n] = torch.tensor(e.token_ids)
        reply[row, :n] = torch.tensor(e.loss_mask, dtype=torch.bool)
        prompt[row, :first] = True
        feedback[row, :n] = torch.tensor(e.grid_mask, dtype=torch.bool)
    return ids, reply, prompt, feedback


def sft_loss(model, ids: torch.Tensor, reply: torch.Tensor, *aux: torch.Tensor) -> list[torch.Tensor]:
    """Mean next-token cross-entropy over the reply tokens, then over each auxiliary mask (0 where a
    mask is empty). Right padding needs no attention mask under causal attention; logits are only
    computed where a loss is taken."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    targets = ids[:, 1:]

    def ce(mask: torch.Tensor) -> torch.Tensor:
        if not mask.any():
            return hidden.sum() * 0.0
        return torch.nn.functional.cross_entropy(model.lm_head(hidden[mask]).float(), targets[mask])

    return [ce(m[:, 1:]) for m in (reply, *aux)]


def sft(model, examples: list[SFTExample], config: SFTSettings, seed: int, pad_id: int,
        log: Log = print_log, on_report: Callable[[int], None] | None = None) -> list[float]:
    """Supervised warm start; returns the per-step reply-token loss. At every progress report (each
    tenth of ``config.sft_steps``, the last one included) ``on_report(steps_done)`` is called with the
    model in train mode: a checkpoint hook."""
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.sft_weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=config.sft_lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < config.sft_warmup_steps:
            return (step + 1) / config.sft_warmup_steps
        progress = (step - config.sft_warmup_steps) / max(1, config.sft_steps - config.sft_warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(seed)
    losses: list[float] = []
    t0 = time.perf_counter()
    report_every = max(1, config.sft_steps // 10)
    for step, batch in enumerate(_batches(examples, config.sft_batch_tokens, config.sft_steps, rng)):
        ids, reply, prompt, feedback = _collate(batch, pad_id)
        reply_loss, prompt_loss, feedback_loss = sft_loss(model, ids, reply, prompt, feedback)
        loss = (reply_loss + config.sft_prompt_loss_weight * prompt_loss
                + config.sft_feedback_loss_weight * feedback_loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        opt.step()
        sched.step()
        losses.append(float(reply_loss.detach()))
        if (step + 1) % report_every == 0 or step + 1 == config.sft_steps:
            recent = losses[-report_every:]
            log(f"sft step {step + 1}/{config.sft_steps}: loss {sum(recent) / len(recent):.4f} "
                f"({time.perf_counter() - t0:.0f} s)")
            if on_report is not None:
                on_report(step + 1)
    model.eval()
    return losses


def loss_summary(losses: list[float]) -> dict[str, Any]:
    if not losses:
        return {"steps": 0}
    k = max(1, len(losses) // 10)
    return {
        "steps": len(losses),
        "first": losses[0],
        "final": sum(losses[-k:]) / k,
        "final_window": k,
        "min": min(losses),
        "curve": [round(sum(losses[i:i + k]) / len(losses[i:i + k]), 5) for i in range(0, len(losses), k)],
    }


# ---------------------------------------------------------------------------------------------
# build


@dataclass
class PreparedInputs:
    """The build's deterministic first half: what the SFT trains on (:func:`prepare_inputs`)."""

    texts: list[str]
    """The tokenizer's training conversations."""
    tokenizer: Any
    """The trained tokenizer (``PreTrainedTokenizerFast``)."""
    examples: list[SFTExample]
    """The SFT examples, in the order the build draws batches from."""
    timings_s: dict[str, float]

    def digests(self) -> dict[str, str]:
        """What ``build_info.json`` records as ``inputs`` (:mod:`.inputs`)."""
        return {"tokenizer_corpus_sha256": inputs.corpus_digest(self.texts),
                "tokenizer_sha256": inputs.tokenizer_digest(self.tokenizer),
                "sft_data_sha256": inputs.sft_data_digest(self.examples),
                "build_code_sha256": inputs.build_code_digest()}


def prepare_inputs(config: TinyModelConfig, seed: int, log: Log = print_log) -> PreparedInputs:
    """Train the tokenizer on the env corpus and play the SFT episodes: what :func:`build_tiny_model` does before
    the model exists (about 20 s on 2 cores). Call it inside ``deterministic(seed, config.num_threads)``, as the
    build does, to get the build's own inputs."""
    from ragen_async.agent.chat import ChatFormat
    from ragen_async.tinymodel.tokenizer import check_tokenizer, train_tokenizer

    timings: dict[str, float] = {}
    t = time.perf_counter()
    texts = list(corpus.corpus_texts(config.env_tags, config.tokenizer_episodes_per_tag, seed=seed,
                                     bandit_rename_prob=config.bandit_rename_prob))
    tokenizer = train_tokenizer(texts, vocab_size=config.vocab_size)
    check_tokenizer(tokenizer)
    chat = ChatFormat(tokenizer)
    timings["tokenizer_s"] = time.perf_counter() - t
    log(f"tokenizer: {len(tokenizer)} tokens from {len(texts)} conversations ({timings['tokenizer_s']:.1f} s)")

    t = time.perf_counter()
    examples = make_sft_examples(chat, config, seed)
    timings["sft_data_s"] = time.perf_counter() - t
    log(f"sft data: {len(examples)} episodes, {sum(len(e.token_ids) for e in examples)} tokens, "
        f"{sum(sum(e.loss_mask) for e in examples)} reply tokens ({timings['sft_data_s']:.1f} s)")
    return PreparedInputs(texts, tokenizer, examples, timings)


def git_commit() -> str | None:
    """The commit checked out where this code lives (``+dirty`` when tracked files have changes), or ``None``
    outside a git checkout."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def build_tiny_model(out_dir: Path | str, seed: int = 0, config: TinyModelConfig | None = None,
                     log: Log = print_log, **overrides: Any) -> Path:
    """Build the tiny model into ``out_dir`` (replacing a previous build there); returns ``out_dir``.

    ``overrides`` are :class:`TinyModelConfig` fields (e.g. ``sft_steps=20`` for a quick build).
    """
    import tokenizers
    import transformers
    from transformers import GenerationConfig, Qwen2ForCausalLM

    config = dataclasses.replace(config or TinyModelConfig(), **overrides)
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    t_start = time.perf_counter()
    key = cache_key(config, seed)
    log(f"building the tiny model into {out_dir} (seed {seed}, cache key {key})")

    with deterministic(seed, config.num_threads):
        prepared = prepare_inputs(config, seed, log)
        tokenizer, examples, timings = prepared.tokenizer, prepared.examples, dict(prepared.timings_s)
        n_tokens = sum(len(e.token_ids) for e in examples)
        n_reply = sum(sum(e.loss_mask) for e in examples)

        model_config = make_model_config(config, tokenizer)
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(model_config).float()
        n_params = sum(p.numel() for p in model.parameters())
        log(f"model: Qwen2, {n_params:,} parameters, head_dim {config.head_dim}")

        t = time.perf_counter()
        losses = sft(model, examples, config, seed, tokenizer.pad_token_id, log=log)
        timings["sft_s"] = time.perf_counter() - t

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=config.max_tokens_per_turn)
    timings["total_s"] = time.perf_counter() - t_start
    info = {
        "complete": True,
        "format_version": FORMAT_VERSION,
        "cache_key": key,
        "env_fingerprint": env_fingerprint(config.env_tags),
        "seed": seed,
        "config": config.to_dict(),
        "model_config": {k: model_config.to_dict()[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")},
        "head_dim": config.head_dim,
        "parameter_count": n_params,
        "vocab_size": len(tokenizer),
        "sft_data": {"episodes": len(examples), "tokens": n_tokens, "reply_tokens": n_reply},
        "sft_loss": loss_summary(losses),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "build_wall_time_s": round(timings["total_s"], 2),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "inputs": prepared.digests(),
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "built_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    save_model_dir(model, tokenizer, out_dir, info)
    final = info["sft_loss"].get("final")
    log(f"done in {timings['total_s']:.1f} s: {n_params:,} parameters, final SFT loss "
        f"{final if final is None else round(final, 4)} -> {out_dir}")
    return out_dir


def save_model_dir(model, tokenizer, out_dir: Path, info: dict[str, Any]) -> None:
    """Write model, tokenizer, generation config and ``build_info.json`` (``info``) into ``out_dir`` at
    once: everything goes to a temporary sibling first, which then replaces ``out_dir``."""
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    # Which weights this is: a study comparing runs must know whether they started from the same model, and
    # that builds with one cache key are equal bit for bit on other machines is not established.
    info = {**info, "weights_sha256": weights_sha256(tmp)}
    (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def check_replaceable(out_dir: Path) -> None:
    """Refuse to overwrite anything but an empty directory or an earlier tiny-model build."""
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / BUILD_INFO).is_file())):
        raise FileExistsError(f"{out_dir} exists and is not a tiny-model build (no {BUILD_INFO}); "
                              "refusing to replace it")


def ensure_tiny_model(out_dir: Path | str = DEFAULT_OUT_DIR, seed: int = 0, config: TinyModelConfig | None = None,
                      force: bool = False, log: Log = print_log, **overrides: Any) -> Path:
    """Return ``out_dir`` holding a complete build for (``config`` + ``overrides``, ``seed``), building it
    only when it is missing, incomplete or built from a different config."""
    config = dataclasses.replace(config or TinyModelConfig(), **overrides)
    out_dir = Path(out_dir)
    key = cache_key(config, seed)
    if not force and is_complete_build(out_dir, key):
        log(f"{out_dir} already holds a complete build (cache key {key}); not rebuilding")
        return out_dir
    if force:
        reason = "--force"
    elif not out_dir.exists():
        reason = "no build there yet"
    elif not is_complete_build(out_dir):
        reason = "the build there is incomplete"
    else:
        reason = f"the build there has cache key {read_build_info(out_dir).get('cache_key')}, wanted {key} " \
                 "(different config, seed, format version or env text)"
    log(f"building {out_dir}: {reason}")
    return build_tiny_model(out_dir, seed=seed, config=config, log=log)
