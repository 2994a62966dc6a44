"""Playing episodes and groups: environment + reply policy -> token-exact ``Trajectory``.

One episode is one token sequence that only grows: prompt, then per turn the reply tokens exactly as
sampled (loss mask 1, with their behaviour log-probs and policy version) and the environment's
feedback as template tokens (mask 0). Budgets end episodes cleanly: ``max_turns``, the action budget
and a *context budget* — an episode whose next turn might overrun the engine's context window is
ended before generation, with the format penalty and ``truncated_by_context`` set (RAGEN crashes
there instead).
"""

from __future__ import annotations

import asyncio
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ragen_async.agent.chat import ChatFormat
from ragen_async.agent.parsing import format_reply, parse_reply
from ragen_async.agent.prompts import feedback_user_message, first_user_message
from ragen_async.envs.base import TextEnv
from ragen_async.inference.base import Generation, InferenceEngine, SamplingConfig, token_versions_or_default
from ragen_async.protocol import NO_VERSION, Trajectory, TrajectoryGroup, TurnRecord


@dataclass(frozen=True, slots=True)
class AgentLimits:
    """Per-episode budgets (RAGEN defaults: 5 turns, 5 actions per turn, 400 tokens per turn)."""

    max_turns: int = 5
    max_actions_per_turn: int = 5
    max_actions_per_episode: int | None = None
    """``None`` = the environment's own budget (``env.max_actions_per_episode``)."""
    max_tokens_per_turn: int = 400
    format_penalty: float = -0.1
    context_budget_tokens: int = 4096
    """Hard cap on the episode's token count; must not exceed the engine's ``max_model_len``."""
    enable_think: bool = True


class ReplyPolicy(ABC):
    """Produces one reply (token ids + log-probs + versions) for the current context."""

    @abstractmethod
    async def reply(self, context_ids: list[int], env: TextEnv, actions_left: int, max_tokens: int,
                    request_seed: int) -> Generation: ...


class EnginePolicy(ReplyPolicy):
    """The LLM: samples from an inference engine."""

    def __init__(self, engine: InferenceEngine, temperature: float = 1.0, top_p: float = 1.0,
                 stop_token_ids: tuple[int, ...] = ()):
        self.engine = engine
        self.temperature = temperature
        self.top_p = top_p
        self.stop_token_ids = stop_token_ids

    async def reply(self, context_ids, env, actions_left, max_tokens, request_seed):
        sampling = SamplingConfig(temperature=self.temperature, top_p=self.top_p, max_tokens=max_tokens,
                                  stop_token_ids=self.stop_token_ids, seed=request_seed)
        return await self.engine.generate(context_ids, sampling)


class ScriptedPolicy(ReplyPolicy):
    """A policy that writes well-formed replies chosen by a function of the true env state.

    ``random``: uniformly random valid actions (the floor); ``oracle``: ``env.oracle_actions`` (the
    ceiling). Their tokens are marked as sampled with log-prob 0 and version 0 so the trajectory
    passes the same checks; they are for evaluation, never for training.
    """

    def __init__(self, chat: ChatFormat, kind: str, actions_per_turn: int, seed: int = 0):
        if kind not in ("random", "oracle"):
            raise ValueError(f"unknown scripted policy {kind!r}; choose 'random' or 'oracle'")
        self.chat = chat
        self.kind = kind
        self.actions_per_turn = actions_per_turn
        self.rng = random.Random(seed)

    async def reply(self, context_ids, env, actions_left, max_tokens, request_seed):
        n = max(1, min(self.actions_per_turn, actions_left))
        if self.kind == "oracle":
            actions = env.oracle_actions(n) or [env.random_action(self.rng)]
        else:
            actions = [env.random_action(self.rng) for _ in range(n)]
        ids = self.chat.encode(format_reply(actions)) + [self.chat.end_of_turn_id]
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), start_version=0, end_version=0,
                          finish_reason="stop")


class _TokenLog:
    """The growing token sequence of an episode with its per-token annotations."""

    def __init__(self, prompt_ids: list[int]):
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.append_context(prompt_ids)

    def append_context(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NO_VERSION] * len(ids)

    def append_sampled(self, gen: Generation) -> None:
        self.ids += gen.token_ids
        self.mask += [1] * len(gen.token_ids)
        self.logprobs += list(gen.logprobs)
        # Engines that cannot tell which version produced each token tag the reply with the version at
        # its start, the oldest it can contain: staleness is then never under-estimated.
        self.versions += token_versions_or_default(gen)


def request_seed(episode_seed: int, turn: int) -> int:
    """Per-request sampling seed: reproducible, distinct across episodes and turns."""
    return (episode_seed * 1_000_003 + turn * 7_919) % (2**31 - 1)


