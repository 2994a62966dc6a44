"""``ragen-async bench pipeline``: throughput of the asynchronous pipeline against staleness k.

Runs one config under ``runtime: ray`` for each k and reports groups/s, learner tokens/s, rollout
and learner idle fractions, mean staleness, throughput relative to k = 0, and the ideal overlap
bound ``(T_gen + T_train) / max(T_gen, T_train)`` computed from the k = 0 run's phase times (what
perfect overlap of generation and training could gain over running them one after the other).

That bound assumes generation and training do not slow each other down. When both sides share
the same cores it is meaningless, so every mode is run *pinned* (rollout actors and their engines
on one CPU set, learner ranks on a disjoint one, thread counts matched) and, for comparison,
*unpinned* (the same thread counts, no CPU sets). *config* keeps the config's own placement (CPU
sets and thread counts): what a run of that config gets, e.g. the study's k = 0 runs, whose two
sides take turns on both cores. Each run consumes groups in arrival order or in order
(``--consume``, ``staleness.consume``), and the table gives each run's share of generated groups dropped
beside its speed. A benchmark measures; nothing here asserts a speed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragen_async.config import RunConfig, load_config


@dataclass
class BenchRow:
    mode: str
    k: int | None
    """The staleness bound; ``None`` = unbounded."""
    groups_per_s: float
    learner_tokens_per_s: float
    rollout_idle: float
    learner_idle: float
    staleness_mean: float
    t_gen_s: float
    t_train_s: float
    steps: int
    wall_s: float
    consume: str = "arrival"
    """``staleness.consume`` of the run: ``arrival`` or ``in_order``."""
    dropped_share: float = float("nan")
    """Groups dropped / (consumed + dropped) over the measured steps."""


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "learner/step" in rec and "timing/step_s" in rec:
            rows.append(rec)
    return rows


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else float("nan")


def split_cpus(cpus: list[int]) -> tuple[list[int], list[int]]:
    """Disjoint CPU sets for the rollout side and the learner side (rollout gets the larger half:
    generation is the bottleneck of agent RL)."""
    if len(cpus) < 2:
        raise ValueError("pinning needs at least 2 CPUs (one per side)")
    half = (len(cpus) + 1) // 2
    return cpus[:half], cpus[half:]


def k_label(k: int | None) -> str:
    return "∞" if k is None else str(k)


MODES = ("pinned", "unpinned", "config")
"""Placements ``bench pipeline`` measures (module docstring)."""


def parse_mode(text: str) -> str:
    """A placement as the command line gives it: one of :data:`MODES`."""
    if text not in MODES:
        raise ValueError(f"--mode {text!r}: expected one of {', '.join(MODES)}")
    return text


CONSUME = ("arrival", "in_order")
"""Consumption modes ``bench pipeline`` measures (``staleness.consume``)."""


def parse_consume(text: str) -> str:
    """A consumption mode as the command line gives it: one of :data:`CONSUME`."""
    if text not in CONSUME:
        raise ValueError(f"--consume {text!r}: expected one of {', '.join(CONSUME)}")
    return text


def bench_config(base: RunConfig, k: int | None, mode: str, steps: int, cpus: list[int],
                 consume: str | None = None) -> RunConfig:
    """The config of one benchmark run: ``base`` at bound ``k`` in placement ``mode``, consuming in ``consume``
    order (``None``: the base config's own ``staleness.consume``)."""
    mode = parse_mode(mode)
    consume = parse_consume(consume if consume is not None else base.staleness.consume)
    data = base.model_dump()
    data.update(runtime="ray", total_steps=steps, name=f"bench-k{'inf' if k is None else k}-{mode}-{consume}")
    data["validation"]["every"] = 0
    data["staleness"] = {"max_staleness": k, "fixed_lag": False, "consume": consume}
    data["logging"]["console"] = False
    if mode != "config":
        rollout_cpus, learner_cpus = split_cpus(cpus)
        data["rollout"]["cpu_affinity"] = rollout_cpus if mode == "pinned" else None
        data["learner"]["cpu_affinity"] = learner_cpus if mode == "pinned" else None
        # Matched thread budgets in both modes, so pinning is the only difference.
        data["rollout"]["cpus_per_worker"] = float(len(rollout_cpus)) / data["rollout"]["num_workers"]
        data["rollout"]["engine_threads"] = None  # the engine's threads follow its CPUs, as the learner's do
        data["learner"]["torch_threads"] = max(1, len(learner_cpus) // data["learner"]["num_ranks"])
    return RunConfig.model_validate(data)


def run_one(cfg: RunConfig, mode: str, warmup_steps: int) -> BenchRow:
    from ragen_async.orchestrator import train

    t0 = time.perf_counter()
    run_dir, _ = train(cfg)
    wall = time.perf_counter() - t0
    rows = _read_metrics(Path(run_dir))
    measured = rows[warmup_steps:] or rows
    elapsed = sum(r["timing/step_s"] for r in measured)
    groups = cfg.rollout.groups_per_step * len(measured)
    dropped = sum(r.get("staleness/dropped_groups", 0.0) for r in measured)
    tokens = sum(r.get("learner/num_tokens", 0.0) for r in measured)
    return BenchRow(
        mode=mode,
        k=cfg.staleness.max_staleness,
        groups_per_s=groups / max(elapsed, 1e-9),
        learner_tokens_per_s=tokens / max(elapsed, 1e-9),
        rollout_idle=_mean(measured, "rollout/idle_frac"),
        learner_idle=_mean(measured, "learner/idle_frac"),
        staleness_mean=_mean(measured, "staleness/mean"),
        t_gen_s=_mean(measured, "timing/wait_batch_s"),
        t_train_s=_mean(measured, "timing/train_s") + _mean(measured, "weight_sync/time_s"),
        steps=len(measured),
        wall_s=wall,
        consume=cfg.staleness.consume,
        dropped_share=dropped / max(groups + dropped, 1e-9),
    )


def overlap_bound(k0: BenchRow) -> float:
    """(T_gen + T_train) / max(T_gen, T_train) from a k = 0 run, where the phases alternate."""
    return (k0.t_gen_s + k0.t_train_s) / max(k0.t_gen_s, k0.t_train_s, 1e-9)


def format_table(rows: list[BenchRow]) -> str:
    """One row per run: the placement (and ``in order`` for an in-order run), k, the rates, the share of
    generated groups dropped, and the speed relative to k = 0 of the same placement and consumption."""
    lines = ["| mode | k | groups/s | learner tok/s | rollout idle | learner idle | mean staleness | dropped | "
             "× k=0 | overlap bound (k=0) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for consume in CONSUME:
            mode_rows = [r for r in rows if r.mode == mode and r.consume == consume]
            base = next((r for r in mode_rows if r.k == 0), None)
            label = mode if consume == "arrival" else f"{mode}, in order"
            for r in mode_rows:
                ratio = r.groups_per_s / base.groups_per_s if base else float("nan")
                bound = f"{overlap_bound(base):.2f}" if base is not None and r.k == 0 else ""
                lines.append(f"| {label} | {k_label(r.k)} | {r.groups_per_s:.3f} | {r.learner_tokens_per_s:.0f} | "
                             f"{r.rollout_idle:.2f} | {r.learner_idle:.2f} | {r.staleness_mean:.2f} | "
                             f"{100 * r.dropped_share:.1f} % | {ratio:.2f} | {bound} |")
    return "\n".join(lines)


def bench_pipeline(config: Path, overrides: list[str], ks: list[int | None], steps: int, warmup_steps: int,
                   modes: list[str], consumes: tuple[str | None, ...] | list[str | None] = (None,)
                   ) -> tuple[list[BenchRow], str]:
    base = load_config(config, overrides)
    cpus = sorted(os.sched_getaffinity(0))
    configs = [(mode, bench_config(base, k, mode, steps, cpus, consume)) for mode in modes for consume in consumes
               for k in ks]
    rows = [run_one(cfg, mode, warmup_steps) for mode, cfg in configs]
    return rows, format_table(rows)
