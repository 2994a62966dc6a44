"""Sokoban: push every box onto a target (RAGEN's SimpleSokoban / LargerSokoban).

Levels come from our own generator, a pure function of the reset seed:

1. **Room.** A random walk inside the border walls carves floor with small stamps (crosses, bars,
   2x2 blocks), so the floor is one connected region with nooks; rooms under half the interior are
   redrawn.
2. **Solved state.** Targets and the player go on distinct random floor cells, each box on its target.
3. **Reverse play.** The player walks randomly; whenever it steps away from an adjacent box it may
   *pull* the box along. A pull undoes a legal push, so every state on the walk is solvable by
   construction. We keep the last walk state of maximal box displacement with no box on a target.
4. **Checks.** A breadth-first search gives the shortest solution (cached as the oracle's first plan).
   Levels whose shortest solution exceeds the action budget are redrawn (by default), so every episode
   is winnable; RAGEN does not guarantee that.

Two difficulty presets (``difficulty``):

* ``"ragen"`` (default): levels as hard as those RAGEN's own generator (gym_sokoban's reverse play)
  draws. Over reset seeds 0-299 of the 6x6, one-box room: shortest solution median 2, mean 2.8, p90 5;
  ten uniformly random moves solve 29 % (RAGEN's generator, measured the same way: median 2, mean
  about 3.3, p90 6, about 27 %). A 20-step reverse walk; any level that is not already solved is kept.
* ``"hard"``: a 60-step walk, and levels with a box displacement under 2 or a solution made of pushes
  only are redrawn. Median 6, mean 5.5, p90 8; ten random moves solve 3 %. Harder than RAGEN's, and
  what this project used before the presets existed (docs/results.md's Sokoban runs).

Redraws continue the same seeded generator, so the level stays a pure function of the seed. Rewards
follow gym_sokoban: -0.1 per step, +1 when a box lands on a target, -1 when one leaves, +10 when all
boxes are on targets, which terminates the episode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ragen_async.envs.base import TextEnv, build_config

STEP_REWARD = -0.1
BOX_ON_TARGET_REWARD = 1.0
SOLVED_REWARD = 10.0

# Action id -> (row, col) step; ids and names follow RAGEN.
ACTION_NAMES = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}
_STEPS = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}

# Floor stamps for the room carver, as (row, col) offsets from the walker.
_STAMPS = (
    ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1)),
    ((0, 0), (0, -1), (0, 1)),
    ((0, 0), (-1, 0), (1, 0)),
    ((0, 0), (0, 1), (1, 0), (1, 1)),
)
_TURN_PROB = 0.35  # chance the carving walker changes direction (RAGEN's value)
_PULL_PROB = 0.8  # chance a step away from an adjacent box drags it along


@dataclass(frozen=True)
class LevelRules:
    """What a difficulty preset changes in level generation."""

    reverse_steps: int
    """Length of the reverse-play walk (longer walks scramble more)."""
    min_displacement: int
    """Redraw levels whose boxes sit fewer than this many cells (Manhattan, summed) from their targets."""
    reject_push_only: bool
    """Redraw levels whose shortest solution is pushes only (never a free step)."""


DIFFICULTIES: dict[str, LevelRules] = {
    "ragen": LevelRules(reverse_steps=20, min_displacement=1, reject_push_only=False),
    "hard": LevelRules(reverse_steps=60, min_displacement=2, reject_push_only=True),
}
"""Difficulty presets; see the module docstring for the distribution each one gives."""
_MAX_ATTEMPTS = 1000  # a few attempts suffice in practice; this only bounds a misconfigured room


@dataclass(frozen=True)
class SokobanConfig:
    dim_room: tuple[int, int] = (6, 6)
    """Grid (rows, cols), border walls included."""
    num_boxes: int = 1
    """Boxes (and targets) per level."""
    max_actions_per_episode: int = 10
    """The agent's action budget per episode."""
    difficulty: str = "ragen"
    """Level difficulty preset: ``ragen`` (RAGEN's distribution) or ``hard`` (see the module docstring)."""
    num_reverse_steps: int | None = None
    """Length of the reverse-play walk; longer walks give harder levels. ``None`` = the preset's."""
    solvable_within_budget: bool = True
    """Only keep levels whose shortest solution fits in ``max_actions_per_episode`` (RAGEN does not check)."""
    step_reward: float = STEP_REWARD
    """Reward of every move (gym_sokoban's -0.1). 0 removes the move penalty: a policy that never places
    a box can then no longer improve its return by moving less (see docs/results.md). The prompt only
    mentions a move cost when this is negative."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dim_room", tuple(self.dim_room))  # YAML and JSON give lists
        if len(self.dim_room) != 2 or min(self.dim_room) < 4:
            raise ValueError(f"dim_room must be (rows, cols) with both >= 4, got {self.dim_room}")
        interior = (self.dim_room[0] - 2) * (self.dim_room[1] - 2)
        if not 1 <= self.num_boxes <= interior // 3:
            raise ValueError(f"num_boxes must lie in [1, {interior // 3}] for a {self.dim_room} room")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {sorted(DIFFICULTIES)}, got {self.difficulty!r}")
        if self.max_actions_per_episode < 1 or (self.num_reverse_steps is not None and self.num_reverse_steps < 1):
            raise ValueError("max_actions_per_episode and num_reverse_steps must be positive")
        if self.solvable_within_budget and self.max_actions_per_episode < 3 and self.difficulty == "hard":
            # The easiest "hard" level takes 3 moves (two pushes plus one free step).
            raise ValueError("solvable_within_budget with difficulty hard needs max_actions_per_episode >= 3")


@dataclass(frozen=True)
class Room:
    """The static part of a level. Cells are flat indices ``row * cols + col``."""

    rows: int
    cols: int
    floor: frozenset[int]
    """Every non-wall cell (targets included)."""
    targets: frozenset[int]

    def step_offset(self, action_id: int) -> int:
        """Flat-index offset of one move; the border walls make wrap-around impossible."""
        d_row, d_col = _STEPS[action_id]
        return d_row * self.cols + d_col


State = tuple[int, frozenset[int]]
"""(player cell, box cells)."""


def move(room: Room, state: State, action_id: int) -> State:
    """The state after one move: the player walks, pushes one box if the cell behind it is free, or stays."""
    player, boxes = state
    offset = room.step_offset(action_id)
    ahead = player + offset
    if ahead not in room.floor:
        return state
    if ahead in boxes:
        beyond = ahead + offset
        if beyond not in room.floor or beyond in boxes:
            return state
        boxes = (boxes - {ahead}) | {beyond}
    return ahead, boxes


def solve(room: Room, state: State) -> list[int] | None:
    """A shortest action-id sequence that puts every box on a target (BFS), or ``None`` if unsolvable."""
    if state[1] == room.targets:
        return []
    parent: dict[State, tuple[State, int] | None] = {state: None}
    frontier = [state]
    while frontier:
        next_frontier = []
        for current in frontier:
            for action_id in ACTION_NAMES:
                child = move(room, current, action_id)
                if child in parent:
                    continue
                parent[child] = (current, action_id)
                if child[1] == room.targets:
                    plan = []
                    link = parent[child]
                    while link is not None:
                        previous, previous_action = link
                        plan.append(previous_action)
                        link = parent[previous]
                    return plan[::-1]
                next_frontier.append(child)
        frontier = next_frontier
    return None


def _carve_room(rng: np.random.Generator, rows: int, cols: int) -> set[int]:
    """Floor cells of a random-walk room; connected because every stamp touches the walker's path."""
    row, col = int(rng.integers(1, rows - 1)), int(rng.integers(1, cols - 1))
    d_row, d_col = _STEPS[int(rng.integers(1, 5))]
    floor: set[int] = set()
    for _ in range(int(1.7 * (rows + cols))):
        if rng.random() < _TURN_PROB:
            d_row, d_col = _STEPS[int(rng.integers(1, 5))]
        for s_row, s_col in _STAMPS[int(rng.integers(len(_STAMPS)))]:
            if 1 <= row + s_row < rows - 1 and 1 <= col + s_col < cols - 1:
                floor.add((row + s_row) * cols + col + s_col)
        row = min(max(row + d_row, 1), rows - 2)
        col = min(max(col + d_col, 1), cols - 2)
    return floor


