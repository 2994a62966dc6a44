"""Collation: trajectories -> right-padded [B, T] tensors the learner's forward pass consumes."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from ragen_async.protocol import NO_VERSION, BatchShard, Trajectory

_HOST_FIELDS = ("lengths", "trained")


@dataclass
class TokenBatch:
    """Padded per-token tensors of a list of trajectories (all [B, T] unless noted), on the learner's
    device, plus the host-side layout the learner plans with (numpy, never on the device): row lengths
    and which tokens are trained. Micro-batching, trimming and the trained-token index need these on the
    host, and reading them back from the device would cost a synchronisation per micro-batch."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    """float 0/1: tokens sampled by the engine (the only ones trained on)."""
    behaviour_logprobs: torch.Tensor
    token_versions: torch.Tensor
    scores: torch.Tensor
    """[B] raw trajectory scores."""
    normalized_scores: torch.Tensor
    """[B] group-normalised scores."""
    successes: torch.Tensor
    """[B] float 0/1: the episode solved its task."""
    lengths: np.ndarray
    """host [B] int64: tokens per row (the row sums of ``attention_mask``)."""
    trained: np.ndarray
    """host [B, T] bool: ``loss_mask > 0``."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_trained(self) -> int:
        """Trained tokens (the loss mask's sum), counted on the host."""
        return int(self.trained.sum())

    def select(self, index: slice | list[int] | np.ndarray | torch.Tensor) -> TokenBatch:
        """Rows ``index``: a slice or host row indices (a list, a numpy array or a CPU tensor)."""
        if isinstance(index, slice):
            host, dev = index, index
        else:
            host = np.asarray(index.numpy() if isinstance(index, torch.Tensor) else index, dtype=np.int64)
            dev = torch.as_tensor(host, device=self.device)
        return TokenBatch(**{f.name: getattr(self, f.name)[host if f.name in _HOST_FIELDS else dev]
                             for f in fields(self)})

    def trimmed(self) -> TokenBatch:
        """Drop padding columns beyond the longest row (micro-batches are often shorter)."""
        length = int(self.lengths.max()) if self.size else 0
        return TokenBatch(**{
            f.name: (v[:, :length] if v.ndim == 2 else v) for f in fields(self) for v in [getattr(self, f.name)]
        })


def collate(trajectories: tuple[Trajectory, ...] | list[Trajectory], scores: np.ndarray,
            normalized_scores: np.ndarray, pad_id: int = 0, device: torch.device | str = "cpu") -> TokenBatch:
    """Pad on the host, then move every tensor to ``device`` once: from here on the learner's tensors
    all live there (a CPU tensor mixed into a GPU step is a device error, or a hidden copy)."""
    n = len(trajectories)
    length = max((t.num_tokens for t in trajectories), default=0)
    input_ids = np.full((n, length), pad_id, dtype=np.int64)
    attention = np.zeros((n, length), dtype=np.float32)
    loss_mask = np.zeros((n, length), dtype=np.float32)
    behaviour = np.zeros((n, length), dtype=np.float32)
    versions = np.full((n, length), NO_VERSION, dtype=np.int64)
    for i, t in enumerate(trajectories):
        k = t.num_tokens
        input_ids[i, :k] = t.token_ids
        attention[i, :k] = 1
        loss_mask[i, :k] = t.loss_mask
        behaviour[i, :k] = t.behaviour_logprobs
        versions[i, :k] = t.token_versions

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return TokenBatch(
        input_ids=dev(input_ids),
        attention_mask=dev(attention),
        loss_mask=dev(loss_mask),
        behaviour_logprobs=dev(behaviour),
        token_versions=dev(versions),
        scores=dev(np.asarray(scores, dtype=np.float32)),
        normalized_scores=dev(np.asarray(normalized_scores, dtype=np.float32)),
        successes=dev(np.array([float(t.success) for t in trajectories], dtype=np.float32)),
        lengths=np.array([t.num_tokens for t in trajectories], dtype=np.int64),
        trained=loss_mask > 0,
    )


def collate_shard(shard: BatchShard, pad_id: int = 0, device: torch.device | str = "cpu") -> TokenBatch:
    return collate(shard.trajectories, shard.scores, shard.normalized_scores, pad_id, device)


def split_even(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering range(n) whose sizes differ by at most one."""
    bounds = np.linspace(0, n, parts + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def pack_rows(lengths: list[int], max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Row indices grouped into micro-batches of at most ``max_rows`` rows and (if given) at most
    ``max_tokens`` padded tokens (rows x the group's longest row; a longer row goes alone). Rows go
    longest first, so each micro-batch holds similar lengths; without ``max_tokens`` the rows keep their
    order in :func:`split_even` slices."""
    if max_tokens is None:
        n = len(lengths)
        return [list(range(s.start, s.stop)) for s in split_even(n, max(1, math.ceil(n / max_rows)))] if n else []
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and len(groups[-1]) < max_rows and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
