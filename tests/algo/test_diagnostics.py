"""Diagnostics: explained variance, k3 KL, stability by staleness lag."""

import math

import pytest
import torch

from ragen_async.algo.diagnostics import approx_kl_k3, explained_variance, lag_metrics, lag_sums


def test_explained_variance_by_hand() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 3.0, -99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    # residual (0, 0, 0, 1): mean 0.25, unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25
    # returns (1, 2, 3, 4): unbiased var 5/3 -> EV = 1 - 0.25 / (5/3) = 0.85
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.85)
    # Constant returns: undefined -> NaN.
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask).item())


def test_approx_kl_k3_by_hand() -> None:
    logp = torch.tensor([[math.log(0.5), math.log(0.5), float("nan")]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # token 0: d = ln 2 -> 0.5 + ln 2 - 1 = 0.1931472; token 1: d = 0 -> 0; token 2 masked -> mean 0.0965736
    assert approx_kl_k3(logp, ref, mask).item() == pytest.approx((0.5 + math.log(2.0) - 1.0) / 2)


def test_lag_metrics_by_hand() -> None:
    nan = float("nan")
    # Row 0: two trained tokens at lag 0 and one at lag 1 (its oldest: lag 1); row 1: two tokens at
    # lag 5 (>= 3: the overflow bucket "3+"); row 2: no trained token (padding garbage must not leak).
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    staleness = torch.tensor([[0, 0, 1, 0], [5, 5, 5, 5], [2, 2, 2, 2]])
    behaviour = torch.tensor([[-1.0, -1.0, -2.0, nan], [nan, -1.0, -1.0, nan], [nan] * 4])
    learner = torch.tensor([[-1.0, -1.0 + math.log(2.0), -2.0, 0.0], [0.0, -1.0, -1.0, 0.0], [0.0] * 4])
    advantages = torch.tensor([[1.0, -1.0, 2.0, nan], [0.0, 4.0, 0.0, nan], [nan] * 4])
    rewards, successes = torch.tensor([3.0, -1.0, 9.0]), torch.tensor([1.0, 0.0, 1.0])
    sums = lag_sums(mask, staleness, behaviour, learner, advantages, rewards, successes, 4, 0.2, 0.28)
    out = lag_metrics(sums.tolist())
    # Lag 0: weights 1 and 2 -> ESS (3^2 / 5) / 2 = 0.9; weight 2 leaves [0.8, 1.28]: 1 of 2 outside;
    # k3 of weight 2: 2 - 1 - ln 2 (as algo.kl_estimate(behaviour, learner, 'k3')).  |A| shares: lag 0 2/8, lag 1 2/8, lag 3+ 4/8.
    assert out["lag/0/tokens"] == 2 and out["lag/0/is_ess"] == pytest.approx(0.9)
    assert out["lag/0/is_outside_clip"] == 0.5
    assert out["lag/0/k3_kl"] == pytest.approx((2.0 - 1.0 - math.log(2.0)) / 2)
    assert [out[f"lag/{s}/adv_share"] for s in ("0", "1", "3+")] == [0.25, 0.25, 0.5]
    # Trajectories go to the bucket of their oldest trained token; the empty bucket 2 logs nothing.
    assert out["lag/0/trajectories"] == 0 and "lag/0/reward" not in out
    assert out["lag/1/trajectories"] == 1 and out["lag/1/reward"] == 3.0 and out["lag/1/success"] == 1.0
    assert out["lag/3+/trajectories"] == 1 and out["lag/3+/reward"] == -1.0 and out["lag/3+/success"] == 0.0
    assert out["lag/3+/is_ess"] == 1.0 and out["lag/3+/k3_kl"] == 0.0
    assert not [k for k in out if k.startswith("lag/2/")]
    assert all(math.isfinite(v) for v in out.values())
