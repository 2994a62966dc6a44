"""The reaper kills what a SIGKILLed driver left running, and nothing after a normal stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ragen_async.records import reaper

pytestmark = pytest.mark.slow  # waits on process deaths by design

# A stand-in driver: starts the reaper on itself, then a grandchild that would outlive it, then waits.
DRIVER = """
import subprocess, sys, time
from ragen_async.records import reaper
r = reaper.start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
if sys.argv[1] == "stop":
    time.sleep(2 * reaper.POLL_S)
    reaper.stop(r)
    print("stopped", flush=True)
time.sleep(600)
"""


def start_driver(mode: str) -> tuple[subprocess.Popen, int]:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return driver, int(driver.stdout.readline())


def test_a_killed_driver_s_children_are_killed():
    driver, child = start_driver("watch")
    time.sleep(2 * reaper.POLL_S)  # the reaper has recorded the child
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + reaper.GRACE_S + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the orphaned child is still running"
        time.sleep(0.2)
    message = driver.stderr.read()
    assert f"the driver (pid {driver.pid}) died; killed 1 process(es) it left" in message, message


def test_a_stopped_reaper_kills_nothing():
    driver, child = start_driver("stop")
    try:
        assert driver.stdout.readline().strip() == "stopped"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        time.sleep(reaper.GRACE_S + 2 * reaper.POLL_S)
        assert psutil.Process(child).is_running()
    finally:
        psutil.Process(child).kill()
