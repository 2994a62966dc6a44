"""Masked reductions and whitening: the statistics every other `algo` module builds on.

Conventions (shared by the whole package):
- ``mask`` is a float tensor broadcastable to ``x`` holding 1.0 on positions that count and 0.0 elsewhere.
  Fractional weights are allowed by the arithmetic, but the package is written and tested for 0/1 masks.
- Masked-out positions may hold anything, including NaN/inf (padding logprobs often do): every reduction
  selects with ``torch.where`` instead of multiplying, because ``nan * 0`` is still NaN.
- No host synchronisation (no ``.item()``, no data-dependent Python branches), so all functions can run
  inside CUDA graphs / compiled regions and never stall the stream.
- Statistics over an empty mask are 0 (not NaN), so an all-padding micro-batch contributes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "masked_moments",
    "moments_to_mean_var",
    "segment_mean_var",
]

# Denominator floor: only matters when the mask is empty (sum is then 0 too, so the result is 0).
_TINY = 1e-8


def _select(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` where mask != 0, exact 0 elsewhere (NaN-safe)."""
    return torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x * mask``; over all elements (scalar) if ``dim`` is None, else over ``dim``.

    Args:
        x: [...] values.
        mask: [...] (broadcastable to ``x``) 0/1 weights.
    """
    selected = _select(x, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 where the mask is empty.

    Args:
        x: [...] values.
        mask: [...] (broadcastable to ``x``) 0/1 weights.
        dim: reduce over these dims (None: all, scalar result).
    """
    mask = mask.to(x.dtype).expand_as(x)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=_TINY)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over the masked positions (scalar).

    Args:
        x: [...] values.
        mask: [...] 0/1 weights.
        unbiased: Bessel correction n/(n-1), as ``torch.var`` and verl's ``masked_var``. With fewer than two
            masked elements the correction is undefined; we return the biased value (0 for one element)
            instead of raising, because raising would need a host sync.
    """
    mask = mask.to(x.dtype).expand_as(x)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        bessel = torch.where(count > 1, count / (count - 1).clamp(min=_TINY), torch.ones_like(count))
        var = var * bessel
    return var


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    stats: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Whiten ``x`` over its masked positions: ``(x - mean) / sqrt(var + eps)``.

    This is how RAGEN/verl normalise GAE advantages over the whole batch (Bessel-corrected variance).

    Args:
        x: [B, T] (any shape) values.
        mask: same shape, 0/1.
        shift_mean: if False the mean is added back (only the scale is normalised), as verl.
        eps: added to the variance.
        stats: optional ``(mean, var)`` scalars, e.g. global statistics all-reduced from
            :func:`masked_moments` + :func:`moments_to_mean_var`; default: local masked statistics.

    Returns:
        Same shape as ``x``; exactly 0 where ``mask`` is 0 (so padding never leaks into later maxima/means).
    """
    if stats is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask, unbiased=True)
    else:
        mean, var = stats
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.expand_as(x) != 0, whitened, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_moments(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Raw moments ``(sum, sum_sq, count)`` of ``x`` over the mask, all scalars.

    They are additive across shards: all-reduce (SUM) them, then call :func:`moments_to_mean_var` to get
    global statistics for :func:`masked_whiten` ``stats=``.
    """
    mask = mask.to(x.dtype).expand_as(x)
    return masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()


def moments_to_mean_var(total: Tensor, total_sq: Tensor, count: Tensor, unbiased: bool = True) -> tuple[Tensor, Tensor]:
    """Mean and variance from (possibly all-reduced) raw moments.

    Uses ``E[x^2] - E[x]^2`` (clamped at 0): slightly less accurate than the two-pass variance in
    :func:`masked_var` when |mean| >> std, which is irrelevant for advantages (fp32, |mean| ~ std).
    Bessel correction as :func:`masked_var` (skipped when count <= 1).
    """
    safe_count = count.clamp(min=_TINY)
    mean = total / safe_count
    var = (total_sq / safe_count - mean * mean).clamp(min=0.0)
    if unbiased:
        var = var * torch.where(count > 1, count / (count - 1).clamp(min=_TINY), torch.ones_like(count))
    return mean, var


def segment_mean_var(x: Tensor, segment_ids: Tensor, num_segments: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-segment mean, unbiased variance and count of a flat tensor, without a Python loop.

    Args:
        x: [N] values (floating point).
        segment_ids: [N] int64 in ``[0, num_segments)``.
        num_segments: K.

    Returns:
        ``(mean [K], var [K], count [K])``. Segments with a single element get ``var = 0`` (torch would give
        NaN): a one-sample group carries no spread information. Empty segments get mean = var = 0.
    """
    zeros = torch.zeros(num_segments, dtype=x.dtype, device=x.device)
    count = zeros.index_add(0, segment_ids, torch.ones_like(x))
    mean = zeros.index_add(0, segment_ids, x) / count.clamp(min=1.0)
    # Two-pass (centre first) so large offsets do not cancel catastrophically.
    centered = x - mean[segment_ids]
    sq = zeros.index_add(0, segment_ids, centered * centered)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1.0), zeros)
    return mean, var, count
