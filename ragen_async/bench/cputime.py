"""CPU time of a process, threads that have ended included: what the benchmarks charge a component."""

from __future__ import annotations

import sys
import time

_SCHED_CLOCK = 2
"""Linux's CPUCLOCK_SCHED: a CPU clock counting scheduler run time in nanoseconds."""


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) process ``pid`` (None: this one) has used so far, ended threads' time
    included. On Linux the process's CPU clock (the clock id ``clock_getcpuclockid`` would return,
    nanoseconds, no /proc parsing), elsewhere psutil (clock ticks). Raises OSError or psutil's
    NoSuchProcess when ``pid`` has gone."""
    if pid is None:
        return time.process_time()
    if sys.platform == "linux":
        return time.clock_gettime(((~pid) << 3) | _SCHED_CLOCK)
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system
