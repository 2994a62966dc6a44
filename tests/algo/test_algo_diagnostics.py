"""Diagnostics: explained variance, k3 KL, bucketed means."""

import math

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.diagnostics import approx_kl_k3, bucket_by, explained_variance, masked_mean_by_bucket


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


def test_bucket_by_by_hand() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    keys = torch.tensor([0, 1, 0, 5, -1])  # 5 -> overflow bucket 2; -1 -> bucket 0
    means, counts = bucket_by(values, keys, 3)
    # bucket 0: (1 + 3 + 5) / 3 = 3; bucket 1: 2; bucket 2: 4
    assert_close(means, torch.tensor([3.0, 2.0, 4.0]))
    assert_close(counts, torch.tensor([3.0, 1.0, 1.0]))
    means, counts = bucket_by(values, keys, 4, weights=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]))
    # bucket 0: (1 + 5) / 2 = 3; bucket 2 is empty -> 0; bucket 3: 4
    assert_close(means, torch.tensor([3.0, 2.0, 0.0, 4.0]))
    assert_close(counts, torch.tensor([2.0, 1.0, 0.0, 1.0]))


@pytest.mark.parametrize("per_row", [True, False])
def test_masked_mean_by_bucket_matches_loop(per_row: bool) -> None:
    gen = torch.Generator().manual_seed(14)
    batch, length, num_buckets = 6, 7, 4
    x = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.6).to(torch.float64)
    x = torch.where(mask.bool(), x, torch.full_like(x, float("nan")))  # padding garbage must not leak
    if per_row:
        bucket = torch.randint(0, 6, (batch,), generator=gen)  # staleness per trajectory; >= 4 overflows
        token_bucket = bucket[:, None].expand(batch, length)
    else:
        bucket = torch.randint(0, 6, (batch, length), generator=gen)
        token_bucket = bucket
    means, counts = masked_mean_by_bucket(x, mask, bucket, num_buckets)
    sums = [0.0] * num_buckets
    ref_counts = [0.0] * num_buckets
    for b in range(batch):
        for t in range(length):
            if mask[b, t].item() == 1.0:
                k = min(int(token_bucket[b, t].item()), num_buckets - 1)
                sums[k] += x[b, t].item()
                ref_counts[k] += 1.0
    ref_means = [s / c if c > 0 else 0.0 for s, c in zip(sums, ref_counts, strict=True)]
    assert_close(means, torch.tensor(ref_means, dtype=torch.float64))
    assert_close(counts, torch.tensor(ref_counts, dtype=torch.float64))
