"""Build environments by name or by RAGEN's preset tags, and register them with gymnasium.

``make_env("sokoban", num_boxes=2)`` takes the env's config options as keywords; a tag is a named
preset (RAGEN's ``config/envs.yaml`` entries) whose options can still be overridden. Importing this module
also registers every env under ``ragen/<Name>-v0`` so ``gymnasium.make`` works; registration is skipped
for ids already present, so re-imports and reloads are harmless.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from ragen_async.envs.bandit import BanditEnv
from ragen_async.envs.base import TextEnv
from ragen_async.envs.countdown import CountdownEnv
from ragen_async.envs.frozen_lake import FrozenLakeEnv
from ragen_async.envs.sokoban import SokobanEnv

ENV_CLASSES: dict[str, type[TextEnv]] = {
    "bandit": BanditEnv,
    "sokoban": SokobanEnv,
    "frozen_lake": FrozenLakeEnv,
    "countdown": CountdownEnv,
}

ENV_TAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "Bandit": ("bandit", {"lo_arm_name": "Phoenix", "hi_arm_name": "Dragon"}),
    "BanditTest": ("bandit", {"lo_arm_name": "Trader", "hi_arm_name": "Librarian"}),
    "SimpleSokoban": ("sokoban", {"dim_room": (6, 6), "num_boxes": 1}),
    "LargerSokoban": ("sokoban", {"dim_room": (8, 8), "num_boxes": 2}),
    "FrozenLake": ("frozen_lake", {}),
    "Countdown": ("countdown", {}),
    # Single-digit numbers: the tiny model copies one-digit numbers; at RAGEN's 1..99 its warm start scores 0.
    "SmallCountdown": ("countdown", {"max_number": 9, "max_target": 50}),
}
"""Tag -> (env name, config options)."""

GYM_IDS: dict[str, str] = {
    "bandit": "ragen/Bandit-v0",
    "sokoban": "ragen/Sokoban-v0",
    "frozen_lake": "ragen/FrozenLake-v0",
    "countdown": "ragen/Countdown-v0",
}


def make_env(name: str, **config: Any) -> TextEnv:
    """A fresh env of type ``name`` (a key of ``ENV_CLASSES``); ``config`` are its config options."""
    if name not in ENV_CLASSES:
        raise ValueError(f"unknown env name {name!r}; valid names: {sorted(ENV_CLASSES)}")
    return ENV_CLASSES[name](**config)


def make_env_from_tag(tag: str, **overrides: Any) -> TextEnv:
    """A fresh env from a RAGEN preset tag (a key of ``ENV_TAGS``), with some options overridden."""
    if tag not in ENV_TAGS:
        raise ValueError(f"unknown env tag {tag!r}; valid tags: {sorted(ENV_TAGS)}")
    name, preset = ENV_TAGS[tag]
    return make_env(name, **{**preset, **overrides})


def _register_with_gymnasium() -> None:
    # No max_episode_steps: the env never truncates itself; the agent's action budget does.
    for name, gym_id in GYM_IDS.items():
        if gym_id not in gym.registry:
            env_class = ENV_CLASSES[name]
            gym.register(id=gym_id, entry_point=f"{env_class.__module__}:{env_class.__name__}")


_register_with_gymnasium()
