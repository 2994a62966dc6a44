"""Solver-derived warm starts: the base tiny model, fine-tuned on episodes of an ε-noisy oracle.

The study's specimen needs a policy with room to learn *and* a foothold: from the base model (format
and perception, no solver) StarPO-S stays at random level on Sokoban, as RAGEN's own StarPO-S does. A
warm start here is RAGEN's SFT row made imperfect on purpose: episodes of one env tag played through
the real agent code (``agent.episode.play_episode`` + ``ChatFormat``, the prompts rollouts send), each
reply's action the oracle's next move with probability 1 − ε and a uniformly random valid one with
probability ε (:class:`~ragen_async.tinymodel.corpus.NoisyOraclePolicy`), then the base build's SFT
(:func:`~ragen_async.tinymodel.build.sft`, same losses, same example path) from the base weights.

``ensure_warm_start(name)`` builds ``artifacts/tiny-model-<name>`` once per cache key (the warm-start
config, its seed and the base build's own cache key); the base model is built first when missing.
Episode seeds start at :data:`FIRST_EPISODE_SEED`, far above the seeds validation and RL rollouts play
(``validation.seed`` 123.., ``rollout.seed`` 10,000 + group index).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ragen_async.tinymodel import build, corpus

FIRST_EPISODE_SEED = 10**12
"""Warm-start episode ``i`` of build seed ``s`` plays level ``FIRST_EPISODE_SEED + s * 10**9 + i``."""

FORMAT_VERSION = 1
"""Bump when the warm-start procedure changes in a way the config does not capture (forces rebuilds)."""


@dataclass(frozen=True)
class WarmStartConfig:
    """Everything that determines a warm start (with its seed and the base build). Part of the cache key."""

    env_tag: str
    """The env whose oracle plays the episodes (its ``oracle_actions``)."""
    eps: float = 0.3
    """Probability that an action is uniformly random instead of the oracle's move. On SimpleSokoban
    (256 validation seeds, temperature 0.5): 0.1 → 0.50, 0.3 → 0.36, 0.5 → 0.18 (random 0.21)."""
    actions_per_reply: int = 1
    """Actions per reply: 1 makes every turn a decision the model can improve on."""
    episodes: int = 8000
    """Episodes played (each one SFT example)."""
    sft_steps: int = 900
    """SFT optimizer steps from the base weights (about 5 min on 2 cores)."""
    sft_batch_tokens: int = 4096
    """Padded tokens per SFT batch."""
    sft_lr: float = 3e-3
    """Peak SFT learning rate (linear warm-up, cosine decay to 10 %)."""
    sft_warmup_steps: int = 20
    """SFT warm-up steps."""
    sft_weight_decay: float = 0.01
    """AdamW weight decay on matrices."""
    sft_prompt_loss_weight: float = 0.5
    """Weight of the auxiliary next-token loss on the first prompt (as in the base build)."""
    sft_feedback_loss_weight: float = 0.5
    """Weight of the auxiliary loss on the grid cells of the env's feedback (as in the base build)."""
    max_turns: int = 5
    """Turns per episode: the ``agent.max_turns`` of the configs that train from this model."""
    max_actions_per_turn: int = 5
    """The parser's cap: the ``agent.max_actions_per_turn`` of those configs."""
    max_tokens_per_turn: int = 64
    """Shown in the prompt ("Keep the reply under N tokens"): those configs' ``agent.max_tokens_per_turn``."""
    num_threads: int = 2
    """torch threads during the build (deterministic algorithms)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps <= 1.0:
            raise ValueError(f"eps must be in [0, 1], got {self.eps}")
        if self.episodes < 1 or self.sft_steps < 1 or self.actions_per_reply < 1:
            raise ValueError("episodes, sft_steps and actions_per_reply must be >= 1")
        if self.episodes >= 10**9:
            raise ValueError("episodes must be < 1e9 (the seed block of one build seed)")

    def limits(self):
        from ragen_async.agent.episode import AgentLimits

        return AgentLimits(max_turns=self.max_turns, max_actions_per_turn=self.max_actions_per_turn,
                           max_tokens_per_turn=self.max_tokens_per_turn, context_budget_tokens=2048)

    def episode_seeds(self, seed: int) -> range:
        start = FIRST_EPISODE_SEED + seed * 10**9
        return range(start, start + self.episodes)


WARM_STARTS: dict[str, WarmStartConfig] = {
    "sokoban": WarmStartConfig(env_tag="SimpleSokoban"),
    # Ten turns: the slippery lake's action budget is ten moves; in five turns of one action the oracle
    # reaches the goal 0.266 of the time and random play 0.152 (256 validation seeds), in ten 0.488 and 0.223.
    "frozen_lake": WarmStartConfig(env_tag="FrozenLake", max_turns=10),
    # One turn of one action (the equation), as RAGEN plays Countdown: the oracle's exhaustive-search answer
    # or, 30 % of the time, the numbers in random order joined by random operators. On single-digit numbers:
    # built on RAGEN's 1..99 it validates at 0.000 (random 0.020): the tiny model does not copy two-digit numbers.
    "countdown": WarmStartConfig(env_tag="SmallCountdown", max_turns=1, max_actions_per_turn=1),
}
"""The named warm starts ``ragen-async make-model --warm-start NAME`` builds (``make specimen``: sokoban)."""


def default_out_dir(name: str) -> Path:
    return Path(f"{build.DEFAULT_OUT_DIR}-{name.replace('_', '-')}")


def warm_start_command(name: str) -> str:
    """The command that builds warm start ``name`` into its default directory."""
    return f"ragen-async make-model --warm-start {name}"


def warm_start_named_by(path: str | Path) -> str | None:
    """The warm start whose default directory is ``path``, if any (for an error naming the command; a config that
    pins one elsewhere names its own, ``model.build``)."""
    for name in WARM_STARTS:
        if Path(path) == default_out_dir(name):
            return name
    return None


def cache_key(config: WarmStartConfig, seed: int, base_key: str) -> str:
    payload = json.dumps({"format_version": FORMAT_VERSION, "seed": seed, "config": dataclasses.asdict(config),
                          "base_cache_key": base_key, "env_fingerprint": build.env_fingerprint((config.env_tag,))},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def make_examples(chat, config: WarmStartConfig, seed: int) -> tuple[list[build.SFTExample], dict[str, Any]]:
    """The warm start's SFT examples (one per episode) and what the data holds: its success rate and
    where the actions came from."""
    from ragen_async.agent.episode import play_episode

    env = corpus.make_env(config.env_tag)
    policy = corpus.NoisyOraclePolicy(chat, config.eps, config.actions_per_reply, seed=seed)
    grid_ids = build.grid_token_ids(chat)
    limits = config.limits()

    async def play_all() -> tuple[list[build.SFTExample], int]:
        examples, successes = [], 0
        for i, level in enumerate(config.episode_seeds(seed)):
            traj = await play_episode(policy, chat, env, config.env_tag, level, limits)
            successes += traj.success
            example = build.trajectory_example(traj, i, grid_ids)
            if example is not None:
                examples.append(example)
        return examples, successes

    examples, successes = asyncio.run(play_all())
    return examples, {"episodes": config.episodes, "success": successes / config.episodes, "actions": policy.kinds,
                      "tokens": sum(len(e.token_ids) for e in examples),
                      "reply_tokens": sum(sum(e.loss_mask) for e in examples)}


def scripted_success(config: WarmStartConfig, kind: str, first_seed: int, n: int, actions_per_reply: int,
                     chat) -> float:
    """Success of the random or oracle policy on seeds ``first_seed ..`` with ``actions_per_reply``
    actions per reply, under the warm start's agent limits: the floor and the ceiling a curve of a model
    trained on that reply format should be drawn against (``ragen-async eval --policy random`` sends the
    agent's cap of actions per reply, ``max_actions_per_turn``: those are the ``*_unlimited_reply`` figures)."""
    from ragen_async.agent.episode import ScriptedPolicy, play_episode

    env = corpus.make_env(config.env_tag)
    policy = ScriptedPolicy(chat, kind, actions_per_reply, seed=first_seed)

    async def play() -> float:
        wins = 0
        for s in range(first_seed, first_seed + n):
            wins += (await play_episode(policy, chat, env, config.env_tag, s, config.limits())).success
        return wins / n

    return asyncio.run(play())


def build_warm_start(name: str, out_dir: Path | str | None = None, base_dir: Path | str = build.DEFAULT_OUT_DIR,
                     seed: int = 0, config: WarmStartConfig | None = None, checkpoints: bool = False,
                     log: build.Log = build.print_log, **overrides: Any) -> Path:
    """Build warm start ``name`` (:data:`WARM_STARTS`, with ``overrides``) from the complete base build
    in ``base_dir`` into ``out_dir``. ``checkpoints`` also writes the model at every tenth of the SFT
    steps to ``<out_dir>.checkpoints/step-N``."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2ForCausalLM

    from ragen_async.agent.chat import ChatFormat

    config = dataclasses.replace(config or WARM_STARTS[name], **overrides)
    out_dir = Path(out_dir or default_out_dir(name))
    base_dir = Path(base_dir)
    base_info = build.read_build_info(base_dir)
    if not build.is_complete_build(base_dir) or base_info is None:
        raise FileNotFoundError(f"{base_dir} holds no complete base build; run `ragen-async make-model` first")
    build.check_replaceable(out_dir)
    key = cache_key(config, seed, base_info["cache_key"])
    t_start = time.perf_counter()
    log(f"warm start {name!r} ({config.env_tag}, eps {config.eps}, {config.episodes} episodes, "
        f"{config.sft_steps} SFT steps) from {base_dir} into {out_dir} (cache key {key})")
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    chat = ChatFormat(tokenizer)
    timings: dict[str, float] = {}
    with build.deterministic(seed, config.num_threads):
        t = time.perf_counter()
        examples, data = make_examples(chat, config, seed)
        timings["sft_data_s"] = time.perf_counter() - t
        log(f"sft data: {len(examples)} episodes, {data['tokens']} tokens, {data['reply_tokens']} reply tokens, "
            f"success {data['success']:.3f}, actions {data['actions']} ({timings['sft_data_s']:.1f} s)")
        model = Qwen2ForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        model.generation_config = GenerationConfig.from_pretrained(str(base_dir))
        info = {"complete": True, "cache_key": key, "seed": seed, "warm_start": name, "config": dataclasses.asdict(config),
                "base": {"path": str(base_dir), "cache_key": base_info["cache_key"]},
                "parameter_count": sum(p.numel() for p in model.parameters()), "sft_data": data,
                "episode_seeds": [config.episode_seeds(seed).start, config.episode_seeds(seed).stop - 1]}

        def checkpoint(steps_done: int) -> None:
            if checkpoints and steps_done < config.sft_steps:
                ckpt = out_dir.parent / f"{out_dir.name}.checkpoints" / f"step-{steps_done}"
                build.save_model_dir(model, tokenizer, ckpt, {**info, "complete": False, "sft_steps_done": steps_done})

        t = time.perf_counter()
        losses = build.sft(model, examples, config, seed, tokenizer.pad_token_id, log=log, on_report=checkpoint)
        timings["sft_s"] = time.perf_counter() - t
    # The floor and the ceiling for this reply format, on the validation seeds the tiny configs use.
    from ragen_async.config import ValidationConfig

    first, n = ValidationConfig().seed, 256
    t = time.perf_counter()
    info["reference_success"] = {
        "seeds": [first, first + n - 1],
        "random": scripted_success(config, "random", first, n, config.actions_per_reply, chat),
        "oracle": scripted_success(config, "oracle", first, n, config.actions_per_reply, chat),
        "random_unlimited_reply": scripted_success(config, "random", first, n, config.max_actions_per_turn, chat),
        "oracle_unlimited_reply": scripted_success(config, "oracle", first, n, config.max_actions_per_turn, chat),
    }
    timings["reference_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start
    info.update(sft_loss=build.loss_summary(losses), timings_s={k: round(v, 2) for k, v in timings.items()},
                build_wall_time_s=round(timings["total_s"], 2))
    build.save_model_dir(model, tokenizer, out_dir, info)
    ref = info["reference_success"]
    log(f"done in {timings['total_s']:.0f} s -> {out_dir}; on seeds {first}..{first + n - 1}: random {ref['random']:.3f}, "
        f"oracle at {config.actions_per_reply} action(s) per reply {ref['oracle']:.3f}")
    return out_dir


def ensure_warm_start(name: str, out_dir: Path | str | None = None, base_dir: Path | str = build.DEFAULT_OUT_DIR,
                      seed: int = 0, force: bool = False, checkpoints: bool = False, log: build.Log = build.print_log,
                      **overrides: Any) -> Path:
    """``out_dir`` holding warm start ``name`` for (its config + ``overrides``, ``seed``, the base build
    in ``base_dir``), building the base model and then the warm start only when missing or stale."""
    if name not in WARM_STARTS:
        raise ValueError(f"unknown warm start {name!r}; known: {', '.join(WARM_STARTS)}")
    config = dataclasses.replace(WARM_STARTS[name], **overrides)
    out_dir = Path(out_dir or default_out_dir(name))
    if not build.is_complete_build(base_dir):  # a complete base build of another config is used as it is
        build.ensure_tiny_model(base_dir, log=log)
    key = cache_key(config, seed, build.read_build_info(base_dir)["cache_key"])
    if not force and build.is_complete_build(out_dir, key):
        log(f"{out_dir} already holds warm start {name!r} (cache key {key}); not rebuilding")
        return out_dir
    return build_warm_start(name, out_dir, base_dir, seed=seed, config=config, checkpoints=checkpoints, log=log)
