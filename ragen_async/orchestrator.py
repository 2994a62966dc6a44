"""The orchestrator: the one training loop, for every runtime.

Setup wires the parts (config -> run directory, metrics sinks, runtime, trajectory buffer); then
:meth:`Trainer.run` drives them top to bottom, once per learner step::

    collect a batch (runtime.receive -> buffer: staleness gate, filter, shards; admission learns
    which groups were consumed or dropped) -> train (runtime.train: version v+1) -> publish
    (v+1, or v+1-k under fixed lag) and open admission for v+1 -> log -> checkpoint / validate
    (always version v+1; under fixed lag admission opens after it on the steps that validate)

The runtime (``runtime/local.py``: local, in one process; ``runtime/ray_runtime.py``: Ray actors, ZeroMQ,
gloo/NCCL) is the only thing that differs between ``runtime: local`` and ``runtime: ray``.
Validation, checkpoints, the time budget, resume and the weight-sync probe exist here, once.

A checkpoint holds the learner side (``runtime.save``; on Ray also ``runtime_state.json``, the runtime's
counters) plus ``driver_state.json`` (:meth:`Trainer.save`: step, version, weight syncs, admission state, the
early-warning signals, the adaptive bound, the time budget spent, the collapse watch, refused duplicates;
docs/architecture.md lists every key); ``--resume`` continues exactly from it: outstanding groups are replayed under their
own index and seed, and metrics/provenance records past the checkpoint are rewound. A run that fails
outside the learner's own work (a dead rollout actor or engine, a failed weight sync, validation) first
saves its last completed learner step (:meth:`Trainer.save_on_failure`), so it ends resumable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragen_async.config import RunConfig, load_saved_config
from ragen_async.learner.flops import tokens_per_s_per_gpu
from ragen_async.protocol import NO_VERSION
from ragen_async.records import reaper
from ragen_async.records.budget import TrainingBudget
from ragen_async.records.logfiles import keep_traceback, log_dir, loggers_to, one_line, output_to
from ragen_async.records.machine import describe_machine
from ragen_async.records.metrics import ConsoleSink, JsonlSink, MetricsSink, MultiSink, WandbSink, resolve_wandb_mode
from ragen_async.records.provenance import ProvenanceLog, rewind_jsonl
from ragen_async.records.rundir import (
    DRIVER_STATE,
    RunDir,
    finalize_checkpoint,
    refuse_relative,
    staging_path,
    unpack_run,
)
from ragen_async.rollout.worker import rollout_metrics
from ragen_async.runtime import Runtime
from ragen_async.runtime.engine_pool import EnginePool
from ragen_async.staleness.bound import StalenessBound
from ragen_async.staleness.buffer import Batch, TrajectoryBuffer
from ragen_async.staleness.collapse import SIGNALS, CollapseWatch, EarlyWarning, stale_tokens
from ragen_async.weight_sync.probe import check_probe
from ragen_async.weight_sync.verify import check_served, checks_due, needed_digests

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals that end a run gracefully: the current step finishes, a checkpoint is written, the run stops
(SLURM's time-limit warning, a preemption notice, ``scancel --signal``)."""


@dataclass(frozen=True)
class StepOutcome:
    """What one pass of the loop saw, for its ``metrics.jsonl`` record (:meth:`Trainer.record`)."""

    step: int
    """The learner steps done, this one included."""
    batch: Batch
    learner: dict[str, float]
    """The learner's merged metrics (``TrainResult.metrics``)."""
    sync: dict[str, float]
    """The weight sync's metrics (:meth:`Trainer.publish`)."""
    rollout_before: list[dict[str, float]]
    """Per producer, cumulative (``Runtime.rollout_stats``), at the previous step's end ..."""
    rollout_after: list[dict[str, float]]
    """... and at this step's end."""
    admission: dict[str, Any]
    """The admission gate's state at the step's end."""
    wait_s: float
    """Waiting for the batch."""
    train_s: float
    step_s: float
    budget_s: float
    """Training time spent so far (``TrainingBudget.spent_s``)."""


