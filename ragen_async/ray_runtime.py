"""``runtime: ray``: rollout actors, trajectory buffer and learner pool as separate processes.

The driver (this module) owns the policy version and the loop::

    receive groups (ZeroMQ) -> buffer: staleness check, StarPO-S filter, shards
    -> learner ranks train (DDP over gloo/NCCL) -> version v+1
    -> rank 0 broadcasts weights to every engine (torch.distributed) -> admission gate learns v+1

while the rollout actors play groups continuously, each asking the admission gate before it starts
one. With ``max_staleness = k`` a group may start only while the groups started are at most
``(k + v + 1) x groups_per_step`` for the version ``v`` every engine has loaded (AReaL's rule), so no
consumed token is more than k versions old; the buffer drops any group that would be, as a safety
net (counted). ``fixed_lag`` publishes version ``v - k`` instead and admits one step of groups at a
time, so every token is exactly k versions old once warmed up, whatever the throughput.

Shutdown is always clean: rollout loops stopped, engines shut down, actors killed, Ray shut down if
this process started it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any

import numpy as np
import ray

from ragen_async.budget import TrainingBudget
from ragen_async.buffer import TrajectoryBuffer
from ragen_async.config import RunConfig
from ragen_async.learner.actor import LearnerActor
from ragen_async.learner.learner import ADDITIVE_METRICS
from ragen_async.metrics import MetricsSink
from ragen_async.protocol import TrajectoryGroup
from ragen_async.provenance import ProvenanceLog
from ragen_async.rollout.actor import AdmissionGate, RolloutActor
from ragen_async.rollout.worker import rollout_metrics
from ragen_async.rundir import RunDir, checkpoint_path, save_checkpoint_marker
from ragen_async.transport import make_receiver

log = logging.getLogger(__name__)


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Sum the additive metrics over ranks, average the rest."""
    keys = set().union(*per_rank)
    out = {}
    for k in keys:
        vals = [m[k] for m in per_rank if k in m]
        out[k] = float(np.sum(vals)) if k in ADDITIVE_METRICS else float(np.mean(vals))
    return out


