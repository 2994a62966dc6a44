"""Thin Ray shell over :class:`Learner`: one data-parallel rank of the learner pool.

Ranks join one torch.distributed group (gloo on CPU, NCCL on GPU) for gradient all-reduce. Each rank
pulls its batch shard from its own ZeroMQ socket (the data plane never goes through Ray). Rank 0 also
owns publishing: it hosts the weight-broadcast group that every inference engine joins, and in
fixed-lag mode keeps a ring buffer of recent weights so it can publish version v - k.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path

import ray
import torch

from ragen_async.config import RunConfig
from ragen_async.learner.learner import Learner, TrainResult
from ragen_async.protocol import BatchShard
from ragen_async.records.logfiles import redirect_output
from ragen_async.transport import CodecError, bind_address, make_receiver
from ragen_async.weight_sync import RayActorsClient, RingBuffer, make_publisher
from ragen_async.weight_sync.verify import published_digests


def join_learner_group(cfg: RunConfig, backend: str, master_address: str, master_port: int, rank: int,
                       world_size: int, store=None) -> None:
    """Join the learner ranks' torch.distributed group through rank 0's TCP store: rank 0 passes the
    ``store`` it opened (:meth:`LearnerActor.rendezvous`), the others connect to ``master_address:master_port``.
    Its timeout is ``learner.group_timeout_s``, not the weight sync's: on resume rank 0 reads a checkpoint of
    several GB (at 0.5B with fp32 masters and AdamW state, about 16 GB) while the other ranks already wait in
    the collective that follows."""
    import torch.distributed as dist

    timeout = dt.timedelta(seconds=cfg.learner.group_timeout_s)
    if store is None:
        if rank == 0:
            raise RuntimeError("learner rank 0 opens the group's rendezvous first (LearnerActor.rendezvous)")
        store = dist.TCPStore(master_address, master_port, world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


@ray.remote
class LearnerActor:
    def __init__(self, cfg_data: dict, rank: int, world_size: int, secret: bytes, log_path: str | None = None):
        if log_path:
            redirect_output(Path(log_path))
        self.cfg = RunConfig.model_validate(cfg_data)
        if self.cfg.learner.cpu_affinity:
            os.sched_setaffinity(0, set(self.cfg.learner.cpu_affinity))
        self.rank, self.world_size = rank, world_size
        self.secret = secret
        torch.set_num_threads(self.cfg.learner.torch_threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(self.cfg.learner.torch_threads))
        self.learner: Learner | None = None
        self.receiver = make_receiver(self.cfg.transport.kind, bind_address(self.cfg.transport.host), secret,
                                      hwm=2, expected=BatchShard,
                                      max_message_bytes=int(self.cfg.transport.max_message_mb * 2**20))
        self.publisher = None
        self.ring: RingBuffer | None = None
        self._store = None
        """Rank 0: the learner group's rendezvous store (:meth:`rendezvous`)."""

    def _device(self) -> str:
        return "cuda" if self.cfg.learner.gpus_per_rank > 0 and torch.cuda.is_available() else "cpu"

    def _backend(self) -> str:
        b = self.cfg.learner.backend
        return b if b != "auto" else ("nccl" if self._device() == "cuda" else "gloo")

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: open the learner group's rendezvous, a TCP store on a port the kernel picks, held by this
        actor until the group forms; returns its address and port. (A port found free here and bound only when
        the group forms can be taken by another process in between; the other ranks would then wait on that
        process's socket until the group's timeout.)"""
        import torch.distributed as dist

        address = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(address, 0, self.world_size, True, wait_for_workers=False,
                                    timeout=dt.timedelta(seconds=self.cfg.learner.group_timeout_s))
        return address, int(self._store.port)

    def shard_address(self) -> str:
        return self.receiver.address

    def setup(self, master_address: str, master_port: int) -> int:
        """Join the learner group and build the model; returns the policy version."""
        if self.world_size > 1:
            join_learner_group(self.cfg, self._backend(), master_address, master_port, self.rank, self.world_size,
                               store=self._store)
        self.learner = Learner(self.cfg, rank=self.rank, world_size=self.world_size, device=self._device())
        weights = self.learner.full_weights()  # every rank: a collective under FSDP; rank 0 gets them
        # What a ticket describes (names, shapes, dtypes), without the data.
        self._meta = [(n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in weights]
        if self.rank == 0 and self.cfg.staleness.fixed_lag:
            self.ring = RingBuffer(capacity=(self.cfg.staleness.max_staleness or 0) + 1)
            self.ring.push(0, weights)
        return self.learner.policy_version

    def train_step(self, timeout_s: float = 600.0) -> TrainResult:
        t0 = time.perf_counter()
        try:  # the driver is this receiver's one producer: a shard it cannot read stops the run, named
            shard = self.receiver.receive(timeout_s, raise_rejects=True)
        except CodecError as exc:
            raise RuntimeError(f"learner rank {self.rank} refused its batch shard: {exc}") from exc
        if shard is None:
            raise TimeoutError(f"learner rank {self.rank}: no batch shard arrived within {timeout_s:.0f} s")
        wait_s = time.perf_counter() - t0
        result = self.learner.train_step(shard)
        if self.cfg.staleness.fixed_lag:
            weights = self.learner.full_weights()  # every rank (a collective under FSDP)
            if self.ring is not None:
                self.ring.push(result.version, weights)
        result.metrics["timing/learner_recv_s"] = wait_s
        result.metrics["timing/learner_compute_s"] = time.perf_counter() - t0 - wait_s
        return result

    # ---- publishing: rank 0 owns the publisher (the driver resolved the backend) ----------------
    def open_publisher(self, rollout_actors: list) -> list[dict | None]:
        """Rank 0: (re)build the publisher for ``rollout_actors``; returns what each one's receiver
        needs to join (run its ``join_weights`` concurrently with :meth:`connect_publisher`)."""
        assert self.rank == 0
        if self.publisher is not None:  # re-forming the group after a rollout actor was replaced
            self.publisher.close()
        backend = self.cfg.weight_sync.backend
        timeout_s = self.cfg.weight_sync.timeout_s
        client = RayActorsClient(rollout_actors, timeout_s=timeout_s) if backend == "nccl" else None
        self.publisher = make_publisher(backend, address=ray.util.get_node_ip_address(),
                                        num_receivers=len(rollout_actors), timeout_s=timeout_s, client=client,
                                        workers_per_engine=self.cfg.inference.tensor_parallel_size)
        return [self.publisher.receiver_info(i) for i in range(len(rollout_actors))]

    def connect_publisher(self) -> None:
        self.publisher.connect()

    def _weights(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """The weights of ``version`` on rank 0: the current ones (every rank must call this for them: a
        gather under FSDP), or an older one from the fixed-lag ring (rank 0 only, no collective)."""
        if version == self.learner.policy_version:
            return self.learner.full_weights()
        if self.ring is not None and version in self.ring:
            return list(self.ring.get(version).items())
        raise ValueError(f"cannot publish version {version}: learner is at {self.learner.policy_version} "
                         f"and the ring buffer holds {self.ring.versions() if self.ring else []}")

    def weight_ticket(self, version: int) -> dict | None:
        """Rank 0: what every receiver needs for ``version`` (``None``: the publisher drives them)."""
        return self.publisher.ticket(self._weights(version) if self.publisher.ticket_carries_tensors else self._meta,
                                     version)

    def publish(self, version: int) -> float:
        """Every rank: the weights of ``version`` (the current one, or an older one in fixed-lag mode) are
        gathered where they are sharded, and rank 0 sends them."""
        t0 = time.perf_counter()
        if self.rank != 0:
            if version == self.learner.policy_version:
                self.learner.full_weights()  # take part in the gather (nothing to do without FSDP)
            return 0.0
        self.publisher.publish(self._weights(version), version)
        return time.perf_counter() - t0

    def probe_logprobs(self, token_ids: list[int], temperature: float = 1.0, version: int | None = None) -> list[float]:
        """The learner's side of the weight-sync probe, under the weights of ``version`` (default: the
        current ones; under fixed lag an older one from the ring, on rank 0, the others return [])."""
        if version is None or version == self.learner.policy_version:
            return self.learner.probe_logprobs(token_ids, temperature)
        if self.rank != 0:
            return []
        return self.learner.probe_logprobs(token_ids, temperature, weights=dict(self._weights(version)))

    def published_digests(self, version: int, needed: list[tuple[str, str]]) -> dict:
        """Every rank (a gather under FSDP); rank 0 returns the digests of the weights of ``version`` in the
        dtypes ``needed`` (the byte-exact weight check), the others ``{}``."""
        if version == self.learner.policy_version:  # streamed bucket by bucket: one gathered bucket at a time
            weights = (item for bucket in self.learner.full_weight_buckets() for item in bucket)
        else:
            weights = iter(self._weights(version) if self.rank == 0 else [])
        digests = published_digests(weights, needed)
        return digests if self.rank == 0 else {}

    def policy_version(self) -> int:
        return self.learner.policy_version

    def pid(self) -> int:
        return os.getpid()

    def vocab_size(self) -> int:
        return int(self.learner.actor.config.vocab_size)

    def save_checkpoint(self, path: str, step: int) -> None:
        """Every rank writes its own state; rank 0 also writes the actor weights (``Learner.save_checkpoint``
        leaves them to rank 0) and the fixed-lag ring (the older versions it still has to publish), so a
        fixed-lag run resumes exactly. The driver gathers every rank's call before finalising."""
        self.learner.save_checkpoint(Path(path), extra={"step": step})
        if self.ring is not None:
            older = {v: self.ring.get(v) for v in self.ring.versions() if v != self.learner.policy_version}
            torch.save(older, Path(path) / "fixed_lag_ring.pt")

    def load_checkpoint(self, path: str) -> int:
        """Restore this rank (and rank 0's ring); returns the policy version."""
        self.learner.load_checkpoint(Path(path))
        if self.ring is not None:
            ring_file = Path(path) / "fixed_lag_ring.pt"
            older = torch.load(ring_file, weights_only=True) if ring_file.exists() else {}
            self.ring = RingBuffer(self.ring.capacity)
            for v in sorted(older):
                self.ring.push(v, older[v])
        if self.cfg.staleness.fixed_lag:
            weights = self.learner.full_weights()  # every rank (a collective under FSDP)
            if self.ring is not None:
                self.ring.push(self.learner.policy_version, weights)
        return self.learner.policy_version

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.receiver.close()
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
