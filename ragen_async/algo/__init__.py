"""Pure StarPO / StarPO-S math: tensors and floats in, tensors or ``(loss, metrics)`` out.

No config objects, no logging, no ``.item()``, no imports from the rest of ``ragen_async`` or from
ray / zmq / vllm / torch.distributed. Distributed callers pass global statistics in (``stats=``,
``num_tokens=``, ``num_seqs=``) instead of this package reaching out for them.

Modules: ``masked`` (masked statistics), ``aggregation`` (the one loss normaliser), ``advantages`` (token
rewards, masked GAE, group normalisation), ``filtering`` (StarPO-S reward-std group filter), ``losses``
(policy/value/entropy/KL), ``corrections`` (per-sample weights of stale tokens), ``diagnostics`` (explained variance, k3 KL, bucketed means).
"""

from ragen_async.algo.advantages import (
    GROUP_NORM_MODES,
    GroupNormMode,
    broadcast_to_tokens,
    compute_gae,
    group_normalize,
    scores_to_token_rewards,
)
from ragen_async.algo.aggregation import LOSS_AGG_MODES, LossAggMode, aggregate_loss
from ragen_async.algo.corrections import Correction, off_policy_correction, sequence_log_ratio
from ragen_async.algo.diagnostics import (
    LAG_SUMS,
    approx_kl_k3,
    explained_variance,
    lag_metrics,
    lag_sums,
)
from ragen_async.algo.filtering import FILTER_MODES, FilterMode, select_groups_by_reward_std
from ragen_async.algo.losses import (
    KL_TYPES,
    OFF_POLICY_MODES,
    KLType,
    OffPolicyMode,
    PolicyLossInputs,
    entropy_from_logits,
    head_logprobs_entropy,
    kl_estimate,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from ragen_async.algo.masked import (
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    moments_to_mean_var,
    segment_mean_var,
)

__all__ = [
    "FILTER_MODES",
    "GROUP_NORM_MODES",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "OFF_POLICY_MODES",
    "FilterMode",
    "GroupNormMode",
    "KLType",
    "LossAggMode",
    "OffPolicyMode",
    "PolicyLossInputs",
    "aggregate_loss",
    "Correction",
    "off_policy_correction",
    "sequence_log_ratio",
    "approx_kl_k3",
    "broadcast_to_tokens",
    "compute_gae",
    "entropy_from_logits",
    "explained_variance",
    "group_normalize",
    "head_logprobs_entropy",
    "kl_estimate",
    "logprobs_from_logits",
    "masked_mean",
    "LAG_SUMS",
    "lag_sums",
    "lag_metrics",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "moments_to_mean_var",
    "policy_loss",
    "scores_to_token_rewards",
    "segment_mean_var",
    "select_groups_by_reward_std",
    "value_loss",
]
