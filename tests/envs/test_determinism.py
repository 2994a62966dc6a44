"""A seed fixes the whole episode (level, slips, payouts) in every process, whatever PYTHONHASHSEED is."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from ragen_async.envs.registry import ENV_TAGS, make_env_from_tag

REPO_ROOT = Path(__file__).resolve().parents[2]
SEEDS = range(21)


def fingerprints() -> dict[str, list[list]]:
    """Per tag and seed: the reset render, then (obs, reward) along five actions picked by ``Random(seed)``."""
    result = {}
    for tag in ENV_TAGS:
        env = make_env_from_tag(tag)
        episodes = []
        for seed in SEEDS:
            obs, _ = env.reset(seed=seed)
            episode = [obs]
            rng = random.Random(seed)
            for _ in range(5):
                obs, reward, terminated, _, _ = env.step(env.random_action(rng))
                episode.append([obs, reward])
                if terminated:
                    break
            episodes.append(episode)
        result[tag] = episodes
    return result


def test_same_seed_same_episode_across_processes():
    script = "import json, test_determinism as t; print(json.dumps(t.fingerprints()))"
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(Path(__file__).parent)]),
        "PYTHONHASHSEED": "12345",  # a different str hash salt than this process
    }
    child = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=environment, capture_output=True, text=True, check=True
    )
    here = json.loads(json.dumps(fingerprints()))  # the same tuple -> list conversion as the child's
    assert json.loads(child.stdout) == here


def test_seeds_give_varied_episodes():
    for tag, episodes in fingerprints().items():
        distinct = len({json.dumps(episode) for episode in episodes})
        # A bandit episode is only (arm order, arm pulled, payout); other envs draw a new level per seed.
        assert distinct >= (3 if tag.startswith("Bandit") else len(SEEDS) - 1), tag
