"""FrozenLake: walk from the start to the goal across ice without falling into a hole (RAGEN's FrozenLake).

Implemented here rather than by wrapping gymnasium's ``FrozenLakeEnv`` so that the map and the slips
both come from our seeded generators. Each reset draws a map, a pure function of the seed: every tile is
frozen with probability ``p_frozen``, start and goal are distinct random tiles, and the map is redrawn
(from the same generator) until a path links them. On slippery ice the player moves in the intended
direction or in either perpendicular one, 1/3 each; a move off the board leaves it in place.

The oracle is finite-horizon value iteration under that slip model. Its horizon is the env's own
``steps_left`` (the action budget minus the actions taken since reset), so it maximizes the chance of
reaching the goal before the agent's budget runs out. It returns one action per call: the env is
stochastic, so re-planning after every step (acting closed-loop) is what optimal play means.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragen_async.envs.base import TextEnv, build_config

# Action id -> (row, col) step, in RAGEN's (and gymnasium's) order. Consecutive directions are
# perpendicular, so the slip directions of action id a are a-1, a and a+1 (cyclically).
ACTION_NAMES = {1: "Left", 2: "Down", 3: "Right", 4: "Up"}
_STEPS = ((0, -1), (1, 0), (0, 1), (-1, 0))


@dataclass(frozen=True)
class FrozenLakeConfig:
    size: int = 4
    """The board is ``size`` x ``size`` tiles."""
    p_frozen: float = 0.8
    """Probability that a tile is frozen (safe) rather than a hole."""
    is_slippery: bool = True
    """Whether moves slip to a perpendicular direction (probability 1/3 each)."""
    max_actions_per_episode: int = 10
    """The agent's action budget per episode, and the oracle's planning horizon."""

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"size must be at least 2, got {self.size}")
        if not 0.0 < self.p_frozen <= 1.0:
            raise ValueError(f"p_frozen must lie in (0, 1], got {self.p_frozen}")
        if self.max_actions_per_episode < 1:
            raise ValueError("max_actions_per_episode must be positive")


@dataclass(frozen=True)
class LakeMap:
    """One board. Tiles are flat indices ``row * size + col``."""

    size: int
    holes: frozenset[int]
    start: int
    goal: int

    def neighbor(self, tile: int, direction: int) -> int:
        """The tile one step in ``direction`` (an index into ``_STEPS``), or ``tile`` at the edge."""
        row, col = divmod(tile, self.size)
        d_row, d_col = _STEPS[direction]
        if 0 <= row + d_row < self.size and 0 <= col + d_col < self.size:
            return (row + d_row) * self.size + col + d_col
        return tile

    def has_path(self) -> bool:
        """Whether the goal is reachable from the start over frozen tiles (BFS)."""
        seen, queue = {self.start}, deque([self.start])
        while queue:
            tile = queue.popleft()
            if tile == self.goal:
                return True
            for direction in range(4):
                nxt = self.neighbor(tile, direction)
                if nxt not in seen and nxt not in self.holes:
                    seen.add(nxt)
                    queue.append(nxt)
        return False


def generate_map(rng: np.random.Generator, size: int, p_frozen: float) -> LakeMap:
    """A random board whose goal is reachable, redrawn from ``rng`` until it is."""
    while True:
        frozen = rng.random(size * size) < p_frozen
        start, goal = (int(tile) for tile in rng.choice(size * size, size=2, replace=False))
        holes = frozenset(int(tile) for tile in np.flatnonzero(~frozen)) - {start, goal}
        lake = LakeMap(size, holes, start, goal)
        if lake.has_path():
            return lake


class FrozenLakeEnv(TextEnv):
    """Text FrozenLake on a generated map; the oracle plays the finite-horizon optimal policy."""

    instructions = (
        "You are crossing a frozen lake. Reach the goal G without stepping into a hole O. Move Left, Down, "
        "Right or Up. The ice is slippery: a move may carry you sideways (to either side of the direction "
        "you chose) instead of where you meant to go, so keep clear of holes next to your path. Moving into "
        "the edge of the lake leaves you where you are."
    )
    grid_vocab = {
        "P": "you (the player)",
        "_": "frozen ice",
        "O": "hole",
        "G": "goal",
        "X": "you, fallen into a hole",
        "√": "you, on the goal",
    }
    action_lookup = ACTION_NAMES

    def __init__(self, *, render_mode: str | None = None, **config: Any) -> None:
        super().__init__(render_mode=render_mode)
        self.config = build_config(FrozenLakeConfig, config)
        self.max_actions_per_episode = self.config.max_actions_per_episode
        self._lake: LakeMap | None = None
        self._player = 0
        self._num_actions = 0
        self._q_values: np.ndarray | None = None
        """Oracle table ``[horizon - 1, tile, direction]``, computed on first use for the current map."""

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:  # type: ignore[override]
        map_rng, self._slip_rng = self._reset_rngs(seed, 2)
        self._lake = generate_map(map_rng, self.config.size, self.config.p_frozen)
        self._player = self._lake.start
        self._num_actions = 0
        self._q_values = None
        self._terminated = False
        return self.render(), {}

    @property
    def steps_left(self) -> int:
        """Actions left in the agent's budget (never below 0)."""
        return max(self.max_actions_per_episode - self._num_actions, 0)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        self._check_steppable()
        assert self._lake is not None
        direction = self.action_id(action) - 1
        if self.config.is_slippery:
            direction = (direction + int(self._slip_rng.integers(-1, 2))) % 4
        before = self._player
        self._player = self._lake.neighbor(before, direction)
        self._num_actions += 1
        self._terminated = self._player == self._lake.goal or self._player in self._lake.holes
        info = {"success": self.success, "action_is_effective": self._player != before}
        return self.render(), float(self.success), self._terminated, False, info

    def render(self) -> str:  # type: ignore[override]
        assert self._lake is not None, "render() before reset()"
        lake = self._lake
        symbols = []
        for tile in range(lake.size * lake.size):
            if tile == self._player:
                symbol = "√" if tile == lake.goal else "X" if tile in lake.holes else "P"
            else:
                symbol = "G" if tile == lake.goal else "O" if tile in lake.holes else "_"
            symbols.append(symbol)
        return "\n".join("".join(symbols[row * lake.size : (row + 1) * lake.size]) for row in range(lake.size))

    @property
    def success(self) -> bool:
        return self._lake is not None and self._player == self._lake.goal

    def oracle_actions(self, max_actions: int) -> list[str]:
        """The one action maximizing the chance of reaching the goal within ``steps_left`` (at least 1) actions.

        Ties go to the action that also does best with fewer actions left, so that with a safe path the
        oracle takes a shortest one instead of bumping into the edge while it can afford to.
        """
        if self._terminated or max_actions < 1:
            return []
        if self._q_values is None:
            self._q_values = self._value_iteration()
        candidates = np.arange(4)
        for horizon in range(max(self.steps_left, 1), 0, -1):  # past the budget, still play the best one-step move
            q_values = self._q_values[horizon - 1, self._player, candidates]
            candidates = candidates[q_values >= q_values.max() - 1e-12]
        return [ACTION_NAMES[int(candidates[0]) + 1]]

    def _value_iteration(self) -> np.ndarray:
        """Q[h - 1, tile, direction] = P(reach the goal within h actions | take direction now, then act optimally)."""
        assert self._lake is not None
        lake, num_tiles = self._lake, self._lake.size**2
        slips = (-1, 0, 1) if self.config.is_slippery else (0,)
        # transition[direction, tile, next_tile] = P(next_tile | tile, direction)
        transition = np.zeros((4, num_tiles, num_tiles))
        for direction in range(4):
            for tile in range(num_tiles):
                for slip in slips:
                    transition[direction, tile, lake.neighbor(tile, (direction + slip) % 4)] += 1 / len(slips)
        at_goal = np.zeros(num_tiles)
        at_goal[lake.goal] = 1.0
        alive = np.ones(num_tiles)  # episodes continue only from frozen non-goal tiles
        alive[[*lake.holes, lake.goal]] = 0.0

        q_values = np.zeros((self.max_actions_per_episode, num_tiles, 4))
        value = np.zeros(num_tiles)
        for horizon in range(self.max_actions_per_episode):
            q_values[horizon] = (transition @ (at_goal + alive * value)).T
            value = q_values[horizon].max(axis=1)
        return q_values
