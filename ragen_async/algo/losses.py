"""StarPO-S losses: clipped PPO policy loss (clip-higher + dual clip, optional off-policy correction),
entropy bonus, KL penalty, clipped value loss, and the logits -> per-token helpers they need.

Every loss takes [B, T] tensors plus the loss mask and returns ``(loss, metrics)``: ``loss`` is a scalar
with a graph, ``metrics`` maps short unprefixed names to detached scalar tensors (callers add prefixes such
as ``actor/`` and call ``.item()`` once per step, off the hot path).

Masked-out positions (prompt, env feedback, padding) may hold arbitrary values, even NaN/inf: inputs are
sanitised with ``torch.where`` before any arithmetic, so neither the loss nor its gradient is poisoned by
them, and all-padding rows contribute exactly zero loss and zero gradient.

Metric semantics under micro-batching: ``pg_loss``, ``entropy``, ``kl_loss`` and ``vf_loss`` go through
:func:`aggregate_loss` with the caller's ``num_tokens``/``num_seqs``, so with global denominators they are
per-micro-batch *contributions* (sum them). All fractions, means and KL diagnostics are local masked means
over this call's tokens (combine them weighted by token count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ragen_async.algo.aggregation import aggregate_loss
from ragen_async.algo.corrections import NEEDS_STALENESS, OFF_POLICY_MODES, OffPolicyMode, off_policy_correction
from ragen_async.algo.masked import masked_mean

__all__ = [
    "entropy_from_logits",
    "head_logprobs_entropy",
    "logprobs_from_logits",
    "KLType",
    "KL_TYPES",
    "kl_estimate",
    "OffPolicyMode",
    "OFF_POLICY_MODES",
    "PolicyLossInputs",
    "policy_loss",
    "value_loss",
]

KLType = Literal["k1", "kl", "k2", "mse", "abs", "k3", "low_var_kl"]
KL_TYPES: tuple[str, ...] = get_args(KLType)

# exp() of a log-ratio beyond this overflows or dominates everything; verl clamps at the same value.
_LOG_RATIO_CLAMP = 20.0
# verl's clamp on the k3 estimate itself (low_var_kl).
_K3_CLAMP = 10.0


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position.

    H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v, which never takes the log of a tiny
    probability (stable for large-magnitude logits).

    Args:
        logits: [B, T, V] (compute in fp32 for accuracy; logits must be finite).

    Returns:
        [B, T] entropies in nats.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, token_ids: Tensor) -> Tensor:
    """Log-probability of ``token_ids`` under ``logits``: ``z[id] - logsumexp(z)``.

    Avoids materialising the full [B, T, V] ``log_softmax`` output (only the gathered column and the
    [B, T] normaliser are kept), which matters for 150k-token vocabularies.

    Args:
        logits: [B, T, V], already aligned so position t scores ``token_ids[:, t]``.
        token_ids: [B, T] int64.

    Returns:
        [B, T] log-probs.
    """
    picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _head_chunk(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float,
                with_entropy: bool) -> tuple[Tensor, ...]:
    logits = head(hidden).float() / temperature
    logprobs = logprobs_from_logits(logits[None], targets[None])[0]
    return (logprobs, entropy_from_logits(logits[None])[0]) if with_entropy else (logprobs,)


def head_logprobs_entropy(
    head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` (and entropies) under ``head(hidden) / temperature`` in fp32, computed
    ``chunk_tokens`` positions at a time so the fp32 logits of all positions never exist at once.

    With a 151,936-token vocabulary the fp32 logits are 0.6 MB per position, and the softmax, logsumexp
    and their gradients each need a tensor of that size again, so one micro-batch of a few thousand
    trained tokens would hold gigabytes. Per chunk, the logits are computed, reduced to two numbers per
    position and dropped. With gradient, each chunk runs under (non-reentrant) activation
    checkpointing: backward keeps only the chunk's ``hidden`` rows and recomputes its logits, so peak
    memory is one chunk's logits and their gradient, whatever the number of positions. The values are
    those of the unchunked computation (the same operations on row blocks); the price with gradient is
    one more head matmul per chunk in backward.

    Args:
        head: [N, H] -> [N, V] (the LM's output embedding).
        hidden: [N, H] final hidden states of the scored positions.
        targets: [N] int64 token ids.
        temperature: logits are divided by it (the sampling temperature).
        chunk_tokens: positions per chunk; None: all at once.
        with_entropy: also return the entropies (else None).

    Returns:
        ``(logprobs [N], entropy [N] or None)`` in fp32.
    """
    n = hidden.shape[0]
    step = n if chunk_tokens is None else chunk_tokens
    use_checkpoint = torch.is_grad_enabled() and n > step
    parts = []
    for start in range(0, n, max(step, 1)):
        h, t = hidden[start:start + step], targets[start:start + step]
        if use_checkpoint:
            parts.append(checkpoint(_head_chunk, head, h, t, temperature, with_entropy, use_reentrant=False))
        else:
            parts.append(_head_chunk(head, h, t, temperature, with_entropy))
    if len(parts) == 1:
        out = parts[0]
    elif parts:
        out = tuple(torch.cat(p) for p in zip(*parts, strict=True))
    else:  # no positions: empty results (through the head, so the graph still reaches its weights)
        out = _head_chunk(head, hidden, targets, temperature, with_entropy)
    return out[0], (out[1] if with_entropy else None)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3 estimators).

    With d = log pi - log pi_ref:
        - ``"k1"`` / ``"kl"``: d (unbiased, high variance, can be negative).
        - ``"k2"`` / ``"mse"``: 0.5 d^2.
        - ``"abs"``: |d|.
        - ``"k3"`` / ``"low_var_kl"``: exp(-d) + d - 1 (unbiased, >= 0, low variance). As verl, -d is
          clamped to [-20, 20] before exp and the result to [-10, 10], so one wild token cannot blow up the loss.

    Args:
        logprobs: [B, T] log pi (the sampling policy).
        ref_logprobs: [B, T] log pi_ref.
        kind: one of the names above.

    Returns:
        [B, T] per-token estimates.

    Raises:
        ValueError: unknown ``kind``.
    """
    diff = logprobs - ref_logprobs
    if kind in ("k1", "kl"):
        return diff
    if kind in ("k2", "mse"):
        return 0.5 * diff * diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k3", "low_var_kl"):
        neg = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log(pi_ref / pi)
        return (torch.exp(neg) - neg - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"unknown kl type {kind!r}; valid types: {', '.join(KL_TYPES)}")


@dataclass(frozen=True, slots=True)
class PolicyLossInputs:
    """Per-token inputs of :func:`policy_loss`; every tensor is [B, T].

    Attributes:
        logprobs: log pi_theta(token) of the policy being optimised (carries the graph).
        old_logprobs: log-probs of the same tokens under the learner's weights at the start of this step
            (the PPO "old" / AReaL "proximal" policy). Treated as constants.
        advantages: A_t (already whitened / group-normalised). Treated as constants.
        mask: 0/1 loss mask (policy-sampled tokens).
        behaviour_logprobs: log mu(token) reported by the inference engine that sampled the token (possibly
            an older policy version, and always a different numerical implementation). Required for the
            ``tis`` and ``decoupled`` off-policy modes; otherwise only used for the ``behaviour_kl_k3``
            diagnostic.
        entropy: per-token entropy of pi_theta (with graph if the bonus is used).
        ref_logprobs: log pi_ref, required when ``kl_coef > 0``.
        staleness: each token's age in policy versions (the learner's version minus the version that
            sampled it); required by the ``age`` off-policy mode, unused by the others.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    behaviour_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    ref_logprobs: Tensor | None = None
    staleness: Tensor | None = None


