"""Sokoban: render format, move and reward rules, generated levels (checked by an independent solver), oracle."""

import random
import time
from collections import deque

import numpy as np
import pytest

from ragen_async.envs.registry import make_env_from_tag
from ragen_async.envs.sokoban import Room, SokobanEnv, move, solve

MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


def parse(render: str):
    """(walls, targets, boxes, player) as sets of (row, col), read back from the text render."""
    walls, targets, boxes, player = set(), set(), set(), None
    for r, line in enumerate(render.split("\n")):
        for c, symbol in enumerate(line):
            if symbol == "#":
                walls.add((r, c))
            if symbol in "O√S":
                targets.add((r, c))
            if symbol in "X√":
                boxes.add((r, c))
            if symbol in "PS":
                assert player is None, "two players"
                player = (r, c)
    return walls, targets, boxes, player


def shortest_solution_length(render: str) -> int | None:
    """Independent reference BFS over (player, boxes), written from the rules rather than the env."""
    walls, targets, boxes, player = parse(render)
    start = (player, frozenset(boxes))
    depth = {start: 0}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        (pr, pc), bxs = state
        if bxs == targets:
            return depth[state]
        for dr, dc in MOVES.values():
            ahead = (pr + dr, pc + dc)
            if ahead in walls:
                continue
            new_boxes = bxs
            if ahead in bxs:
                beyond = (ahead[0] + dr, ahead[1] + dc)
                if beyond in walls or beyond in bxs:
                    continue
                new_boxes = (bxs - {ahead}) | {beyond}
            nxt = (ahead, new_boxes)
            if nxt not in depth:
                depth[nxt] = depth[state] + 1
                queue.append(nxt)
    return None


def load(env: SokobanEnv, text: str) -> None:
    """Put a hand-written level into ``env`` (tests only: pokes the env's private state)."""
    lines = text.strip().split("\n")
    cols = len(lines[0])
    cell = {(r, c): r * cols + c for r in range(len(lines)) for c in range(cols)}
    walls, targets, boxes, player = parse(text.strip())
    env._room = Room(
        len(lines), cols, frozenset(v for k, v in cell.items() if k not in walls), frozenset(cell[t] for t in targets)
    )
    env._state = (cell[player], frozenset(cell[b] for b in boxes))
    env._plan_from = None
    env._terminated = False


def check_render(render: str, rows: int, cols: int, num_boxes: int) -> None:
    lines = render.split("\n")
    assert len(lines) == rows and all(len(line) == cols for line in lines)
    assert set(render) - {"\n"} <= set(SokobanEnv.grid_vocab)
    assert lines[0] == lines[-1] == "#" * cols
    assert all(line[0] == line[-1] == "#" for line in lines)
    assert sum(render.count(s) for s in "PS") == 1
    assert sum(render.count(s) for s in "X√") == num_boxes
    assert sum(render.count(s) for s in "O√S") == num_boxes


@pytest.mark.parametrize("difficulty", ["ragen", "hard"])
@pytest.mark.parametrize(("dim_room", "num_boxes", "num_seeds"), [((6, 6), 1, 300), ((8, 8), 2, 40)])
def test_generated_levels_are_solvable_within_budget(dim_room, num_boxes, num_seeds, difficulty):
    env = SokobanEnv(dim_room=dim_room, num_boxes=num_boxes, difficulty=difficulty)
    shortest = 3 if difficulty == "hard" else 1  # hard: two pushes and a free step at least
    lengths = set()
    for seed in range(num_seeds):
        obs, _ = env.reset(seed=seed)
        check_render(obs, *dim_room, num_boxes)
        assert "√" not in obs, "no box starts on a target"
        length = shortest_solution_length(obs)
        assert length is not None, f"seed {seed} unsolvable:\n{obs}"
        assert shortest <= length <= env.max_actions_per_episode
        assert len(env.oracle_actions(100)) == length
        lengths.add(length)
    assert len(lengths) >= 4, "levels should vary in difficulty"


def test_oracle_solves_every_level_with_its_plan():
    env = SokobanEnv()
    for seed in range(300):
        env.reset(seed=seed)
        plan = env.oracle_actions(env.max_actions_per_episode)
        assert env.oracle_actions(2) == plan[:2]
        total_reward = 0.0
        for action in plan:
            assert env.oracle_actions(100)[0] == action  # the cache advances as the plan is followed
            _, reward, terminated, _, info = env.step(action)
            total_reward += reward
        assert terminated and info["success"] and env.success
        assert total_reward == pytest.approx(-0.1 * len(plan) + 1.0 + 10.0)
        assert env.oracle_actions(5) == []


def test_oracle_replans_after_a_detour():
    env = SokobanEnv(difficulty="hard")  # no level one random move could solve
    rng = random.Random(0)
    replanned = 0
    for seed in range(100):
        env.reset(seed=seed)
        env.step(env.random_action(rng))
        plan = env.oracle_actions(100)
        if not plan:  # the random move wedged the box: the oracle correctly gives up
            assert shortest_solution_length(env.render()) is None
            continue
        assert len(plan) == shortest_solution_length(env.render())
        for action in plan:
            env.step(action)
        assert env.success
        replanned += 1
    assert replanned > 50


