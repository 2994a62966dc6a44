"""``ragen-async eval``: play fixed seeds with one or more policies and report success, reward, validity,
length.

The same seeds and the same action budget serve three policies, so every learning curve has its
floor and ceiling measured on identical ground: ``llm`` (the model in ``model.path`` on vLLM, or the
configured engine), ``random`` (uniformly random valid actions) and ``oracle`` (the best policy
computable from the true state). One call can play several of them (``--policy random --policy oracle``);
each gets the same seeds and the same numbers as a call with it alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ragen_async.agent.chat import ChatFormat
from ragen_async.agent.episode import EnginePolicy, ReplyPolicy, ScriptedPolicy
from ragen_async.config import EnvGroupSpec, RunConfig
from ragen_async.envs.registry import ENV_TAGS
from ragen_async.protocol import Trajectory
from ragen_async.rollout.engines import make_engine
from ragen_async.rollout.worker import agent_limits, evaluate, summarize_trajectories

POLICIES = ("llm", "random", "oracle")


def episode_record(t: Trajectory, chat: ChatFormat, policy: str) -> dict[str, Any]:
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
        "policy": policy, "env_tag": t.env_tag, "seed": t.seed, "success": t.success, "reward": t.env_reward,
        "score": t.score, "format_penalty": t.format_penalty, "num_turns": len(t.turns), "num_tokens": t.num_tokens,
        "response_tokens": t.num_response_tokens, "truncated_by_context": t.truncated_by_context,
        "turns": [msgspec.structs.asdict(turn) for turn in t.turns], "replies": replies,
    }


def _summary(policy: str, trajectories: list[Trajectory], specs: list[EnvGroupSpec]) -> dict[str, Any]:
    """One policy's figures, overall and per environment tag."""
    metrics = summarize_trajectories(trajectories, "eval")
    per_env = {}
    for spec in specs:
        trajs = [t for t in trajectories if t.env_tag == spec.tag]
        m = summarize_trajectories(trajs, "x")
        per_env[spec.tag] = {"success": m["x/success"], "reward_mean": m["x/reward_mean"],
                             "valid_action_rate": m["x/valid_action_rate"], "num_turns": m["x/num_turns"],
                             "response_length": m["x/response_length"], "episodes": len(trajs)}
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


def run_eval(cfg: RunConfig, *, policies: Sequence[str], env_tags: list[str] | None, seeds: int | None,
             first_seed: int | None, temperature: float | None, out: Path | None,
             console: Console | None = None) -> dict[str, dict[str, Any]]:
    """Play the same seeds with every policy in ``policies`` (in order, duplicates once) and print one
    table, a row per (env, policy). ``temperature`` is the LLM's sampling temperature (0 = greedy;
    ``None`` = ``validation.temperature``); the scripted policies ignore it. Returns each policy's
    summary (:func:`_summary`), keyed by policy in the order given."""
    console = console or Console(stderr=True)
    policies = list(dict.fromkeys(policies))
    if not policies:
        raise ValueError("no policy to evaluate")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"--policy must be llm, random or oracle (got {bad[0]!r})")
    if temperature is not None and not temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if env_tags:
        unknown = [t for t in env_tags if t not in ENV_TAGS]
        if unknown:
            raise ValueError(f"unknown environment tag(s) {unknown}; known: {sorted(ENV_TAGS)}")
        specs = [EnvGroupSpec(tag=t, n_groups=seeds or 128) for t in env_tags]
    else:
        specs = [s if seeds is None else s.model_copy(update={"n_groups": seeds}) for s in cfg.validation.envs]
    first = cfg.validation.seed if first_seed is None else first_seed
    # Passed straight to the sampler (SamplingConfig, vLLM's SamplingParams), where 0 is greedy decoding:
    # the config's temperature fields are > 0 and are not involved.
    llm_temperature = cfg.validation.temperature if temperature is None else temperature
    chat = ChatFormat.from_pretrained(cfg.model.path, enable_think=cfg.agent.enable_think)
    limits = agent_limits(cfg.agent, cfg.inference)
    total = sum(s.n_groups for s in specs)

    async def main() -> dict[str, list[Trajectory]]:
        engine = None
        results: dict[str, list[Trajectory]] = {}
        try:
            for policy in policies:
                if policy == "llm":
                    engine = make_engine(cfg, seed=cfg.seed)
                    reply_policy: ReplyPolicy = EnginePolicy(engine, temperature=llm_temperature,
                                                             stop_token_ids=(chat.end_of_turn_id,))
                else:
                    reply_policy = ScriptedPolicy(chat, policy, cfg.agent.max_actions_per_turn, seed=first)
                with Progress(TextColumn(f"eval {policy}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              console=console, transient=True) as progress:
                    task = progress.add_task("episodes", total=total)
                    results[policy] = await evaluate(reply_policy, chat, specs, first, limits,
                                                     progress=lambda n, task=task: progress.advance(task, n))
        finally:
            if engine is not None:
                engine.shutdown()
        return results

    trajectories = asyncio.run(main())
    summaries = {policy: _summary(policy, trajectories[policy], specs) for policy in policies}
    title = f"seeds {first}..{first + max(s.n_groups for s in specs) - 1}"
    if "llm" in policies:
        title += f"  llm temperature {llm_temperature:g}" + (" (greedy)" if llm_temperature == 0 else "")
    # No vertical rules, and the figures never cropped: the table fits 80 columns (a SLURM log).
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("env", "policy", "episodes", "success", "reward", "valid actions", "turns", "response tokens"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col in ("env", "policy"))
    for i, spec in enumerate(specs):
        for j, policy in enumerate(policies):
            e = summaries[policy]["per_env"][spec.tag]
            table.add_row(spec.tag, policy, str(e["episodes"]), f"{e['success']:.3f}",
                          f"{e['reward_mean']:+.3f}", f"{e['valid_action_rate']:.3f}", f"{e['num_turns']:.2f}",
                          f"{e['response_length']:.1f}", end_section=j == len(policies) - 1 and i < len(specs) - 1)
    console.print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for policy in policies:
                for t in trajectories[policy]:
                    f.write(json.dumps(episode_record(t, chat, policy)) + "\n")
        console.print(f"episodes written to {out}")
    return summaries