def _where_masked(x: Tensor, sampled: Tensor) -> Tensor:
    """x on sampled tokens, exact 0 elsewhere; the gradient to masked-out entries is exactly 0."""
    return torch.where(sampled, x, torch.zeros((), dtype=x.dtype, device=x.device))


def policy_loss(
    inputs: PolicyLossInputs,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    dual_clip_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    off_policy: str = "none",
    is_cap: float | None = 2.0,
    opsm_delta: float = 0.01,
    geo_cap: float = 1.01,
    age_tau: float = 2.0,
    age_negatives_only: bool = True,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_type: str = "k1",
    num_tokens: int | float | Tensor | None = None,
    num_seqs: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """StarPO-S actor loss: PPO clip-higher + dual clip, optional off-policy correction, entropy and KL terms.

    Per token, with r = exp(log pi_theta - log pi_old):
        L_clip = max(-A r, -A clip(r, 1 - clip_eps_low, 1 + clip_eps_high))     (PPO; DAPO clip-higher)
        L      = min(L_clip, -A c) if A < 0 else L_clip                          (dual clip, Ye et al. 2020)
    The dual clip bounds the loss of a negative-advantage token whose ratio exploded (r > c), which plain
    PPO leaves unbounded.

    Off-policy correction (``off_policy``) for tokens sampled by a stale / numerically different engine mu:
        - ``"none"``: as above.
        - ``"tis"``: L *= min(exp(log pi_old - log mu), is_cap), detached (truncated IS, verl/slime).
        - ``"decoupled"``: L *= exp(log pi_old - log mu), detached, and tokens whose weight exceeds
          ``is_cap`` get weight 0 (AReaL decoupled PPO: the cap masks instead of truncating). Masked tokens
          still count in the denominator, as AReaL, so ``num_tokens`` keeps the same meaning in every mode.
        - ``"opsm"``, ``"geo_mask"``, ``"geo_tis"``, ``"age"``: L *= the weight of
          :func:`~ragen_async.algo.corrections.off_policy_correction` (sequence masking of stale negatives,
          geometric-mean sequence mask / truncated weight, age-scaled negatives), detached; masked tokens
          likewise stay in the denominator.
        ``is_cap=None`` disables truncation / masking of ``tis`` / ``decoupled``. Every mode compares pi_old
        with mu (pi_old == pi_theta in the one-pass regime).

    Total loss = agg(L) - entropy_coef * agg(entropy) + kl_coef * agg(kl_estimate(log pi_theta, log pi_ref)),
    every ``agg`` being :func:`aggregate_loss` with ``loss_agg_mode``, ``num_tokens``, ``num_seqs``.

    Args:
        inputs: see :class:`PolicyLossInputs`.
        clip_eps_low: epsilon below 1 (0.2).
        clip_eps_high: epsilon above 1 (0.28 in StarPO-S, 0.2 in vanilla StarPO).
        dual_clip_c: dual-clip constant c > 1 (3.0); None disables dual clip.
        loss_agg_mode: see :func:`aggregate_loss`.
        off_policy: one of :data:`OFF_POLICY_MODES`.
        is_cap: importance-weight cap of ``tis`` / ``decoupled``.
        opsm_delta, geo_cap, age_tau, age_negatives_only: the other modes' bounds, see
            :func:`~ragen_async.algo.corrections.off_policy_correction`.
        entropy_coef: entropy bonus coefficient (StarPO-S 0.001); needs ``inputs.entropy`` when non-zero.
        kl_coef: KL penalty coefficient (StarPO-S 0); needs ``inputs.ref_logprobs`` when > 0.
        kl_type: estimator for the KL penalty, see :func:`kl_estimate` (RAGEN ``kl`` = k1).
        num_tokens, num_seqs: global denominators, see :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``. Metrics: ``pg_loss``; ``pg_clipfrac`` (tokens where the clipped branch is
        active), ``pg_clipfrac_low`` (r < 1 - eps_low with A < 0), ``pg_clipfrac_high`` (r > 1 + eps_high
        with A > 0), ``pg_clipfrac_dual`` (dual clip active); ``ppo_kl`` = ``approx_kl_k3`` (k3 of
        KL(pi_old || pi_theta)); ``entropy`` when given; ``kl_loss`` whenever ``ref_logprobs`` is given (it
        is only added to the loss when ``kl_coef > 0``; RAGEN tracks it post hoc); ``behaviour_kl_k3``
        (k3 of KL(mu || pi_old), the engine/learner mismatch) when behaviour log-probs are given; in the
        off-policy modes ``is_weight_mean`` / ``is_weight_max`` (raw weight exp(log pi_old - log mu) before
        capping), ``is_capped_frac`` (raw weight > is_cap) and ``is_masked_frac`` (tokens dropped: equal to
        ``is_capped_frac`` for ``decoupled``, 0 for ``tis``; these two only for ``tis`` / ``decoupled``);
        in every off-policy mode ``corr_weight_mean`` (mean applied weight), ``corr_masked_frac`` (tokens
        whose loss the correction removed) and ``corr_truncated_frac`` (tokens whose weight it reduced).

    Raises:
        ValueError: unknown mode, missing behaviour / ref / entropy tensors for the requested terms, or
            ``dual_clip_c <= 1``.
    """
    if off_policy not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off_policy mode {off_policy!r}; valid modes: {', '.join(OFF_POLICY_MODES)}")
    if off_policy != "none" and inputs.behaviour_logprobs is None:
        raise ValueError(f"off_policy={off_policy!r} needs inputs.behaviour_logprobs")
    if off_policy in NEEDS_STALENESS and inputs.staleness is None:
        raise ValueError(f"off_policy={off_policy!r} needs inputs.staleness (each token's age in versions)")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
    if kl_coef > 0.0 and inputs.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs inputs.ref_logprobs")
    if entropy_coef != 0.0 and inputs.entropy is None:
        raise ValueError("entropy_coef != 0 needs inputs.entropy")

    logprobs = inputs.logprobs
    mask = inputs.mask.to(logprobs.dtype)
    sampled = inputs.mask != 0
    agg_kwargs = {"num_tokens": num_tokens, "num_seqs": num_seqs}

    # Sanitise first: padding may hold garbage, and where() keeps its gradient at exactly 0.
    logp = _where_masked(logprobs, sampled)
    old_logp = _where_masked(inputs.old_logprobs.detach().to(logprobs.dtype), sampled)
    adv = _where_masked(inputs.advantages.detach().to(logprobs.dtype), sampled)

    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    if dual_clip_c is not None:
        loss_dual = -adv * dual_clip_c
        per_token = torch.where(adv < 0, torch.minimum(loss_clip, loss_dual), loss_clip)
        dual_active = (adv < 0) & (loss_clip > loss_dual)
    else:
        per_token = loss_clip
        dual_active = torch.zeros_like(sampled)

    metrics: dict[str, Tensor] = {}
    behaviour = inputs.behaviour_logprobs
    if behaviour is not None:
        behav_logp = _where_masked(behaviour.detach().to(logprobs.dtype), sampled)
        with torch.no_grad():
            metrics["behaviour_kl_k3"] = masked_mean(kl_estimate(behav_logp, old_logp, "k3"), mask)
        if off_policy != "none":
            staleness = inputs.staleness
            corr = off_policy_correction(
                off_policy, old_logprobs=old_logp, behaviour_logprobs=behav_logp, advantages=adv, mask=mask,
                staleness=staleness.detach() if staleness is not None else None, is_cap=is_cap,
                opsm_delta=opsm_delta, geo_cap=geo_cap, age_tau=age_tau, age_negatives_only=age_negatives_only)
            with torch.no_grad():
                metrics["is_weight_mean"] = masked_mean(corr.token_ratio, mask)
                metrics["is_weight_max"] = _where_masked(corr.token_ratio, sampled).amax()
                if off_policy in ("tis", "decoupled"):
                    capped = corr.truncated | corr.masked
                    metrics["is_capped_frac"] = masked_mean(capped.to(mask.dtype), mask)
                    metrics["is_masked_frac"] = masked_mean(corr.masked.to(mask.dtype), mask)
                metrics["corr_weight_mean"] = masked_mean(corr.weight, mask)
                metrics["corr_masked_frac"] = masked_mean(corr.masked.to(mask.dtype), mask)
                metrics["corr_truncated_frac"] = masked_mean(corr.truncated.to(mask.dtype), mask)
            per_token = per_token * corr.weight

    pg_loss = aggregate_loss(per_token, mask, loss_agg_mode, **agg_kwargs)
    total = pg_loss

    if inputs.entropy is not None:
        entropy = aggregate_loss(_where_masked(inputs.entropy, sampled), mask, loss_agg_mode, **agg_kwargs)
        if entropy_coef != 0.0:
            total = total - entropy_coef * entropy
        metrics["entropy"] = entropy.detach()

    if inputs.ref_logprobs is not None:
        ref_logp = _where_masked(inputs.ref_logprobs.detach().to(logprobs.dtype), sampled)
        kl_loss = aggregate_loss(kl_estimate(logp, ref_logp, kl_type), mask, loss_agg_mode, **agg_kwargs)
        if kl_coef > 0.0:
            total = total + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()

    with torch.no_grad():
        ratio_d = ratio.detach()
        metrics["pg_loss"] = pg_loss.detach()
        metrics["pg_clipfrac"] = masked_mean((loss_clipped > loss_unclipped).to(mask.dtype), mask)
        metrics["pg_clipfrac_low"] = masked_mean(((ratio_d < 1.0 - clip_eps_low) & (adv < 0)).to(mask.dtype), mask)
        metrics["pg_clipfrac_high"] = masked_mean(((ratio_d > 1.0 + clip_eps_high) & (adv > 0)).to(mask.dtype), mask)
        metrics["pg_clipfrac_dual"] = masked_mean(dual_active.to(mask.dtype), mask)
        # k3 of KL(pi_old || pi_theta) = r - 1 - log r (cleanrl's approx_kl), always >= 0.
        ppo_kl = masked_mean(kl_estimate(old_logp, logp.detach(), "k3"), mask)
        metrics["ppo_kl"] = ppo_kl
        metrics["approx_kl_k3"] = ppo_kl
    return total, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    num_tokens: int | float | Tensor | None = None,
    num_seqs: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)).

    The clipped term keeps the critic from moving further than ``c`` from its pre-update prediction in one
    step (PPO2 / verl; RAGEN ``cliprange_value`` = 0.5). Because of the max it only ever increases the loss.

    Args:
        values: [B, T] current predictions (with graph).
        old_values: [B, T] predictions at the start of the step (constants).
        returns: [B, T] GAE returns (constants).
        mask: [B, T] 0/1.
        clip_range_value: c; None disables clipping.
        loss_agg_mode, num_tokens, num_seqs: see :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` with ``vf_loss`` (= loss), ``vf_clipfrac`` (tokens where the clipped term is
        larger) and ``vpred_mean`` (masked mean prediction).
    """
    sampled = mask != 0
    fmask = mask.to(values.dtype)
    v = _where_masked(values, sampled)
    v_old = _where_masked(old_values.detach().to(values.dtype), sampled)
    ret = _where_masked(returns.detach().to(values.dtype), sampled)

    loss_unclipped = (v - ret) ** 2
    if clip_range_value is not None:
        v_clipped = v_old + (v - v_old).clamp(-clip_range_value, clip_range_value)
        loss_clipped = (v_clipped - ret) ** 2
        per_token = torch.maximum(loss_unclipped, loss_clipped)
    else:
        loss_clipped = loss_unclipped
        per_token = loss_unclipped
    loss = 0.5 * aggregate_loss(per_token, fmask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)

    with torch.no_grad():
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(fmask.dtype), fmask),
            "vpred_mean": masked_mean(v.detach(), fmask),
        }
    return loss, metrics
