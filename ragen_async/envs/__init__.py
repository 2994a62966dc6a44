"""RAGEN's text environments (Bandit, Sokoban, FrozenLake, Countdown) behind one ``TextEnv`` interface.

Importing the package registers them with gymnasium (``ragen/Sokoban-v0`` etc.).
"""

from ragen_async.envs.bandit import BanditConfig, BanditEnv
from ragen_async.envs.base import TextEnv
from ragen_async.envs.countdown import CountdownConfig, CountdownEnv
from ragen_async.envs.frozen_lake import FrozenLakeConfig, FrozenLakeEnv
from ragen_async.envs.registry import ENV_CLASSES, ENV_TAGS, GYM_IDS, make_env, make_env_from_tag
from ragen_async.envs.sokoban import SokobanConfig, SokobanEnv

__all__ = [
    "ENV_CLASSES",
    "ENV_TAGS",
    "GYM_IDS",
    "BanditConfig",
    "BanditEnv",
    "CountdownConfig",
    "CountdownEnv",
    "FrozenLakeConfig",
    "FrozenLakeEnv",
    "SokobanConfig",
    "SokobanEnv",
    "TextEnv",
    "make_env",
    "make_env_from_tag",
]
