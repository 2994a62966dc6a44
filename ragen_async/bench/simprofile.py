"""The engine profile that drives the simulated cluster (``ragen-async bench cluster``).

A profile is what the real rollout path produced on the real engine: whole Sokoban groups played by the
real ``RolloutWorker`` (its own concurrency, ``rollout.max_concurrent_groups`` groups at once) on the vLLM
engine with the project's tiny model. Of every episode it keeps only shapes and times: prompt tokens, and
per turn the reply tokens, the generate call's wall time (so its per-token latency, prefill and queueing
included, at the engine's real load) and the environment feedback tokens; the episode's wall time (the
rest is agent and environment time between turns); the score and success. The simulated actors draw whole
recorded groups from it, so per-token latencies, turns per episode, tokens per turn and in-group score
spreads keep their real joint distribution.

``measure_profile`` makes one (``python -m ragen_async.bench.simprofile OUT.json``); the one the
benchmark uses by default is ``configs/sim/sokoban_tiny_profile.json``, with its provenance inside.
"""

from __future__ import annotations

import asyncio
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_PROFILE = Path("configs/sim/sokoban_tiny_profile.json")


@dataclass(frozen=True)
class EpisodeShape:
    """One recorded episode: token counts, generate times and outcome."""

    prompt_tokens: int
    reply_tokens: tuple[int, ...]
    """Per turn: tokens the engine sampled."""
    generate_s: tuple[float, ...]
    """Per turn: wall time of the generate call."""
    feedback_tokens: tuple[int, ...]
    """Per turn: context tokens appended after the reply (the environment's message; 0 after the last)."""
    episode_s: float
    """Wall time of the whole episode (generate calls + agent and environment time between them)."""
    env_reward: float
    format_penalty: float
    success: bool

    @property
    def turns(self) -> int:
        return len(self.reply_tokens)

    @property
    def agent_s_per_turn(self) -> float:
        """Time between generate calls (templating, parsing, env steps), spread evenly over the turns."""
        return max(0.0, self.episode_s - sum(self.generate_s)) / max(1, self.turns)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + sum(self.reply_tokens) + sum(self.feedback_tokens)


@dataclass(frozen=True)
class Profile:
    groups: tuple[tuple[EpisodeShape, ...], ...]
    provenance: dict

    def per_token_latency_s(self) -> np.ndarray:
        """Every recorded turn's generate time per sampled token."""
        return np.array([g / max(1, n) for grp in self.groups for e in grp
                         for n, g in zip(e.reply_tokens, e.generate_s, strict=True)])

    def group_s(self) -> np.ndarray:
        """Each recorded group's duration as the simulation plays it (its slowest episode)."""
        return np.array([max(e.episode_s for e in grp) for grp in self.groups])

    def summary(self) -> dict[str, float]:
        eps = [e for grp in self.groups for e in grp]
        lat = self.per_token_latency_s()
        return {"groups": len(self.groups), "episodes": len(eps),
                "turns_mean": float(np.mean([e.turns for e in eps])),
                "reply_tokens_mean": float(np.mean([n for e in eps for n in e.reply_tokens])),
                "episode_tokens_mean": float(np.mean([e.num_tokens for e in eps])),
                "token_latency_ms_p50": 1e3 * float(np.median(lat)),
                "token_latency_ms_p90": 1e3 * float(np.quantile(lat, 0.9)),
                "group_s_mean": float(np.mean(self.group_s()))}


def load_profile(path: Path = DEFAULT_PROFILE) -> Profile:
    data = json.loads(Path(path).read_text())
    groups = tuple(tuple(EpisodeShape(e["prompt_tokens"], tuple(e["reply_tokens"]), tuple(e["generate_s"]),
                                      tuple(e["feedback_tokens"]), e["episode_s"], e["env_reward"],
                                      e["format_penalty"], bool(e["success"])) for e in grp["episodes"])
                   for grp in data["groups"])
    if not groups or any(not grp for grp in groups):
        raise ValueError(f"{path}: a profile needs at least one group, each with episodes")
    return Profile(groups, data.get("provenance", {}))


