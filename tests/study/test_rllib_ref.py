"""The RLlib APPO reference: one-hot Sokoban wrappers, level seeds, evaluation, and one short real run."""

from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from ragen_async.cli import app
from ragen_async.envs.sokoban import Room, SokobanEnv, solve
from ragen_async.study.rllib_ref import (
    EVAL_SEED,
    MOVES,
    SYMBOLS,
    TRAIN_SEED_LOW,
    AppoSettings,
    RunResult,
    cells,
    encode_grid,
    evaluate,
    format_cells,
    knobs_for_k,
    make_env,
    reference_csv,
    train_appo,
)

pytestmark = pytest.mark.ray_lane


def test_encode_grid_exact_on_a_hand_written_grid():
    grid = encode_grid("#####\n#PX_#\n#O√S#\n#####")
    assert grid.shape == (len(SYMBOLS), 4, 5) and grid.dtype == np.float32
    expected = {(1, 1): "P", (1, 2): "X", (1, 3): "_", (2, 1): "O", (2, 2): "√", (2, 3): "S"}
    for r in range(4):
        for c in range(5):
            want = expected.get((r, c), "#")
            assert grid[:, r, c].tolist() == [1.0 if s == want else 0.0 for s in SYMBOLS], (r, c)
    with pytest.raises(ValueError):
        encode_grid("##\n#")
    with pytest.raises(ValueError):
        encode_grid("#?#")


