"""StarPO-S rollout filtering: keep the groups whose rewards vary most.

A group is the set of trajectories started from the same initial state (RAGEN: ``group_size`` = 16 per
state). Groups whose rewards barely vary give (near-)zero normalised advantages and mostly add noise, so
StarPO-S keeps only the top ``keep_ratio`` fraction of groups by in-group reward std (RAGEN paper §4.2;
default ratio 0.25, type ``std``).

Deliberate difference from RAGEN: RAGEN's filter reads the *normalised* scores, because its score
normalisation writes in place into the tensor the filter later reads (spec §1 "Filter details"). These
functions take the RAW scores; callers must pass them before any group normalisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from ragen_async.algo.masked import segment_mean_var

__all__ = ["FilterMode", "FILTER_MODES", "select_groups_by_reward_std"]

FilterMode = Literal["std", "std_rev", "none"]
FILTER_MODES: tuple[str, ...] = get_args(FilterMode)


def _flatten_groups(group_scores: Tensor | Sequence[Tensor]) -> tuple[Tensor, Tensor, int]:
    """(flat scores [M], group index [M], G) for a [G, N] tensor or a list of G 1-D tensors."""
    if isinstance(group_scores, Tensor):
        if group_scores.dim() != 2:
            raise ValueError(f"group_scores tensor must be [G, N], got shape {tuple(group_scores.shape)}")
        num_groups, group_size = group_scores.shape
        if group_size == 0:
            raise ValueError("every group must hold at least one score")
        flat = group_scores.reshape(-1)
        ids = torch.arange(num_groups, device=flat.device).repeat_interleave(group_size)
        return flat, ids, num_groups
    groups = list(group_scores)
    if any(g.dim() != 1 for g in groups):
        raise ValueError("each group in a list of groups must be a 1-D tensor")
    if any(g.numel() == 0 for g in groups):
        raise ValueError("every group must hold at least one score")
    if not groups:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long), 0
    flat = torch.cat(groups)
    sizes = torch.tensor([g.numel() for g in groups], device=flat.device)
    ids = torch.arange(len(groups), device=flat.device).repeat_interleave(sizes)
    return flat, ids, len(groups)


@torch.no_grad()
def select_groups_by_reward_std(
    group_scores: Tensor | Sequence[Tensor],
    keep_ratio: float,
    mode: str = "std",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Choose which groups to train on by the spread of their RAW rewards.

    Args:
        group_scores: the raw (un-normalised) trajectory scores, either a [G, N] tensor (equal-size groups)
            or a sequence of G 1-D tensors of any sizes (a buffer window may hold partial groups). Never
            modified.
        keep_ratio: fraction of groups to keep; ``k = max(1, int(keep_ratio * G))`` as RAGEN (note the
            floor: 0.25 of 8 groups keeps 2).
        mode: ``"std"`` keeps the k groups with the highest unbiased std, ``"std_rev"`` the k lowest,
            ``"none"`` keeps all (metrics are still computed). A group of one trajectory has std 0.

    Returns:
        ``(kept_group_indices, metrics)``: int64 indices into the G groups, sorted ascending (the batch
        keeps its order). Ties in std are broken deterministically: the lower group index wins. Metrics
        (scalar tensors): ``in_group_std``, ``in_group_mean``, ``in_group_max`` (means over all groups of the
        per-group std / mean / max), ``chosen_in_group_std``, ``chosen_in_group_mean``,
        ``chosen_in_group_max`` (same over kept groups), ``kept_groups``, ``kept_fraction``.

    Raises:
        ValueError: unknown mode, ``keep_ratio`` outside (0, 1], or no groups / an empty group.
    """
    if mode not in FILTER_MODES:
        raise ValueError(f"unknown filter mode {mode!r}; valid modes: {', '.join(FILTER_MODES)}")
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    flat, ids, num_groups = _flatten_groups(group_scores)
    if num_groups == 0:
        raise ValueError("select_groups_by_reward_std needs at least one group")
    flat = flat.to(flat.dtype if flat.is_floating_point() else torch.get_default_dtype())

    mean, var, _ = segment_mean_var(flat, ids, num_groups)
    std = var.sqrt()
    group_max = torch.full((num_groups,), float("-inf"), dtype=flat.dtype, device=flat.device)
    group_max = group_max.scatter_reduce(0, ids, flat, reduce="amax", include_self=True)

    if mode == "none":
        kept = torch.arange(num_groups, device=flat.device)
    else:
        k = max(1, int(keep_ratio * num_groups))
        # Stable sort: equal stds keep index order, so the lower index is taken first in both directions.
        order = torch.sort(std, descending=(mode == "std"), stable=True).indices
        kept = torch.sort(order[:k]).values

    num_kept = torch.tensor(float(kept.numel()), dtype=flat.dtype, device=flat.device)
    metrics = {
        "in_group_std": std.mean(),
        "in_group_mean": mean.mean(),
        "in_group_max": group_max.mean(),
        "chosen_in_group_std": std[kept].mean(),
        "chosen_in_group_mean": mean[kept].mean(),
        "chosen_in_group_max": group_max[kept].mean(),
        "kept_groups": num_kept,
        "kept_fraction": num_kept / num_groups,
    }
    return kept, metrics
