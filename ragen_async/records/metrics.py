"""Metrics: one sink per run that writes ``metrics.jsonl``, W&B and a live terminal line.

Every learner step produces one flat record (``{"learner/step": 3, "rollout/success": 0.5, ...}``).
The jsonl file is the source of truth (one JSON object per line, flushed each step, so a crashed run
is still readable); W&B gets the same record, online when a key is configured, offline otherwise,
disabled under ``WANDB_MODE=disabled`` (tests). Only the orchestrator owns a sink; other processes
return their numbers to it.
"""

from __future__ import annotations

import json
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

RENAMED = {"staleness/bound": "staleness/max_staleness"}
"""Old metric names and their names now; readers of ``metrics.jsonl`` apply them (:func:`current_names`)."""


def current_names(record: dict[str, Any]) -> dict[str, Any]:
    """A ``metrics.jsonl`` record with its keys under their current names (a run logged before a rename)."""
    if not RENAMED.keys() & record.keys():
        return record
    return {RENAMED.get(key, key): value for key, value in record.items()}


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class MetricsSink(ABC):
    @abstractmethod
    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self, exit_code: int = 0) -> None:  # noqa: B027 - optional hook
        pass

    def alert(self, title: str, text: str) -> None:  # noqa: B027 - optional hook
        """Tell a person watching the run (W&B alert when online, a red line in the terminal)."""

    def log_episodes(self, step: int, rows: list[dict[str, Any]]) -> None:  # noqa: B027 - optional hook
        """Sampled episodes of learner step ``step`` (``EPISODE_COLUMNS`` each)."""


EPISODE_COLUMNS = ("env_tag", "seed", "group_index", "score", "success", "staleness", "text")
"""What a sampled episode row holds (``logging.episodes_every``)."""


class MemorySink(MetricsSink):
    """Keeps records and alerts in memory (tests)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.alerts: list[tuple[str, str]] = []
        self.episodes: list[dict[str, Any]] = []

    def log(self, record):
        self.records.append({k: _clean(v) for k, v in record.items()})

    def alert(self, title: str, text: str) -> None:
        self.alerts.append((title, text))

    def log_episodes(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.episodes += [{"learner/step": step, **row} for row in rows]


class JsonlSink(MetricsSink):
    """``metrics.jsonl``, and the sampled episodes in ``episodes_path`` (one JSON object per episode)."""

    def __init__(self, path: Path, episodes_path: Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", buffering=1)
        self.episodes_path = episodes_path

    def log(self, record):
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def log_episodes(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self.episodes_path is not None:
            with Path(self.episodes_path).open("a") as f:
                f.writelines(json.dumps({"learner/step": step, **{k: _clean(v) for k, v in row.items()}}) + "\n"
                             for row in rows)

    def close(self, exit_code: int = 0):
        self._f.close()


def resolve_wandb_mode(configured: str) -> str:
    """``WANDB_MODE`` wins; ``auto`` = online only when an API key is available."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    if configured != "auto":
        return configured
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file() and \
        "api.wandb.ai" in (Path.home() / ".netrc").read_text(errors="ignore")
    return "online" if has_key else "offline"


