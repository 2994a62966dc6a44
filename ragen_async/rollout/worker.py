"""The rollout worker: environment groups + agent protocol + one inference engine.

A plain class used directly by the single-process loop and wrapped by the Ray rollout actor. Groups
are identified by a *global sequence index* handed out by admission control; the index alone fixes
which environment the group plays and from which seed, so the data a run trains on does not depend
on which worker played it or in what order groups finished.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ragen_async.agent.chat import ChatFormat
from ragen_async.agent.episode import AgentLimits, EnginePolicy, ReplyPolicy, play_episode, play_group
from ragen_async.config import AgentConfig, EnvGroupSpec, InferenceConfig, RunConfig
from ragen_async.envs.registry import make_env_from_tag
from ragen_async.inference.base import InferenceEngine
from ragen_async.protocol import Trajectory, TrajectoryGroup
from ragen_async.staleness.ids import format_group_id

log = logging.getLogger(__name__)


def agent_limits(agent: AgentConfig, inference: InferenceConfig) -> AgentLimits:
    return AgentLimits(
        max_turns=agent.max_turns,
        max_actions_per_turn=agent.max_actions_per_turn,
        max_actions_per_episode=agent.max_actions_per_episode,
        max_tokens_per_turn=agent.max_tokens_per_turn,
        format_penalty=agent.format_penalty,
        context_budget_tokens=inference.max_model_len,
        enable_think=agent.enable_think,
    )


@dataclass(frozen=True)
class GroupAssignment:
    env: EnvGroupSpec
    seed: int


def assign_group(index: int, envs: Sequence[EnvGroupSpec], base_seed: int) -> GroupAssignment:
    """Group ``index`` of the run: within each step's block of groups, the first ``envs[0].n_groups``
    play ``envs[0]``, and so on; the seed is ``base_seed + index`` (RAGEN: base + counter)."""
    per_step = sum(e.n_groups for e in envs)
    slot = index % per_step
    for spec in envs:
        if slot < spec.n_groups:
            return GroupAssignment(spec, base_seed + index)
        slot -= spec.n_groups
    raise AssertionError("unreachable")


class RolloutWorker:
    def __init__(self, cfg: RunConfig, engine: InferenceEngine, chat: ChatFormat, *, worker_id: str = "w0"):
        self.cfg = cfg
        self.engine = engine
        self.chat = chat
        self.worker_id = worker_id
        self.limits = agent_limits(cfg.agent, cfg.inference)
        self.policy = EnginePolicy(engine, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                   stop_token_ids=(chat.end_of_turn_id,))
        self.groups_played = 0
        self.busy_s = 0.0
        """Seconds :meth:`run` had at least one group in flight."""
        self.admission_wait_s = 0.0
        """Seconds :meth:`run` sat idle because admission control refused a new group."""

    async def play_group(self, index: int) -> TrajectoryGroup:
        a = assign_group(index, self.cfg.rollout.envs, self.cfg.rollout.seed)
        group = await play_group(
            self.policy, self.chat, lambda: make_env_from_tag(a.env.tag, **a.env.overrides), a.env.tag, a.seed,
            self.cfg.rollout.group_size, self.limits, group_id=format_group_id(index), index=index, worker_id=self.worker_id,
            run_seed=self.cfg.seed)
        self.groups_played += 1
        return group

    async def run(self, admit: Callable[[int], Awaitable[list[int]]],
                  send: Callable[[TrajectoryGroup], Awaitable[None]], should_stop: Callable[[], bool],
                  wait_s: float = 0.05) -> None:
        """Play admitted groups, up to ``max_concurrent_groups`` at once, and ``send`` each when done.

        Whenever a slot is free one admission request is out: ``admit(n)`` returns up to ``n`` group indices,
        and may hold the call until the gate has any (an empty answer: none yet, ask again). Finished groups
        are sent while it waits. The loop records how long it had nothing in flight while waiting for
        admission and how long it had work in flight, which become ``staleness/admission_wait_s`` and
        ``rollout/idle_frac``; ``wait_s`` is how often it looks at ``should_stop``.
        """
        in_flight: set[asyncio.Task] = set()
        request: asyncio.Task | None = None
        limit = self.cfg.rollout.max_concurrent_groups
        loop = asyncio.get_running_loop()
        last = retry_at = loop.time()
        try:
            while not should_stop():
                if request is None and len(in_flight) < limit and loop.time() >= retry_at:
                    request = asyncio.ensure_future(admit(limit - len(in_flight)))
                idle = not in_flight
                waiting = in_flight | {request} if request else in_flight
                if waiting:
                    done, _ = await asyncio.wait(waiting, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                else:
                    done = set()
                    await asyncio.sleep(wait_s)
                now = loop.time()
                if idle:
                    self.admission_wait_s += now - last
                else:
                    self.busy_s += now - last
                last = now
                if request in done:
                    done.discard(request)
                    indices = request.result()
                    in_flight |= {asyncio.create_task(self.play_group(i)) for i in indices}
                    request = None
                    if not indices:  # none now: ask again a tick later (a gate that waits has waited already)
                        retry_at = now + wait_s
                for task in done:
                    in_flight.discard(task)
                    await send(task.result())  # an exception here fails the worker loudly
        finally:
            for task in [*in_flight, *([request] if request else [])]:
                task.cancel()


def summarize_trajectories(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
    """Success, reward, validity and length statistics, overall and per environment tag."""
    out: dict[str, float] = {}
    by_tag: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_tag[t.env_tag].append(t)
    for tag, trajs in [("", list(trajectories)), *sorted(by_tag.items())]:
        if not trajs:
            continue
        key = f"{prefix}/{tag}/" if tag else f"{prefix}/"
        turns = [turn for t in trajs for turn in t.turns]
        out[key + "success"] = float(np.mean([t.success for t in trajs]))
        if tag:
            continue
        out[key + "reward_mean"] = float(np.mean([t.score for t in trajs]))
        out[key + "env_reward_mean"] = float(np.mean([t.env_reward for t in trajs]))
        out[key + "valid_action_rate"] = float(np.mean([turn.format_ok for turn in turns])) if turns else 0.0
        out[key + "num_turns"] = float(np.mean([len(t.turns) for t in trajs]))
        out[key + "response_length"] = float(np.mean([t.num_response_tokens for t in trajs]))
        out[key + "context_truncated_frac"] = float(np.mean([t.truncated_by_context for t in trajs]))
    for tag, trajs in sorted(by_tag.items()):
        out[f"{prefix}/{tag}/reward_mean"] = float(np.mean([t.score for t in trajs]))
    return out


def rollout_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Statistics of the groups a batch was built from, *before* the StarPO-S filter (RAGEN logs
    env metrics before filtering): success, reward, validity, length, in-group reward std."""
    stds = [float(np.std(g.scores, ddof=1)) if len(g.scores) > 1 else 0.0 for g in groups]
    out = summarize_trajectories([t for g in groups for t in g.trajectories], "rollout")
    out["rollout/in_group_reward_std"] = float(np.mean(stds)) if stds else 0.0
    out["rollout/groups"] = float(len(groups))
    out["rollout/generated_tokens"] = float(sum(t.num_response_tokens for g in groups for t in g.trajectories))
    return out


