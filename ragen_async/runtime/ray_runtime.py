"""``runtime: ray``: rollout actors, admission gate and learner pool as separate processes.

The one loop (``orchestrator.Trainer``) drives this runtime exactly as it drives the local one; here

* ``receive`` takes groups from the ZeroMQ receiver the rollout actors push to (and polls the actors'
  health), while every rollout actor plays groups continuously, asking the admission gate (a Ray actor
  over the pure ``AdmissionController``, ``staleness/gate.py``) before it starts one; a request that finds no
  free slot waits at the gate until one opens. With ``max_staleness = k`` a group may
  start only while the groups started are at most ``(k + v + 1) x groups_per_step`` for the version
  ``v`` every engine has loaded (AReaL's rule), so no consumed token is more than k versions old; the
  loop's buffer drops any group that would be, as a safety net (counted, and its slot returned once).
* ``train`` sends each learner rank its shard over ZeroMQ; the ranks train as one DDP group (gloo or
  NCCL) and return the new version.
* ``publish`` broadcasts weights from learner rank 0 to every engine (gloo on CPU, vLLM's NCCL engine
  on GPU, or tensors through Ray for tests). Under fixed lag the loop asks for version ``v - k``, which
  rank 0 keeps in a ring buffer, and admission is k = 0, so every token is exactly k versions old.

Shutdown is always clean: rollout loops stopped, engines shut down, actors killed, Ray shut down if
this process started it. With an :class:`~ragen_async.runtime.engine_pool.EnginePool` the run starts on idle
rollout actors of earlier runs where it can, and its live rollout actors go back to the pool instead
(the pool then ends them, and the Ray session the run started).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from ragen_async.config import RunConfig
from ragen_async.learner.actor import LearnerActor
from ragen_async.learner.learner import TrainResult, merge_rank_metrics
from ragen_async.protocol import AnyGroup, BatchShard, TrajectoryGroup
from ragen_async.records.rundir import refuse_relative, refuse_unshared
from ragen_async.rollout.actor import GateActor, RolloutActor
from ragen_async.runtime import Admission, Runtime
from ragen_async.runtime.engine_pool import EnginePool, actor_cpus, engine_key
from ragen_async.transport import bind_address, make_receiver, make_sender
from ragen_async.weight_sync import WeightSyncTimeout, resolve_backend

RUNTIME_STATE = "runtime_state.json"
"""In a checkpoint: the runtime's running counters (rollout actors replaced, groups abandoned with them)."""

log = logging.getLogger(__name__)


def _failed(ref: Any) -> bool:
    try:
        ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - any error means this call failed
        return True
    return False


def multi_node() -> str | None:
    """Why this run spans several nodes, or ``None``: a SLURM allocation of more than one node
    (``SLURM_JOB_NUM_NODES`` or ``SLURM_NNODES``), or a connected Ray cluster with more than one alive node."""
    for var in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return f"{var}={value}"
    if ray.is_initialized():
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        if alive > 1:
            return f"the Ray cluster has {alive} alive nodes"
    return None


@ray.remote(num_cpus=0)
def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


SHARED_CHECK_TIMEOUT_S = 120.0
"""How long :func:`blind_nodes` waits for the nodes' answers."""


def alive_nodes() -> set[str]:
    """The IDs of the Ray cluster's alive nodes."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def blind_nodes(marker: Path, token: str, only: set[str] | None = None) -> list[str]:
    """The alive Ray nodes (by address; ``only``: those of these IDs) that do not read ``token`` in the file
    ``marker``: a task pinned to each reads it there (:func:`~ragen_async.records.rundir.refuse_unshared`)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive") and (only is None or n["NodeID"] in only)]
    reads = [_read_marker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
             .remote(str(marker)) for n in nodes]
    try:
        texts = ray.get(reads, timeout=SHARED_CHECK_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"checking that every node sees {marker.parent}: no answer from every node within "
                           f"{SHARED_CHECK_TIMEOUT_S:g} s") from None
    return [n["NodeManagerAddress"] for n, text in zip(nodes, texts, strict=True) if text != token]