def staleness_histogram(record: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(counts, bin edges)`` from a step's ``staleness/token_hist/{i}`` counters (bin i = tokens i versions
    old; the ``overflow`` bin, if any, is drawn as one more bin), or ``None`` if the record has none."""
    prefix = "staleness/token_hist/"
    bins = {k.removeprefix(prefix): v for k, v in record.items() if k.startswith(prefix) and v is not None}
    if not bins:
        return None
    counts = [float(bins[str(i)]) for i in range(len(bins)) if str(i) in bins]
    if "overflow" in bins:
        counts.append(float(bins["overflow"]))
    return np.asarray(counts), np.arange(len(counts) + 1, dtype=float) - 0.5


SUMMARY_BEST = {"val/success": ("val/success_best", max), "actor/entropy": ("actor/entropy_min", min)}
"""Run summary entries kept over the whole run: the best validation success and the lowest entropy."""


class WandbSink(MetricsSink):
    """A W&B run plotted against ``learner/step``. After a resume, records whose ``learner/step`` is at
    most ``skip_until_step`` (points the run already has from before the interruption) are not sent
    again, so no step appears twice. Each step's token staleness is also logged as a W&B histogram
    (``staleness/token_histogram``), and the summary keeps :data:`SUMMARY_BEST`."""

    def __init__(self, run_dir: Path, config: dict[str, Any], mode: str, project: str, entity: str | None,
                 name: str, resume_id: str | None = None, skip_until_step: int = -1, group: str | None = None,
                 tags: list[str] | tuple[str, ...] = ()):
        import wandb

        self._wandb = wandb
        self.mode = mode
        self.skip_until_step = skip_until_step
        self._best: dict[str, float] = {}
        self.run = wandb.init(project=project, entity=entity, name=name, config=config, mode=mode,
                              dir=str(run_dir), id=resume_id, resume="allow" if resume_id else None,
                              group=group, tags=list(tags) or None, job_type="train")
        for name, _ in SUMMARY_BEST.values():  # a resumed run keeps the best it had
            try:
                self._best[name] = float(self.run.summary[name])
            except (KeyError, TypeError, ValueError):
                pass
        if mode != "disabled":
            # Async RL has several clocks; plot everything against the learner step by default.
            self.run.define_metric("learner/step")
            self.run.define_metric("*", step_metric="learner/step")

    @property
    def run_id(self) -> str | None:
        return getattr(self.run, "id", None)

    def log(self, record):
        if record.get("learner/step", self.skip_until_step + 1) <= self.skip_until_step:
            return
        data = {k: _clean(v) for k, v in record.items() if _clean(v) is not None}
        hist = staleness_histogram(data)
        if hist is not None:
            data["staleness/token_histogram"] = self._wandb.Histogram(np_histogram=hist)
        self.run.log(data)
        for key, (name, better) in SUMMARY_BEST.items():
            if key in data:
                self._best[name] = better(self._best.get(name, data[key]), data[key])
                self.run.summary[name] = self._best[name]

    def close(self, exit_code: int = 0):
        self.run.finish(exit_code=exit_code)

    def log_episodes(self, step: int, rows: list[dict[str, Any]]) -> None:
        if step <= self.skip_until_step or not rows:
            return
        table = self._wandb.Table(columns=list(EPISODE_COLUMNS),
                                  data=[[_clean(row[c]) for c in EPISODE_COLUMNS] for row in rows])
        self.run.log({"learner/step": step, "episodes": table})

    def alert(self, title: str, text: str) -> None:
        if self.mode == "online":  # offline and disabled runs have no one to notify
            self.run.alert(title=title, text=text, level=self._wandb.AlertLevel.WARN)


class ConsoleSink(MetricsSink):
    """One compact line per step: the numbers a researcher watches for collapse."""

    FIELDS = (
        ("learner/step", "step", "{:d}"),
        ("rollout/success", "succ", "{:.3f}"),
        ("rollout/reward_mean", "rew", "{:+.3f}"),
        ("rollout/in_group_reward_std", "std", "{:.3f}"),
        ("actor/entropy", "ent", "{:.3f}"),
        ("actor/grad_norm", "gnorm", "{:.3f}"),
        ("staleness/mean", "stale", "{:.2f}"),
        ("throughput/tokens_per_s", "tok/s", "{:.0f}"),
        ("timing/step_s", "s", "{:.1f}"),
    )

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)

    def log(self, record):
        parts = []
        for key, label, fmt in self.FIELDS:
            if key in record and record[key] is not None:
                value = _clean(record[key])
                parts.append(f"{label} " + (fmt.format(int(value)) if fmt.endswith("d}") else fmt.format(value)))
        val = [f"{k.removeprefix('val/')} {_clean(v):.3f}" for k, v in record.items()
               if k.startswith("val/") and k.endswith("/success")]
        if val:
            parts.append("[bold green]val[/] " + " ".join(val))
        self.console.print(" | ".join(parts), highlight=False, soft_wrap=True)

    def alert(self, title: str, text: str) -> None:
        self.console.print(f"[bold red]{title}[/]: {text}", highlight=False, soft_wrap=True)


class MultiSink(MetricsSink):
    def __init__(self, sinks: list[MetricsSink]):
        self.sinks = sinks

    def log(self, record):
        for s in self.sinks:
            s.log(record)

    def close(self, exit_code: int = 0):
        for s in self.sinks:
            s.close(exit_code)

    def alert(self, title: str, text: str) -> None:
        for s in self.sinks:
            s.alert(title, text)

    def log_episodes(self, step: int, rows: list[dict[str, Any]]) -> None:
        for s in self.sinks:
            s.log_episodes(step, rows)


class Timer:
    """``with timer("gen"): ...`` accumulates wall seconds under ``timing/gen_s``."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def __call__(self, name: str) -> _TimerCtx:
        return _TimerCtx(self, name)

    def pop(self) -> dict[str, float]:
        out = {f"timing/{k}_s": v for k, v in self.totals.items()}
        self.totals = {}
        return out


class _TimerCtx:
    def __init__(self, timer: Timer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> _TimerCtx:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.totals[self.name] = self.timer.totals.get(self.name, 0.0) + time.perf_counter() - self.t0