def episode_shape(traj) -> dict:  # noqa: ANN001 - a protocol.Trajectory
    """A played trajectory's shape: token runs from its loss mask, times from its turn records."""
    mask = np.asarray(traj.loss_mask).astype(bool)
    # Runs of equal mask values: [prompt], reply, feedback, reply, feedback, ...
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    runs = np.split(mask, edges)
    lengths = [len(r) for r in runs]
    first_sampled = bool(runs[0][0]) if runs else False
    prompt = 0 if first_sampled else lengths[0]
    rest = lengths[0 if first_sampled else 1:]
    replies, feedback = rest[0::2], rest[1::2]
    feedback += [0] * (len(replies) - len(feedback))
    if replies != [t.response_tokens for t in traj.turns if t.response_tokens] or len(replies) != len(traj.turns):
        raise ValueError(f"{traj.traj_id}: the loss mask's reply runs {replies} do not match the turn records")
    return {"prompt_tokens": prompt, "reply_tokens": replies, "generate_s": [t.generate_s for t in traj.turns],
            "feedback_tokens": feedback, "episode_s": float(traj.timings.get("episode_s", 0.0)),
            "env_reward": traj.env_reward, "format_penalty": traj.format_penalty, "success": bool(traj.success)}


def measure_profile(config: Path, overrides: list[str], groups: int, warmup_groups: int) -> dict:
    """Play ``warmup_groups + groups`` groups with the real rollout worker on the configured (real) engine,
    exactly as a rollout actor plays them (``RolloutWorker.run``); keep the shapes of the last ``groups``."""
    from ragen_async.agent.chat import ChatFormat
    from ragen_async.bench.machine import machine_description
    from ragen_async.config import load_config
    from ragen_async.rollout.engines import make_engine
    from ragen_async.rollout.worker import RolloutWorker

    cfg = load_config(config, overrides)
    engine = make_engine(cfg, seed=cfg.seed)
    chat = ChatFormat.from_pretrained(cfg.model.path, enable_think=cfg.agent.enable_think)
    worker = RolloutWorker(cfg, engine, chat)
    total = warmup_groups + groups
    played: list = []
    next_index = 0

    async def admit(n: int) -> list[int]:
        nonlocal next_index
        got = list(range(next_index, min(total, next_index + n)))
        next_index += len(got)
        return got

    async def send(group) -> None:  # noqa: ANN001
        played.append(group)

    t0 = time.perf_counter()
    try:
        asyncio.run(worker.run(admit, send, lambda: len(played) >= total))
    finally:
        engine.shutdown()
    wall = time.perf_counter() - t0
    kept = sorted((g for g in played if g.index >= warmup_groups), key=lambda g: g.index)
    return {
        "provenance": {
            "measured": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python -m ragen_async.bench.simprofile " + " ".join(
                [str(config), *overrides, f"--groups {groups} --warmup-groups {warmup_groups}"]),
            "machine": machine_description(), "python": platform.python_version(),
            "engine": cfg.inference.engine, "model": cfg.model.path, "env": [e.tag for e in cfg.rollout.envs],
            "group_size": cfg.rollout.group_size, "max_concurrent_groups": cfg.rollout.max_concurrent_groups,
            "max_tokens_per_turn": cfg.agent.max_tokens_per_turn, "wall_s": wall,
            "note": "played by RolloutWorker.run on one engine, max_concurrent_groups groups at once; the first "
                    "warmup groups are not kept",
        },
        "groups": [{"index": g.index, "episodes": [episode_shape(t) for t in g.trajectories]} for g in kept],
    }


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", type=Path, default=Path("configs/tiny/starpo_s_sokoban.yaml"))
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--warmup-groups", type=int, default=8)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    data = measure_profile(args.config, args.overrides, args.groups, args.warmup_groups)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    print(json.dumps(load_profile(args.out).summary(), indent=1))


if __name__ == "__main__":  # vLLM on CPU spawns processes: keep the entry point guarded
    main(sys.argv[1:])
