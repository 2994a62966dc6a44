"""The engine pool's key: a warm rollout actor is reused only by a run whose engine would be built the same way.
(The pool at work, on real Ray and vLLM, is in test_ray_runtime.py.)"""

from __future__ import annotations

import sys

import pytest

from ragen_async.config import load_config
from ragen_async.engine_pool import EnginePool, engine_key


def key(*overrides, worker="w0", backend="gloo"):
    return engine_key(load_config("configs/tiny/starpo_s_bandit.yaml", ["model.path=/m", "runtime=ray", *overrides]), worker, backend)


def test_what_belongs_to_the_run_does_not_change_the_key():
    assert key() == key("staleness.max_staleness=4", "staleness.fixed_lag=true", "total_steps=9", "run_root=/x",
                        "learner.num_ranks=2", "rollout.group_size=8", "rollout.num_workers=3",
                        "algo.filter_ratio=0.5", "learner.actor_lr=1e-3")


@pytest.mark.parametrize("change", [["model.path=/other"], ["inference.kv_cache_gib=0.25"], ["seed=1"],
                                    ["rollout.cpus_per_worker=2"], ["inference.kv_on_update=recompute"]])
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
