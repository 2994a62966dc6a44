"""Warm rollout actors kept between the runs of one process (a sweep's cells, a test module's runs).

Starting a rollout actor on CPU costs about half a minute of the machine (the actor and vLLM's
engine-core process each import vllm and torch, then the engine loads the model and sizes its KV
cache), far more than the few learner steps of a short run. A run on the Ray runtime given an
:class:`EnginePool` takes an idle actor whose engine was built exactly as its own would be (same
:func:`engine_key`: model, inference settings, engine seed, resources) instead of starting one, and
gives its actors back when it ends. What belongs to a run is never carried over: the actor
is re-bound to the new run (config, worker id, trajectory socket and secret, admission gate, log
file), joins the new run's weight group, and its engine is loaded with the new learner's version-0
weights and re-stamped version 0 before it plays anything (its prefix cache is cleared with the
load, and requests are salted with their version anyway). Learner ranks and the admission gate are
always new. A run gives back every rollout actor that releases cleanly within a minute (its engine
alive), also when the run itself failed; the others are ended.

Idle actors hold their Ray resources (CPUs, GPUs). A run that must start actors of its own first makes room
(:meth:`EnginePool.make_room`): the actors idle longest are ended until the new ones fit, so that a sweep
whose runs differ in seed or model does not wait forever for its first new actor.

The pool owns the Ray session a pooled run started (the run leaves it up for the next one);
:meth:`EnginePool.close` kills the idle actors and shuts that session down.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from ragen_async.config import RunConfig

log = logging.getLogger(__name__)


def engine_key(cfg: RunConfig, worker_id: str, weight_backend: str) -> str:
    """Everything a rollout actor's process and engine were built from; actors are reused only under an equal key."""
    r = cfg.rollout
    return json.dumps({
        "model": cfg.model.model_dump(mode="json"), "inference": cfg.inference.model_dump(mode="json"),
        "seed": cfg.seed, "worker": worker_id, "weight_backend": weight_backend, "engine_threads": r.threads_per_engine,
        "resources": [r.cpus_per_worker, r.gpus_per_worker, r.cpu_affinity]}, sort_keys=True)


def actor_cpus(cfg: RunConfig) -> float:
    """Logical CPUs a run's actors ask Ray for: its rollout actors and learner ranks."""
    return cfg.rollout.num_workers * cfg.rollout.cpus_per_worker + cfg.learner.num_ranks * cfg.learner.cpus_per_rank


class EnginePool:
    """Idle rollout actors by :func:`engine_key`. Use as a context manager, or call :meth:`close`."""

    def __init__(self) -> None:
        self._idle: list[tuple[str, Any]] = []
        """(key, actor), in the order they were given back: the first has been idle longest."""
        self.owns_ray = False
        """A run using this pool started the Ray session: :meth:`close` shuts it down."""
        self.session_cpus = 0.0
        """The fewest logical CPUs a local Ray session started by a run of this pool advertises: a sweep sets
        its largest run's :func:`actor_cpus`, or a later run that needs more than the first would not fit."""
        self.built = 0
        """Rollout actors started for runs using this pool."""
        self.reused = 0
        """Rollout actors a run took from this pool instead of starting one."""
        self.evicted = 0
        """Idle actors ended to make room for a run's new ones."""

    def take(self, key: str) -> Any | None:
        """An idle actor built under ``key``, or None (none, or the Ray session they lived in is gone)."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            self._idle.clear()  # they died with their session
            return None
        for i in range(len(self._idle) - 1, -1, -1):
            if self._idle[i][0] == key:
                return self._idle.pop(i)[1]
        return None

    def give(self, key: str, actor: Any) -> None:
        """Keep ``actor`` (released from its run, engine alive) for a later run with the same key."""
        self._idle.append((key, actor))

    def __len__(self) -> int:
        return len(self._idle)

    def make_room(self, cpus: float, gpus: float) -> int:
        """End idle actors, the longest idle first, until ``cpus`` and ``gpus`` are free in the Ray session for
        the actors a run is about to start (Ray frees an ended actor's resources shortly after; the new actors
        wait for them). Returns how many were ended."""
        ray = sys.modules.get("ray")
        if not self._idle or ray is None or not ray.is_initialized():
            return 0
        free = ray.available_resources()
        cpu, gpu = free.get("CPU", 0.0), free.get("GPU", 0.0)
        ended = []
        while (cpu < cpus - 1e-9 or gpu < gpus - 1e-9) and self._idle:
            key, actor = self._idle.pop(0)
            held_cpus, held_gpus = json.loads(key)["resources"][:2]
            cpu, gpu = cpu + held_cpus, gpu + held_gpus
            ended.append(actor)
        if ended:
            log.info("ending %d idle rollout actor(s) to make room for this run's new ones", len(ended))
            self._end(ray, ended)
            self.evicted += len(ended)
        return len(ended)

    @staticmethod
    def _end(ray: Any, actors: list[Any]) -> None:
        try:
            ray.get([a.shutdown.remote() for a in actors], timeout=60)
        except Exception as e:  # noqa: BLE001 - the actors are killed below either way
            log.warning("error while shutting pooled rollout actors down: %s", e)
        for a in actors:
            ray.kill(a, no_restart=True)

    def close(self) -> None:
        """Shut the idle actors' engines down and end them; end the Ray session if a pooled run started it."""
        ray = sys.modules.get("ray")  # (never imported: nothing of Ray to end)
        actors = [a for _, a in self._idle]
        self._idle.clear()
        if ray is not None and ray.is_initialized():
            self._end(ray, actors)
            if self.owns_ray:
                ray.shutdown()
        self.owns_ray = False

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
