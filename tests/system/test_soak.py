"""Soak: a long Ray run whose rollout actor ``w1`` is killed every few minutes (its process, or only its
engine-core process, in turn), with every process's resident memory sampled throughout.

Marked ``soak``: deselected by default (``addopts``), run by hand before stopping and reported in
docs/reliability.md::

    SOAK_MINUTES=30 SOAK_OUT=artifacts/soak WANDB_MODE=disabled .venv/bin/python -m pytest -m soak -s tests/system/test_soak.py

``SOAK_OUT`` receives ``soak_summary.json`` (the figures below) and ``soak_rss.csv`` (every sample).

The policy is held fixed (learning rates 0; weights are still published every step), so the work per
step is the same from start to end and a change in throughput is the system's, not the task's: a
learning policy changes its replies (lengths, turns) as it learns. ``SOAK_LEARN=1`` trains for real.

It asserts: the run keeps training until its time budget; every kill is followed by a replacement;
no group is trained on twice and the audit explains every index; learner steps per minute in the last
third of the run are within 20 % of the first third (each third sees the same number of kills); and
the resident memory of every process that lives through the run (driver, learner, admission gate,
rollout actor ``w0`` and its engine core) is flat: its last sample is at most 10 % + 32 MiB above its
sample at the end of the first third.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from ragen_async.config import load_config
from ragen_async.orchestrator import run_trainer
from ragen_async.records.metrics import MemorySink
from ragen_async.records.provenance import audit, read_provenance
from ragen_async.records.rundir import RunDir

pytestmark = [pytest.mark.ray_lane, pytest.mark.soak, pytest.mark.vllm, pytest.mark.slow]

MINUTES = float(os.environ.get("SOAK_MINUTES", "30"))
KILL_EVERY_S = float(os.environ.get("SOAK_KILL_EVERY_S", MINUTES * 60 / 6))
"""Kills at 0.5, 1.5, 2.5, ... x this after the first step: by default two in each third of the run (at 30
min: 2.5, 7.5, 12.5 ... 27.5). Keep it well above the time a replacement takes (about a minute on 2 cores),
or kills land on replacements."""
SAMPLE_EVERY_S = 10.0
LEARN = os.environ.get("SOAK_LEARN", "0") == "1"


def engine_core(actor_pid: int) -> int | None:
    cores = [c.pid for c in psutil.Process(actor_pid).children(recursive=True)
             if "EngineCore" in " ".join(c.cmdline())]
    return cores[0] if cores else None


def rss_mib(pid: int | None) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20 if pid else None
    except psutil.NoSuchProcess:
        return None


class StampedSink(MemorySink):
    """Records with the wall-clock second (since ``t0``) they were logged at, as ``_t_s``."""

    def __init__(self, t0: float) -> None:
        super().__init__()
        self.t0 = t0
        self.steps = 0

    def log(self, record):
        super().log({**record, "_t_s": time.monotonic() - self.t0})
        self.steps += "actor/grad_norm" in record


@pytest.mark.timeout(int(MINUTES * 60 * 1.5) + 900)  # the suite's 900 s default would cut the soak short
def test_soak_with_actor_kills(tiny_model_path, tmp_path):
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}})
    from ragen_async.runtime.ray_runtime import RayRuntime

    out = Path(os.environ.get("SOAK_OUT", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [
        f"model.path={tiny_model_path}", f"run_root={tmp_path}", "name=soak", "runtime=ray",
        "total_steps=100000", f"time_budget_minutes={MINUTES}", "checkpoint_every=25",
        "staleness.max_staleness=1", "rollout.num_workers=2", "learner.num_ranks=1",
        "rollout.group_size=4", "rollout.envs=[{tag: Bandit, n_groups: 4}]", "learner.mini_batch_size=2",
        "learner.micro_batch_size=2", "validation.every=0", "logging.console=false",
        "inference.kv_cache_gib=0.1", "weight_sync.timeout_s=30",
        *([] if LEARN else ["learner.actor_lr=0", "learner.critic_lr=0"])])
    run_dir = RunDir.create(cfg)
    runtime = RayRuntime(cfg)
    t0 = time.monotonic()
    done = threading.Event()
    kills: list[dict] = []
    samples: list[dict] = []

    def killer():
        while not sink.steps and not done.wait(timeout=1.0):
            pass
        first = time.monotonic()
        n = 0
        while not done.wait(timeout=max(0.0, first + (n + 0.5) * KILL_EVERY_S - time.monotonic())):
            if time.monotonic() - first > MINUTES * 60 - 90:
                break  # a replacement takes about a minute: the last kill must leave time for it
            victim = "actor" if n % 2 == 0 else "engine"
            try:
                pid = ray.get(runtime.rollouts[1].pid.remote(), timeout=60)
                target = engine_core(pid) if victim == "engine" else pid
                os.kill(target, signal.SIGKILL)
                kills.append({"t_s": time.monotonic() - t0, "victim": victim, "pid": target})
            except Exception as e:  # noqa: BLE001 - record and go on: the assertions count the kills
                kills.append({"t_s": time.monotonic() - t0, "victim": victim, "error": repr(e)})
            n += 1

    def sampler():
        fixed = {"driver": os.getpid(), "learner": ray.get(runtime.learners[0].pid.remote()),
                 "gate": ray.get(runtime.gate.__ray_call__.remote(lambda _: os.getpid()))}
        while not done.wait(timeout=SAMPLE_EVERY_S):
            row = {"t_s": time.monotonic() - t0, **{k: rss_mib(p) for k, p in fixed.items()}}
            for i in range(len(runtime.rollouts)):
                try:
                    pid = ray.get(runtime.rollouts[i].pid.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - being replaced
                    continue
                row[f"w{i}"], row[f"w{i}_engine"] = rss_mib(pid), rss_mib(engine_core(pid))
            samples.append(row)

    sink = StampedSink(t0)
    threads = [threading.Thread(target=f, daemon=True) for f in (killer, sampler)]
    for t in threads:
        t.start()
    try:
        run_trainer(cfg, run_dir, sink, runtime)
    finally:
        done.set()
        for t in threads:
            t.join(60)
        ray.shutdown()

    steps = pd.DataFrame([r for r in sink.records if "actor/grad_norm" in r])
    mem = pd.DataFrame(samples)
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    final = json.loads((sorted(run_dir.checkpoints.glob("step_*"))[-1] / "driver_state.json").read_text())
    accounting = audit(provenance, final["admission"], int(final["step"]))
    ids = [g["group_id"] for p in provenance for g in p["groups"]]

    # Throughput per third of the run (first to last step), from the step records' wall-clock stamps.
    stamps = steps["_t_s"]
    first, third = stamps.min(), (stamps.max() - stamps.min()) / 3
    bins = pd.cut(stamps, [first - 1e-6, first + third, first + 2 * third, stamps.max() + 1e-6], labels=False)
    thirds = [float(n) / (third / 60) for n in bins.value_counts().reindex([0, 1, 2], fill_value=0)]
    start = mem[mem.t_s <= first + third].iloc[-1]
    end = mem.iloc[-1]
    lived = ["driver", "learner", "gate", "w0", "w0_engine"]
    growth = {k: (float(start[k]), float(end[k])) for k in lived}
    summary = {
        "minutes": MINUTES, "learning": LEARN, "steps": len(steps), "steps_per_min_by_third": thirds,
        "kills": kills, "actor_restarts": float(steps["rollout/actor_restarts"].iloc[-1]),
        "abandoned_groups": float(steps["rollout/abandoned_groups"].iloc[-1]),
        "consumed_groups": len(ids), "duplicates": accounting["duplicates"], "unexplained": accounting["unexplained"],
        "drop_reasons": accounting["drop_reasons"], "rss_mib_end_of_first_third_vs_end": growth,
        "rss_mib_max": {k: float(mem[k].max()) for k in mem.columns if k != "t_s"},
    }
    (out / "soak_summary.json").write_text(json.dumps(summary, indent=1))
    mem.to_csv(out / "soak_rss.csv", index=False)
    columns = ["learner/step", "_t_s", "timing/step_s", "rollout/response_length", "throughput/tokens_per_s",
               "rollout/actor_restarts", "weight_sync/time_s"]
    steps[[c for c in columns if c in steps]].to_csv(out / "soak_steps.csv", index=False)
    print("\nsoak:", json.dumps(summary, indent=1))

    assert len(kills) >= 6 and not [k for k in kills if "error" in k], kills
    assert summary["actor_restarts"] == len(kills)
    assert len(ids) == len(set(ids)) and not accounting["duplicates"] and not accounting["unexplained"], accounting
    assert abs(thirds[2] - thirds[0]) <= 0.2 * thirds[0], thirds
    for k, (a, b) in growth.items():
        assert b <= 1.1 * a + 32, (k, a, b)
