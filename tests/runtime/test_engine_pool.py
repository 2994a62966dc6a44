"""The engine pool's key: a warm rollout actor is reused only by a run whose engine would be built the same way.
(The pool at work, on real Ray and vLLM, is in tests/system/test_ray_runtime.py.)"""

from __future__ import annotations

import sys

import pytest

from ragen_async.config import load_config
from ragen_async.runtime.engine_pool import EnginePool, engine_key


def key(*overrides, worker="w0", backend="gloo"):
    return engine_key(load_config("configs/tiny/starpo_s_bandit.yaml", ["model.path=/m", "runtime=ray", *overrides]), worker, backend)


def test_what_belongs_to_the_run_does_not_change_the_key():
    assert key() == key("staleness.max_staleness=4", "staleness.fixed_lag=true", "total_steps=9", "run_root=/x",
                        "learner.num_ranks=2", "rollout.group_size=8", "rollout.num_workers=3",
                        "algo.filter_ratio=0.5", "learner.actor_lr=1e-3")


@pytest.mark.parametrize("change", [["model.path=/other"], ["inference.kv_cache_gib=0.25"], ["seed=1"],
                                    ["rollout.cpus_per_worker=2"], ["inference.kv_on_update=recompute"],
                                    ["rollout.engine_threads=2"]])
def test_what_the_engine_was_built_from_does(change):
    assert key() != key(*change)


def test_worker_and_weight_backend_are_part_of_the_key():
    assert key() != key(worker="w1")
    assert key() != key(backend="nccl")


def test_without_a_ray_session_the_pool_has_nothing_to_give(monkeypatch):
    pool = EnginePool()
    pool.give(key(), object())
    assert len(pool) == 1
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray had never been imported
    assert pool.take(key()) is None and len(pool) == 0
    pool.close()


class FakeActor:
    def __init__(self, name, log):
        self.name, self.log = name, log
        outer = self

        class Shutdown:
            @staticmethod
            def remote():
                outer.log.append(("shutdown", outer.name))

        self.shutdown = Shutdown


class FakeRay:
    def __init__(self, free_cpus, log):
        self.free, self.log = {"CPU": free_cpus}, log

    def is_initialized(self):
        return True

    def available_resources(self):
        return dict(self.free)

    def get(self, refs, timeout=None):
        return refs

    def kill(self, actor, no_restart=True):
        self.log.append(("kill", actor.name))


def test_a_run_that_needs_new_actors_ends_the_longest_idle_ones_until_they_fit(monkeypatch):
    """Idle actors hold their CPUs: a sweep whose next run differs in seed would otherwise wait for ever for
    its first new actor (the study's 2-CPU Ray session holds exactly one idle 2-CPU engine)."""
    log = []
    fake = FakeRay(free_cpus=1.0, log=log)
    monkeypatch.setitem(sys.modules, "ray", fake)
    pool = EnginePool()
    two_cpus = ["rollout.cpus_per_worker=2"]
    for name, k in [("a", key(*two_cpus)), ("b", key(*two_cpus, "seed=1")), ("c", key(*two_cpus, "seed=2"))]:
        pool.give(k, FakeActor(name, log))
    assert pool.make_room(cpus=1.0, gpus=0.0) == 0 and log == []  # fits already: nothing ended
    assert pool.make_room(cpus=2 + 1.0, gpus=0.0) == 1  # one new 2-CPU actor and a learner: a (oldest) goes
    assert log == [("shutdown", "a"), ("kill", "a")] and len(pool) == 2 and pool.evicted == 1
    assert pool.take(key(*two_cpus)) is None  # a is gone; b and c are still there to take
    assert pool.take(key(*two_cpus, "seed=2")).name == "c"
    assert pool.make_room(cpus=100.0, gpus=0.0) == 1 and len(pool) == 0  # ends what there is, no more
    assert pool.make_room(cpus=100.0, gpus=0.0) == 0
