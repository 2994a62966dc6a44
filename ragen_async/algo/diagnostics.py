"""Training-health diagnostics: explained variance, k3 KL, and stability by staleness lag.

All functions are side-effect free, return tensors (no ``.item()``) and run under ``torch.no_grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

import torch
from torch import Tensor

from ragen_async.algo.corrections import Correction
from ragen_async.algo.losses import kl_estimate
from ragen_async.algo.masked import masked_mean, masked_var

__all__ = ["explained_variance", "approx_kl_k3", "LAG_SUMS", "lag_sums", "lag_metrics"]


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


LAG_SUMS = ("tokens", "k3", "is_w", "is_w2", "outside_clip", "abs_adv", "trajectories", "reward", "success",
            "corr_w", "corr_w2", "corr_masked", "corr_truncated", "corr_masked_trajectories",
            "corr_truncated_trajectories")
"""The per-staleness-bucket sums :func:`lag_sums` returns (rows of its [len(LAG_SUMS), K] tensor)."""


@torch.no_grad()
def lag_sums(
    mask: Tensor,
    staleness: Tensor,
    behaviour_logprobs: Tensor,
    learner_logprobs: Tensor,
    advantages: Tensor,
    rewards: Tensor,
    successes: Tensor,
    num_buckets: int,
    clip_low: float,
    clip_high: float,
    correction: Correction | None = None,
) -> Tensor:
    """Sums, per staleness bucket, from which :func:`lag_metrics` derives the stability-by-lag metrics.

    Token rows (``mask``, ``staleness`` [B, T]: trained tokens and each one's lag in learner steps) go to
    the bucket of their own lag; trajectory rows (``rewards``, ``successes`` [B]) to the bucket of their
    oldest trained token. Lags >= ``num_buckets - 1`` share the last bucket. The importance weight of a
    token is ``exp(learner - behaviour)`` (the learner's log-prob before this step's update); it is
    *outside the clip* when it leaves ``[1 - clip_low, 1 + clip_high]``. Sums, not means, so ranks can
    all-reduce them. ``correction`` (:func:`~ragen_async.algo.corrections.off_policy_correction` on the
    same tokens) adds what it did: per token its weight, the weight squared, masked and truncated tokens; per
    trajectory whether any of its tokens was masked, and truncated (without it: weight 1, nothing masked). Returns float64
    [len(LAG_SUMS), K].
    """
    trained = mask > 0
    m = trained.double()
    idx = staleness.long().clamp(0, num_buckets - 1)
    behaviour = torch.where(trained, behaviour_logprobs, 0.0).double()
    learner = torch.where(trained, learner_logprobs, 0.0).double()
    w = (learner - behaviour).clamp(-20.0, 20.0).exp()
    k3 = kl_estimate(behaviour, learner, "k3")  # KL(behaviour || learner) from behaviour's samples
    outside = ((w < 1.0 - clip_low) | (w > 1.0 + clip_high)).double()
    abs_adv = torch.where(trained, advantages.double().abs(), 0.0)
    token_rows = [m, k3 * m, w * m, w * w * m, outside * m, abs_adv]
    if correction is not None:
        cw = torch.where(trained, correction.weight, 0.0).double()
        masked, truncated = (correction.masked & trained).double(), (correction.truncated & trained).double()
    else:
        cw, masked, truncated = m, torch.zeros_like(m), torch.zeros_like(m)
    corr_rows = [cw, cw * cw, masked, truncated]
    out = torch.zeros(len(LAG_SUMS), num_buckets, dtype=torch.float64, device=mask.device)
    flat_idx = idx.reshape(-1)
    for r, values in enumerate(token_rows):
        out[r].index_add_(0, flat_idx, values.reshape(-1))
    has_tokens = trained.any(dim=1)
    oldest = torch.where(trained, idx, torch.zeros_like(idx)).amax(dim=1)
    t = has_tokens.double()
    for r, values in zip(range(6, 9), (t, rewards.double() * t, successes.double() * t), strict=True):
        out[r].index_add_(0, oldest, values)
    for r, values in enumerate(corr_rows, start=9):
        out[r].index_add_(0, flat_idx, values.reshape(-1))
    out[13].index_add_(0, oldest, (masked.sum(dim=1) > 0).double() * t)
    out[14].index_add_(0, oldest, (truncated.sum(dim=1) > 0).double() * t)
    return out


def lag_metrics(sums: list[list[float]], prefix: str = "lag", correction: bool = False) -> dict[str, float]:
    """``{prefix}/{s}/...`` per bucket from :func:`lag_sums`'s rows (summed over ranks, as host lists;
    the last bucket is named ``{K-1}+``), and ``mismatch/k3_kl``, the same KL over all lags. An empty bucket (no
    token, no trajectory) logs nothing: a reader takes a missing bucket as empty. Otherwise ``tokens`` and
    ``trajectories``; where the bucket holds tokens, ``k3_kl`` (behaviour vs learner), ``is_ess`` (the importance weights' effective sample
    size over the token count, 1 = no mismatch), ``is_outside_clip`` (share of tokens whose weight leaves
    the clip range) and ``adv_share`` (share of the step's summed |advantage|); where it holds
    trajectories, their mean ``reward`` and ``success``. With ``correction`` (an off-policy correction
    acted), per bucket with tokens ``corr_masked`` / ``corr_truncated`` (share of its tokens whose loss the
    correction removed / whose weight it reduced), ``corr_weight`` (mean applied weight) and ``corr_ess``
    (the applied weights' effective sample size over the token count: (sum w)^2 / (n sum w^2), the kept share
    for a 0/1 mask, 0 when every token is masked); per bucket with trajectories ``corr_masked_seqs`` /
    ``corr_truncated_seqs`` (share of them with a masked / truncated token); and the same over all lags as
    ``correction/masked``, ``truncated``, ``weight``, ``ess``, ``masked_seqs``, ``truncated_seqs``."""
    rows = dict(zip(LAG_SUMS, sums, strict=True))
    total_adv = sum(rows["abs_adv"])
    n_all = sum(rows["tokens"])
    out: dict[str, float] = {"mismatch/k3_kl": sum(rows["k3"]) / n_all} if n_all > 0 else {}
    last = len(rows["tokens"]) - 1
    for s in range(len(rows["tokens"])):
        key = f"{prefix}/{s}{'+' if s == last else ''}"
        n, n_traj = rows["tokens"][s], rows["trajectories"][s]
        if n == 0 and n_traj == 0:
            continue
        out[f"{key}/tokens"] = n
        out[f"{key}/trajectories"] = n_traj
        if n > 0:
            out[f"{key}/k3_kl"] = rows["k3"][s] / n
            w2 = rows["is_w2"][s]
            out[f"{key}/is_ess"] = rows["is_w"][s] ** 2 / (w2 * n) if w2 > 0 else 0.0
            out[f"{key}/is_outside_clip"] = rows["outside_clip"][s] / n
            out[f"{key}/adv_share"] = rows["abs_adv"][s] / total_adv if total_adv > 0 else 0.0
        if n_traj > 0:
            out[f"{key}/reward"] = rows["reward"][s] / n_traj
            out[f"{key}/success"] = rows["success"][s] / n_traj
        if correction:
            out.update(_correction_metrics(rows, f"{key}/corr_", n, n_traj, itemgetter(s)))
    if correction:
        out.update(_correction_metrics(rows, "correction/", n_all, sum(rows["trajectories"]), sum))
    return out


def _correction_metrics(rows: dict[str, list[float]], prefix: str, n: float, n_traj: float,
                        pick: Callable[[list[float]], float]) -> dict[str, float]:
    out: dict[str, float] = {}
    if n > 0:
        w, w2 = pick(rows["corr_w"]), pick(rows["corr_w2"])
        out[f"{prefix}masked"] = pick(rows["corr_masked"]) / n
        out[f"{prefix}truncated"] = pick(rows["corr_truncated"]) / n
        out[f"{prefix}weight"] = w / n
        out[f"{prefix}ess"] = w * w / (w2 * n) if w2 > 0 else 0.0
    if n_traj > 0:
        out[f"{prefix}masked_seqs"] = pick(rows["corr_masked_trajectories"]) / n_traj
        out[f"{prefix}truncated_seqs"] = pick(rows["corr_truncated_trajectories"]) / n_traj
    return out