def check_cluster_fits(cfg: RunConfig, resources: dict[str, float]) -> None:
    """Raise if the Ray cluster (``ray.cluster_resources()``) can never hold the configured actors: Ray would
    wait for them forever (e.g. a SLURM job whose GPUs Ray does not see)."""
    r, lrn = cfg.rollout, cfg.learner
    need = {"CPU": actor_cpus(cfg),
            "GPU": r.num_workers * r.gpus_per_worker + lrn.num_ranks * lrn.gpus_per_rank}
    for kind, needed in need.items():
        have = float(resources.get(kind, 0.0))
        if needed > have + 1e-9:
            raise RuntimeError(
                f"the config needs {needed:g} {kind}s (rollout.num_workers x rollout.{kind.lower()}s_per_worker + "
                f"learner.num_ranks x learner.{kind.lower()}s_per_rank) but the Ray cluster has {have:g}; "
                f"give the cluster more, or ask for fewer")


class RayAdmission(Admission):
    def __init__(self, gate: Any):
        self.gate = gate

    async def resolve(self, consumed: list[int], dropped: list[int]) -> None:
        await self.gate.resolve.remote(consumed, dropped)

    async def set_published_version(self, version: int) -> None:
        await self.gate.set_published_version.remote(version)

    async def state(self) -> dict[str, Any]:
        return await self.gate.state.remote()

    async def set_max_staleness(self, k: int | None) -> int:
        return await self.gate.set_max_staleness.remote(k)

    async def restore(self, state: dict[str, Any]) -> None:
        await self.gate.restore.remote(state)


