"""The stale-sample corrections through the learner: a batch with stale negative trajectories is masked / weighted
by a real learner step (the tiny model, the single-pass regime of the study configs), and what the correction did
is logged per lag."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from torch.testing import assert_close

from ragen_async.learner.learner import Learner
from ragen_async.protocol import NO_VERSION
from tests.learner.test_train_step import make_cfg, make_shard

VERSION, AGE = 6, 5
"""The consuming learner's version and the stale trajectories' age (lag bucket 5)."""


def _stale_batch(model_path, cfg):
    """The 16 trajectories of a real Sokoban shard rewritten: even rows are AGE versions old and their engine gave
    each sampled token probability 1 (log mu = 0 above every log pi_old, so their mean log(mu / pi_old) is large);
    odd rows are fresh with log mu = -30 (mean log(mu / pi_old) < 0). Advantages (GRPO's normalised scores) alternate
    in sign by pairs, so stale and fresh rows each have both signs. Returns the shard and its stale-negative rows."""
    shard = make_shard(model_path, cfg)[0]
    rows, stale_negative = [], []
    scores = np.zeros(len(shard.trajectories), dtype=np.float32)
    for i, t in enumerate(shard.trajectories):
        stale, sign = i % 2 == 0, (1.0 if (i // 2) % 2 == 0 else -1.0)
        sampled = t.loss_mask.astype(bool)
        assert sampled.any()
        versions = np.where(sampled, VERSION - AGE if stale else VERSION, NO_VERSION).astype(np.int32)
        behaviour = np.where(sampled, 0.0 if stale else -30.0, 0.0).astype(np.float32)
        rows.append(dataclasses.replace(t, token_versions=versions, behaviour_logprobs=behaviour))
        scores[i] = sign * (0.5 + 0.1 * i)
        if stale and sign < 0:
            stale_negative.append(i)
    shard = dataclasses.replace(shard, learner_version=VERSION, trajectories=tuple(rows), normalized_scores=scores)
    return shard, stale_negative


def _step(model_path, shard, *overrides):
    cfg = make_cfg(model_path, "algo.adv_estimator=grpo", "learner.mini_batch_size=16", *overrides)
    learner = Learner(cfg)
    result = learner.train_step(shard)
    return result.metrics, [p.detach().clone() for p in learner.actor.parameters()]


@pytest.mark.parametrize(("mode", "stale_negative_weight"), [("opsm", 0.0), ("age", 2.0 / AGE)])
def test_stale_negatives_are_masked_or_weighted_through_the_learner(tiny_model_path, mode, stale_negative_weight):
    cfg = make_cfg(tiny_model_path)
    shard, stale_negative = _stale_batch(tiny_model_path, cfg)
    # The correction's step equals the uncorrected step on the same batch whose stale negatives' advantages are
    # scaled by their weight (0: masked; 2/5: age_tau / age), everything else (entropy bonus, the loss's token
    # count, the other rows) the same.
    metrics, params = _step(tiny_model_path, shard, f"algo.off_policy={mode}", "algo.age_tau=2")
    scaled = shard.normalized_scores.copy()
    scaled[stale_negative] *= stale_negative_weight
    ref_metrics, ref_params = _step(tiny_model_path, dataclasses.replace(shard, normalized_scores=scaled))
    plain_metrics, plain_params = _step(tiny_model_path, shard)
    assert metrics["learner/optimizer_steps"] == 1 and metrics["learner/micro_batches"] > 1  # one pass, accumulated
    assert metrics["actor/pg_clipfrac"] == 0.0  # pi / pi_old == 1: the clip never acts, the correction does
    assert metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert metrics["actor/pg_loss"] != pytest.approx(plain_metrics["actor/pg_loss"], rel=1e-3)
    # Adam's first step is lr * g / (|g| + eps): float32 rounding of w * A against (w A) moves a parameter whose
    # gradient is near eps by up to ~1e-6 (seen 5.8e-7); the uncorrected step differs by up to lr = 1e-3.
    for p, ref in zip(params, ref_params, strict=True):
        assert_close(p, ref, rtol=1e-5, atol=2e-6)
    assert max((p - q).abs().max().item() for p, q in zip(params, plain_params, strict=True)) > 1e-4

    # What it did, per lag: lag 0 holds the fresh rows (untouched), lag 5 the stale ones.
    tokens = np.array([t.loss_mask.sum() for t in shard.trajectories], dtype=float)
    stale_tokens, hit_tokens = tokens[0::2].sum(), tokens[stale_negative].sum()
    assert metrics["lag/5/tokens"] == stale_tokens and metrics["lag/5/trajectories"] == 8
    if mode == "opsm":
        assert metrics["lag/5/corr_masked"] == pytest.approx(hit_tokens / stale_tokens)
        assert metrics["lag/5/corr_masked_seqs"] == pytest.approx(len(stale_negative) / 8)
        assert metrics["lag/5/corr_ess"] == pytest.approx(1 - hit_tokens / stale_tokens)  # the kept share
        assert metrics["lag/5/corr_truncated"] == 0.0
        assert metrics["correction/masked"] == pytest.approx(hit_tokens / tokens.sum())
        assert metrics["actor/corr_masked_frac"] == pytest.approx(hit_tokens / tokens.sum())
    else:
        w = np.where(np.isin(np.arange(0, 16, 2), stale_negative), stale_negative_weight, 1.0)
        sw, sw2 = (w * tokens[0::2]).sum(), (w * w * tokens[0::2]).sum()
        assert metrics["lag/5/corr_truncated"] == pytest.approx(hit_tokens / stale_tokens)
        assert metrics["lag/5/corr_weight"] == pytest.approx(sw / stale_tokens)
        assert metrics["lag/5/corr_ess"] == pytest.approx(sw * sw / (sw2 * stale_tokens))
        assert metrics["lag/5/corr_masked"] == 0.0 and metrics["lag/5/corr_masked_seqs"] == 0.0
        assert metrics["correction/truncated"] == pytest.approx(hit_tokens / tokens.sum())
        assert metrics["lag/5/corr_truncated_seqs"] == pytest.approx(len(stale_negative) / 8)
    assert metrics["lag/0/corr_masked"] == 0.0 and metrics["lag/0/corr_truncated"] == 0.0
    assert metrics["lag/0/corr_ess"] == 1.0 and metrics["lag/0/corr_masked_seqs"] == 0.0
    # Without a correction nothing about one is logged (and the stale negatives were trained on as they were).
    assert not any("corr" in k for k in plain_metrics)
