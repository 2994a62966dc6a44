"""Countdown: task generation, reward rules, the sandboxed evaluator, solver oracle and random answers."""

import ast
import random
from collections import Counter

import pytest

from ragen_async.envs.countdown import CountdownEnv, safe_eval, score_equation, solve


def test_generated_tasks():
    env = CountdownEnv()
    counts = Counter()
    for seed in range(300):
        obs, info = env.reset(seed=seed)
        assert info == {}
        assert obs == f"Target: {env.target}, nums: {env.numbers}"
        assert all(1 <= n <= 99 for n in env.numbers)
        assert 1 <= env.target <= 100
        counts[len(env.numbers)] += 1
    assert set(counts) == {3, 4} and min(counts.values()) > 100


def test_oracle_always_scores_one():
    env = CountdownEnv()
    for seed in range(300):
        env.reset(seed=seed)
        (equation,) = env.oracle_actions(1)
        _, reward, terminated, truncated, info = env.step(equation)
        assert reward == 1.0, (env.numbers, env.target, equation)
        assert terminated and not truncated and info == {"success": True, "action_is_effective": True}
        assert env.oracle_actions(1) == []


@pytest.mark.parametrize(
    ("equation", "reward"),
    [
        ("(3 + 5) * 2", 1.0),
        ("2*(5+3)", 1.0),
        ("  -(3 - 5) * 2 ", 0.1),  # unary minus is fine; the value is wrong
        ("(3 + 5) * 2 + 3", 0.0),  # an extra number
        ("5 * 2 + 3", 0.1),  # right numbers, wrong value
        ("3 / (5 - 5) * 2", 0.0),  # an extra 5
        ("16", 0.0),  # the target alone
        ("(3 + 5) * 2 = 16", 0.0),  # the target counts as an extra number
        ("(3 + 5) * 2)", 0.0),  # does not parse
        ("three plus five", 0.0),
        ("", 0.0),
        ("(3.0 + 5) * 2", 0.0),  # floats are not the given integers
    ],
)
def test_reward_rules(equation, reward):
    assert score_equation(equation, [3, 5, 2], 16) == reward


def test_division_by_zero_is_a_wrong_value():
    assert score_equation("5 / (3 - 3)", [3, 3, 5], 1) == 0.1
    assert score_equation("8 / 3 * 3", [8, 3, 3], 8) == 1.0  # exact arithmetic, no float drift


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')",
        "__import__('os').system('echo hi')",
        "(1).real",
        "x + 1",
        "2 ** 10000",
        "9 ** 9 ** 9",
        "2 ^ 3",
        "7 // 2",
        "7 % 2",
        "True + 1",
        "'a' * 3",
        "[1, 2]",
        "(lambda: 1)()",
        "1 if 1 else 2",
        "+1",
        "~1",
        "1; 2",
        "9" * 1000,
        "(" * 200 + "1" + ")" * 200,
    ],
)
def test_safe_eval_rejects(text):
    assert safe_eval(text) is None
    assert score_equation(text, [1, 2], 3) == 0.0


def test_safe_eval_accepts_arithmetic():
    assert safe_eval("-(2 - 7) * 3 / 5") == 3
    assert safe_eval("1 / 0") is None


def test_solver():
    assert safe_eval(solve([4, 7, 8, 8], 24)) == 24
    assert safe_eval(solve([1, 5, 5, 5], 24)) == 24  # needs a fractional intermediate: 5 * (5 - 1 / 5)
    assert solve([1, 1, 1], 50) is None


def test_random_action_uses_exactly_the_numbers():
    env = CountdownEnv()
    rng = random.Random(0)
    rewards = Counter()
    for seed in range(200):
        env.reset(seed=seed)
        equation = env.random_action(rng)
        literals = [node.value for node in ast.walk(ast.parse(equation)) if isinstance(node, ast.Constant)]
        assert sorted(literals) == sorted(env.numbers)
        rewards[env.step(equation)[1]] += 1
    assert rewards[0.1] > 150 and set(rewards) <= {0.1, 1.0}
    assert env.valid_actions() == [] and env.action_lookup is None


def test_episode_rules():
    env = CountdownEnv()
    env.reset(seed=0)
    env.step("1 + 1")
    with pytest.raises(RuntimeError, match="terminated"):
        env.step("1 + 1")
    with pytest.raises(ValueError, match="min_count"):
        CountdownEnv(min_count=5, max_count=4)