class RayTrainer:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, sink: MetricsSink):
        self.cfg, self.run_dir, self.sink = cfg, run_dir, sink
        self._started_ray = False
        self.rollouts: list[Any] = []
        self.learners: list[Any] = []
        self.gate = None
        self.receiver = None
        self.shard_senders: list[Any] = []
        self.start_step = 0
        self.version = 0
        self.syncs = 0
        self.provenance = ProvenanceLog(run_dir.path / "provenance.jsonl" if cfg.record_provenance else None)
        self._init_ray()
        try:
            self._build()
        except BaseException:
            self.close()  # half-built actors and the Ray we started must not outlive the error
            raise

    # ------------------------------------------------------------------ construction
    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        cfg = self.cfg
        needed = cfg.rollout.num_workers * cfg.rollout.cpus_per_worker + cfg.learner.num_ranks * cfg.learner.cpus_per_rank
        kwargs: dict[str, Any] = {"log_to_driver": True}
        if not os.environ.get("RAY_ADDRESS"):
            # A local Ray: advertise enough logical CPUs for the configured actors (they share the cores;
            # logical CPUs are only admission control) and keep the object store small. Inside a Ray job
            # (RAY_ADDRESS set) the job's own runtime env applies; adding env vars here would clash with it.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            kwargs.update(num_cpus=max(int(np.ceil(needed)), os.cpu_count() or 1), include_dashboard=False,
                          object_store_memory=200 * 2**20,
                          runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}})
        ray.init(**kwargs)
        self._started_ray = True

    def _build(self) -> None:
        cfg = self.cfg
        data = cfg.model_dump(mode="json")
        secret = secrets.token_bytes(32)  # per-run HMAC key: nothing outside the run can inject data
        host = ray.util.get_node_ip_address() if cfg.transport.host == "auto" else cfg.transport.host
        self.receiver = make_receiver(cfg.transport.kind, f"tcp://{host}:*", secret,
                                      hwm=cfg.transport.high_water_mark, expected=TrajectoryGroup,
                                      max_message_bytes=int(cfg.transport.max_message_mb * 2**20))
        k_admit = 0 if cfg.staleness.fixed_lag else cfg.staleness.max_staleness
        self.gate = AdmissionGate.options(num_cpus=0).remote(k_admit, cfg.rollout.groups_per_step)

        L = cfg.learner.num_ranks
        self.learners = [
            LearnerActor.options(num_cpus=cfg.learner.cpus_per_rank, num_gpus=cfg.learner.gpus_per_rank,
                                 name=None).remote(data, rank, L, secret)
            for rank in range(L)
        ]
        master_address, master_port = ray.get(self.learners[0].rendezvous.remote())
        ray.get([lrn.setup.remote(master_address, master_port) for lrn in self.learners])
        from ragen_async.transport import make_sender

        self.shard_senders = [make_sender(cfg.transport.kind, addr, secret, hwm=2,
                                          send_timeout_s=cfg.transport.send_timeout_s)
                              for addr in ray.get([lrn.shard_address.remote() for lrn in self.learners])]

        R = cfg.rollout.num_workers
        threads = max(1, int(cfg.rollout.cpus_per_worker))
        self.rollouts = [
            RolloutActor.options(num_cpus=cfg.rollout.cpus_per_worker, num_gpus=cfg.rollout.gpus_per_worker,
                                 max_concurrency=64).remote(data, f"w{i}", self.receiver.address, secret,
                                                            self.gate, threads)
            for i in range(R)
        ]
        ray.get([r.setup.remote() for r in self.rollouts])
        self.weight_backend = self._weight_backend()
        if self.weight_backend == "gloo":
            address, port, self.manifest = ray.get(self.learners[0].open_weight_group.remote(R))
            connect = self.learners[0].connect_weight_group.remote()
            ray.get([r.init_weight_group.remote(address, port, R + 1, i + 1, cfg.weight_sync.timeout_s)
                     for i, r in enumerate(self.rollouts)] + [connect])
        elif self.weight_backend == "nccl":
            self._connect_nccl()
        vocab = ray.get(self.learners[0].vocab_size.remote())
        self.probe_ids = np.random.default_rng(0).integers(0, vocab, size=48).tolist()
        self.buffer = TrajectoryBuffer(
            groups_per_step=cfg.rollout.groups_per_step, max_staleness=cfg.staleness.max_staleness,
            filter_mode=cfg.algo.filter_mode, filter_ratio=cfg.algo.filter_ratio, norm_mode=cfg.algo.grpo_norm,
            num_ranks=L, fixed_lag=cfg.staleness.fixed_lag, group_size=cfg.rollout.group_size)

    def _connect_nccl(self) -> None:
        """GPU path: vLLM's native NCCL weight-transfer engine, driven from learner rank 0."""
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync.backend=nccl needs CUDA GPUs; use gloo (or auto) on CPU")
        # Rank 0 drives the whole exchange (init handshake, start/update/finish) through the actors.
        ray.get(self.learners[0].open_nccl_group.remote(self.rollouts))
        ray.get(self.learners[0].connect_weight_group.remote())
        self.manifest = None

    def _weight_backend(self) -> str:
        b = self.cfg.weight_sync.backend
        if b != "auto":
            return b
        return "nccl" if self.cfg.rollout.gpus_per_worker > 0 else "gloo"

    # ------------------------------------------------------------------ weight sync
    def published_version_for(self, learner_version: int) -> int:
        if self.cfg.staleness.fixed_lag:
            return max(0, learner_version - (self.cfg.staleness.max_staleness or 0))
        return learner_version

    async def verify_sync(self) -> dict[str, float]:
        """Every engine's log-probs of a fixed probe sequence against learner rank 0's."""
        probe = self.probe_ids
        learner_lp, *engine_lps = await asyncio.gather(self.learners[0].probe_logprobs.remote(probe),
                                                       *[r.probe_logprobs.remote(probe) for r in self.rollouts])
        diffs = [float(np.max(np.abs(np.asarray(e[1:]) - np.asarray(learner_lp[1:])))) for e in engine_lps]
        return {"weight_sync/probe_max_abs_diff": max(diffs)}

    async def publish(self, learner_version: int) -> dict[str, float]:
        """Push weights to every engine, then tell the gate; returns timing metrics."""
        target = self.published_version_for(learner_version)
        t0 = time.perf_counter()
        if self.weight_backend == "gloo":
            sender = self.learners[0].publish.remote(target)
            receivers = [r.receive_broadcast.remote(self.manifest, target) for r in self.rollouts]
            await asyncio.gather(sender, *receivers)
        elif self.weight_backend == "nccl":
            await self.learners[0].publish.remote(target)  # rank 0's client drives every engine
        else:  # rpc: tensors through the object store (tests, tiny models)
            weights = await self.learners[0].weights_for_rpc.remote(target)
            await asyncio.gather(*[r.load_state_dict.remote(weights, target) for r in self.rollouts])
        sync_s = time.perf_counter() - t0
        await self.gate.set_published_version.remote(learner_version)
        out = {"weight_sync/time_s": sync_s, "weight_sync/published_version": float(target)}
        self.syncs += 1
        every = self.cfg.weight_sync.verify_every
        if every and self.syncs % every == 0 and target == learner_version:
            out.update(await self.verify_sync())  # (fixed lag serves an older version: nothing to compare)
        return out

    # ------------------------------------------------------------------ the loop
    def resume(self, checkpoint) -> None:
        extras = ray.get([lrn.load_checkpoint.remote(str(checkpoint)) for lrn in self.learners])
        self.start_step = int(extras[0]["step"])
        self.version = ray.get(self.learners[0].policy_version.remote())

    async def _fill_buffer(self) -> None:
        """Receive groups until the buffer can assemble a batch, watching the actors' health."""
        last_check = time.perf_counter()
        while not self.buffer.ready(self.version):
            msg = self.receiver.receive(0.2)
            if msg is not None:
                if not self.buffer.add(msg, self.version, time.time()):
                    await self.gate.on_dropped.remote(1)
            drops = self.buffer.drain_drops()
            if drops:
                await self.gate.on_dropped.remote(len(drops))
            if time.perf_counter() - last_check > 2.0:
                await asyncio.gather(*[r.check.remote() for r in self.rollouts])
                last_check = time.perf_counter()

    async def run(self) -> dict[str, float]:
        cfg = self.cfg
        if self.version > 0:
            await self.publish(self.version)
        last_val: dict[str, float] = {}
        if cfg.validation.every and self.start_step == 0:
            last_val = await self.validate(0)
        await asyncio.gather(*[r.start.remote() for r in self.rollouts])
        prev_stats = await asyncio.gather(*[r.stats.remote() for r in self.rollouts])
        budget = TrainingBudget(cfg.time_budget_minutes)
        done = self.start_step
        for step in range(self.start_step, cfg.total_steps):
            budget.start()
            t_step = time.perf_counter()
            await self._fill_buffer()
            wait_s = time.perf_counter() - t_step
            shards, batch_metrics = self.buffer.next_batch(self.version, step, time.time())
            self.provenance.write(step + 1, self.version, self.buffer.last_groups, shards)
            consumed = [t for s in shards for t in s.trajectories]
            for sender, shard in zip(self.shard_senders, shards, strict=True):
                sender.send(shard)
            t0 = time.perf_counter()
            per_rank = await asyncio.gather(*[lrn.train_step.remote() for lrn in self.learners])
            train_s = time.perf_counter() - t0
            learner_metrics = merge_rank_metrics(per_rank)
            self.version = int(learner_metrics["learner/policy_version"])
            sync = await self.publish(self.version)

            stats = await asyncio.gather(*[r.stats.remote() for r in self.rollouts])
            step_s = time.perf_counter() - t_step
            record: dict[str, Any] = {"learner/step": step + 1, "policy_version": self.version}
            record.update(self._rollout_metrics(batch_metrics))
            record.update(learner_metrics)
            record.update(sync)
            record.update(self._idle_metrics(prev_stats, stats, train_s, step_s))
            record.update(self.receiver.stats.as_metrics("transport"))
            prev_stats = stats
            n_tokens = sum(t.num_tokens for t in consumed)
            record.update({"timing/step_s": step_s, "timing/wait_batch_s": wait_s, "timing/train_s": train_s,
                           "throughput/tokens_per_s": n_tokens / max(step_s, 1e-9),
                           "throughput/learner_tokens_per_s": learner_metrics.get("learner/num_tokens", 0.0)
                           / max(train_s, 1e-9)})
            record["timing/budget_spent_s"] = budget.spent_s
            self.sink.log(record)
            done = step + 1
            budget.pause()  # rollout actors keep playing during validation; only learner time is charged
            final = budget.is_last_step(done, cfg.total_steps)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and not final:
                await self.save(done)
            if cfg.validation.every and (done % cfg.validation.every == 0 or final):
                last_val = await self.validate(done)
            if final:
                break
        await self.save(done)
        return last_val

    def _rollout_metrics(self, batch_metrics: dict[str, float]) -> dict[str, float]:
        return {**batch_metrics, **rollout_metrics(self.buffer.last_groups)}

    def _idle_metrics(self, prev, cur, train_s: float, step_s: float) -> dict[str, float]:
        busy = [c["busy_s"] - p["busy_s"] for p, c in zip(prev, cur, strict=True)]
        wait = [c["admission_wait_s"] - p["admission_wait_s"] for p, c in zip(prev, cur, strict=True)]
        return {
            "rollout/idle_frac": float(np.mean([max(0.0, 1 - b / max(step_s, 1e-9)) for b in busy])),
            "learner/idle_frac": max(0.0, 1 - train_s / max(step_s, 1e-9)),
            "staleness/admission_wait_s": float(np.mean(wait)),
            "rollout/engine_versions_min": float(min(c["policy_version"] for c in cur)),
        }

    async def validate(self, step: int) -> dict[str, float]:
        """Validation on the first rollout actor's engine (fixed seeds, RAGEN temperature 0.5)."""
        t0 = time.perf_counter()
        metrics = await self.rollouts[0].validate.remote()
        metrics.update({"learner/step": step, "policy_version": self.version, "timing/val_s": time.perf_counter() - t0})
        self.sink.log(metrics)
        return metrics

    async def save(self, step: int) -> None:
        path = checkpoint_path(self.run_dir, step)
        await asyncio.gather(*[lrn.save_checkpoint.remote(str(path), step) for lrn in self.learners])
        save_checkpoint_marker(path)

    def close(self) -> None:
        try:
            if self.rollouts:
                ray.get([r.shutdown.remote() for r in self.rollouts], timeout=60)
            if self.learners:
                ray.get([lrn.shutdown.remote() for lrn in self.learners], timeout=60)
        except Exception as e:  # noqa: BLE001 - shutting down after a failure must not mask it
            log.warning("error while shutting actors down: %s", e)
        finally:
            for a in [*self.rollouts, *self.learners, self.gate]:
                if a is not None:
                    ray.kill(a, no_restart=True)
            for s in self.shard_senders:
                s.close()
            if self.receiver is not None:
                self.receiver.close()
            self.provenance.close()
            if self._started_ray:
                ray.shutdown()
