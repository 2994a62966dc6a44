"""Masked statistics: hand-computed cases and a loop reference for segment statistics."""

import statistics

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.masked import (
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    moments_to_mean_var,
    segment_mean_var,
)

NAN = float("nan")


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    # Selected values: 1, 2, 5. The NaN sits on a masked-out position and must not leak.
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    return x, mask


def test_masked_sum_and_mean_by_hand() -> None:
    x, mask = _example()
    assert_close(masked_sum(x, mask), torch.tensor(8.0, dtype=torch.float64))  # 1 + 2 + 5
    assert_close(masked_mean(x, mask), torch.tensor(8.0 / 3.0, dtype=torch.float64))
    assert_close(masked_sum(x, mask, dim=1), torch.tensor([3.0, 5.0], dtype=torch.float64))  # 1+2 | 5
    assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 5.0], dtype=torch.float64))


def test_masked_var_by_hand() -> None:
    x, mask = _example()
    # mean 8/3; deviations -5/3, -2/3, 7/3; squares 25/9 + 4/9 + 49/9 = 78/9
    assert_close(masked_var(x, mask, unbiased=True), torch.tensor(78.0 / 9.0 / 2.0, dtype=torch.float64))  # 13/3
    assert_close(masked_var(x, mask, unbiased=False), torch.tensor(78.0 / 9.0 / 3.0, dtype=torch.float64))  # 26/9


def test_masked_var_degenerate_counts() -> None:
    x = torch.tensor([3.0, 7.0])
    # One element: Bessel undefined -> biased value 0, not NaN/inf.
    assert_close(masked_var(x, torch.tensor([1.0, 0.0])), torch.tensor(0.0))
    # Empty mask: mean and var are 0.
    assert_close(masked_mean(x, torch.zeros(2)), torch.tensor(0.0))
    assert_close(masked_var(x, torch.zeros(2)), torch.tensor(0.0))


def test_masked_mean_matches_torch_on_random() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=gen) < 0.6).to(torch.float64)
    sel = x[mask.bool()]
    assert_close(masked_mean(x, mask), sel.mean())
    assert_close(masked_var(x, mask), sel.var(unbiased=True))


def test_masked_whiten_by_hand() -> None:
    x, mask = _example()
    out = masked_whiten(x, mask)
    std = (13.0 / 3.0 + 1e-8) ** 0.5
    expected = torch.tensor(
        [[(1 - 8 / 3) / std, (2 - 8 / 3) / std, 0.0], [0.0, (5 - 8 / 3) / std, 0.0]], dtype=torch.float64
    )
    assert_close(out, expected)
    # Whitened values have masked mean 0 and unbiased variance ~1.
    assert_close(masked_mean(out, mask), torch.tensor(0.0, dtype=torch.float64))
    assert_close(masked_var(out, mask), torch.tensor(1.0, dtype=torch.float64))
    # shift_mean=False adds the mean back (scale-only normalisation).
    out_noshift = masked_whiten(x, mask, shift_mean=False)
    assert_close(out_noshift, torch.where(mask.bool(), expected + 8 / 3, torch.zeros(())).to(torch.float64))


def test_masked_whiten_with_external_stats() -> None:
    x, mask = _example()
    # stats = (mean 0, var 4): (x - 0) / sqrt(4 + 1e-8) ~= x / 2 on masked positions.
    out = masked_whiten(x, mask, stats=(torch.tensor(0.0), torch.tensor(4.0)))
    assert_close(out, torch.tensor([[0.5, 1.0, 0.0], [0.0, 2.5, 0.0]], dtype=torch.float64))


def test_moments_roundtrip_and_sharding() -> None:
    x, mask = _example()
    total, total_sq, count = masked_moments(x, mask)
    assert_close(total, torch.tensor(8.0, dtype=torch.float64))
    assert_close(total_sq, torch.tensor(30.0, dtype=torch.float64))  # 1 + 4 + 25
    assert_close(count, torch.tensor(3.0, dtype=torch.float64))
    mean, var = moments_to_mean_var(total, total_sq, count)
    # (30/3 - 64/9) * 3/2 = 26/9 * 3/2 = 13/3
    assert_close(mean, torch.tensor(8.0 / 3.0, dtype=torch.float64))
    assert_close(var, torch.tensor(13.0 / 3.0, dtype=torch.float64))

    # Summing the moments of two "ranks" gives the global statistics (what an all-reduce would do).
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    bmask = (torch.rand(8, 6, generator=gen) < 0.5).to(torch.float64)
    parts = [masked_moments(big[:3], bmask[:3]), masked_moments(big[3:], bmask[3:])]
    summed = [parts[0][i] + parts[1][i] for i in range(3)]
    g_mean, g_var = moments_to_mean_var(*summed)
    assert_close(g_mean, masked_mean(big, bmask))
    assert_close(g_var, masked_var(big, bmask))
    assert_close(masked_whiten(big, bmask, stats=(g_mean, g_var)), masked_whiten(big, bmask))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segment_mean_var_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_segments = 6
    ids = torch.randint(0, num_segments, (40,), generator=gen)
    x = torch.randn(40, generator=gen, dtype=torch.float64)
    mean, var, count = segment_mean_var(x, ids, num_segments)
    for k in range(num_segments):
        vals = x[ids == k].tolist()
        assert count[k].item() == len(vals)
        assert mean[k].item() == pytest.approx(statistics.fmean(vals) if vals else 0.0)
        assert var[k].item() == pytest.approx(statistics.variance(vals) if len(vals) > 1 else 0.0)