class Interrupted(Exception):
    """The run stopped early on a stop signal, after writing the checkpoint it resumes from."""

    def __init__(self, run_dir: Path, step: int, signal_name: str):
        super().__init__(f"stopped by {signal_name} after step {step}, checkpoint written; "
                         f"continue with: ragen-async train --resume {run_dir}")
        self.run_dir, self.step = run_dir, step


def probe_ids(vocab_size: int, n: int = 48) -> list[int]:
    """The fixed token sequence every weight-sync check compares log-probs on."""
    return np.random.default_rng(0).integers(0, vocab_size, size=n).tolist()


def make_sink(cfg: RunConfig, run_dir: RunDir, skip_wandb_until: int = -1) -> MetricsSink:
    sinks: list[MetricsSink] = [JsonlSink(run_dir.metrics_path, run_dir.episodes_path)]
    mode = resolve_wandb_mode(cfg.logging.wandb_mode)
    if mode != "disabled":
        state = run_dir.read_state()
        wandb_sink = WandbSink(run_dir.path, cfg.model_dump(mode="json"), mode, cfg.logging.wandb_project,
                               cfg.logging.wandb_entity, run_dir.path.name, resume_id=state.get("wandb_id"),
                               skip_until_step=skip_wandb_until, group=cfg.logging.wandb_group,
                               tags=cfg.logging.wandb_tags)
        run_dir.write_state(**{**state, "wandb_id": wandb_sink.run_id})
        sinks.append(wandb_sink)
    if cfg.logging.console:
        sinks.append(ConsoleSink())
    return MultiSink(sinks)


def make_buffer(cfg: RunConfig, bound: StalenessBound) -> TrajectoryBuffer:
    """The run's trajectory buffer, asking ``bound`` (the run's one bound) for each group's."""
    return TrajectoryBuffer(
        groups_per_step=cfg.rollout.groups_per_step, filter_mode=cfg.algo.filter_mode,
        filter_ratio=cfg.algo.filter_ratio, norm_mode=cfg.algo.grpo_norm,
        num_ranks=cfg.learner.num_ranks if cfg.runtime == "ray" else 1, group_size=cfg.rollout.group_size,
        consume=cfg.staleness.consume, bound=bound)


def make_runtime(cfg: RunConfig, log_dir: Path | None = None, pool: EnginePool | None = None,
                 run_dir_given: tuple[str | Path, str] | None = None) -> Runtime:
    """The configured runtime; engine and worker output goes to files in ``log_dir`` (None: the console).
    ``pool``: warm rollout actors the Ray runtime takes and gives back (the local runtime ignores it).
    ``run_dir_given``: the run directory as the user gave it and how (``run_root``, ``--run-dir``,
    ``--resume``); the Ray runtime refuses a relative one once it sees a cluster of several nodes."""
    if cfg.runtime == "ray":
        from ragen_async.runtime.ray_runtime import RayRuntime

        return RayRuntime(cfg, log_dir, pool, run_dir_given=run_dir_given)
    import torch

    from ragen_async.runtime import LocalRuntime

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    engine_log = None if log_dir is None else log_dir / "engine.log"
    with output_to(engine_log):  # the engine core process starts here and keeps the file
        runtime = LocalRuntime(cfg)
    loggers_to(engine_log)
    if engine_log is not None:  # checkpoints are written in this process: no "Writing model shards" bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return runtime


class StopRequest:
    """Set from a signal handler; the loop checks it after every step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        print(f"{self.signal_name} received: stopping after the current step, with a checkpoint", flush=True)

    def install(self) -> dict[int, Any]:
        """Handle :data:`STOP_SIGNALS` (main thread only); returns the previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self) for s in STOP_SIGNALS}


