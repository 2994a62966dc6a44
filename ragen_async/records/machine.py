"""The machine a run started on, recorded in its ``run_state.json`` at every start and resume.

An unbounded pipeline's realised staleness is a property of the hardware, not only of the config: the rollout's
speed against the learner's sets how far the backlog grows. The same study placement on 2-core machines gave
Sokoban mean ages of 7-14 versions (one of them an AMD EPYC with AVX-512 BF16) and under 2 (an AMD EPYC with AVX2
only), so a run names the CPU it ran on. It is the driver's machine; on several nodes, the other nodes are not
described.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

MATRIX_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The CPU flags that decide which matrix kernels PyTorch and vLLM's CPU backend can use."""


def cpu_info(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`MATRIX_FLAGS` it has, from ``/proc/cpuinfo`` (or the text
    given); ``platform.processor()`` and no flags where there is none (macOS)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model or platform.processor() or platform.machine(), [f for f in MATRIX_FLAGS if f in flags]


def describe_machine(step: int) -> dict[str, Any]:
    """One start of a run: when, from which learner step (0 for a new run), on which CPU with how many cores
    usable, and which GPUs this process can see."""
    model, flags = cpu_info()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from_step": step, "host": platform.node(),
            "cpu": model, "cpu_flags": flags, "cpus": usable, "gpus": gpus}
