"""One update per learner step: the critic's old values come from the update's own forwards, bit for bit what the
separate no-grad pass gave (the same losses, the same weights after the step); several updates keep that pass."""

from __future__ import annotations

import copy

import pytest
import torch

from ragen_async.learner.learner import Learner
from tests.learner.test_train_step import make_cfg, make_shard

# Exact metrics: the losses and what the step reports of them (timings and FLOP rates aside).
TIMED = ("timing/", "learner/tflops_per_gpu")


def _critic_forwards(learner: Learner) -> list[bool]:
    """A record of the critic's forwards: whether each ran with gradients."""
    calls: list[bool] = []
    learner.critic.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    return calls


@pytest.mark.parametrize("overrides", [
    ("learner.micro_batch_size=3",),  # six micro-batches in row order
    ("learner.micro_batch_size=16", "learner.micro_batch_tokens=1024"),  # packed longest first: rows reordered
], ids=["rows", "tokens"])
def test_one_update_takes_the_old_values_from_its_own_critic_forwards(tiny_model_path, overrides):
    cfg = make_cfg(tiny_model_path, "learner.mini_batch_size=16", *overrides)  # one mini-batch, one epoch
    shard = make_shard(tiny_model_path, cfg)[0]
    learner = Learner(cfg)
    reference = copy.deepcopy(learner)
    reference.critic_values_from_update = False  # the separate no-grad pass of the critic
    fast_calls, ref_calls = _critic_forwards(learner), _critic_forwards(reference)

    expected = reference.train_step(shard).metrics
    got = learner.train_step(shard).metrics

    micro = int(got["learner/micro_batches"])
    assert micro > 1
    assert ref_calls == [False] * micro + [True] * micro  # the no-grad pass, then the update's
    assert fast_calls == [True] * micro  # the update's forwards only
    assert got["critic/vf_loss"] > 0 and "critic/vf_explained_var" in got
    assert {k: v for k, v in got.items() if not k.startswith(TIMED)} == \
        {k: v for k, v in expected.items() if not k.startswith(TIMED)}
    for model in ("actor", "critic"):
        for (name, a), b in zip(getattr(learner, model).named_parameters(), getattr(reference, model).parameters(),
                                strict=True):
            assert torch.equal(a, b), f"{model}.{name}"
    for opt in ("actor_opt", "critic_opt"):  # and the optimizers' moments
        for a, b in zip(getattr(learner, opt).state.values(), getattr(reference, opt).state.values(), strict=True):
            assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq")), opt


def test_several_updates_keep_the_no_grad_pass_of_the_critic(tiny_model_path):
    """Two mini-batches: the second update's old values are the critic's before the first one stepped, which no
    forward of the update sees, so the separate pass stays."""
    cfg = make_cfg(tiny_model_path, "learner.mini_batch_size=8", "learner.micro_batch_size=8")
    learner = Learner(cfg)
    calls = _critic_forwards(learner)
    metrics = learner.train_step(make_shard(tiny_model_path, cfg)[0]).metrics
    assert metrics["learner/optimizer_steps"] == 2
    assert calls == [False, False, True, True]  # the pass over the batch (two micro-batches), then one per update