def checkpoint_ranks(runtime: Runtime) -> int:
    """How many learner ranks' files a checkpoint of ``runtime`` must hold, from the config, never from the
    files present: the local runtime's one learner, the Ray runtime's ``learner.num_ranks``; 0 for a
    runtime with no learner (the simulated cluster, tests' stand-ins)."""
    from ragen_async.runtime import LocalRuntime

    return 1 if isinstance(runtime, LocalRuntime) else int(getattr(runtime, "checkpoint_ranks", 0))


class Trainer:
    """Owns one run: the loop, the buffer, provenance, checkpoints; the runtime does the placing."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, sink: MetricsSink, runtime: Runtime,
                 stop: StopRequest | None = None):
        self.cfg, self.run_dir, self.sink, self.runtime = cfg, run_dir, sink, runtime
        self.stop = stop or StopRequest()
        self.bound = StalenessBound.from_config(cfg.staleness)
        """The run's staleness bound, the one object that holds it (with the adaptive controller, if any)."""
        self.buffer = make_buffer(cfg, self.bound)
        self.provenance = ProvenanceLog(run_dir.path / "provenance.jsonl" if cfg.record_provenance else None)
        self.start_step = 0
        self.version = 0
        self.syncs = 0
        self.received: set[int] = set()
        """Every group index this process has taken from the runtime (a second copy is refused)."""
        self.duplicates = 0
        self._drops: list[dict] = []
        self.collapse_watch = CollapseWatch()
        """Validation success against its peak (``alert/collapse`` and a sink alert when it falls)."""
        self.budget = TrainingBudget(cfg.time_budget_minutes)
        """Training time spent (validation excluded) against ``time_budget_minutes``; kept by checkpoints."""
        self.warnings = EarlyWarning()
        """The early-warning signals, step by step (``warning/<signal>``)."""
        self._tokenizer: Any = None
        """Loaded on the first ``log_episodes``."""
        self.completed = 0
        """The last learner step whose update the learner holds (what a failure saves)."""
        self.saved_step: int | None = None
        """The step of the latest checkpoint of this run (written or resumed from)."""
        self._learner_busy = False
        """True while the learner trains or a checkpoint is written: a failure there is not followed by a save."""

    # ------------------------------------------------------------------ the loop
    async def run(self) -> dict[str, float]:
        """The loop; an error that ends it first saves the last completed step (:meth:`save_on_failure`)."""
        self.completed = self.start_step
        try:
            return await self._run()
        except Interrupted:
            raise
        except Exception as e:
            await self.save_on_failure(e)
            raise

    async def _run(self) -> dict[str, float]:
        cfg, rt = self.cfg, self.runtime
        last_val: dict[str, float] = {}
        if self.version > 0:
            await self.publish()
        # Step 0's validation, or on a resume the validation of the checkpoint's step if it is due there and the run
        # stopped before it (a stop signal on a validation step saves the step, then stops before validating).
        if cfg.validation.every and (self.start_step == 0 or (self.start_step % cfg.validation.every == 0
                                                              and not self.validated(self.start_step))):
            last_val = await self.validate(self.start_step)
        await rt.start()
        prev_stats = await rt.rollout_stats()
        budget = self.budget
        done = self.start_step
        for step in range(self.start_step, cfg.total_steps):
            budget.start()
            t_step = time.perf_counter()
            batch = await self.collect(step)
            wait_s = time.perf_counter() - t_step
            # Under fixed lag the next batch's weights (v + 1 - k, k >= 1) are already in the ring: the engines
            # take them and admission opens the next version before this step trains, so the next batch plays
            # while this one trains. Validation lends the engines the current weights (validate): before a step
            # that validates, no group of the next version may start on them, so admission opens after it.
            hold = self.published_version(self.version + 1) != self.version + 1 and self.validates_at(step + 1)
            ahead = bool(cfg.staleness.fixed_lag and cfg.staleness.max_staleness) and not hold
            sync = await self.publish(version=self.version + 1) if ahead else {}
            t0 = time.perf_counter()
            self._learner_busy = True
            result = await rt.train(batch.shards)
            if ahead and result.version != self.version + 1:  # (the learner still busy: nothing is saved)
                raise RuntimeError(f"the learner went from version {self.version} to {result.version} in one step; "
                                   "fixed lag published the next batch's weights for one version more")
            self._learner_busy = False
            train_s = time.perf_counter() - t0
            self.version, self.completed = result.version, step + 1
            if not ahead:
                sync = await self.publish(open_admission=not hold)
            stats = await rt.rollout_stats()
            step_s = time.perf_counter() - t_step
            record = self.record(StepOutcome(
                step=step + 1, batch=batch, learner=result.metrics, sync=sync, rollout_before=prev_stats,
                rollout_after=stats, admission=await rt.admission.state(), wait_s=wait_s, train_s=train_s,
                step_s=step_s, budget_s=budget.spent_s))
            await self.adapt(record)
            self.sink.log(record)
            self.log_episodes(step + 1, batch)
            prev_stats, done = stats, step + 1
            budget.pause()  # producers keep playing during validation; only learner time is charged
            reason = budget.end_reason(done, cfg.total_steps)
            final = reason is not None
            if final:
                print(reason, flush=True)
                log.info(reason)
            stopping = self.stop.signal_name is not None and not final
            if stopping or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and not final):
                await self.save(done)
            if stopping:
                raise Interrupted(self.run_dir.path, done, self.stop.signal_name)
            if cfg.validation.every and (done % cfg.validation.every == 0 or final):
                last_val = await self.validate(done)
            if hold:
                await rt.admission.set_published_version(self.version)
            if final:
                break
        await self.save(done)
        return last_val

    # ------------------------------------------------------------------ the loop's parts
    async def collect(self, step: int) -> Batch:
        """Receive groups until the buffer can assemble this step's batch; report every drop once."""
        while not self.buffer.ready(self.version, time.time()):
            group = await self.runtime.receive(0.2)
            if group is not None and group.index in self.received:
                # A second copy (a replayed frame): training on it twice, or failing on it, is not an option.
                self.duplicates += 1
                log.warning("group %d received twice; the copy is ignored", group.index)
            elif group is not None:
                self.received.add(group.index)
                self.buffer.add(group, self.version, time.time())
            await self._report(consumed=[])
        batch = self.buffer.next_batch(self.version, step, time.time())
        await self._report(consumed=batch.indices)
        bounds = self.bound.consumed(g.index for g in batch.groups)
        self.provenance.write(step + 1, self.version, batch.groups, batch.shards, self._drops, bounds)
        self._drops = []
        return batch

    async def _report(self, consumed: list[int]) -> None:
        drops = self.buffer.drain_drops()
        self._drops += [d.as_record() for d in drops]
        if consumed or drops:
            await self.runtime.admission.resolve(consumed, [d.index for d in drops])

    async def adapt(self, record: dict[str, Any]) -> None:
        """This step's early warnings (``warning/<signal>`` in ``record``); under adaptive staleness they, or with
        ``staleness.kl_target`` the stale tokens' KL, set the bound for the next steps, at admission and in the
        buffer together (``StalenessBound.decide`` and ``move``), and the record says whether it moved."""
        record.update(stale_tokens(record))
        fired = self.warnings.update(record)
        record.update({f"warning/{s}": float(s in fired) for s in SIGNALS})
        move = self.bound.decide(record, fired & set(self.cfg.staleness.adaptive_signals))
        if move is not None:
            line = move.line(record.get("learner/step"))
            print(line, flush=True)  # the run's console, with its step lines
            log.info(line)
            await self.bound.move(move.after, self.runtime.admission)

    def log_episodes(self, step: int, batch: Batch) -> None:
        """Every ``logging.episodes_every`` steps, a few of the batch's episodes as text."""
        every, n = self.cfg.logging.episodes_every, self.cfg.logging.episodes_per_log
        if not every or step % every:
            return
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        rows = []
        for group in sorted(batch.groups, key=lambda g: g.index)[:n]:
            traj = group.trajectories[0]
            rows.append({"env_tag": traj.env_tag, "seed": traj.seed, "group_index": group.index,
                         "score": traj.score, "success": traj.success,
                         "staleness": None if traj.oldest_version == NO_VERSION else self.version - 1 - traj.oldest_version,
                         "text": self._tokenizer.decode(traj.token_ids.tolist())})
        self.sink.log_episodes(step, rows)

    def published_version(self, version: int | None = None) -> int:
        """What the engines serve at learner version v (default: the current one): v, or v - k under fixed lag."""
        version = self.version if version is None else version
        if self.cfg.staleness.fixed_lag:
            return max(0, version - (self.cfg.staleness.max_staleness or 0))
        return version

    async def publish(self, open_admission: bool = True, version: int | None = None) -> dict[str, float]:
        """Weights to every engine for learner version ``version`` (default: the current one), the checks due at
        this sync, then admission opens the slots of that version (unless ``open_admission`` is False: the caller
        opens them later). A check that fails leaves admission where it was, so the state a failure saves is that
        of the last completed step."""
        version = self.version if version is None else version
        target = self.published_version(version)
        t0 = time.perf_counter()
        await self.runtime.publish(target)
        out = {"weight_sync/time_s": time.perf_counter() - t0, "weight_sync/published_version": float(target)}
        self.syncs += 1
        ws = self.cfg.weight_sync
        check, probe = checks_due(self.syncs, verify_first=ws.verify_first, verify_every=ws.verify_every,
                                  probe=ws.probe)
        if check:  # under fixed lag: the older version sent
            out.update(await self.verify_weights(target))
        if probe:
            learner_lp, engine_lps = await self.runtime.probe(probe_ids(self.runtime.vocab_size), target)
            # Above the dtype's tolerance an engine samples from other weights than the learner's: stop.
            out["weight_sync/probe_max_abs_diff"] = check_probe(learner_lp, engine_lps, version=target,
                                                                dtype=self.cfg.model.dtype)
        if open_admission:
            await self.runtime.admission.set_published_version(version)
        return out

    async def verify_weights(self, version: int) -> dict[str, float]:
        """The byte-exact weight check: every engine's served tensors against learner rank 0's digests of
        ``version`` (``weight_sync/verify.py``); raises ``WeightSyncMismatch`` naming engine, tensor, version."""
        t0 = time.perf_counter()
        served = await self.runtime.served_weights()
        expected = await self.runtime.published_digests(version, needed_digests(entries for _, entries in served))
        checked = check_served(expected, served, version=version)
        return {"weight_sync/verify_s": time.perf_counter() - t0, "weight_sync/verified_tensors": float(checked)}

    def record(self, o: StepOutcome) -> dict[str, Any]:
        """The step's ``metrics.jsonl`` record."""
        pairs = list(zip(o.rollout_before, o.rollout_after, strict=True))
        busy = [c["busy_s"] - p["busy_s"] for p, c in pairs]
        wait = [c["admission_wait_s"] - p["admission_wait_s"] for p, c in pairs]
        n_tokens = sum(t.num_tokens for g in o.batch.groups for t in g.trajectories)
        step_s, train_s, learner_metrics, admission = o.step_s, o.train_s, o.learner, o.admission
        return {
            "learner/step": o.step, "policy_version": self.version,
            **o.batch.metrics, **rollout_metrics(o.batch.groups), **learner_metrics, **o.sync,
            "rollout/idle_frac": float(np.mean([min(1.0, max(0.0, 1 - b / max(step_s, 1e-9))) for b in busy])),
            "learner/idle_frac": max(0.0, 1 - train_s / max(step_s, 1e-9)),
            "staleness/admission_wait_s": float(np.mean(wait)),
            "staleness/admission_refusals": float(admission["refusals"]),
            "staleness/max_staleness": math.nan if self.bound.current is None else float(self.bound.current),
            "staleness/groups_outstanding": float(len(admission["outstanding"])),
            "transport/duplicate_groups": float(self.duplicates),
            "rollout/engine_versions_min": min(s["policy_version"] for s in o.rollout_after),
            "timing/step_s": step_s, "timing/wait_batch_s": o.wait_s, "timing/train_s": train_s,
            "timing/budget_spent_s": o.budget_s,
            "throughput/tokens_per_s": n_tokens / max(step_s, 1e-9),
            "throughput/groups_per_s": len(o.batch.groups) / max(step_s, 1e-9),
            "throughput/learner_tokens_per_s": learner_metrics.get("learner/num_tokens", 0.0) / max(train_s, 1e-9),
            "throughput/tokens_per_s_per_gpu": tokens_per_s_per_gpu(n_tokens, step_s, self.cfg.learner.num_ranks),
        }

    def validated(self, step: int) -> bool:
        """Whether the run's metrics hold the validation of learner step ``step``."""
        path = self.run_dir.metrics_path
        lines = path.read_text().splitlines() if path.exists() else []
        return any(record.get("learner/step") == step and "val/success" in record
                   for record in map(json.loads, filter(str.strip, lines)))

    def validates_at(self, done: int) -> bool:
        """Whether the loop validates after ``done`` steps whatever the time budget says (it also validates
        the step a time budget ends the run on)."""
        every = self.cfg.validation.every
        return bool(every) and (done % every == 0 or done >= self.cfg.total_steps)

    async def validate(self, step: int) -> dict[str, float]:
        """Validation episodes of the learner's current policy (``val/policy_version`` = ``policy_version``),
        in every mode: the trained policy is what validation measures (the behaviour policy's success is
        ``rollout/success``). Under fixed lag the engines serve version v - k: they get the current weights
        for the validation and the lagged ones back after it. The loop opens admission for the next version
        only after that, so no group it trains on is played on the lent weights (a run that a time budget
        ends off the validation interval is the exception: it trains on nothing after)."""
        t0 = time.perf_counter()
        lagged = self.published_version()
        if lagged != self.version:
            await self.runtime.publish(self.version)
        metrics = await self.runtime.validate()
        if lagged != self.version:
            await self.runtime.publish(lagged)
        metrics.update({"learner/step": step, "policy_version": self.version, "timing/val_s": time.perf_counter() - t0})
        success = metrics.get("val/success", math.nan)
        metrics["alert/collapse"] = float(self.collapse_watch.update(success))
        self.sink.log(metrics)
        if metrics["alert/collapse"]:
            self.sink.alert("Collapse", f"{self.run_dir.path.name}: validation success {success:.3f} at step {step} "
                            f"is below half its peak {self.collapse_watch.peak:.3f} for "
                            f"{self.collapse_watch.min_points} validations in a row")
        return metrics

    # ------------------------------------------------------------------ checkpoints
    async def save(self, step: int) -> Path:
        """Learner side (runtime) + driver state, written to a staging directory, then renamed (atomic) once
        every learner rank's files are there."""
        self._learner_busy = True  # a save that fails is not tried again by save_on_failure
        path = staging_path(self.run_dir, step)
        await self.runtime.save(path, step)
        state = {"step": step, "version": self.version, "syncs": self.syncs,
                 "admission": await self.runtime.admission.state(), "early_warning": self.warnings.state(),
                 **self.bound.state(),
                 "budget": self.budget.state(), "collapse_watch": self.collapse_watch.state(),
                 "duplicate_groups": self.duplicates}
        (path / DRIVER_STATE).write_text(json.dumps(state))
        final = finalize_checkpoint(self.run_dir, path, step, learner_ranks=checkpoint_ranks(self.runtime))
        self.saved_step, self._learner_busy = step, False
        return final

    async def save_on_failure(self, error: Exception) -> None:
        """The run is ending on ``error``. Unless it came from the learner's own work (a step or a save under
        way, or a dead learner rank), the learner's state is that of the last completed step, consistent
        between steps: save it (unless the latest checkpoint already holds it), bounded by
        ``learner.group_timeout_s``, and say in one line (logged, and noted on the error) where the
        checkpoint is and how to continue. A rollout actor or engine that dies on the NCCL path (which
        cannot replace it), a weight sync or validation that fails, all end here. After a failed weight
        sync the learner holds the step just trained, whose metrics record was not yet written: the resumed
        run continues after it, without that one record."""
        if self._learner_busy or getattr(self.runtime, "learners_broken", False):
            return
        step, resume = self.completed, f"ragen-async train --resume {self.run_dir.path}"
        if step in (self.start_step, self.saved_step):
            held = f"checkpoint step_{step:06d}" if self.saved_step == step else "no checkpoint: it starts over"
            line = f"run failed at learner step {step}, nothing new to save ({held}); continue with: {resume}"
        else:
            try:
                path = await asyncio.wait_for(self.save(step), self.cfg.learner.group_timeout_s)
                line = f"run failed after learner step {step}: checkpoint written to {path}; continue with: {resume}"
            except Exception as save_error:  # noqa: BLE001 - the run's own error is the one to raise
                why = one_line(save_error) if str(save_error) else \
                    f"no answer within learner.group_timeout_s={self.cfg.learner.group_timeout_s:g} s"
                line = f"run failed after learner step {step}, and saving that step failed too: {why}"
        log.error(line)
        error.add_note(line)

    async def resume(self, checkpoint: Path) -> None:
        state = json.loads((checkpoint / DRIVER_STATE).read_text())
        self.version = await self.runtime.load(checkpoint)
        if self.version != state["version"]:
            raise RuntimeError(f"{checkpoint}: learner is at version {self.version}, driver state says "
                               f"{state['version']}")
        self.start_step, self.syncs = int(state["step"]), int(state["syncs"])
        self.completed = self.saved_step = self.start_step
        await self.runtime.admission.restore(state["admission"])
        if self.buffer.consume == "in_order":  # the head of the line: the lowest index not yet resolved
            self.buffer.restore(int(state["admission"]["next_index"]), state["admission"]["outstanding"])
        if "early_warning" in state:
            self.warnings.restore(state["early_warning"])
        if "budget" in state:  # (older checkpoints lack these: keep their defaults)
            self.budget.restore(state["budget"])
            self.collapse_watch.restore(state["collapse_watch"])
            self.duplicates = int(state["duplicate_groups"])
        await self.bound.restore(state, self.runtime.admission)
        log.info("resumed from %s at step %d (policy version %d, %d groups to replay)", checkpoint,
                 self.start_step, self.version, len(state["admission"]["outstanding"]))

    def close(self) -> None:
        self.provenance.close()


