"""The driver process of a Ray run is SIGKILLed mid-run, at a random moment after its second checkpoint
(possibly while it writes the next one): it leaves no process behind, and ``train --resume`` completes
the run with every step logged once, no group trained on twice, and a clean audit.

Runs ``ragen-async train`` as a real subprocess (its own local Ray, its own process session), the way a
user's driver dies when its node is lost or the OOM killer picks it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ragen_async.records.provenance import read_provenance

pytestmark = [pytest.mark.ray_lane, pytest.mark.vllm, pytest.mark.slow]

TOTAL_STEPS = 10


def session_processes(sid: int) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return alive


def train(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled", "RAGEN_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "ragen_async.cli", "train", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_a_killed_driver_leaves_no_process_and_resume_completes_the_run(tiny_model_path, tmp_path):
    overrides = [
        f"model.path={tiny_model_path}", f"run_root={tmp_path}", "name=killed", "runtime=ray",
        f"total_steps={TOTAL_STEPS}", "checkpoint_every=2", "staleness.max_staleness=1",
        "rollout.group_size=4", "rollout.envs=[{tag: Bandit, n_groups: 4}]", "learner.mini_batch_size=2",
        "learner.micro_batch_size=2", "validation.every=0", "logging.console=false", "rollout.num_workers=1",
        "learner.num_ranks=1", "inference.kv_cache_gib=0.1", "logging.wandb_mode=disabled"]
    driver = train(["configs/tiny/starpo_s_bandit.yaml", *overrides], tmp_path / "first.log")
    sid = driver.pid  # start_new_session: the driver leads its own session; Ray and the engines join it
    try:
        deadline = time.monotonic() + 400
        while not list(tmp_path.glob("killed-*/checkpoints/step_000002")):
            assert driver.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 400 s"
            time.sleep(0.2)
        time.sleep(random.Random(os.getpid()).uniform(0.0, 3.0))
        assert driver.poll() is None, "the run ended before it could be killed"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()

        # Ray's reaper and the actors' owner checks take the rest of the session down with the driver.
        deadline = time.monotonic() + 60
        while (left := session_processes(sid)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, f"left behind by the killed driver: {[(p.pid, p.name()) for p in left]}"
    finally:
        for p in session_processes(sid):  # whatever the assertions found, never leak into later tests
            p.kill()

    (run_dir,) = tmp_path.glob("killed-*")
    resumed = train(["--resume", str(run_dir)], tmp_path / "resume.log")
    try:
        assert resumed.wait(timeout=600) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    finally:
        for p in session_processes(resumed.pid):
            p.kill()

    steps = [json.loads(line)["learner/step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "actor/grad_norm" in line]
    assert steps == list(range(1, TOTAL_STEPS + 1))
    provenance = read_provenance(run_dir / "provenance.jsonl")
    assert [p["step"] for p in provenance] == list(range(1, TOTAL_STEPS + 1))
    ids = [g["group_id"] for p in provenance for g in p["groups"]]
    assert len(ids) == len(set(ids)) == TOTAL_STEPS * 4
    audit = subprocess.run([sys.executable, "-m", "ragen_async.cli", "audit", str(run_dir)], capture_output=True,
                           text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert audit.returncode == 0, audit.stdout + audit.stderr
    result = json.loads(audit.stdout.strip().splitlines()[-1])
    assert result["consumed"] == TOTAL_STEPS * 4 and not result["duplicates"] and not result["unexplained"]

    # By default a run's console holds its own lines only: vLLM's, Ray's and the workers' output is in the
    # run directory's log files (one per actor, the engine core's included), not on the console.
    for console in ("first.log", "resume.log"):
        text = (tmp_path / console).read_text()
        assert "run directory:" in text
        noise = [line for line in text.splitlines() if " INFO " in line or "(RolloutActor" in line
                 or "(LearnerActor" in line or "EngineCore" in line]
        assert not noise, noise[:5]
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert {"rollout-w0.log", "learner-0.log"} <= set(logs), sorted(logs)
    assert "(EngineCore" in logs["rollout-w0.log"] and " INFO " in logs["rollout-w0.log"]