async def evaluate(policy: ReplyPolicy, chat: ChatFormat, envs: Sequence[EnvGroupSpec], seed: int,
                   limits: AgentLimits, *, concurrency: int = 32,
                   progress: Callable[[int], None] | None = None) -> list[Trajectory]:
    """Play ``spec.n_groups`` fixed seeds (``seed``, ``seed+1``, ...) of every env, one episode each."""
    sem = asyncio.Semaphore(concurrency)

    async def one(spec: EnvGroupSpec, s: int) -> Trajectory:
        async with sem:
            env = make_env_from_tag(spec.tag, **spec.overrides)
            traj = await play_episode(policy, chat, env, spec.tag, s, limits, group_id=f"val-{spec.tag}-{s}",
                                      sampling_seed=s)
            if progress:
                progress(1)
            return traj

    jobs = [one(spec, seed + i) for spec in envs for i in range(spec.n_groups)]
    return list(await asyncio.gather(*jobs))


async def validate_engine(cfg: RunConfig, engine: InferenceEngine, chat: ChatFormat) -> dict[str, float]:
    """Validation: one episode on each fixed seed of the validation envs, at validation temperature.

    ``val/policy_version`` is the version the engine held, the policy validated: the learner's current one
    (``Trainer.validate`` lends a fixed-lag run's engines the current weights for it).

    Every episode is submitted at once and the engine batches them as its scheduler allows (``max_num_seqs``):
    few, full engine steps. Each episode samples from its own seeds, so which episodes run together changes
    no token.
    """
    v = cfg.validation
    version = engine.policy_version
    policy = EnginePolicy(engine, temperature=v.temperature, stop_token_ids=(chat.end_of_turn_id,))
    episodes = sum(spec.n_groups for spec in v.envs)
    trajs = await evaluate(policy, chat, v.envs, v.seed, agent_limits(cfg.agent, cfg.inference),
                           concurrency=max(1, episodes))
    return {**summarize_trajectories(trajs, "val"), "val/policy_version": float(version)}
