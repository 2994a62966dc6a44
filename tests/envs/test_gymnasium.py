"""Every environment passes gymnasium's own checker and works through ``gymnasium.make``."""

from __future__ import annotations

import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from ragen_async.envs.registry import ENV_CLASSES, ENV_TAGS, GYM_IDS, make_env_from_tag

TAGS = ["Bandit", "SimpleSokoban", "FrozenLake", "Countdown"]


def gym_make(tag: str, **kwargs) -> gym.Env:
    """The tag's env through ``gymnasium.make`` (so it has a spec: ``check_env`` then also builds it in
    every declared render mode)."""
    name, preset = ENV_TAGS[tag]
    return gym.make(GYM_IDS[name], **preset, **kwargs)


@pytest.mark.parametrize("tag", TAGS)
def test_check_env_passes_without_warnings(tag):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker warning is a failure too
        check_env(gym_make(tag).unwrapped)  # the render check included
        check_env(gym_make(tag, render_mode="text").unwrapped)


@pytest.mark.parametrize("tag", TAGS)
def test_text_render_mode_renders_the_observation(tag):
    env = gym_make(tag, render_mode="text")
    assert env.render_mode == "text" and env.unwrapped.render_mode == "text"
    obs, _ = env.reset(seed=5)
    assert env.render() == obs
    obs, *_ = env.step(env.action_space.sample())
    assert env.render() == obs
    assert make_env_from_tag(tag, render_mode="text").render_mode == "text"
    assert make_env_from_tag(tag).render_mode is None


@pytest.mark.parametrize("name", sorted(ENV_CLASSES))
@pytest.mark.parametrize("mode", ["human", "rgb_array", "ansi", ""])
def test_unknown_render_mode_is_refused(name, mode):
    with pytest.raises(ValueError, match=r"render_mode must be None or 'text'"):
        ENV_CLASSES[name](render_mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium warns about the mode first
        with pytest.raises(ValueError, match=r"render_mode must be None or 'text'"):
            gym.make(GYM_IDS[name], render_mode=mode)


@pytest.mark.parametrize("tag", TAGS)
def test_seeding_follows_gymnasium_and_stays_reproducible(tag):
    a, b = make_env_from_tag(tag), make_env_from_tag(tag)
    assert a.reset(seed=7)[0] == b.reset(seed=7)[0]  # a seeded reset is a pure function of the seed
    # an unseeded reset continues the seeded stream: the same in both envs
    assert [a.reset()[0] for _ in range(3)] == [b.reset()[0] for _ in range(3)]
    if a.action_lookup:
        action = a.action_space.sample()
        assert a.action_space.contains(action) and action in a.valid_actions()
        assert not a.action_space.contains("not-an-action")


def test_gymnasium_make_builds_a_checked_env():
    env = gym.make("ragen/FrozenLake-v0")
    obs, _ = env.reset(seed=3)
    assert isinstance(obs, str)
    env.step(env.action_space.sample())
