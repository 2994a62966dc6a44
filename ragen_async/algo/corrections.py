"""Per-sample corrections of stale (off-policy) tokens: one detached weight per token that multiplies the
policy loss, computed from the engine's behaviour log-probs mu, the learner's proximal log-probs pi_old, the
advantages and (for ``age``) each token's measured age in policy versions.

Every correction is anchored at mu: it compares pi_old with mu, never pi_theta with pi_old. With one optimizer
pass per step (the study configs), pi_theta == pi_old at the only forward, so PPO's clip never acts there
and these weights are the only treatment a stale token gets; pi_old is then also pi_theta, as DeepSeek-V3.2
and TRL write the masking rule. No correction drops a group or a trajectory from the batch: a masked token
keeps its place in the loss denominator (``num_tokens`` means the same in every mode) and only its loss is 0.

Modes (``d_t = log mu_t - log pi_old_t`` per trained token, clamped to [-20, 20]; ``D_i`` the mean of d_t
over the trained tokens of trajectory i; ``a_t`` the token's age in versions):

- ``none``: w = 1.
- ``tis``: w = min(exp(-d), is_cap) (token-level truncated IS; ``truncated`` where exp(-d) > is_cap).
- ``decoupled``: w = exp(-d), 0 where exp(-d) > is_cap (AReaL's masked token IS; ``masked`` there).
- ``opsm``: w = 0 where A_t < 0 and D_i > opsm_delta, else 1 (DeepSeek-V3.2 off-policy sequence masking; with
  per-token advantages the sign is read per token, which for a group-normalised score is the sequence's).
- ``geo_mask``: w = 0 on every token of i when rho_i = exp(-D_i) (the geometric-mean sequence ratio
  pi_old/mu) lies outside [1/geo_cap, geo_cap], else 1.
- ``geo_tis``: w = min(rho_i, geo_cap) on every token of i (``truncated`` where rho_i > geo_cap).
- ``age``: w = min(1, age_tau / a_t) (1 at a_t = 0) on tokens with A_t < 0 (on every token with
  ``age_negatives_only=False``): each stale sample's step is scaled so that age x step stays at most
  age_tau x step; ``truncated`` where w < 1.

All functions are pure tensor math under ``torch.no_grad``; masked-out positions may hold anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = ["OffPolicyMode", "OFF_POLICY_MODES", "Correction", "off_policy_correction", "sequence_log_ratio"]

OffPolicyMode = Literal["none", "tis", "decoupled", "opsm", "geo_mask", "geo_tis", "age"]
OFF_POLICY_MODES: tuple[str, ...] = get_args(OffPolicyMode)
NEEDS_STALENESS = frozenset({"age"})
"""Modes that read each token's age (``staleness``)."""

_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True, slots=True)
class Correction:
    """What a correction does to each token ([B, T], zero / False off the loss mask).

    Attributes:
        weight: the factor on the token's policy loss (detached): 1 untouched, 0 masked.
        masked: the correction removed the token's loss (weight 0 although the token is trained).
        truncated: the correction reduced the token's weight by a cap (tis, geo_tis) or by its age (age),
            without removing it.
        token_ratio: exp(-d) = pi_old / mu per token, the raw token importance weight (1 off the mask).
    """

    weight: Tensor
    masked: Tensor
    truncated: Tensor
    token_ratio: Tensor


