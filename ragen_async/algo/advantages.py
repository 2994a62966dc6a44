"""Advantage estimators for multi-turn trajectories: token rewards, masked GAE, group normalisation.

A trajectory is one token sequence in which policy-sampled tokens (``mask`` = 1) are interleaved with
prompt / environment-feedback tokens (``mask`` = 0). The MDP the policy acts in consists of the sampled
tokens only, so GAE here walks the sampled tokens in order and skips everything else: the "next state" of a
sampled token is the next sampled token of the same row. (verl runs GAE over every position; with RAGEN's
gamma = lambda = 1 and the reward on the last token both give A_t = R - V_t, but for gamma < 1 ours does not
discount across environment tokens the policy never chose.)

All estimators run under ``torch.no_grad``: advantages and returns are targets, never differentiated.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from ragen_async.algo.masked import segment_mean_var

__all__ = [
    "scores_to_token_rewards",
    "compute_gae",
    "GroupNormMode",
    "GROUP_NORM_MODES",
    "group_normalize",
    "broadcast_to_tokens",
]

GroupNormMode = Literal["mean_std", "mean", "identity", "asym_clip"]
GROUP_NORM_MODES: tuple[str, ...] = get_args(GroupNormMode)

# RAGEN's thresholds for mean_std: epsilon added to sigma, and "no spread" cut-off.
_STD_EPS = 1e-6


def _float_dtype(t: Tensor) -> torch.dtype:
    return t.dtype if t.is_floating_point() else torch.get_default_dtype()


@torch.no_grad()
def scores_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each trajectory's scalar score on its last sampled token (RAGEN's reward placement).

    Args:
        scores: [B] trajectory scores.
        mask: [B, T] 0/1 loss mask.

    Returns:
        [B, T] zeros except ``scores[b]`` at the last position where ``mask[b]`` is 1. Rows with an empty
        mask get no reward at all.
    """
    batch, length = mask.shape
    sampled = mask != 0
    positions = torch.arange(length, device=mask.device).expand(batch, length)
    # Largest masked position per row (-1 if none).
    last = torch.where(sampled, positions, torch.full_like(positions, -1)).amax(dim=1)  # [B]
    has_any = last >= 0
    dtype = _float_dtype(scores)
    values = torch.where(has_any, scores.to(dtype), torch.zeros((), dtype=dtype, device=scores.device))
    out = torch.zeros(batch, length, dtype=dtype, device=mask.device)
    return out.scatter(1, last.clamp(min=0).unsqueeze(1), values.unsqueeze(1))


def _compact_sampled(mask: Tensor) -> Tensor:
    """Permutation [B, T] per row that moves sampled positions to the front, keeping their order."""
    # Key 0 for sampled, 1 for others; a stable sort keeps the original order within each class.
    key = (mask == 0).to(torch.int8)
    return torch.sort(key, dim=1, stable=True).indices


