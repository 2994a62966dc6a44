"""Nothing outlives a killed driver: a watchdog process that ends the driver's descendants when it dies.

A driver that exits normally shuts down what it started (Ray, engines, learner processes). A driver
that is SIGKILLed (OOM killer, a lost terminal, ``kill -9``) cannot, and some of its descendants do not
notice: a local Ray leaves its dashboard and runtime-env agents running, the local runtime leaves
vLLM's engine-core process. :func:`start` launches ``python -m ragen_async.records.reaper DRIVER_PID``: it
records the driver's descendants every ``POLL_S`` seconds and, once the driver is gone, waits
``GRACE_S`` for them to exit on their own, then kills those still running (the same processes: psutil
checks the start time, so a reused PID is never hit). :func:`stop` ends it after a normal exit.
It ignores SIGINT, so a Ctrl-C to the terminal's process group still leaves it to clean up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 1.0
"""How often the reaper records the driver's descendants and checks that the driver is alive."""
GRACE_S = 5.0
"""After the driver died, how long its descendants get to exit by themselves."""


def start() -> subprocess.Popen:
    """Watch this process; returns the reaper's handle for :func:`stop`."""
    return subprocess.Popen([sys.executable, "-m", "ragen_async.records.reaper", str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def stop(reaper: subprocess.Popen) -> None:
    """End the reaper after a normal exit (it kills nothing then)."""
    reaper.terminate()
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(driver_pid: int) -> list[str]:
    """Block until ``driver_pid`` dies, then kill what it left; returns ``name(pid)`` of each process killed."""
    driver = psutil.Process(driver_pid)
    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    while _alive(driver):
        try:
            seen.update((p.pid, p) for p in driver.children(recursive=True) if p.pid != me)
        except psutil.NoSuchProcess:
            break
        time.sleep(POLL_S)
    deadline = time.monotonic() + GRACE_S
    while any(_alive(p) for p in seen.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = []
    for p in seen.values():
        if _alive(p):
            try:
                name = p.name()
                p.kill()
                killed.append(f"{name}({p.pid})")
            except psutil.NoSuchProcess:
                continue
    return killed


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    driver_pid = int(sys.argv[1])
    killed = watch(driver_pid)
    if killed:
        print(f"[ragen_async] the driver (pid {driver_pid}) died; killed {len(killed)} process(es) it left: "
              f"{', '.join(killed)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
