"""The orchestrator: builds every component from the config and owns a run's lifecycle.

Two runtimes share all the plain classes below it:

* ``local`` — the synchronous reference loop in one process: roll out ``groups_per_step`` groups
  with the engine, filter, compute advantages, update, load the new weights into the engine, log.
  It is staleness 0 by construction and is what the asynchronous runtime must reproduce at k = 0.
* ``ray`` — rollout actors, trajectory buffer and learner pool as separate processes
  (``ragen_async.ray_runtime``), connected by ZeroMQ and torch.distributed.

A run directory holds the resolved config, ``metrics.jsonl``, checkpoints and logs; ``--resume``
continues from its latest checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ragen_async.agent.chat import ChatFormat
from ragen_async.budget import TrainingBudget
from ragen_async.buffer import TrajectoryBuffer
from ragen_async.config import RunConfig, load_config
from ragen_async.inference.base import InferenceEngine
from ragen_async.learner.learner import Learner
from ragen_async.metrics import ConsoleSink, JsonlSink, MetricsSink, MultiSink, WandbSink, resolve_wandb_mode
from ragen_async.provenance import ProvenanceLog
from ragen_async.rollout.engines import make_engine
from ragen_async.rollout.worker import RolloutWorker, rollout_metrics, validate_engine
from ragen_async.rundir import RunDir, checkpoint_path, save_checkpoint_marker

log = logging.getLogger(__name__)


def make_sink(cfg: RunConfig, run_dir: RunDir) -> MetricsSink:
    sinks: list[MetricsSink] = [JsonlSink(run_dir.metrics_path)]
    mode = resolve_wandb_mode(cfg.logging.wandb_mode)
    if mode != "disabled":
        state = run_dir.read_state()
        wandb_sink = WandbSink(run_dir.path, cfg.model_dump(mode="json"), mode, cfg.logging.wandb_project,
                               cfg.logging.wandb_entity, run_dir.path.name, resume_id=state.get("wandb_id"))
        run_dir.write_state(**{**state, "wandb_id": wandb_sink.run_id})
        sinks.append(wandb_sink)
    if cfg.logging.console:
        sinks.append(ConsoleSink())
    return MultiSink(sinks)


def save_checkpoint(run_dir: RunDir, learner: Learner, step: int) -> Path:
    path = checkpoint_path(run_dir, step)
    learner.save_checkpoint(path, extra={"step": step})
    save_checkpoint_marker(path)
    return path


# ---------------------------------------------------------------------------- local runtime
class LocalTrainer:
    """The synchronous single-process reference loop (staleness 0)."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, sink: MetricsSink, engine: InferenceEngine | None = None):
        self.cfg, self.run_dir, self.sink = cfg, run_dir, sink
        self.chat = ChatFormat.from_pretrained(cfg.model.path, enable_think=cfg.agent.enable_think)
        self.learner = Learner(cfg)
        self.engine = engine if engine is not None else make_engine(cfg, seed=cfg.seed)
        self.worker = RolloutWorker(cfg, self.engine, self.chat)
        self.buffer = TrajectoryBuffer(
            groups_per_step=cfg.rollout.groups_per_step, max_staleness=0, filter_mode=cfg.algo.filter_mode,
            filter_ratio=cfg.algo.filter_ratio, norm_mode=cfg.algo.grpo_norm, num_ranks=1)
        self.start_step = 0
        self.provenance = ProvenanceLog(run_dir.path / "provenance.jsonl" if cfg.record_provenance else None)
        self.syncs = 0

    def resume(self, checkpoint: Path) -> None:
        extra = self.learner.load_checkpoint(checkpoint)
        self.start_step = int(extra["step"])
        log.info("resumed from %s at step %d (policy version %d)", checkpoint, self.start_step,
                 self.learner.policy_version)

    async def _publish(self) -> dict[str, float]:
        t0 = time.perf_counter()
        await self.engine.load_state_dict(self.learner.named_weights(), self.learner.policy_version)
        out = {"weight_sync/time_s": time.perf_counter() - t0}
        self.syncs += 1
        every = self.cfg.weight_sync.verify_every
        if every and self.syncs % every == 0:
            probe = np.random.default_rng(0).integers(0, self.learner.actor.config.vocab_size, size=48).tolist()
            engine_lp = np.asarray((await self.engine.prompt_logprobs(probe))[1:])
            learner_lp = np.asarray(self.learner.probe_logprobs(probe)[1:])
            out["weight_sync/probe_max_abs_diff"] = float(np.max(np.abs(engine_lp - learner_lp)))
        return out

    async def run(self) -> dict[str, float]:
        cfg = self.cfg
        if self.learner.policy_version > 0:
            await self._publish()
        groups_per_step = cfg.rollout.groups_per_step
        last: dict[str, float] = {}
        if cfg.validation.every and self.start_step == 0:
            last = await self._validate_and_log(0)
        budget = TrainingBudget(cfg.time_budget_minutes)
        done = self.start_step
        for step in range(self.start_step, cfg.total_steps):
            budget.start()
            t_step = time.perf_counter()
            t0 = time.perf_counter()
            groups = await asyncio.gather(*[self.worker.play_group(step * groups_per_step + j)
                                            for j in range(groups_per_step)])
            gen_s = time.perf_counter() - t0
            now = time.time()
            for g in groups:
                self.buffer.add(g, self.learner.policy_version, now)
            shards, batch_metrics = self.buffer.next_batch(self.learner.policy_version, step, now)
            self.provenance.write(step + 1, self.learner.policy_version, self.buffer.last_groups, shards)
            t0 = time.perf_counter()
            learner_metrics = self.learner.train_step(shards[0])
            train_s = time.perf_counter() - t0
            sync_metrics = await self._publish()

            record: dict[str, Any] = {"learner/step": step + 1, "policy_version": self.learner.policy_version}
            trajs = [t for g in groups for t in g.trajectories]
            record.update(batch_metrics)
            record.update(rollout_metrics(self.buffer.last_groups))
            record.update(learner_metrics)
            step_s = time.perf_counter() - t_step
            record.update({
                **sync_metrics, "timing/gen_s": gen_s, "timing/train_s": train_s,
                "timing/step_s": step_s,
                "throughput/tokens_per_s": float(sum(t.num_tokens for t in trajs)) / max(step_s, 1e-9),
                "throughput/learner_tokens_per_s": learner_metrics.get("learner/num_tokens", 0.0) / max(train_s, 1e-9),
            })
            record["timing/budget_spent_s"] = budget.spent_s
            self.sink.log(record)
            done = step + 1
            budget.pause()
            final = budget.is_last_step(done, cfg.total_steps)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and not final:
                save_checkpoint(self.run_dir, self.learner, done)
            if cfg.validation.every and (done % cfg.validation.every == 0 or final):
                last = await self._validate_and_log(done)
            if final:
                break
        save_checkpoint(self.run_dir, self.learner, done)
        return last

    async def _validate_and_log(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = await validate_engine(self.cfg, self.engine, self.chat)
        metrics.update({"learner/step": step, "policy_version": self.learner.policy_version,
                        "timing/val_s": time.perf_counter() - t0})
        self.sink.log(metrics)
        return metrics

    def close(self) -> None:
        self.provenance.close()
        self.engine.shutdown()


def _apply_thread_settings(cfg: RunConfig) -> None:
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1) if cfg.runtime == "local" else cfg.learner.torch_threads)


