"""Mixed precision of the learner, as verl keeps it: fp32 master weights and optimizer state, compute in
``model.dtype``, gradients reduced and clipped in fp32, engines given ``model.dtype`` copies.

- A single process or DDP runs each forward under ``torch.autocast(model.dtype)``: the matmuls see
  ``model.dtype`` copies of the fp32 parameters, the gradients land on the fp32 parameters, DDP
  reduces them in fp32.
- FSDP2 gets ``MixedPrecisionPolicy(param_dtype=model.dtype, reduce_dtype=float32)``: each layer is
  all-gathered in ``model.dtype``, its gradients are reduce-scattered in fp32 onto the fp32 shards.

On a CPU without bf16 kernels (no AVX-512 BF16 or AMX), bf16 matmuls are several times slower than
fp32 ones, so there the learner computes in fp32 (and says so once); the engines still get
``model.dtype`` weights.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MASTER_DTYPE = torch.float32
"""What the learner keeps its weights, gradients, optimizer state and checkpoints in."""

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 matmul kernels (AVX-512 BF16 or AMX BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(f in flags for f in _CPU_BF16_FLAGS)


def compute_dtype(model_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype the learner computes in: ``model.dtype``, except reduced precision on a CPU without
    native kernels for it, where fp32 is faster (logged once)."""
    dtype = DTYPES[model_dtype]
    if device.type == "cpu" and dtype != torch.float32:
        if dtype == torch.float16 or not cpu_has_bf16():
            _warn_cpu_fallback(model_dtype)
            return torch.float32
    return dtype


@functools.cache
def _warn_cpu_fallback(model_dtype: str) -> None:
    log.warning("model.dtype=%s: this CPU has no native %s matmul kernels, so the learner computes in float32 "
                "(master weights are float32 either way; the engines still get %s weights)",
                model_dtype, model_dtype, model_dtype)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Forward passes in ``dtype`` over fp32 parameters; a no-op for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def fsdp_policy(dtype: torch.dtype):
    """FSDP2's policy: parameters gathered in ``dtype``, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def engine_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an engine gets of a master weight: itself when the dtypes agree, else a ``dtype`` copy."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
