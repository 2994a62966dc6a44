"""The solver-derived warm start (tinymodel.warmstart): a few-step build from the session's base model,
its cache, its seeds and its prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragen_async.config import load_config
from ragen_async.tinymodel import build
from ragen_async.tinymodel.warmstart import (
    FIRST_EPISODE_SEED,
    WARM_STARTS,
    WarmStartConfig,
    build_warm_start,
    default_out_dir,
    ensure_warm_start,
    make_examples,
    warm_start_named_by,
)

REPO = Path(__file__).resolve().parents[2]
SPECIMEN = REPO / "configs" / "tiny" / "specimen_sokoban.yaml"
QUICK = dict(episodes=24, sft_steps=4, sft_warmup_steps=1)


def test_episode_seeds_are_disjoint_from_validation_and_from_every_seed_rl_draws():
    cfg = load_config(SPECIMEN)
    warm = WARM_STARTS["sokoban"]
    seeds = warm.episode_seeds(0)
    val = range(cfg.validation.seed, cfg.validation.seed + max(e.n_groups for e in cfg.validation.envs))
    # Group i of a run plays rollout.seed + i: even a run of a million steps stays below the warm start's seeds.
    rl = range(cfg.rollout.seed, cfg.rollout.seed + 10**6 * cfg.rollout.groups_per_step)
    for other in (val, rl):
        assert max(other) < seeds.start, (other, seeds)
    assert seeds.start == FIRST_EPISODE_SEED and len(seeds) == warm.episodes
    # another build seed gets its own block
    assert set(warm.episode_seeds(1)).isdisjoint(seeds)


@pytest.mark.parametrize("name, config, pinned", [("sokoban", "specimen_sokoban.yaml", "studies/specimen/warm_start"),
                                                  ("frozen_lake", "specimen_frozen_lake.yaml",
                                                   "studies/specimen_frozen_lake/warm_start"),
                                                  ("countdown", "specimen_countdown.yaml",
                                                   "studies/specimen_countdown/warm_start")])
def test_the_warm_start_prompts_are_what_the_specimen_rollouts_send(name, config, pinned):
    cfg = load_config(REPO / "configs" / "tiny" / config)
    warm = WARM_STARTS[name]
    assert cfg.model.path == pinned and cfg.model.sha256  # the pinned build, by default
    assert build.read_build_info(REPO / cfg.model.path)["warm_start"] == name
    assert warm_start_named_by(default_out_dir(name)) == name  # what `make specimen` rebuilds
    assert [e.tag for e in cfg.rollout.envs] == [warm.env_tag]
    assert (warm.max_turns, warm.max_actions_per_turn, warm.max_tokens_per_turn) == (
        cfg.agent.max_turns, cfg.agent.max_actions_per_turn, cfg.agent.max_tokens_per_turn)


@pytest.mark.parametrize("tag", ["SimpleSokoban", "FrozenLake"])
def test_noisy_oracle_data_is_mostly_oracle_moves_and_eps_one_is_all_random(tiny_model_dir, tag):
    from ragen_async.agent.chat import ChatFormat

    chat = ChatFormat.from_pretrained(str(tiny_model_dir))
    examples, data = make_examples(chat, WarmStartConfig(env_tag=tag, episodes=40, eps=0.1), seed=0)
    assert len(examples) == 40 and data["actions"]["random"] > 0
    assert data["actions"]["oracle"] > 4 * data["actions"]["random"]
    # every reply carries one action: "Keep the reply under 64 tokens" is in every prompt
    text = chat.decode(examples[0].token_ids, skip_special_tokens=False)
    assert "64 tokens" in text and "400 tokens" not in text
    _, noise = make_examples(chat, WarmStartConfig(env_tag=tag, episodes=40, eps=1.0), seed=0)
    assert noise["actions"]["oracle"] == 0 and noise["success"] < data["success"]


def test_a_few_step_warm_start_builds_once_and_records_its_floor_and_ceiling(tiny_model_dir, tmp_path):
    out = tmp_path / "tiny-model-sokoban"
    logs: list[str] = []
    path = ensure_warm_start("sokoban", out, base_dir=tiny_model_dir, checkpoints=True, log=logs.append, **QUICK)
    assert build.is_complete_build(path)
    info = json.loads((path / build.BUILD_INFO).read_text())
    assert info["warm_start"] == "sokoban" and info["config"]["episodes"] == 24
    assert info["base"]["cache_key"] == build.read_build_info(tiny_model_dir)["cache_key"]
    ref = info["reference_success"]
    # one action per reply cannot finish the longest levels in five turns; five per reply can
    assert ref["random"] < ref["oracle"] < ref["oracle_unlimited_reply"] == 1.0
    assert (out.parent / f"{out.name}.checkpoints").is_dir()
    # the same key is not rebuilt; another eps is
    logs.clear()
    ensure_warm_start("sokoban", out, base_dir=tiny_model_dir, log=logs.append, **QUICK)
    assert any("not rebuilding" in line for line in logs)
    logs.clear()
    ensure_warm_start("sokoban", out, base_dir=tiny_model_dir, log=logs.append, **{**QUICK, "eps": 0.2})
    assert json.loads((out / build.BUILD_INFO).read_text())["config"]["eps"] == 0.2


def test_a_warm_start_needs_a_base_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete base build"):
        build_warm_start("sokoban", tmp_path / "out", base_dir=tmp_path / "nothing", **QUICK)
