"""The machine a benchmark ran on, in words every figure carries: CPUs differ between machines, and so do
the speeds measured on them."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and whether it has native bf16 matmul kernels: CPUs of the same
    name differ, and bf16 compute is faster than fp32 only with those kernels."""
    from ragen_async.learner.precision import cpu_has_bf16

    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or 'unknown CPU'}, bf16 kernels {'yes' if cpu_has_bf16() else 'no'}"


def machine_description() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return f"{platform.machine()} {len(cpus)} CPUs ({cpu_model()}; {platform.platform()})"
