"""The learner's training and scoring forwards build no KV cache, and compute what a forward with one computes."""

from __future__ import annotations

import torch

from ragen_async.learner.batch import collate_shard
from ragen_async.learner.learner import Learner
from tests.learner.test_learner import make_cfg, make_shard


def test_training_and_scoring_forwards_run_without_a_kv_cache(tiny_model_path):
    cfg = make_cfg(tiny_model_path, "learner.mini_batch_size=8", "algo.kl_coef=0.1")  # old log-probs, reference pass
    learner = Learner(cfg)
    seen: list[tuple[str, object]] = []
    for name, model in {"actor": learner.actor, "critic": learner.critic, "ref": learner.ref}.items():
        model.base_model.register_forward_pre_hook(
            lambda _m, _args, kwargs, name=name: seen.append((name, kwargs.get("use_cache"))), with_kwargs=True)
    shard = make_shard(tiny_model_path, cfg)[0]
    learner.train_step(shard)
    learner.probe_logprobs(shard.trajectories[0].token_ids.tolist()[:20])
    assert {name for name, _ in seen} == {"actor", "critic", "ref"}
    assert {use_cache for _, use_cache in seen} == {False}


def test_forwards_without_a_cache_equal_those_with_one(tiny_model_path):
    cfg = make_cfg(tiny_model_path)
    learner = Learner(cfg)
    mb = collate_shard(make_shard(tiny_model_path, cfg)[0], learner.pad_id).select(slice(0, 4)).trimmed()
    with torch.no_grad():
        body = learner.actor.base_model
        with_cache, without = body(input_ids=mb.input_ids, use_cache=True), body(input_ids=mb.input_ids, use_cache=False)
        assert with_cache.past_key_values is not None and without.past_key_values is None
        assert torch.equal(with_cache.last_hidden_state, without.last_hidden_state)
        critic = learner.critic
        assert torch.equal(critic(input_ids=mb.input_ids, use_cache=True).logits,
                           critic(input_ids=mb.input_ids, use_cache=False).logits)
