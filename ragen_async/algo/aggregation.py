"""The single owner of loss normalisation (verl's ``agg_loss``).

Every per-token loss in `algo` ([B, T] matrix + [B, T] mask) is reduced to a scalar here, so the choice of
denominator lives in one place and is the same for the policy loss, entropy bonus, KL penalty and value loss.

Invariance to the parallel layout: pass the *global* denominators (``num_tokens`` = masked tokens in the
whole mini-batch across all micro-batches and ranks, ``num_seqs`` = non-empty sequences likewise). Each
micro-batch then returns its *contribution*, and the contributions sum to the full-batch value, so gradient
accumulation (sum of backward passes) and DP all-reduce (sum of gradients) reproduce the single-batch loss.
With ``num_tokens``/``num_seqs`` left as None the local counts are used (single micro-batch).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from ragen_async.algo.masked import masked_sum

__all__ = ["LossAggMode", "LOSS_AGG_MODES", "aggregate_loss"]

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


def _denominator(local: Tensor, override: int | float | Tensor | None) -> Tensor:
    if override is None:
        # Local count; floor at 1 so an all-padding micro-batch gives 0 rather than 0/0.
        return local.clamp(min=1.0)
    return torch.as_tensor(override, dtype=local.dtype, device=local.device)


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: int | float | Tensor | None = None,
    num_seqs: int | float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss matrix to a scalar.

    Args:
        loss_mat: [B, T] per-token loss (masked-out entries may be anything, even NaN).
        mask: [B, T] 0/1 loss mask.
        mode:
            - ``"token-mean"``: sum over masked tokens / token count (DAPO's token-level loss; long
              trajectories weigh more). RAGEN's default *config* value.
            - ``"seq-mean-token-mean"``: mean over sequences of each sequence's token-mean (every trajectory
              weighs the same). What RAGEN *effectively* ran (micro_batch_size_per_gpu=1, see spec §1).
            - ``"seq-mean-token-sum"``: mean over sequences of each sequence's token-sum.
        num_tokens: global masked-token count for ``token-mean`` (see module docstring). Ignored otherwise.
        num_seqs: global count of non-empty sequences for the ``seq-mean-*`` modes. Ignored otherwise.

    Returns:
        Scalar loss. Sequences whose mask is all zero count neither in the numerator nor in the local
        sequence count.

    Raises:
        ValueError: unknown ``mode``.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / _denominator(mask.sum(), num_tokens)

    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        seq_tokens = mask.sum(dim=-1)  # [B]
        seq_sum = masked_sum(loss_mat, mask, dim=-1)  # [B]
        if mode == "seq-mean-token-mean":
            per_seq = seq_sum / seq_tokens.clamp(min=1.0)  # empty rows: 0 / 1 = 0
        else:
            per_seq = seq_sum
        num_nonempty = (seq_tokens > 0).to(loss_mat.dtype).sum()
        return per_seq.sum() / _denominator(num_nonempty, num_seqs)

    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