def test_one_hot_observation_matches_the_level():
    env = make_env({"train": False})
    observation, _ = env.reset(seed=EVAL_SEED)
    base: SokobanEnv = env.unwrapped
    rows, cols = base.config.dim_room
    grid = observation.reshape(len(SYMBOLS), rows, cols)
    assert env.observation_space.contains(observation)
    np.testing.assert_array_equal(grid.sum(axis=0), np.ones((rows, cols)))  # one symbol per cell
    player, boxes = base._state
    assert grid[SYMBOLS.index("P"), player // cols, player % cols] == 1.0  # the level's player is not on a target
    for box in boxes:
        assert grid[SYMBOLS.index("X"), box // cols, box % cols] == 1.0
    lines = base.render().split("\n")
    for r in range(rows):
        for c in range(cols):
            assert SYMBOLS[int(grid[:, r, c].argmax())] == lines[r][c]


def test_evaluation_seeds_reproduce_the_envs_levels():
    for seed in (EVAL_SEED, EVAL_SEED + 7, 5):
        a, _ = make_env({"train": False}).reset(seed=seed)
        b, _ = make_env({"train": False}).reset(seed=seed)
        text, _ = SokobanEnv().reset(seed=seed)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, encode_grid(text).ravel())


def test_training_seeds_are_the_envs_own_levels_reproducibly_and_disjoint_from_evaluation():
    first, second = make_env(), make_env()
    levels = []
    for i in range(5):
        obs_a, info_a = first.reset(seed=42 if i == 0 else None)
        obs_b, info_b = second.reset(seed=42 if i == 0 else None)
        assert info_a["level_seed"] == info_b["level_seed"] >= TRAIN_SEED_LOW
        np.testing.assert_array_equal(obs_a, obs_b)
        text, _ = SokobanEnv().reset(seed=info_a["level_seed"])
        np.testing.assert_array_equal(obs_a, encode_grid(text).ravel())
        levels.append(info_a["level_seed"])
    assert len(set(levels)) == 5
    assert make_env().reset(seed=43)[1]["level_seed"] != levels[0]


def test_discrete_actions_map_onto_the_envs_moves():
    assert MOVES == ("Up", "Down", "Left", "Right")
    for seed in range(20):
        for action, name in enumerate(MOVES):
            env = make_env({"train": False})
            env.reset(seed=seed)
            base = SokobanEnv()
            base.reset(seed=seed)
            observation, reward, terminated, _, info = env.step(action)
            text, base_reward, base_terminated, _, base_info = base.step(name)
            np.testing.assert_array_equal(observation, encode_grid(text).ravel())
            assert (reward, terminated, info["success"]) == (base_reward, base_terminated, base_info["success"])


def test_the_move_budget_truncates():
    env = make_env({"train": False})
    env.reset(seed=EVAL_SEED)
    steps, done = 0, False
    while not done:
        _, _, terminated, truncated, _ = env.step(MOVES.index("Up") if steps % 2 else MOVES.index("Down"))
        steps, done = steps + 1, terminated or truncated
    assert terminated or steps == 10
    assert steps <= 10


def _oracle(observations: np.ndarray) -> np.ndarray:
    """Logits preferring the first move of a shortest solution, read off the one-hot grid alone."""
    logits = np.zeros((len(observations), len(MOVES)))
    for i, observation in enumerate(observations):
        grid = observation.reshape(len(SYMBOLS), 6, 6).argmax(axis=0).ravel()
        symbol = [SYMBOLS[s] for s in grid]
        floor = frozenset(j for j, s in enumerate(symbol) if s != "#")
        targets = frozenset(j for j, s in enumerate(symbol) if s in "O√S")
        player = next(j for j, s in enumerate(symbol) if s in "PS")
        boxes = frozenset(j for j, s in enumerate(symbol) if s in "X√")
        plan = solve(Room(6, 6, floor, targets), (player, boxes))
        logits[i, plan[0] - 1] = 1.0  # env action ids 1..4 are MOVES 0..3
    return logits


def test_evaluate_brackets_oracle_and_a_constant_policy():
    seeds = range(EVAL_SEED, EVAL_SEED + 32)
    assert evaluate(_oracle, seeds) == 1.0  # every level is solvable within the budget
    always_up = evaluate(lambda x: np.tile([1.0, 0, 0, 0], (len(x), 1)), seeds)
    assert 0.0 <= always_up < 0.5
    uniform = evaluate(lambda x: np.zeros((len(x), 4)), seeds, temperature=1.0, rng_seed=3)
    assert uniform == evaluate(lambda x: np.zeros((len(x), 4)), seeds, temperature=1.0, rng_seed=3)
    assert 0.0 < uniform < 1.0


def test_k_maps_onto_broadcast_interval():
    assert [knobs_for_k(k).broadcast_interval for k in (0, 1, 2, 4, 8)] == [1, 2, 3, 5, 9]
    knobs = knobs_for_k(4)
    assert (knobs.circular_buffer_num_batches, knobs.circular_buffer_iterations_per_batch) == (1, 1)
    with pytest.raises(ValueError):
        knobs_for_k(-1)


def test_run_statistics_and_table():
    runs = [RunResult(k=0, seed=s, knobs=vars(knobs_for_k(0)).copy(), train_s=10.0, env_steps=1000 * (s + 1),
                      learner_updates=5, evals=[(500, 0.1 * s, 0.2), (1000, 0.2 + 0.1 * s, 0.3)],
                      lag_counts={0: 1, 2: 3}) for s in range(3)]
    assert runs[1].final_success == pytest.approx(0.3) and runs[1].best_success == pytest.approx(0.3)
    assert runs[0].lag_mean == pytest.approx(6 / 4) and runs[0].lag_max == 2
    assert runs[2].env_steps_per_s == pytest.approx(300.0)
    table = cells(runs)
    row = table.iloc[0]
    assert row["seeds"] == 3 and row["final_success"] == pytest.approx(0.3)
    assert row["final_success_ci"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)
    text = format_cells(table)
    assert "| 0 | 1 | 3 | 0.300 ± 0.248 |" in text
    # The same cells as the reference CSV the study's report draws beside its own runs.
    ref = pd.read_csv(io.StringIO(reference_csv(table)))
    assert list(ref.columns) == ["label", "k", "seeds", "lag_mean", "final_success", "final_success_lo",
                                 "final_success_hi"]
    assert ref.loc[0, "lag_mean"] == pytest.approx(1.5) and ref.loc[0, "final_success_lo"] == pytest.approx(0.3 - row["final_success_ci"], abs=1e-4)


def test_bench_rllib_rejects_bad_options():
    result = CliRunner().invoke(app, ["bench", "rllib", "--k", "-1"])
    assert result.exit_code != 0 and "--max-staleness must be >= 0" in result.output


@pytest.fixture
def own_ray():
    """A small local Ray for the test, shut down afterwards unless one was already running."""
    import ray

    from ragen_async.study.rllib_ref import ensure_ray

    already = ray.is_initialized()
    ensure_ray()
    yield
    if not already:
        ray.shutdown()


@pytest.mark.slow
def test_a_short_real_appo_run_returns_its_metrics(own_ray):
    """About 20 s on 2 shared cores."""
    settings = AppoSettings(train_batch_size=100, num_envs_per_env_runner=4, rollout_fragment_length=25,
                            eval_every_s=1e9, eval_episodes=16)
    result = train_appo(k=1, seed=0, budget_s=60.0, settings=settings, max_env_steps=3000)
    assert 3000 <= result.env_steps < 20_000
    assert result.learner_updates >= 10
    assert result.knobs["broadcast_interval"] == 2
    assert len(result.evals) == 1 and result.evals[0][0] == result.env_steps
    assert 0.0 <= result.final_success <= 1.0 and 0.0 <= result.final_success_sampled <= 1.0
    assert result.lag_counts and min(result.lag_counts) >= 0
    # every trained timestep is counted once: at most what was sampled, most of it
    trained = sum(result.lag_counts.values())
    assert 0.5 * result.env_steps <= trained <= result.env_steps
    assert math.isfinite(result.lag_mean) and result.env_steps_per_s > 0