@torch.no_grad()
def compute_gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the sampled tokens of each row (Schulman et al. 2015).

    For the k-th sampled token of a row (k = 0..K-1, in position order):
        delta_k = r_k + gamma * V_{k+1} - V_k          (V_K = 0: the episode ends after the last sampled token)
        A_k     = delta_k + gamma * gae_lambda * A_{k+1} (A_K = 0)
        R_k     = A_k + V_k

    Args:
        token_rewards: [B, T] rewards; only entries on sampled tokens are used (put rewards on sampled
            tokens, e.g. with :func:`scores_to_token_rewards`; rewards on env tokens are ignored).
        values: [B, T] critic values V(s_t) (only sampled positions are read).
        mask: [B, T] 0/1 loss mask.
        gamma: discount.
        gae_lambda: GAE lambda.

    Returns:
        ``(advantages [B, T], returns [B, T])`` in at least fp32, both exactly 0 where ``mask`` is 0. Not whitened: call
        :func:`ragen_async.algo.masked.masked_whiten` on the advantages as RAGEN does.

    Vectorised over B: a stable sort moves each row's sampled tokens to the front (so "next sampled token"
    becomes "next column"), the recursion runs over columns, then a scatter puts results back. With
    ``gamma * gae_lambda == 1`` the recursion is a reverse cumulative sum and no Python loop is needed.
    """
    # At least fp32: a long reverse recursion / cumsum in bf16 loses the small per-token deltas.
    dtype = torch.promote_types(_float_dtype(values), torch.float32)
    order = _compact_sampled(mask)  # [B, T]
    sampled = torch.gather(mask != 0, 1, order)  # True entries form a prefix of each row
    m = sampled.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    # where (not multiply) so NaN/inf in padded positions cannot leak into the recursion.
    r = torch.where(sampled, torch.gather(token_rewards.to(dtype), 1, order), zero)
    v = torch.where(sampled, torch.gather(values.to(dtype), 1, order), zero)

    # Value of the next sampled token; 0 past the last one (its mask entry is 0 or it is off the end).
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    delta = (r + gamma * next_v - v) * m
    decay = gamma * gae_lambda

    if decay == 1.0:
        # A_k = sum_{j>=k} delta_j within the prefix (delta is 0 outside it).
        adv_c = delta.flip(1).cumsum(1).flip(1)
    else:
        adv_c = torch.zeros_like(delta)
        running = torch.zeros_like(delta[:, 0])
        for t in range(delta.shape[1] - 1, -1, -1):
            # The mask reset stops accumulation past the prefix end (running is 0 there anyway).
            running = delta[:, t] + decay * running * m[:, t]
            adv_c[:, t] = running
    adv_c = adv_c * m
    ret_c = (adv_c + v) * m

    advantages = torch.zeros_like(adv_c).scatter(1, order, adv_c)
    returns = torch.zeros_like(ret_c).scatter(1, order, ret_c)
    return advantages, returns


@torch.no_grad()
def group_normalize(scores: Tensor, group_ids: Tensor, mode: str) -> Tensor:
    """Normalise trajectory scores within groups (GRPO / RAGEN ``reward_normalization``).

    Args:
        scores: [N] raw scores.
        group_ids: [N] int64 group labels (any values; e.g. the initial-state ``group_id``).
        mode:
            - ``"mean_std"``: (x - mu) / (sigma + 1e-6) with unbiased sigma; a group with sigma <= 1e-6
              (incl. singleton groups) maps to 0 (RAGEN's rule: no spread, no signal).
            - ``"mean"``: x - mu.
            - ``"identity"``: x (as float).
            - ``"asym_clip"``: ``mean_std`` clamped to [-1, 3].

    Returns:
        [N] normalised scores (a new tensor; the input is never modified).

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in GROUP_NORM_MODES:
        raise ValueError(f"unknown group normalization mode {mode!r}; valid modes: {', '.join(GROUP_NORM_MODES)}")
    x = scores.to(_float_dtype(scores))
    if mode == "identity":
        return x.clone()

    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    mean, var, _ = segment_mean_var(x, inverse, unique_ids.numel())
    centered = x - mean[inverse]
    if mode == "mean":
        return centered

    std = var.sqrt()[inverse]
    normed = torch.where(std > _STD_EPS, centered / (std + _STD_EPS), torch.zeros_like(centered))
    if mode == "asym_clip":
        # Asymmetric: a lucky success may push harder (up to 3) than a failure pulls (down to -1).
        normed = normed.clamp(min=-1.0, max=3.0)
    return normed


def broadcast_to_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """Copy a per-trajectory scalar onto every sampled token (GRPO token advantages).

    Args:
        values: [B].
        mask: [B, T] 0/1.

    Returns:
        [B, T] with ``values[b]`` where ``mask[b, t]`` is 1, else exactly 0.
    """
    dtype = _float_dtype(values)
    full = values.to(dtype).unsqueeze(1).expand(mask.shape)
    return torch.where(mask != 0, full, torch.zeros((), dtype=dtype, device=values.device))