def train(cfg: RunConfig | None = None, *, resume: Path | None = None, runtime: Runtime | None = None,
          run_dir_path: Path | None = None, pool: EnginePool | None = None) -> tuple[Path, dict[str, float]]:
    """Run training (or continue the run directory ``resume``); returns the run directory and the last
    validation metrics. ``run_dir_path``: the new run's directory (default ``RUN_ROOT/NAME-TIMESTAMP``).
    ``runtime`` overrides the configured one (tests); ``pool`` keeps rollout actors warm between runs (a
    sweep's). SIGTERM or SIGUSR1 stops the run after the current step with a checkpoint and raises
    :class:`Interrupted`."""
    checkpoint, skip_wandb_until = None, -1
    if resume is not None:
        run_dir = RunDir(Path(resume))
        if not run_dir.config_path.is_file():
            raise FileNotFoundError(f"{resume} is not a run directory (no config.yaml)")
        cfg = load_saved_config(run_dir.config_path)
        given: tuple[str | Path, str] = (resume, "--resume")
        _refuse_relative_on_multi_node(cfg, given)
        checkpoint = run_dir.latest_checkpoint()
        # Without a checkpoint (stopped before its first one, or weights not kept) the run starts over.
        step = -1 if checkpoint is None else int(json.loads((checkpoint / DRIVER_STATE).read_text())["step"])
        if checkpoint is None:
            print(f"{resume} has no checkpoint: training it from the start", flush=True)
        unpack_run(run_dir.path)  # a packed run (ragen-async pack) appends to its plain records again
        # Records past the checkpoint belong to steps that will run again: rewind them. W&B cannot
        # rewind offline, so it skips the steps it already has (no duplicate points).
        skip_wandb_until = rewind_jsonl(run_dir.metrics_path, step, key="learner/step")
        rewind_jsonl(run_dir.episodes_path, step, key="learner/step")
        if checkpoint is None:  # (with a checkpoint, run_trainer rewinds provenance to it)
            rewind_jsonl(run_dir.path / "provenance.jsonl", step, key="step")
    else:
        assert cfg is not None
        given = (run_dir_path, "--run-dir") if run_dir_path is not None else (cfg.run_root, "run_root")
        _refuse_relative_on_multi_node(cfg, given)
        run_dir = RunDir.create(cfg, run_dir_path)
    print(f"run directory: {run_dir.path}", flush=True)
    state = run_dir.read_state()
    run_dir.write_state(**{**state, "machines": [*state.get("machines", []), describe_machine(
        0 if checkpoint is None else step)]})
    if (uncorrected := cfg.uncorrected_staleness()) is not None:
        print(uncorrected, flush=True)
    logs = log_dir(run_dir.path)
    if logs is not None:
        print(f"engine and worker logs: {logs}/ (--verbose shows them here)", flush=True)
    sink = make_sink(cfg, run_dir, skip_wandb_until)
    exit_code = 1
    watchdog = reaper.start()  # if this process is killed, nothing it started keeps running
    stop = StopRequest()
    previous = stop.install()  # before the runtime: a stop during its start-up (engines, actors) counts too
    try:
        runtime = runtime if runtime is not None else make_runtime(cfg, logs, pool, given)
        last = run_trainer(cfg, run_dir, sink, runtime, checkpoint, stop=stop)
        exit_code = 0
        return run_dir.path, last
    except Exception as e:
        if logs is not None and not isinstance(e, Interrupted):
            keep_traceback(e, logs / "driver.log")
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sink.close(exit_code)
        reaper.stop(watchdog)