class RayRuntime(Runtime):
    HEALTH_CHECK_S = 2.0
    """How often ``receive`` asks the rollout actors whether their loops are still alive."""

    checkpoint_ranks = 0
    """Learner ranks whose files a checkpoint must hold: ``learner.num_ranks`` once they are built (a
    subclass with stand-in learners, as the simulated cluster's, writes none)."""

    def __init__(self, cfg: RunConfig, log_dir: Path | None = None, pool: EnginePool | None = None,
                 run_dir_given: tuple[str | Path, str] | None = None):
        """``run_dir_given``: the run directory as the user gave it and how (``run_root``, ``--run-dir``,
        ``--resume``): refused, before any actor starts, if the cluster has several nodes and it is relative or
        not the same folder on every node (a node-local path such as ``/tmp``)."""
        self.cfg = cfg
        self.log_dir = log_dir  # each actor's output goes to a file there (None: the console)
        self.pool = pool  # warm rollout actors to take, and to give back at the end (None: start and end our own)
        self._keys: list[str] = []
        self.reused: list[int] = []
        """Which rollout actors (by index) came from the pool."""
        self._started_ray = False
        self.rollouts: list[Any] = []
        self.learners: list[Any] = []
        self.gate = None
        self.receiver = None
        self.shard_senders: list[Any] = []
        self._last_check = time.perf_counter()
        self._run_dir_given = run_dir_given
        self._checked_nodes: set[str] = set()
        """The nodes shown to see the run directory (on a multi-node run all alive ones at the start, then
        :meth:`_check_new_nodes`); empty on one node."""
        self._published = 0
        self._started = False
        self.restarts = 0
        self.abandoned = 0
        self._learners_broken = False
        self._last_stats: list[dict[str, float]] = []
        self._init_ray()
        try:
            if run_dir_given is not None:  # the cluster is known now (a RAY_ADDRESS cluster, e.g. a Ray job's)
                nodes = multi_node()
                refuse_relative(*run_dir_given, nodes)
                if nodes is not None:
                    refuse_unshared(*run_dir_given, blind_nodes)
                    self._checked_nodes = alive_nodes()  # a multi-node run's nodes: later ones are checked too
            self._build()
        except BaseException:
            self.close()  # half-built actors and the Ray we started must not outlive the error
            raise

    # ------------------------------------------------------------------ construction
    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        needed = max(actor_cpus(self.cfg), self.pool.session_cpus if self.pool is not None else 0.0)
        kwargs: dict[str, Any] = {"log_to_driver": self.log_dir is None}
        if self.log_dir is not None:
            kwargs["logging_level"] = logging.WARNING  # no "Started a local Ray instance" on the console
        if not os.environ.get("RAY_ADDRESS"):
            # A local Ray: advertise enough logical CPUs for the configured actors (they share the cores;
            # logical CPUs are only admission control) and keep the object store small. Inside a Ray job
            # (RAY_ADDRESS set) the job's own runtime env applies; adding env vars here would clash with it.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            kwargs.update(num_cpus=max(int(np.ceil(needed)), os.cpu_count() or 1), include_dashboard=False,
                          object_store_memory=200 * 2**20,
                          runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}})
        # ray.init() replaces the SIGTERM handler with one that exits the process at once; the run's own (stop
        # after the current step, with a checkpoint) is put back. A SIGTERM inside ray.init() still exits.
        before = signal.getsignal(signal.SIGTERM)
        ray.init(**kwargs)
        if threading.current_thread() is threading.main_thread() and before is not None:
            signal.signal(signal.SIGTERM, before)
        self._started_ray = True

    def _open_planes(self) -> bytes:
        """The run's trajectory receiver (data plane) and admission gate (control plane); returns the run's
        MAC secret. ``bench cluster``'s simulated runtime opens the same two."""
        cfg = self.cfg
        secret = secrets.token_bytes(32)  # per-run MAC secret: nothing outside the run can inject data
        self.receiver = make_receiver(cfg.transport.kind, bind_address(cfg.transport.host), secret,
                                      hwm=cfg.transport.high_water_mark, expected=TrajectoryGroup,
                                      max_message_bytes=int(cfg.transport.max_message_mb * 2**20))
        k_admit = 0 if cfg.staleness.fixed_lag else cfg.staleness.max_staleness
        self.gate = GateActor.options(num_cpus=0).remote(k_admit, cfg.rollout.groups_per_step)
        self.admission = RayAdmission(self.gate)
        self._secret = secret
        return secret

    def _build(self) -> None:
        cfg = self.cfg
        check_cluster_fits(cfg, ray.cluster_resources())
        self.weight_backend = resolve_backend(cfg.weight_sync.backend, cfg.rollout.gpus_per_worker)
        data = cfg.model_dump(mode="json")
        data["weight_sync"]["backend"] = self.weight_backend  # resolved once, here, for every actor
        self._actor_cfg = data
        secret = self._open_planes()

        # The engines start while the learner ranks load their models and form their group: the two
        # depend on each other only through the weight group, formed once both are up.
        self._keys = [engine_key(cfg, f"w{i}", self.weight_backend) for i in range(cfg.rollout.num_workers)]
        self.rollouts = [self._pooled_actor(i) for i in range(cfg.rollout.num_workers)]
        new = [i for i, actor in enumerate(self.rollouts) if actor is None]
        L = self.checkpoint_ranks = cfg.learner.num_ranks
        if self.pool is not None:  # idle actors of other runs hold the resources the new actors need
            self.pool.make_room(cpus=len(new) * cfg.rollout.cpus_per_worker + L * cfg.learner.cpus_per_rank,
                                gpus=len(new) * cfg.rollout.gpus_per_worker + L * cfg.learner.gpus_per_rank)
        for i in new:
            self.rollouts[i] = self._rollout_actor(i)
        engines_up = [r.setup.remote() for r in self.rollouts]
        self.learners = [
            LearnerActor.options(num_cpus=cfg.learner.cpus_per_rank, num_gpus=cfg.learner.gpus_per_rank,
                                 name=None).remote(data, rank, L, secret, self._log_path(f"learner-{rank}"))
            for rank in range(L)
        ]
        master_address, master_port = ray.get(self.learners[0].rendezvous.remote())
        ray.get([lrn.setup.remote(master_address, master_port) for lrn in self.learners])
        self.shard_senders = [make_sender(cfg.transport.kind, addr, secret, hwm=2,
                                          send_timeout_s=cfg.transport.send_timeout_s)
                              for addr in ray.get([lrn.shard_address.remote() for lrn in self.learners])]
        ray.get(engines_up)
        ray.get(self._form_weight_group())
        if self.reused:  # a pooled engine still holds its last run's weights and version
            asyncio.run(self._broadcast(0))
        self._vocab_size = int(ray.get(self.learners[0].vocab_size.remote()))

    def _pooled_actor(self, i: int) -> Any | None:
        """An idle actor from the pool, bound to this run, or None."""
        actor = self.pool.take(self._keys[i]) if self.pool is not None else None
        if actor is None:
            return None
        try:
            ray.get(actor.bind.remote(self._actor_cfg, f"w{i}", self.receiver.address, self._secret, self.gate,
                                      self._log_path(f"rollout-w{i}")), timeout=60)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("a pooled rollout actor could not join the run (%s); starting a new one", e)
            ray.kill(actor, no_restart=True)
            return None
        self.reused.append(i)
        self.pool.reused += 1
        return actor

    def _rollout_actor(self, i: int) -> Any:
        cfg = self.cfg
        if self.pool is not None:
            self.pool.built += 1
        return RolloutActor.options(num_cpus=cfg.rollout.cpus_per_worker, num_gpus=cfg.rollout.gpus_per_worker,
                                    max_concurrency=64).remote(self._actor_cfg, f"w{i}",
                                                               self.receiver.address, self._secret, self.gate,
                                                               cfg.rollout.threads_per_engine,
                                                               self._log_path(f"rollout-w{i}"))

    def _log_path(self, name: str) -> str | None:
        """The log file of actor ``name`` (``rollout-w0``, ``learner-1``), or None on the console."""
        return None if self.log_dir is None else str(self.log_dir / f"{name}.log")

    def _log_note(self, name: str) -> str:
        path = self._log_path(name)
        return f" (its log: {path})" if path else ""

    def _form_weight_group(self) -> list[Any]:
        """(Re)form the weight plane: learner rank 0's publisher and every rollout actor's receiver."""
        infos = ray.get(self.learners[0].open_publisher.remote(self.rollouts))
        return [r.join_weights.remote(info) for r, info in zip(self.rollouts, infos, strict=True)] + [
            self.learners[0].connect_publisher.remote()]

    # ------------------------------------------------------------------ the seam
    async def start(self) -> None:
        await asyncio.gather(*[r.start.remote() for r in self.rollouts])
        self._started = True

    async def receive(self, timeout_s: float) -> AnyGroup | None:
        if time.perf_counter() - self._last_check > self.HEALTH_CHECK_S:
            self._check_new_nodes()
            await self._replace_dead()
            self._last_check = time.perf_counter()
        return self.receiver.receive(timeout_s)  # blocks this loop briefly: nothing else runs on it while collecting

    def _check_new_nodes(self) -> None:
        """A node that joined the cluster after the start (where a replaced rollout actor may land) must see the
        run directory as the others do: the same check as at the start (``refuse_unshared``), on the new nodes
        only; a blind one stops the run (``UnsharedRunDir``) naming it."""
        if self._run_dir_given is None or not self._checked_nodes:  # not a multi-node run
            return
        new = alive_nodes() - self._checked_nodes
        if new:
            refuse_unshared(*self._run_dir_given, lambda marker, token: blind_nodes(marker, token, only=new))
            self._checked_nodes |= new

    # ------------------------------------------------------------------ rollout actor failures
    async def _replace_dead(self) -> None:
        """Replace every rollout actor whose process died; re-raise the error of a loop that failed."""
        results = await asyncio.gather(*[r.check.remote() for r in self.rollouts], return_exceptions=True)
        dead = [i for i, res in enumerate(results) if isinstance(res, ray.exceptions.RayActorError)]
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, ray.exceptions.RayActorError):
                raise res
        if dead:
            await self._replace(dead)

    async def _replace(self, dead: list[int]) -> None:
        """New actors for dead ones: their admitted but undelivered groups go back to the gate to be replayed
        under the same index and seed, the weight group is formed again, the new engines get the current
        weights, and they start playing. A replacement that dies while starting is replaced again."""
        if self.weight_backend == "nccl":
            raise RuntimeError(f"rollout actor(s) {dead} died; replacing actors on the NCCL path is not supported")
        for _ in range(3):
            for i in dead:
                lost = await self.gate.abandon.remote(f"w{i}")
                self.abandoned += len(lost)
                log.warning("rollout actor w%d died%s; its %d undelivered group(s) %s will be replayed", i,
                            self._log_note(f"rollout-w{i}"), len(lost), lost)
                ray.kill(self.rollouts[i], no_restart=True)
                self.rollouts[i] = self._rollout_actor(i)
            try:
                await asyncio.gather(*[self.rollouts[i].setup.remote() for i in dead])
                await asyncio.gather(*self._form_weight_group())
                await self._broadcast(self._published)
                if self._started:
                    await asyncio.gather(*[self.rollouts[i].start.remote() for i in dead])
            except ray.exceptions.RayActorError as e:
                log.warning("replacing rollout actor(s) %s failed (%s); trying again", dead, str(e).splitlines()[0])
                results = await asyncio.gather(*[r.check.remote() for r in self.rollouts], return_exceptions=True)
                dead = [i for i, res in enumerate(results) if isinstance(res, ray.exceptions.RayActorError)] or dead
                continue
            self.restarts += len(dead)
            return
        raise RuntimeError(f"could not replace rollout actor(s) {dead} after 3 attempts")

    async def train(self, shards: list[BatchShard]) -> TrainResult:
        for sender, shard in zip(self.shard_senders, shards, strict=True):
            sender.send(shard)
        results = await self._on_learners("train_step", phase="a learner step")
        if len({r.version for r in results}) != 1:
            raise RuntimeError(f"learner ranks disagree on the version: {[r.version for r in results]}")
        metrics = merge_rank_metrics([r.metrics for r in results])
        metrics.update(self.receiver.stats.as_metrics("transport"))
        metrics.update({"rollout/actor_restarts": float(self.restarts), "rollout/abandoned_groups": float(self.abandoned)})
        return TrainResult(results[0].version, metrics)

    async def _on_learners(self, method: str, *args: Any, phase: str) -> list[Any]:
        """Call ``method`` on every learner rank. If a rank died, the run stops with an error naming it: the
        surviving ranks may be stuck in a collective with it, so they are not waited for."""
        calls = [getattr(lrn, method).remote(*args) for lrn in self.learners]
        try:
            return await asyncio.gather(*calls)
        except ray.exceptions.RayActorError as e:
            self._learners_broken = True
            ready, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
            dead = [r for r, c in enumerate(calls) if c in ready and _failed(c)]
            logs = "".join(self._log_note(f"learner-{r}") for r in dead)
            raise RuntimeError(f"learner rank(s) {dead or '?'} died during {phase}{logs}; the run stops here. "
                               "Continue from the latest checkpoint with `ragen-async train --resume RUN_DIR`") from e

    async def publish(self, version: int) -> None:
        """Weights to every engine. A rollout actor that dies during the sync is replaced and the sync
        repeated (the broadcast's other peers fail within ``weight_sync.timeout_s``)."""
        self._published = version  # what every engine must serve from now on, replacements included
        for _ in range(3):
            await self._replace_dead()
            try:
                await self._broadcast(version)
                return
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                log.warning("weight sync of version %d failed (%s); checking the rollout actors", version,
                            str(e).splitlines()[0])
                last = e
        raise RuntimeError(f"weight sync of version {version} failed three times") from last

    async def _broadcast(self, version: int) -> None:
        """One sync, the same for every backend: rank 0's ticket goes to every receiver while the learner
        ranks publish (rank 0 sends; under FSDP the others take part in gathering the full weights; no
        ticket: rank 0 drives the receivers itself). Both ends bound each blocking step by
        ``weight_sync.timeout_s``; the bound here is a backstop for a peer that stops answering Ray."""
        ticket = await self.learners[0].weight_ticket.remote(version)
        calls = [self._on_learners("publish", version, phase="a weight sync")]  # all: FSDP gathers, rank 0 sends
        if ticket is not None:
            calls += [r.receive_weights.remote(ticket) for r in self.rollouts]
        backstop_s = 2 * self.cfg.weight_sync.timeout_s + 60
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), backstop_s)
        except TimeoutError:
            raise WeightSyncTimeout(f"weight sync of version {version} ({self.weight_backend}): learner rank 0 or "
                                    f"a rollout actor did not answer within {backstop_s:g} s") from None
        for res in results:  # after every peer finished
            if isinstance(res, BaseException):
                raise res

    async def probe(self, token_ids: list[int], version: int) -> tuple[list[float], list[list[float]]]:
        # every rank: under FSDP the learner's forward is a collective
        learner_lps, *engine_lps = await asyncio.gather(
            self._on_learners("probe_logprobs", token_ids, 1.0, version, phase="the weight-sync probe"),
            *[r.probe_logprobs.remote(token_ids) for r in self.rollouts])
        return learner_lps[0], engine_lps

    async def served_weights(self) -> list[tuple[int, list]]:
        return list(await asyncio.gather(*[r.served_weights.remote() for r in self.rollouts]))

    async def published_digests(self, version: int, needed: list[tuple[str, str]]) -> dict:
        # every rank: under FSDP the full weights are gathered
        return (await self._on_learners("published_digests", version, needed, phase="the weight check"))[0]

    async def validate(self) -> dict[str, float]:
        """On the first rollout actor's engine (its other groups keep playing meanwhile)."""
        await self._replace_dead()
        return await self.rollouts[0].validate.remote()

    async def rollout_stats(self) -> list[dict[str, float]]:
        """Per actor; an actor that just died reports its last known numbers (it is replaced on the next check)."""
        results = await asyncio.gather(*[r.stats.remote() for r in self.rollouts], return_exceptions=True)
        stats = []
        for i, res in enumerate(results):
            if isinstance(res, ray.exceptions.RayActorError) and i < len(self._last_stats):
                res = self._last_stats[i]
            elif isinstance(res, BaseException):
                raise res
            stats.append(res)
        self._last_stats = stats
        return stats

    @property
    def learners_broken(self) -> bool:
        """A learner rank died: the others may be stuck in a collective with it (nothing can be saved)."""
        return self._learners_broken

    async def save(self, path: Path, step: int) -> None:
        # An absolute path: the ranks' working directories need not be the driver's (another node's, a job's).
        target = str(Path(path).absolute())
        await asyncio.gather(*[lrn.save_checkpoint.remote(target, step) for lrn in self.learners])
        counters = {"actor_restarts": self.restarts, "abandoned_groups": self.abandoned}
        (Path(path) / RUNTIME_STATE).write_text(json.dumps(counters))

    async def load(self, path: Path) -> int:
        versions = await asyncio.gather(*[lrn.load_checkpoint.remote(str(Path(path).absolute()))
                                          for lrn in self.learners])
        counters = Path(path) / RUNTIME_STATE
        if counters.is_file():  # (older checkpoints, written before these counters were kept, do not have it)
            state = json.loads(counters.read_text())
            self.restarts, self.abandoned = int(state["actor_restarts"]), int(state["abandoned_groups"])
        return int(versions[0])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def close(self) -> None:
        kept: list[Any] = []
        try:
            if self.rollouts and self.pool is not None:  # (a dead learner rank leaves the engines usable)
                kept = self._give_back()
            rest = [r for r in self.rollouts if r not in kept]
            if rest:
                ray.get([r.shutdown.remote() for r in rest], timeout=60)
            if self.learners and not self._learners_broken:
                ray.get([lrn.shutdown.remote() for lrn in self.learners], timeout=60)
        except Exception as e:  # noqa: BLE001 - shutting down after a failure must not mask it
            log.warning("error while shutting actors down: %s", e)
        finally:
            for a in [*self.rollouts, *self.learners, self.gate]:
                if a is not None and a not in kept:
                    ray.kill(a, no_restart=True)
            for s in self.shard_senders:
                s.close()
            if self.receiver is not None:
                self.receiver.close()
            if self._started_ray:
                if self.pool is not None:
                    self.pool.owns_ray = True  # the pooled actors live in it: the pool ends it
                else:
                    ray.shutdown()

    def _give_back(self) -> list[Any]:
        """Release every live rollout actor from this run into the pool; returns those kept."""
        released = [r.release.remote() for r in self.rollouts]
        kept = []
        for i, (actor, ref) in enumerate(zip(self.rollouts, released, strict=True)):
            try:
                ray.get(ref, timeout=60)
            except Exception as e:  # noqa: BLE001 - a dead or stuck actor is simply not kept
                log.warning("rollout actor w%d is not kept for the next run: %s", i, str(e).splitlines()[0])
                continue
            self.pool.give(self._keys[i], actor)
            kept.append(actor)
        return kept
