"""The text-environment interface every RAGEN environment implements.

An environment is a gymnasium ``Env`` whose observations are text renders and whose actions are
action *strings* in its vocabulary (``action_lookup`` values, matched case-insensitively by the
agent's parser before they get here). The agent protocol builds prompts from the attributes
(``instructions``, ``grid_vocab``, ``action_lookup``), so the same prompt code serves every env.
Read them after ``reset``: an env may change them per episode (Bandit reassigns its arm names).

``oracle_actions`` gives the best actions computable from the true state; together with a
uniformly random valid policy it brackets every learning curve on the same seeds and budget.

Determinism: everything random in an episode (the level, slips, payouts) is drawn from generators
that ``episode_rngs`` derives from the reset seed alone, so ``reset(seed=s)`` followed by the same
actions gives the same trajectory in every process. Nothing goes through Python's ``hash()``, which
is salted per process (RAGEN's Sokoban reseeds through it, so its levels differ between workers).
"""

from __future__ import annotations

import dataclasses
import random
import string
from abc import abstractmethod
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

ConfigT = TypeVar("ConfigT")

# Renders and actions are short printable strings; "√" is the one non-ASCII grid symbol.
_TEXT_SPACE = spaces.Text(max_length=4096, min_length=0, charset=string.printable + "√")


class ActionNames(spaces.Space):
    """The action space of an env with a fixed vocabulary: one of ``names`` (case-insensitive)."""

    def __init__(self, names: tuple[str, ...], seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)
        self.names = names

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return self.names[int(self.np_random.integers(len(self.names)))]

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and x.strip().casefold() in {n.casefold() for n in self.names}

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"ActionNames({self.names})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActionNames) and other.names == self.names


def episode_rngs(seed: int | None, n: int) -> list[np.random.Generator]:
    """``n`` independent generators for one episode, a pure function of ``seed``.

    Each stream gets its own ``SeedSequence`` child, so e.g. a FrozenLake map and its slip draws never
    share numbers. ``seed=None`` draws fresh OS entropy (an unreproducible episode).
    """
    return [np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(n)]


def build_config(config_cls: type[ConfigT], overrides: dict[str, Any]) -> ConfigT:
    """``config_cls(**overrides)``, but an unknown option is a ``ValueError`` naming the valid ones."""
    valid = sorted(field.name for field in dataclasses.fields(config_cls))  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown {config_cls.__name__} option(s) {unknown}; valid options: {valid}")
    return config_cls(**overrides)


class TextEnv(gym.Env):
    """Base class: reset(seed) -> (text, info), step(action string) -> gymnasium 5-tuple."""

    # "text": render() returns the text observation. gymnasium's checker wants a positive render_fps
    # whenever render modes are declared; nothing here is animated, so the value is nominal.
    metadata = {"render_modes": ["text"], "render_fps": 1}
    # gymnasium's make() requires declared spaces: observations are text; actions are the env's action
    # names (see ``action_space``), or any text for free-form envs.
    observation_space = _TEXT_SPACE

    instructions: str = ""
    """Task description placed at the top of the first user message."""
    grid_vocab: dict[str, str] | None = None
    """Symbol -> meaning legend shown in the prompt, if the render is a grid."""
    action_lookup: dict[int, str] | None = None
    """Action id -> canonical action name; ``None`` means free-form text actions (Countdown)."""
    max_actions_per_episode: int = 10
    """The agent's action budget for one episode; the oracle plans within it."""

    _terminated: bool | None = None
    """``None`` until the first reset, then whether the current episode has ended."""

    def __init__(self, *, render_mode: str | None = None) -> None:
        """Subclasses take ``render_mode`` (gymnasium's ``make`` passes it) besides their config options
        and hand it here first: ``None`` or ``"text"``, stored as ``self.render_mode``."""
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            modes = " or ".join(repr(m) for m in self.metadata["render_modes"])
            raise ValueError(f"{type(self).__name__}: render_mode must be None or {modes} (got {render_mode!r})")
        self.render_mode = render_mode

    @abstractmethod
    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:  # type: ignore[override]
        """Start a new episode deterministically from ``seed`` (same seed, same state, in any process)."""

    def _reset_rngs(self, seed: int | None, n: int) -> list[np.random.Generator]:
        """Subclasses' ``reset`` starts here: seeds gymnasium's ``np_random`` (``super().reset``, so
        gymnasium's wrappers, vector envs and ``check_env`` see a seeded env) and returns the episode's
        ``n`` generators. A seeded reset is a pure function of ``seed``; an unseeded one continues
        ``np_random``'s stream (gymnasium's semantics), so it too is reproducible after a seeded reset."""
        super().reset(seed=seed)
        if seed is None:
            seed = int(self.np_random.integers(2**63 - 1))
        return episode_rngs(seed, n)

    @abstractmethod
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        """Apply one action string (a canonical ``action_lookup`` value, or free text).

        Returns gymnasium's ``(observation_text, reward, terminated, truncated, info)``; ``info`` has at
        least ``success: bool`` and ``action_is_effective: bool``. ``terminated`` means the env's own
        rules ended the episode (goal, hole, bandit pulled); the env never truncates by itself, the
        agent's action budget does. Stepping before ``reset`` or after termination is a ``RuntimeError``,
        and an action outside the vocabulary is a ``ValueError``.
        """

    @abstractmethod
    def render(self) -> str:  # type: ignore[override]
        """Text render of the current state: the observation ``reset`` and ``step`` return (gymnasium's
        ``"text"`` render mode). It is returned with ``render_mode=None`` too, because the agent and the
        envs themselves build observations from it."""

    @property
    @abstractmethod
    def success(self) -> bool:
        """The task is solved in the current state."""

    @abstractmethod
    def oracle_actions(self, max_actions: int) -> list[str]:
        """Best next actions (at most ``max_actions``) from the true current state."""

    @property
    def action_space(self) -> spaces.Space:  # type: ignore[override]
        """``ActionNames`` of the current vocabulary (it may change at reset), or any text (free-form)."""
        if not self.action_lookup:
            return _TEXT_SPACE
        names = tuple(self.action_lookup.values())
        cached = self.__dict__.get("_action_space")
        if cached is None or cached.names != names:
            cached = self.__dict__["_action_space"] = ActionNames(names)
        return cached

    def valid_actions(self) -> list[str]:
        """Every action string the env accepts (empty for free-form envs)."""
        return list(self.action_lookup.values()) if self.action_lookup else []

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random valid action."""
        return rng.choice(self.valid_actions())

    def action_id(self, action: str) -> int:
        """The ``action_lookup`` id of an action name (case and surrounding whitespace ignored)."""
        wanted = action.strip().casefold()
        for action_id, name in (self.action_lookup or {}).items():
            if name.casefold() == wanted:
                return action_id
        raise ValueError(f"unknown action {action!r}; valid actions: {self.valid_actions()}")

    def _check_steppable(self) -> None:
        """Raise unless an episode is running (subclasses call this first thing in ``step``)."""
        if self._terminated is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if self._terminated:
            raise RuntimeError(f"{type(self).__name__}: the episode has terminated; call reset()")
