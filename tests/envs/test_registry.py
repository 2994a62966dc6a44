"""Registry: names, tags, overrides, clear errors, gymnasium registration."""

import importlib

import gymnasium as gym
import pytest

from ragen_async.envs import registry
from ragen_async.envs.bandit import BanditEnv
from ragen_async.envs.countdown import CountdownEnv
from ragen_async.envs.frozen_lake import FrozenLakeEnv
from ragen_async.envs.registry import ENV_TAGS, GYM_IDS, make_env, make_env_from_tag
from ragen_async.envs.sokoban import SokobanEnv


@pytest.mark.parametrize(
    ("name", "env_class"),
    [("bandit", BanditEnv), ("sokoban", SokobanEnv), ("frozen_lake", FrozenLakeEnv), ("countdown", CountdownEnv)],
)
def test_make_env(name, env_class):
    env = make_env(name)
    assert type(env) is env_class
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and info == {}


def test_tags():
    assert set(ENV_TAGS) == {"Bandit", "BanditTest", "SimpleSokoban", "LargerSokoban", "FrozenLake", "Countdown",
                             "SmallCountdown"}
    test_bandit = make_env_from_tag("BanditTest")
    test_bandit.reset(seed=0)
    assert set(test_bandit.valid_actions()) == {"Trader", "Librarian"}
    assert test_bandit.oracle_actions(1) == ["Librarian"]

    larger = make_env_from_tag("LargerSokoban")
    assert (larger.config.dim_room, larger.config.num_boxes) == ((8, 8), 2)
    obs, _ = larger.reset(seed=0)
    assert len(obs.split("\n")) == 8 and obs.count("X") == 2

    simple = make_env_from_tag("SimpleSokoban", max_actions_per_episode=20)
    assert simple.config.dim_room == (6, 6) and simple.max_actions_per_episode == 20
    assert make_env_from_tag("Bandit").config.hi_arm_name == "Dragon"


def test_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match=r"unknown env name 'maze'.*'bandit', 'countdown', 'frozen_lake', 'sokoban'"):
        make_env("maze")
    with pytest.raises(ValueError, match=r"unknown env tag 'Sokoban'.*'LargerSokoban'"):
        make_env_from_tag("Sokoban")
    with pytest.raises(ValueError, match=r"unknown SokobanConfig option\(s\) \['boxes'\].*'num_boxes'"):
        make_env("sokoban", boxes=2)
    with pytest.raises(ValueError, match=r"unknown BanditConfig option"):
        make_env_from_tag("Bandit", lo_arm="Cat")


def test_gymnasium_registration_is_idempotent():
    importlib.reload(registry)  # registering again must neither raise nor duplicate
    for gym_id in GYM_IDS.values():
        assert gym_id in gym.registry
    env = gym.make("ragen/Sokoban-v0", dim_room=(7, 7), difficulty="hard")  # no one-move levels
    obs, _ = env.reset(seed=3)
    assert len(obs.split("\n")) == 7
    _, reward, _, _, info = env.step(env.unwrapped.oracle_actions(1)[0])
    assert reward == pytest.approx(-0.1) and {"success", "action_is_effective"} <= set(info)
    bandit = gym.make("ragen/Bandit-v0", lo_arm_name="Owl")
    bandit.reset(seed=0)
    assert "Owl" in bandit.unwrapped.valid_actions()