def sequence_log_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[B] mean over each row's trained tokens of log pi_old - log mu (clamped per token to [-20, 20]);
    0 for a row without trained tokens. Minus DeepSeek-V3.2's per-sequence k1 KL; ``exp`` of it is the
    geometric-mean sequence ratio."""
    sampled = mask != 0
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    diff = torch.where(sampled, (old_logprobs - behaviour_logprobs.to(old_logprobs.dtype))
                       .clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), zero)
    count = sampled.sum(dim=-1).clamp(min=1).to(old_logprobs.dtype)
    return diff.sum(dim=-1) / count


@torch.no_grad()
def off_policy_correction(
    mode: str,
    *,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    staleness: Tensor | None = None,
    is_cap: float | None = 2.0,
    opsm_delta: float = 0.01,
    geo_cap: float = 1.01,
    age_tau: float = 2.0,
    age_negatives_only: bool = True,
) -> Correction:
    """The per-token weights of correction ``mode`` (see the module docstring for each formula).

    Args:
        mode: one of :data:`OFF_POLICY_MODES`.
        old_logprobs: [B, T] log pi_old (the learner's log-probs before this step's update).
        behaviour_logprobs: [B, T] log mu (the engine's log-probs of the sampled tokens).
        advantages: [B, T] per-token advantages (only their sign is read, by ``opsm`` and ``age``).
        mask: [B, T] 0/1 loss mask.
        staleness: [B, T] each token's age in policy versions (needed by ``age``).
        is_cap: cap of ``tis`` / ``decoupled``; None: no truncation / masking.
        opsm_delta: ``opsm``'s threshold on D_i (nats per token).
        geo_cap: ``geo_mask``'s band [1/geo_cap, geo_cap] and ``geo_tis``'s cap on rho_i (> 1).
        age_tau: ``age``'s age (versions) beyond which weights fall as age_tau / age (> 0).
        age_negatives_only: ``age`` scales only negative-advantage tokens.

    Returns:
        A :class:`Correction`.

    Raises:
        ValueError: unknown mode, ``age`` without ``staleness``, or a bound out of range.
    """
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off_policy mode {mode!r}; valid modes: {', '.join(OFF_POLICY_MODES)}")
    if mode in NEEDS_STALENESS and staleness is None:
        raise ValueError(f"off_policy={mode!r} needs each token's age (staleness)")
    if mode in ("geo_mask", "geo_tis") and not geo_cap > 1.0:
        raise ValueError(f"geo_cap must be > 1, got {geo_cap}")
    if mode == "age" and not age_tau > 0.0:
        raise ValueError(f"age_tau must be > 0, got {age_tau}")
    sampled = mask != 0
    dtype = old_logprobs.dtype
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    one = torch.ones((), dtype=dtype, device=old_logprobs.device)
    old = torch.where(sampled, old_logprobs, zero)
    behav = torch.where(sampled, behaviour_logprobs.to(dtype), zero)
    adv = torch.where(sampled, advantages.to(dtype), zero)
    token_ratio = torch.exp((old - behav).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    no = torch.zeros_like(sampled)

    if mode == "none":
        weight, masked, truncated = torch.ones_like(token_ratio), no, no
    elif mode in ("tis", "decoupled"):
        capped = (token_ratio > is_cap) & sampled if is_cap is not None else no
        if mode == "tis":
            weight = token_ratio.clamp(max=is_cap) if is_cap is not None else token_ratio
            masked, truncated = no, capped
        else:
            weight = torch.where(capped, zero, token_ratio)
            masked, truncated = capped, no
    elif mode in ("opsm", "geo_mask", "geo_tis"):
        seq_log_rho = sequence_log_ratio(old, behav, mask)[:, None].expand_as(old)  # -D_i on every token
        if mode == "opsm":
            masked = sampled & (adv < 0) & (-seq_log_rho > opsm_delta)
            weight, truncated = torch.where(masked, zero, one), no
        elif mode == "geo_mask":
            masked = sampled & (seq_log_rho.abs() > math.log(geo_cap))
            weight, truncated = torch.where(masked, zero, one), no
        else:  # geo_tis
            rho = torch.exp(seq_log_rho)
            truncated = sampled & (rho > geo_cap)
            weight, masked = rho.clamp(max=geo_cap), no
    else:  # age
        assert staleness is not None
        age = torch.where(sampled, staleness.to(dtype), zero).clamp(min=0)
        scaled = torch.where(age > age_tau, age_tau / torch.where(age > 0, age, one), one)
        applies = (adv < 0) if age_negatives_only else torch.ones_like(sampled)
        weight = torch.where(applies, scaled, one)
        truncated = sampled & applies & (age > age_tau)
        masked = no
    weight = torch.where(sampled, weight, zero)
    return Correction(weight=weight, masked=masked & sampled, truncated=truncated & sampled,
                      token_ratio=torch.where(sampled, token_ratio, one))
