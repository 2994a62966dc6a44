"""Training-health diagnostics: explained variance, k3 KL, and per-bucket means (e.g. by staleness).

All functions are side-effect free, return tensors (no ``.item()``) and run under ``torch.no_grad``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ragen_async.algo.losses import kl_estimate
from ragen_async.algo.masked import masked_mean, masked_var

__all__ = ["explained_variance", "approx_kl_k3", "bucket_by", "masked_mean_by_bucket"]


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[R - V] / Var[R] over the masked tokens (unbiased variances).

    1 is a perfect critic, 0 is no better than predicting the mean, < 0 is worse.

    Args:
        values: [B, T] critic predictions.
        returns: [B, T] targets.
        mask: [B, T] 0/1.

    Returns:
        Scalar; NaN when Var[R] == 0 (undefined, as cleanrl), never a division blow-up.
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    nan = torch.full_like(var_returns, float("nan"))
    return torch.where(var_returns > 0, 1.0 - var_residual / torch.where(var_returns > 0, var_returns, 1.0), nan)


@torch.no_grad()
def approx_kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Masked mean of the k3 estimate of KL(pi || pi_ref) for tokens sampled from pi.

    Args:
        logprobs: [B, T] log pi (the policy that sampled the tokens).
        ref_logprobs: [B, T] log pi_ref.
        mask: [B, T] 0/1.
    """
    sampled = mask != 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logp = torch.where(sampled, logprobs, zero)
    ref = torch.where(sampled, ref_logprobs.to(logprobs.dtype), zero)
    return masked_mean(kl_estimate(logp, ref, "k3"), mask.to(logprobs.dtype))


@torch.no_grad()
def bucket_by(
    values: Tensor,
    keys: Tensor,
    num_buckets: int,
    weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Weighted mean of ``values`` per integer key, without a Python loop.

    Args:
        values: [N].
        keys: [N] integer bucket ids. Keys >= ``num_buckets`` go to the last bucket (an overflow bucket
            "K-1 or more", natural for staleness) and negative keys to bucket 0.
        num_buckets: K.
        weights: optional [N] 0/1 (or non-negative) weights; default 1. Zero-weight entries are ignored
            even if their value is NaN.

    Returns:
        ``(means [K], counts [K])``: ``counts`` is the summed weight per bucket; ``means`` is 0 for empty
        buckets. To combine across ranks, all-reduce ``means * counts`` and ``counts``.
    """
    dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
    w = torch.ones_like(values, dtype=dtype) if weights is None else weights.to(dtype)
    idx = keys.long().clamp(0, num_buckets - 1)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    contrib = torch.where(w != 0, values.to(dtype) * w, zero)
    zeros = torch.zeros(num_buckets, dtype=dtype, device=values.device)
    sums = zeros.index_add(0, idx, contrib)
    counts = zeros.index_add(0, idx, w)
    return sums / counts.clamp(min=1e-8), counts


@torch.no_grad()
def masked_mean_by_bucket(x: Tensor, mask: Tensor, bucket: Tensor, num_buckets: int) -> tuple[Tensor, Tensor]:
    """Masked token mean of ``x`` per bucket, e.g. behaviour/learner k3 KL by trajectory staleness.

    Args:
        x: [B, T] per-token values.
        mask: [B, T] 0/1.
        bucket: [B, T] or [B] (one bucket per trajectory, e.g. ``policy_version`` lag) int ids; clamped into
            ``[0, num_buckets)`` as :func:`bucket_by`.
        num_buckets: K.

    Returns:
        ``(means [K], counts [K])`` with counts = masked tokens per bucket.
    """
    if bucket.dim() == 1:
        bucket = bucket.unsqueeze(1).expand_as(x)
    return bucket_by(x.reshape(-1), bucket.reshape(-1), num_buckets, weights=mask.reshape(-1))
