"""Data parallelism of the learner's models across ranks: DDP replicas or FSDP2 shards.

Every forward and backward of a wrapped model is a collective (FSDP gathers and reduce-scatters each one; DDP
syncs buffers and reduces the last micro-batch's gradients), so the learner has every rank run the same number
of them (``Learner._padded``).
"""

from __future__ import annotations

import torch
from torch import nn

from ragen_async.learner import precision


def wrap(model: nn.Module, strategy: str, compute_dtype: torch.dtype) -> nn.Module:
    """``model`` for data-parallel training: FSDP2 (``strategy`` ``fsdp``) shards each decoder layer as its
    own unit (gathered for its forward and backward only, the next one's gather overlapping this one's
    compute), then the root (embeddings, tied head, final norm, value head), gathered in ``compute_dtype`` and
    reduced in fp32; ``ddp`` wraps a replica whose fp32 gradients DDP averages."""
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        policy = precision.fsdp_policy(compute_dtype)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model (its ``_no_split_modules`` classes, e.g.
    ``Qwen2DecoderLayer``): the units FSDP shards one at a time."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (no _no_split_modules) to shard with FSDP")
    return layers