async def play_episode(
    policy: ReplyPolicy,
    chat: ChatFormat,
    env: TextEnv,
    env_tag: str,
    seed: int,
    limits: AgentLimits,
    *,
    group_id: str = "",
    traj_id: str = "",
    sampling_seed: int = 0,
) -> Trajectory:
    """Play one episode of ``env`` from ``seed``; ``sampling_seed`` decorrelates episodes of a group."""
    t_start = time.perf_counter()
    state, _ = env.reset(seed=seed)
    action_budget = limits.max_actions_per_episode or env.max_actions_per_episode
    actions_left = action_budget
    log = _TokenLog(chat.initial_prompt_ids(
        first_user_message(env, state, actions_left, action_budget, limits.max_tokens_per_turn)))
    turns: list[TurnRecord] = []
    penalty = 0.0
    truncated_by_context = False

    for turn in range(1, limits.max_turns + 1):
        if len(log.ids) + limits.max_tokens_per_turn + 1 > limits.context_budget_tokens:
            truncated_by_context = True
            penalty += limits.format_penalty
            break
        t_gen = time.perf_counter()
        gen = await policy.reply(log.ids, env, actions_left, limits.max_tokens_per_turn,
                                 request_seed(sampling_seed, turn))
        generate_s = time.perf_counter() - t_gen
        log.append_sampled(gen)
        if not gen.token_ids or gen.token_ids[-1] != chat.end_of_turn_id:
            # Cut off by the token limit: close the turn so the template stays well formed.
            log.append_context([chat.end_of_turn_id])

        reply_text = chat.reply_prefix + chat.decode(gen.token_ids, skip_special_tokens=False)
        parsed = parse_reply(reply_text, env.action_lookup, min(limits.max_actions_per_turn, actions_left),
                             enable_think=limits.enable_think)
        if not parsed.format_ok:
            penalty += limits.format_penalty

        t_env = time.perf_counter()
        reward, done = 0.0, False
        for action in parsed.actions:
            state, step_reward, terminated, truncated, _ = env.step(action)
            reward += float(step_reward)
            actions_left -= 1
            if terminated or truncated:
                done = True
                break
        done = done or actions_left <= 0
        turns.append(TurnRecord(
            reward=reward, actions=parsed.actions, num_dropped_actions=parsed.num_dropped,
            format_ok=parsed.format_ok, policy_version=gen.start_version, end_policy_version=gen.end_version,
            response_tokens=len(gen.token_ids), generate_s=generate_s, env_step_s=time.perf_counter() - t_env,
        ))
        if done or turn == limits.max_turns:
            break
        log.append_context(chat.continuation_ids(
            feedback_user_message(reward, turn + 1, state, actions_left, limits.max_tokens_per_turn)))

    traj = Trajectory(
        traj_id=traj_id or f"{group_id}/{sampling_seed}",
        env_tag=env_tag,
        seed=seed,
        group_id=group_id,
        token_ids=np.asarray(log.ids, dtype=np.int32),
        loss_mask=np.asarray(log.mask, dtype=np.int8),
        behaviour_logprobs=np.asarray(log.logprobs, dtype=np.float32),
        token_versions=np.asarray(log.versions, dtype=np.int32),
        turns=tuple(turns),
        format_penalty=penalty,
        success=bool(env.success),
        truncated_by_context=truncated_by_context,
        timings={"episode_s": time.perf_counter() - t_start},
    )
    traj.validate()
    return traj


async def play_group(
    policy: ReplyPolicy,
    chat: ChatFormat,
    make_env: Callable[[], TextEnv],
    env_tag: str,
    seed: int,
    group_size: int,
    limits: AgentLimits,
    *,
    group_id: str,
    index: int,
    worker_id: str = "",
    run_seed: int = 0,
) -> TrajectoryGroup:
    """Play ``group_size`` episodes from the same initial state concurrently.

    Every episode's sampling seed mixes the env ``seed``, the episode's place in the group, the group id
    and the run's ``run_seed``: runs that differ only in ``run_seed`` play the same levels with different
    samples.
    """
    created = time.time()
    episodes = [
        play_episode(policy, chat, make_env(), env_tag, seed, limits, group_id=group_id, traj_id=f"{group_id}/{i}",
                     sampling_seed=seed * 4_099 + i * 131 + hash_group_id(group_id) + run_seed * 7_919_993)
        for i in range(group_size)
    ]
    trajectories = await asyncio.gather(*episodes)
    return TrajectoryGroup(group_id=group_id, index=index, env_tag=env_tag, seed=seed, trajectories=tuple(trajectories),
                           worker_id=worker_id, created_at=created, finished_at=time.time())


def hash_group_id(group_id: str) -> int:
    """A process-independent integer from a group id (Python's ``hash`` is salted per process)."""
    value = 0
    for ch in group_id:
        value = (value * 131 + ord(ch)) % 1_000_000_007
    return value
