"""Thin Ray shell over :class:`RolloutWorker`: one engine per actor, groups streamed over ZeroMQ.

Everything that is not Ray plumbing lives in the plain classes (worker, engine, transport). The actor
is an async Ray actor, so the vLLM ``AsyncLLM`` lives on the actor's event loop and the weight-sync
calls from the orchestrator interleave with generation (in-flight updates).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray

from ragen_async.agent.chat import ChatFormat
from ragen_async.config import RunConfig
from ragen_async.inference.base import InferenceEngine
from ragen_async.protocol import TrajectoryGroup
from ragen_async.records.logfiles import redirect_output
from ragen_async.rollout.engines import make_engine
from ragen_async.rollout.worker import RolloutWorker, validate_engine
from ragen_async.staleness.gate import AdmissionGate
from ragen_async.transport import make_sender
from ragen_async.weight_sync import WeightReceiver, make_receiver, resolve_backend

log = logging.getLogger(__name__)

ENGINE_WATCH_S = 1.0
"""How often a rollout actor checks that its inference engine is alive."""

ADMIT_WAIT_S = 1.0
"""How long the gate holds an admission request while no slot is free before it answers none (the actor then
asks again): short enough that a stopping actor is not held up, long enough that blocked actors cost the gate
about one call a second each instead of one per rollout-loop tick."""

GateActor = ray.remote(AdmissionGate)
"""The run's admission gate as a Ray actor (the plain class, unchanged; an async actor: one event loop)."""


