"""A vLLM worker extension for CPU tests of the NCCL weight path (``worker_extension_cls``).

vLLM's NCCL update is three worker calls: ``start_weight_update`` (layerwise reload set up),
``update_weights`` (the NCCL broadcast, each received chunk handed to ``model.load_weights``) and
``finish_weight_update`` (layerwise reload finalised). On CPU only the broadcast cannot run, so an engine
started with ``weight_transfer_backend="nccl"`` and this extension runs vLLM's own start and finish, and
:meth:`NcclStandInExtension.standin_receive` does what ``NCCLWeightTransferEngine.receive_weights`` does
with the tensors once they arrived: ``self.model.load_weights`` on the checkpoint-named tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ragen_async.inference.vllm_worker_ext import WeightSyncWorkerExtension
from ragen_async.weight_sync.wire import dtype_from_name

QUALNAME = "nccl_standin.NcclStandInExtension"


class NcclStandInExtension(WeightSyncWorkerExtension):
    def standin_receive(self, items: Sequence[Sequence[Any]]) -> int:
        """vLLM's ``Worker.update_weights`` with the broadcast's tensors given: ``items`` are
        ``(name, dtype_name, shape, raw_bytes)``. Returns how many tensors were loaded."""
        from vllm.config import set_current_vllm_config

        if not getattr(self, "_weight_update_active", False):
            raise RuntimeError("start_weight_update must be called before update_weights.")
        named = []
        for name, dtype, shape, raw in items:
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            named.append((str(name), buf.view(dtype_from_name(dtype)).view(tuple(int(s) for s in shape))))
        with set_current_vllm_config(self.vllm_config):
            self.weight_transfer_engine.model.load_weights(named)  # receive_weights' post_unpack_func
        return len(named)