def _manhattan(room: Room, a: int, b: int) -> int:
    return abs(a // room.cols - b // room.cols) + abs(a % room.cols - b % room.cols)


def _reverse_play(rng: np.random.Generator, config: SokobanConfig) -> tuple[Room, State, int] | None:
    """One attempt: a room, a solved state, then a random pull walk; ``None`` if nothing got scrambled.

    Returns the last walk state of maximal total box displacement with no box on a target (the player
    may have walked off after the last pull), together with that displacement.
    """
    rows, cols = config.dim_room
    floor = _carve_room(rng, rows, cols)
    if len(floor) < max(2 * config.num_boxes + 2, (rows - 2) * (cols - 2) // 2):  # too cramped to scramble
        return None
    cells = [int(cell) for cell in rng.choice(sorted(floor), size=config.num_boxes + 1, replace=False)]
    targets, player = cells[:-1], cells[-1]
    room = Room(rows, cols, frozenset(floor), frozenset(targets))

    boxes = list(targets)  # boxes[i] started on targets[i]; pulls keep that identity
    best: State | None = None
    best_displacement = 0
    rules = DIFFICULTIES[config.difficulty]
    for _ in range(config.num_reverse_steps or rules.reverse_steps):
        action_id = int(rng.integers(1, 5))
        offset = room.step_offset(action_id)
        ahead, behind = player + offset, player - offset
        if ahead not in room.floor or ahead in boxes:
            continue
        if behind in boxes and rng.random() < _PULL_PROB:
            boxes[boxes.index(behind)] = player
        player = ahead
        if room.targets.isdisjoint(boxes):
            displacement = sum(_manhattan(room, box, target) for box, target in zip(boxes, targets, strict=True))
            if displacement >= best_displacement:
                best, best_displacement = (player, frozenset(boxes)), displacement
    return None if best is None else (room, best, best_displacement)


def generate_level(rng: np.random.Generator, config: SokobanConfig) -> tuple[Room, State, list[int]]:
    """A level drawn from ``rng`` by reverse play, with a shortest solution (action ids).

    Attempts continue the same generator, so the result is still a pure function of its seed. An attempt
    is rejected when the preset calls it trivial (:class:`LevelRules`) or, with ``solvable_within_budget``,
    when it needs more moves than the action budget.
    """
    rules = DIFFICULTIES[config.difficulty]
    for _ in range(_MAX_ATTEMPTS):
        scrambled = _reverse_play(rng, config)
        if scrambled is None:
            continue
        room, state, displacement = scrambled
        plan = solve(room, state)
        assert plan is not None, "reverse play only builds solvable levels"
        if displacement < rules.min_displacement or (rules.reject_push_only and len(plan) == displacement):
            continue
        if config.solvable_within_budget and len(plan) > config.max_actions_per_episode:
            continue
        return room, state, plan
    raise RuntimeError(f"no Sokoban level after {_MAX_ATTEMPTS} attempts for {config}")


class SokobanEnv(TextEnv):
    """Text Sokoban on a generated level; the oracle replays a cached shortest solution."""

    _rules = (
        "You are the warehouse keeper P in a Sokoban puzzle. Move Up, Down, Left or Right. Walking into a "
        "box pushes it one cell forward, but only if that cell is free; you can never pull a box, so a box "
        "pushed into a corner or against a wall may be stuck for good. Put every box on a target to win. "
    )
    # The prompt states the reward rules the episode actually uses (step_reward < 0 or not).
    instructions = _rules + "Each move costs a little, a box placed on a target earns a reward, and finishing earns a bonus."
    _instructions_free_moves = _rules + "A box placed on a target earns a reward, and finishing earns a bonus."
    grid_vocab = {
        "#": "wall",
        "_": "empty floor",
        "O": "target",
        "√": "box on target",
        "X": "box",
        "P": "you (the player)",
        "S": "you standing on a target",
    }
    action_lookup = ACTION_NAMES

    def __init__(self, *, render_mode: str | None = None, **config: Any) -> None:
        super().__init__(render_mode=render_mode)
        self.config = build_config(SokobanConfig, config)
        if self.config.step_reward >= 0:
            self.instructions = self._instructions_free_moves
        self.max_actions_per_episode = self.config.max_actions_per_episode
        self._room: Room | None = None
        self._state: State = (0, frozenset())
        # Oracle cache: a shortest plan valid from state `_plan_from`, advanced as the agent follows it.
        self._plan: list[int] = []
        self._plan_from: State | None = None

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:  # type: ignore[override]
        (rng,) = self._reset_rngs(seed, 1)
        self._room, self._state, self._plan = generate_level(rng, self.config)
        self._plan_from = self._state
        self._terminated = False
        return self.render(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        self._check_steppable()
        assert self._room is not None
        action_id = self.action_id(action)
        before = self._state
        self._state = move(self._room, before, action_id)
        if self._plan_from == before and self._plan and self._plan[0] == action_id:
            self._plan, self._plan_from = self._plan[1:], self._state

        on_target_change = len(self._state[1] & self._room.targets) - len(before[1] & self._room.targets)
        reward = self.config.step_reward + BOX_ON_TARGET_REWARD * on_target_change
        if self.success:
            reward += SOLVED_REWARD
        self._terminated = self.success
        info = {"success": self.success, "action_is_effective": self._state[0] != before[0]}
        return self.render(), reward, self._terminated, False, info

    def render(self) -> str:  # type: ignore[override]
        assert self._room is not None, "render() before reset()"
        room, (player, boxes) = self._room, self._state
        lines = []
        for row in range(room.rows):
            symbols = []
            for cell in range(row * room.cols, (row + 1) * room.cols):
                on_target = cell in room.targets
                if cell == player:
                    symbols.append("S" if on_target else "P")
                elif cell in boxes:
                    symbols.append("√" if on_target else "X")
                elif cell in room.floor:
                    symbols.append("O" if on_target else "_")
                else:
                    symbols.append("#")
            lines.append("".join(symbols))
        return "\n".join(lines)

    @property
    def success(self) -> bool:
        return self._room is not None and self._state[1] == self._room.targets

    def oracle_actions(self, max_actions: int) -> list[str]:
        """The first ``max_actions`` moves of a shortest solution from the current state.

        Empty once solved, and also after the agent has pushed a box somewhere it can never leave.
        """
        assert self._room is not None, "oracle_actions() before reset()"
        if self._plan_from != self._state:
            self._plan, self._plan_from = solve(self._room, self._state) or [], self._state
        return [ACTION_NAMES[action_id] for action_id in self._plan[:max_actions]]