@ray.remote
class RolloutActor:
    def __init__(self, cfg_data: dict, worker_id: str, buffer_address: str, secret: bytes, gate: Any,
                 engine_threads: int = 1, log_path: str | None = None):
        # Each engine gets its own small thread budget so rollout actors and learners do not fight
        # over the same cores (set before vLLM/torch start their pools; Ray has set it to the actor's CPUs).
        # rollout.engine_threads can ask for fewer: on a busy machine a second OpenMP thread of the tiny model's
        # engine spins at barriers while its partner is descheduled.
        os.environ["OMP_NUM_THREADS"] = str(engine_threads)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.engine: InferenceEngine | None = None
        self.bind(cfg_data, worker_id, buffer_address, secret, gate, log_path)
        if self.cfg.rollout.cpu_affinity:
            # Set before the engine starts: its engine-core process inherits the mask.
            os.sched_setaffinity(0, set(self.cfg.rollout.cpu_affinity))

    def bind(self, cfg_data: dict, worker_id: str, buffer_address: str, secret: bytes, gate: Any,
             log_path: str | None = None) -> None:
        """Join a run: its config, worker id, trajectory socket and secret, admission gate and log file. A
        pooled actor (:mod:`ragen_async.runtime.engine_pool`) is bound again for each run and keeps only its engine;
        that engine's engine-core process keeps writing to the log of the run that started it."""
        if log_path:  # before the engine starts: its engine-core process inherits the file
            redirect_output(Path(log_path))
        self.cfg = RunConfig.model_validate(cfg_data)
        self.worker_id = worker_id
        self.buffer_address = buffer_address
        self.secret = secret
        self.gate = gate
        self._stop = False
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        # ZeroMQ sockets are not thread-safe: one dedicated thread creates and uses the sender.
        self._send_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"send-{worker_id}")
        self._sender = None
        self.worker: RolloutWorker | None = None
        self.receiver: WeightReceiver | None = None
        self._started_at = 0.0
        self._sent = 0

    async def setup(self) -> int:
        """Start the engine (on this actor's event loop; a pooled actor keeps its own) and connect the sender;
        returns the engine's version (a pooled engine's is its last run's until the runtime loads version 0)."""
        cfg = self.cfg
        backend = resolve_backend(cfg.weight_sync.backend, cfg.rollout.gpus_per_worker)  # the driver resolved it
        if self.engine is None:
            self.engine = make_engine(cfg, seed=cfg.seed + hash_worker(self.worker_id),
                                      weight_transfer_backend="nccl" if backend == "nccl" else None)
        engine = self.engine
        self.receiver = make_receiver(backend, engine, cfg.weight_sync.timeout_s)
        chat = ChatFormat.from_pretrained(cfg.model.path, enable_think=cfg.agent.enable_think)
        self.worker = RolloutWorker(cfg, engine, chat, worker_id=self.worker_id)
        loop = asyncio.get_running_loop()
        self._sender = await loop.run_in_executor(self._send_pool, lambda: make_sender(
            cfg.transport.kind, self.buffer_address, self.secret, hwm=cfg.transport.high_water_mark,
            send_timeout_s=cfg.transport.send_timeout_s))
        return engine.policy_version

    async def _admit(self, n: int) -> list[int]:
        return await self.gate.admit.remote(self.worker_id, n, ADMIT_WAIT_S)

    def pid(self) -> int:
        return os.getpid()

    async def _send(self, group: TrajectoryGroup) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._send_pool, self._sender.send, group)
        self._sent += 1

    async def start(self) -> None:
        assert self.worker is not None, "call setup() first"
        self._started_at = time.perf_counter()
        self._task = asyncio.create_task(self.worker.run(self._admit, self._send, lambda: self._stop))
        self._watch = asyncio.create_task(self._watch_engine())

    async def stop(self) -> None:
        self._stop = True
        if self._watch is not None:
            self._watch.cancel()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=30)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()

    def _exit_if_engine_dead(self) -> None:
        """An actor whose engine died ends its own process, so the runtime replaces it like any dead actor
        (a new engine, its undelivered groups replayed) instead of stopping the run on the loop's error."""
        if self.engine is not None and self.engine.dead:
            log.error("rollout actor %s: its inference engine died; exiting so that it is replaced", self.worker_id)
            os._exit(1)

    async def _watch_engine(self) -> None:
        while True:
            self._exit_if_engine_dead()
            await asyncio.sleep(ENGINE_WATCH_S)

    async def check(self) -> None:
        """Re-raise a failure of the background loop (the orchestrator polls this)."""
        self._exit_if_engine_dead()
        if self._task is not None and self._task.done() and not self._task.cancelled():
            exc = self._task.exception()
            if exc is not None:
                raise exc

    async def stats(self) -> dict[str, float]:
        w = self.worker
        elapsed = max(time.perf_counter() - self._started_at, 1e-9) if self._started_at else 0.0
        return {"busy_s": w.busy_s, "admission_wait_s": w.admission_wait_s, "elapsed_s": elapsed,
                "groups_sent": float(self._sent), "policy_version": float(w.engine.policy_version)}

    # ---- weight sync: this actor's receiver (built for the run's backend) does the transfer --------
    async def join_weights(self, info: dict | None) -> None:
        await self.receiver.join(info)

    async def receive_weights(self, ticket: dict) -> dict:
        t0 = time.perf_counter()
        stats = await self.receiver.receive(ticket)
        return {**stats, "receive_s": time.perf_counter() - t0}

    async def probe_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        return await self.worker.engine.prompt_logprobs(token_ids, temperature)

    async def served_weights(self) -> tuple[int, list]:
        return await self.worker.engine.served_weights()

    async def validate(self) -> dict[str, float]:
        """Validation episodes on this actor's engine (fixed seeds, validation temperature)."""
        return await validate_engine(self.cfg, self.worker.engine, self.worker.chat)

    async def policy_version(self) -> int:
        return self.worker.engine.policy_version

    async def release(self) -> None:
        """Leave the run (loop stopped, sender closed, weight group left) and keep the engine for the next
        run's :meth:`bind`; raises if the engine is dead (such an actor is not pooled)."""
        await self._leave_run()
        if self.engine is None or self.engine.dead:
            raise RuntimeError(f"rollout actor {self.worker_id}: no live engine to keep")

    async def shutdown(self) -> None:
        await self._leave_run()
        if self.engine is not None:
            self.engine.shutdown()

    async def _leave_run(self) -> None:
        await self.stop()
        if self._sender is not None:
            await asyncio.get_running_loop().run_in_executor(self._send_pool, self._sender.close)
            self._sender = None
        if self.receiver is not None:
            try:
                await self.receiver.close()
            except Exception as e:  # noqa: BLE001 - a group already broken must not stop the shutdown
                log.warning("rollout actor %s: leaving the weight group failed: %s", self.worker_id, e)
            self.receiver = None
        self._send_pool.shutdown(wait=False)


def hash_worker(worker_id: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(worker_id)) % 10_007