def test_pushes_and_rewards():
    env = SokobanEnv(num_boxes=2)
    env.reset(seed=0)
    load(env, "#######\n#P√_O_#\n#_X___#\n#_____#\n#######")

    obs, reward, terminated, _, info = env.step("Right")  # the box leaves its target
    assert reward == pytest.approx(-1.1) and not terminated
    assert info == {"success": False, "action_is_effective": True}
    assert obs.split("\n")[1] == "#_SXO_#"

    obs, reward, terminated, _, _ = env.step("Right")  # onto the other target, but one box is still off
    assert reward == pytest.approx(0.9) and not terminated
    assert obs.split("\n")[1] == "#_OP√_#"

    for action in ["Down", "Down", "Left"]:
        assert env.step(action)[1] == pytest.approx(-0.1)
    obs, reward, terminated, truncated, info = env.step("Up")  # last box home: +1 and the +10 bonus
    assert reward == pytest.approx(10.9) and terminated and not truncated
    assert info == {"success": True, "action_is_effective": True}
    assert obs.split("\n")[1:3] == ["#_√_√_#", "#_P___#"]
    with pytest.raises(RuntimeError, match="terminated"):
        env.step("Left")


@pytest.mark.parametrize(
    ("level", "action"),
    [
        ("######\n#O_PX#\n######", "Right"),  # box against a wall
        ("#######\n#PXX_O#\n#____O#\n#######", "Right"),  # box against a box
        ("######\n#P_XO#\n######", "Up"),  # player against a wall
    ],
)
def test_blocked_moves_change_nothing(level, action):
    env = SokobanEnv(num_boxes=level.count("X"))
    env.reset(seed=0)
    load(env, level)
    before = env.render()
    obs, reward, terminated, _, info = env.step(action)
    assert obs == before == level
    assert reward == pytest.approx(-0.1) and not terminated
    assert info == {"success": False, "action_is_effective": False}


def test_generation_is_fast():
    env = SokobanEnv()
    start = time.perf_counter()
    for seed in range(100):
        env.reset(seed=10_000 + seed)
    assert (time.perf_counter() - start) / 100 < 0.02


def test_config_validation():
    with pytest.raises(ValueError, match="dim_room"):
        SokobanEnv(dim_room=(3, 6))
    with pytest.raises(ValueError, match="num_boxes"):
        SokobanEnv(num_boxes=0)
    assert SokobanEnv(dim_room=[7, 5]).config.dim_room == (7, 5)


def test_step_reward_is_configurable_and_the_prompt_follows_it():
    default, free = SokobanEnv(), SokobanEnv(step_reward=0.0)
    assert "Each move costs a little" in default.instructions
    assert "costs" not in free.instructions and "A box placed on a target earns a reward" in free.instructions
    for env in (default, free):
        env.reset(seed=7)
    plan = default.oracle_actions(default.max_actions_per_episode)
    totals = [sum(env.step(action)[1] for action in plan) for env in (default, free)]
    assert totals == pytest.approx([-0.1 * len(plan) + 11.0, 11.0])


def _level_statistics(difficulty: str, seeds: range = range(300)) -> tuple[float, float, float, float]:
    """Shortest-solution median, mean and p90 (the generator's own BFS) and the fraction of levels that
    ten uniformly random moves solve, over reset seeds ``seeds`` of SimpleSokoban."""
    lengths, solved = [], 0
    for seed in seeds:
        env = make_env_from_tag("SimpleSokoban", difficulty=difficulty)
        env.reset(seed=seed)
        room, state = env._room, env._state
        lengths.append(len(solve(room, state)))
        rng = np.random.default_rng(10_000 + seed)
        for _ in range(10):
            state = move(room, state, int(rng.integers(1, 5)))
            if state[1] == room.targets:
                solved += 1
                break
    lengths = np.asarray(lengths)
    return float(np.median(lengths)), float(lengths.mean()), float(np.percentile(lengths, 90)), solved / len(seeds)


def test_default_difficulty_matches_ragens_level_distribution():
    """RAGEN's generator over seeds 0-299: shortest solution median 2, mean ~3.3, p90 6; ten random moves
    solve ~27 %. The default preset must match: median 2 +- 1, mean 3.3 +- 0.7, random >= 20 %."""
    median, mean, _, random_solved = _level_statistics("ragen")
    assert 1 <= median <= 3 and abs(mean - 3.3) <= 0.7 and random_solved >= 0.20, (median, mean, random_solved)
    assert make_env_from_tag("SimpleSokoban").config.difficulty == "ragen"


def test_hard_preset_keeps_the_earlier_harder_levels():
    median, mean, p90, random_solved = _level_statistics("hard")
    assert median >= 5 and mean >= 5 and random_solved < 0.06, (median, mean, p90, random_solved)
    with pytest.raises(ValueError, match="difficulty"):
        make_env_from_tag("SimpleSokoban", difficulty="impossible")