def train(cfg: RunConfig | None = None, *, resume: Path | None = None) -> tuple[Path, dict[str, float]]:
    """Run training; returns the run directory and the last validation metrics."""
    if resume is not None:
        run_dir = RunDir(Path(resume))
        if not run_dir.config_path.is_file():
            raise FileNotFoundError(f"{resume} is not a run directory (no config.yaml)")
        cfg = load_config(run_dir.config_path)
    else:
        assert cfg is not None
        run_dir = RunDir.create(cfg)
    print(f"run directory: {run_dir.path}", flush=True)
    sink = make_sink(cfg, run_dir)
    exit_code = 1
    try:
        if cfg.runtime == "ray":
            from ragen_async.ray_runtime import RayTrainer

            trainer = RayTrainer(cfg, run_dir, sink)
        else:
            _apply_thread_settings(cfg)
            trainer = LocalTrainer(cfg, run_dir, sink)
        try:
            checkpoint = run_dir.latest_checkpoint() if resume is not None else None
            if checkpoint is not None:
                trainer.resume(checkpoint)
            last = asyncio.run(trainer.run())
        finally:
            trainer.close()
        exit_code = 0
        return run_dir.path, last
    finally:
        sink.close(exit_code)


def summarize_val(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("val/") and k.endswith("success")}


def mean_of(records: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in records if key in r and r[key] is not None]
    return float(np.mean(vals)) if vals else float("nan")