def _refuse_relative_on_multi_node(cfg: RunConfig, given: tuple[str | Path, str]) -> None:
    """Before anything is written: a Ray run whose directory is relative, on an allocation of several nodes
    (SLURM's, or a Ray cluster this process is already connected to), is refused. A cluster reached
    through ``RAY_ADDRESS`` is counted once the runtime connects (``RayRuntime``)."""
    if cfg.runtime == "ray":
        from ragen_async.runtime.ray_runtime import multi_node

        refuse_relative(*given, multi_node())


def run_trainer(cfg: RunConfig, run_dir: RunDir, sink: MetricsSink, runtime: Runtime,
                checkpoint: Path | None = None, stop: StopRequest | None = None) -> dict[str, float]:
    """Build the trainer on ``runtime``, resume from ``checkpoint`` if given, run; always closes both."""
    if checkpoint is not None:  # provenance past the checkpoint describes steps that will run again
        step = int(json.loads((checkpoint / DRIVER_STATE).read_text())["step"])
        rewind_jsonl(run_dir.path / "provenance.jsonl", step, key="step")
    trainer = Trainer(cfg, run_dir, sink, runtime, stop)
    try:
        async def main() -> dict[str, float]:
            if checkpoint is not None:
                await trainer.resume(checkpoint)
            return await trainer.run()

        return asyncio.run(main())
    finally:
        trainer.close()
        runtime.close()


def summarize_val(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("val/") and k.endswith("success")}
