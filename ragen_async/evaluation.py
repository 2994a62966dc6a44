"""``ragen-async eval``: play fixed seeds with a policy and report success, reward, validity, length.

The same seeds and the same action budget serve three policies, so every learning curve has its
floor and ceiling measured on identical ground: ``llm`` (the model in ``model.path`` on vLLM, or the
configured engine), ``random`` (uniformly random valid actions) and ``oracle`` (the best policy
computable from the true state).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ragen_async.agent.chat import ChatFormat
from ragen_async.agent.episode import EnginePolicy, ScriptedPolicy
from ragen_async.config import EnvGroupSpec, RunConfig
from ragen_async.envs.registry import ENV_TAGS
from ragen_async.protocol import Trajectory
from ragen_async.rollout.engines import make_engine
from ragen_async.rollout.worker import agent_limits, evaluate, summarize_trajectories


def episode_record(t: Trajectory, chat: ChatFormat) -> dict[str, Any]:
    replies = []
    ids, mask = t.token_ids.tolist(), t.loss_mask.tolist()
    start = None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            replies.append(chat.decode(ids[start:i], skip_special_tokens=False))
            start = None
    return {
        "env_tag": t.env_tag, "seed": t.seed, "success": t.success, "reward": t.env_reward, "score": t.score,
        "format_penalty": t.format_penalty, "num_turns": len(t.turns), "num_tokens": t.num_tokens,
        "response_tokens": t.num_response_tokens, "truncated_by_context": t.truncated_by_context,
        "turns": [msgspec.structs.asdict(turn) for turn in t.turns], "replies": replies,
    }


def run_eval(cfg: RunConfig, *, policy: str, env_tags: list[str] | None, seeds: int | None,
             first_seed: int | None, temperature: float | None, out: Path | None,
             console: Console | None = None) -> dict[str, Any]:
    console = console or Console(stderr=True)
    if env_tags:
        unknown = [t for t in env_tags if t not in ENV_TAGS]
        if unknown:
            raise ValueError(f"unknown environment tag(s) {unknown}; known: {sorted(ENV_TAGS)}")
        specs = [EnvGroupSpec(tag=t, n_groups=seeds or 128) for t in env_tags]
    else:
        specs = [s if seeds is None else s.model_copy(update={"n_groups": seeds}) for s in cfg.validation.envs]
    first = cfg.validation.seed if first_seed is None else first_seed
    chat = ChatFormat.from_pretrained(cfg.model.path, enable_think=cfg.agent.enable_think)
    limits = agent_limits(cfg.agent, cfg.inference)
    total = sum(s.n_groups for s in specs)

    async def main() -> list[Trajectory]:
        engine = None
        if policy == "llm":
            engine = make_engine(cfg, seed=cfg.seed)
            reply_policy = EnginePolicy(engine, temperature=temperature or cfg.validation.temperature,
                                        stop_token_ids=(chat.end_of_turn_id,))
        else:
            reply_policy = ScriptedPolicy(chat, policy, cfg.agent.max_actions_per_turn, seed=first)
        try:
            with Progress(TextColumn(f"eval {policy}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                task = progress.add_task("episodes", total=total)
                return await evaluate(reply_policy, chat, specs, first, limits,
                                      progress=lambda n: progress.advance(task, n))
        finally:
            if engine is not None:
                engine.shutdown()

    trajectories = asyncio.run(main())
    metrics = summarize_trajectories(trajectories, "eval")
    table = Table(title=f"policy={policy}  seeds {first}..{first + max(s.n_groups for s in specs) - 1}")
    for col in ("env", "episodes", "success", "reward", "valid actions", "turns", "response tokens"):
        table.add_column(col, justify="right")
    per_env = {}
    for spec in specs:
        trajs = [t for t in trajectories if t.env_tag == spec.tag]
        m = summarize_trajectories(trajs, "x")
        per_env[spec.tag] = {"success": m["x/success"], "reward_mean": m["x/reward_mean"],
                             "valid_action_rate": m["x/valid_action_rate"], "num_turns": m["x/num_turns"],
                             "response_length": m["x/response_length"], "episodes": len(trajs)}
        e = per_env[spec.tag]
        table.add_row(spec.tag, str(len(trajs)), f"{e['success']:.3f}", f"{e['reward_mean']:+.3f}",
                      f"{e['valid_action_rate']:.3f}", f"{e['num_turns']:.2f}", f"{e['response_length']:.1f}")
    console.print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for t in trajectories:
                f.write(json.dumps(episode_record(t, chat)) + "\n")
        console.print(f"episodes written to {out}")
    return {
        "policy": policy,
        "success": metrics["eval/success"],
        "reward_mean": metrics["eval/reward_mean"],
        "valid_action_rate": metrics["eval/valid_action_rate"],
        "num_turns": metrics["eval/num_turns"],
        "response_length": metrics["eval/response_length"],
        "episodes": len(trajectories),
        "per_env": per_env,
    }
