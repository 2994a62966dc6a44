"""Bandit: payout statistics, name shuffling, success, prompt and episode rules."""

import random
import re

import pytest

from ragen_async.envs.bandit import BanditEnv


def test_payout_frequencies_and_name_assignment():
    env = BanditEnv()
    hi_payouts, dragon_is_first = [], 0
    for seed in range(20_000):
        env.reset(seed=seed)
        dragon_is_first += env.action_lookup[1] == "Dragon"
        _, reward, *_ = env.step("Dragon")
        hi_payouts.append(reward)
    assert set(hi_payouts) == {0.0, 1.0}
    assert abs(sum(hi_payouts) / len(hi_payouts) - 0.25) < 0.02
    assert abs(dragon_is_first / 20_000 - 0.5) < 0.02

    for seed in range(1_000):
        env.reset(seed=seed)
        assert env.step("Phoenix")[1] == 0.1


def test_step_outcome_and_info():
    env = BanditEnv()
    first_obs, info = env.reset(seed=7)
    assert info == {}
    assert "Phoenix" in first_obs and "Dragon" in first_obs
    obs, reward, terminated, truncated, info = env.step("dragon")  # names match case-insensitively
    assert re.fullmatch(r"Dragon: (0\.0|1\.0) points", obs)
    assert obs == f"Dragon: {reward} points"
    assert terminated and not truncated
    assert info == {"success": True, "action_is_effective": True}
    assert env.success


def test_low_risk_arm_is_not_success_by_default():
    env = BanditEnv()
    env.reset(seed=0)
    assert env.oracle_actions(5) == ["Dragon"]
    assert env.step("Phoenix")[4]["success"] is False
    assert env.oracle_actions(5) == []


def test_success_follows_the_higher_expectation():
    env = BanditEnv(lo_arm_score=0.3)  # 0.3 > 0.25 * 1.0: now the safe arm is the better one
    env.reset(seed=0)
    assert env.oracle_actions(1) == ["Phoenix"]
    assert env.step("Phoenix")[4]["success"] is True


def test_prompt_follows_the_per_reset_lookup():
    env = BanditEnv(lo_arm_name="Trader", hi_arm_name="Librarian")
    orders = set()
    for seed in range(20):
        env.reset(seed=seed)
        first, second = env.action_lookup[1], env.action_lookup[2]
        assert {first, second} == {"Trader", "Librarian"}
        assert env.valid_actions() == [first, second]
        assert env.instructions.index(first) < env.instructions.index(second)
        assert env.random_action(random.Random(seed)) in (first, second)
        orders.add(first)
    assert orders == {"Trader", "Librarian"}


def test_episode_rules():
    env = BanditEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("Dragon")
    env.reset(seed=1)
    with pytest.raises(ValueError, match="valid actions"):
        env.step("Unicorn")
    env.step("Phoenix")
    with pytest.raises(RuntimeError, match="terminated"):
        env.step("Phoenix")
    assert env.max_actions_per_episode == 1


def test_config_validation():
    with pytest.raises(ValueError, match="distinct"):
        BanditEnv(lo_arm_name="Dragon", hi_arm_name="dragon")
    with pytest.raises(ValueError, match="hi_arm_prob"):
        BanditEnv(hi_arm_prob=1.5)
