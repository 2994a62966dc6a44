"""FrozenLake: maps (checked by an independent BFS), render, move and slip rules, rewards, oracle vs random."""

import random
from collections import Counter, deque

import pytest

from ragen_async.envs.frozen_lake import FrozenLakeEnv

MOVES = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def find(render: str, symbols: str) -> list[tuple[int, int]]:
    return [(r, c) for r, line in enumerate(render.split("\n")) for c, s in enumerate(line) if s in symbols]


def goal_reachable(render: str) -> bool:
    """Reference BFS over the text render from P to G, avoiding O."""
    lines = render.split("\n")
    (start,), (goal,) = find(render, "P"), find(render, "G")
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        if (r, c) == goal:
            return True
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < len(lines) and 0 <= nc < len(lines) and lines[nr][nc] != "O" and (nr, nc) not in seen:
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


def test_every_map_has_a_path_and_a_valid_render():
    env = FrozenLakeEnv()
    holes = 0
    for seed in range(1000):
        obs, info = env.reset(seed=seed)
        assert info == {}
        lines = obs.split("\n")
        assert len(lines) == 4 and all(len(line) == 4 for line in lines)
        assert set(obs) - {"\n"} <= set(FrozenLakeEnv.grid_vocab)
        assert obs.count("P") == 1 and obs.count("G") == 1
        assert goal_reachable(obs), f"seed {seed}:\n{obs}"
        holes += obs.count("O")
    assert 0.1 < holes / (1000 * 14) < 0.25  # about 20% of the non-start, non-goal tiles


def test_larger_maps():
    env = FrozenLakeEnv(size=6)
    for seed in range(100):
        obs, _ = env.reset(seed=seed)
        assert len(obs.split("\n")) == 6 and goal_reachable(obs)


def test_deterministic_moves_goal_and_edges():
    env = FrozenLakeEnv(is_slippery=False, max_actions_per_episode=20)
    for seed in range(50):
        obs, _ = env.reset(seed=seed)
        ((row, col),) = find(obs, "P")
        for step in range(20):
            assert env.steps_left == 20 - step
            action = env.oracle_actions(1)[0]  # without slips the oracle walks a shortest safe path
            dr, dc = MOVES[action]
            obs, reward, terminated, truncated, info = env.step(action)
            assert (row + dr, col + dc) in find(obs, "P√")
            row, col = row + dr, col + dc
            assert info["action_is_effective"] and not truncated
            if terminated:
                break
        assert reward == 1.0 and info["success"] and env.success
        assert "√" in obs and "G" not in obs
        assert env.oracle_actions(1) == []


def test_edge_and_hole():
    env = FrozenLakeEnv(is_slippery=False)
    for seed in range(200):  # find a map whose start touches the border and a hole
        obs, _ = env.reset(seed=seed)
        ((row, col),) = find(obs, "P")
        into_hole = [a for a, (dr, dc) in MOVES.items() if (row + dr, col + dc) in find(obs, "O")]
        off_board = [a for a, (dr, dc) in MOVES.items() if not (0 <= row + dr < 4 and 0 <= col + dc < 4)]
        if into_hole and off_board:
            break
    obs, reward, terminated, _, info = env.step(off_board[0])
    assert (reward, terminated, info) == (0.0, False, {"success": False, "action_is_effective": False})
    obs, reward, terminated, _, info = env.step(into_hole[0])
    assert (reward, terminated, info) == (0.0, True, {"success": False, "action_is_effective": True})
    assert obs.count("X") == 1 and "P" not in obs
    with pytest.raises(RuntimeError, match="terminated"):
        env.step("Left")


def test_slips_are_one_third_each_and_never_backwards():
    env = FrozenLakeEnv(size=7, p_frozen=1.0)
    outcomes = Counter()
    for seed in range(3000):
        obs, _ = env.reset(seed=seed)
        ((row, col),) = find(obs, "P")
        if not (1 <= row <= 5 and 1 <= col <= 5):
            continue  # keep starts where every move changes the tile
        obs, *_ = env.step("Down")
        ((new_row, new_col),) = find(obs, "P√")
        outcomes[(new_row - row, new_col - col)] += 1
    total = sum(outcomes.values())
    assert set(outcomes) == {(1, 0), (0, -1), (0, 1)}
    assert all(abs(count / total - 1 / 3) < 0.04 for count in outcomes.values())


def test_oracle_beats_random():
    env = FrozenLakeEnv()

    def success_rate(policy) -> float:
        wins = 0
        for seed in range(500):
            env.reset(seed=seed)
            rng = random.Random(seed)
            for _ in range(env.max_actions_per_episode):
                if env.step(policy(rng))[2]:
                    break
            wins += env.success
        return wins / 500

    oracle = success_rate(lambda rng: env.oracle_actions(env.max_actions_per_episode)[0])
    uniform = success_rate(env.random_action)
    assert oracle > uniform + 0.2, (oracle, uniform)
    env.reset(seed=0)
    assert len(env.oracle_actions(5)) == 1 and env.oracle_actions(0) == []


def test_config_validation():
    with pytest.raises(ValueError, match="p_frozen"):
        FrozenLakeEnv(p_frozen=0.0)
    with pytest.raises(ValueError, match="size"):
        FrozenLakeEnv(size=1)
