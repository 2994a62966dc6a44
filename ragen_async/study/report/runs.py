"""Loading runs: the ``metrics.jsonl``, ``config.yaml`` and sweep manifests a report reads, and a reference's
cells CSV.

Runs may be of different lengths, still running (a half-written last line is skipped with a warning),
resumed (a replayed step keeps its latest record), or missing any metric (a series without it is empty).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from pydantic import ValidationError

from ragen_async.config import EnvGroupSpec, RunConfig
from ragen_async.records.metrics import current_names
from ragen_async.records.rundir import PACKED, read_record, record_file
from ragen_async.staleness.collapse import stale_tokens

STEP = "learner/step"
MISSING = "—"
"""How a value a run did not log is shown."""
CELL_IGNORED = frozenset({"seed", "rollout.seed", "learner.seed", "name", "run_root", "model.path", "model.sha256",
                          "rollout.cpus_per_worker", "rollout.cpu_affinity", "learner.torch_threads",
                          "learner.cpu_affinity"})
"""Config keys that do not define a study cell (which runs are seeds of each other): the seed, the run's name
and place, the weights' path and digest (a study pins one start; its first validation shows it), and where
processes run (cores and threads change a step's time, not what it computes)."""
CELL_IGNORED_PREFIXES = ("logging.",)


@functools.cache
def _config_defaults() -> dict[str, Any]:
    """Every config key's current default, flattened: a key a run's config lacks (recorded before the field
    existed) counts as its default, so a field added later does not split a cell."""
    return pd.json_normalize(RunConfig().model_dump(mode="json"), sep=".").iloc[0].to_dict()


class ReportError(ValueError):
    """Nothing to report on; the message says what was looked at."""


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return math.nan


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a ``metrics.jsonl`` and warnings about lines that could not be read."""
    warnings: list[str] = []
    try:
        text = read_record(path)
    except (OSError, EOFError) as e:
        return [], [f"cannot read {path}: {e}"]
    lines = text.split("\n")
    complete = text.endswith("\n")
    if complete:
        lines.pop()  # the empty string after the final newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            last = number == len(lines)
            warnings.append(f"skipped a partial last line of {path.name} (run still writing?)" if last and not complete
                            else f"skipped unreadable line {number} of {path.name}")
            continue
        if isinstance(record, dict):
            records.append(current_names(record))
    return records, warnings


def _latest_per_step(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per learner step, the latest written (a resumed run replays the steps after its
    checkpoint), sorted by step."""
    by_step: dict[float, dict[str, Any]] = {}
    for r in records:
        step = _number(r.get(STEP))
        if math.isfinite(step):
            by_step[step] = r
    return [by_step[s] for s in sorted(by_step)]


def _lookup(config: dict[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


@dataclass
class RunData:
    name: str
    path: Path | None
    config: dict[str, Any] = field(default_factory=dict)
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    status: str | None = None
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path, name: str | None = None, status: str | None = None) -> RunData:
        run = cls(name=name or path.name, path=path, status=status)
        config_path = path / "config.yaml"
        if config_path.is_file():
            try:
                loaded = yaml.safe_load(config_path.read_text())
                run.config = loaded if isinstance(loaded, dict) else {}
            except yaml.YAMLError:
                run.warnings.append("config.yaml is not valid YAML; staleness settings unknown")
        metrics = path / "metrics.jsonl"
        if record_file(metrics) is not None:
            records, problems = read_metrics(metrics)
            run.warnings += problems
            training, validation = [], []
            for r in records:
                if any(k.startswith("val/") for k in r):
                    validation.append(r)
                else:
                    training.append({**stale_tokens(r), **r})  # runs logged before stale/* had the per-lag parts
            run.train, run.val = _latest_per_step(training), _latest_per_step(validation)
        elif status != "pending":
            run.warnings.append("no metrics.jsonl (not started yet?)")
        return run

    # ---------------------------------------------------------------- settings
    @property
    def has_config(self) -> bool:
        return bool(self.config)

    @property
    def k(self) -> int | None:
        """``max_staleness`` (``None`` = unbounded); see :attr:`has_config` for "unknown"."""
        value = _lookup(self.config, "staleness.max_staleness", 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def lag(self) -> str:
        """How staleness is set: ``bounded`` (at most k), ``fixed`` (exactly k) or ``adaptive`` (a bound
        that moves, ``staleness.adaptive``)."""
        if _lookup(self.config, "staleness.fixed_lag", False):
            return "fixed"
        return "adaptive" if _lookup(self.config, "staleness.adaptive", False) else "bounded"

    @property
    def off_policy(self) -> str:
        return str(_lookup(self.config, "algo.off_policy", "none"))

    @property
    def groups_per_step(self) -> int:
        """Groups a learner step consumes (``RolloutConfig.groups_per_step``); 0 where the config does not say
        or its environments do not validate."""
        try:
            return sum(EnvGroupSpec.model_validate(env).n_groups for env in _lookup(self.config, "rollout.envs") or [])
        except (ValidationError, TypeError):
            return 0

    @property
    def placement(self) -> str:
        """``pinned`` where the rollout engine or the learner is pinned to cores (``rollout.cpu_affinity``,
        ``learner.cpu_affinity``), else ``shared`` (every process on every core): where processes run changes
        a step's time, not what it computes (:data:`CELL_IGNORED`), so speeds are compared within a placement."""
        pinned = _lookup(self.config, "rollout.cpu_affinity") or _lookup(self.config, "learner.cpu_affinity")
        return "pinned" if pinned else "shared"

    @property
    def actor_lr(self) -> float:
        value = _lookup(self.config, "learner.actor_lr")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan

    @property
    def seed(self) -> Any:
        return _lookup(self.config, "seed")

    @property
    def cell(self) -> dict[str, str]:
        """Flattened config without the seed and the keys that name, place or log a run."""
        if not self.config:
            return {}
        flat = {**_config_defaults(), **pd.json_normalize(self.config, sep=".").iloc[0].to_dict()}
        return {k: str(v) for k, v in sorted(flat.items())
                if k not in CELL_IGNORED and not k.startswith(CELL_IGNORED_PREFIXES)}

    @property
    def total_steps(self) -> int | None:
        value = _lookup(self.config, "total_steps")
        return int(value) if isinstance(value, int) else None

    @property
    def budget_spent(self) -> bool:
        """Whether the run stopped on ``time_budget_minutes`` (its last step spent the budget)."""
        minutes = _lookup(self.config, "time_budget_minutes")
        spent = self.series("timing/budget_spent_s")[1]
        return isinstance(minutes, (int, float)) and spent.size > 0 and spent[-1] >= 60.0 * minutes

    # ---------------------------------------------------------------- series
    def series(self, key: str, validation: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) where ``key`` is a finite number."""
        pairs = [(_number(r.get(STEP)), _number(r.get(key))) for r in (self.val if validation else self.train)]
        pairs = [(s, v) for s, v in pairs if math.isfinite(v)]
        if not pairs:
            return np.zeros(0), np.zeros(0)
        steps, values = zip(*pairs, strict=True)
        return np.asarray(steps), np.asarray(values)

    @property
    def val_envs(self) -> list[str]:
        """Validation environment tags, from ``val/<Env>/success``."""
        tags = {k.split("/")[1] for r in self.val for k in r if k.startswith("val/") and k.count("/") == 2
                and k.endswith("/success")}
        return sorted(tags)

    def val_success(self) -> tuple[np.ndarray, np.ndarray]:
        """Overall validation success per validation step (``val/success``, else the env mean)."""
        steps, values = self.series("val/success", validation=True)
        if steps.size or not self.val_envs:
            return steps, values
        per_env = [dict(zip(*self.series(f"val/{t}/success", validation=True), strict=True)) for t in self.val_envs]
        common = sorted(set.intersection(*(set(d) for d in per_env)))
        return np.asarray(common), np.asarray([np.mean([d[s] for d in per_env]) for s in common])

    @property
    def last_step(self) -> int:
        steps = [_number(r.get(STEP)) for r in self.train]
        return int(max(steps)) if steps else 0


def find_runs(paths: Sequence[str | Path]) -> tuple[list[RunData], list[str]]:
    """Runs under ``paths`` (run dirs, sweep dirs, or folders holding either) and warnings.

    A sweep's runs are named as in its manifest and keep its status; other runs are named after
    their directory. Names that clash get their sweep (or parent folder) in front.
    """
    runs: list[RunData] = []
    warnings: list[str] = []
    seen: set[Path] = set()
    origin: dict[int, str] = {}  # id(run) -> sweep or parent folder, to tell clashing names apart

    def add(path: Path, name: str | None = None, status: str | None = None, group: str | None = None) -> None:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            runs.append(RunData.load(path, name=name, status=status))
            origin[id(runs[-1])] = group or path.parent.name

    def add_sweep(directory: Path) -> None:
        for name, record in _manifest_runs(directory / "sweep.json", warnings):
            if record.get("run_dir"):
                add(directory / record["run_dir"], name=name, status=record.get("status"), group=directory.name)
            else:
                runs.append(RunData(name=name, path=None, status=record.get("status", "pending")))
                origin[id(runs[-1])] = directory.name

    for given in map(Path, paths):
        if (given / "sweep.json").is_file():
            add_sweep(given)
        elif record_file(given / "metrics.jsonl") is not None or (given / "config.yaml").is_file():
            add(given)
        elif given.is_dir():
            before = len(runs)
            for manifest in sorted(given.rglob("sweep.json")):
                add_sweep(manifest.parent)
            for path in sorted({p.parent for name in ("metrics.jsonl", "metrics.jsonl" + PACKED)
                                for p in given.rglob(name)}):
                add(path)
            if len(runs) == before:
                warnings.append(f"{given}: no run directories (metrics.jsonl) under it")
        else:
            warnings.append(f"{given}: not a directory")
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:
            r.name = f"{origin[id(r)]}/{r.name}"
    return runs, warnings


def _manifest_runs(path: Path, warnings: list[str]) -> list[tuple[str, dict[str, Any]]]:
    try:
        runs = json.loads(path.read_text())["runs"]
        return [(name, rec) for name, rec in runs.items() if isinstance(rec, dict)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.append(f"{path}: unreadable sweep manifest ({e})")
        return []


def val_success_vs_time(run: RunData) -> tuple[np.ndarray, np.ndarray]:
    """(training minutes, validation success): each validation at the training time its step ended
    (``timing/budget_spent_s``, else the summed step times; validation itself not counted)."""
    steps, values = run.val_success()
    t_steps, spent = run.series("timing/budget_spent_s")
    if not spent.size:
        t_steps, step_s = run.series("timing/step_s")
        spent = np.cumsum(step_s)
    if not spent.size or not steps.size:
        return np.zeros(0), np.zeros(0)
    minutes = np.interp(steps, np.r_[0.0, t_steps], np.r_[0.0, spent]) / 60.0
    return minutes, values


REFERENCE_COLUMNS = ("lag_mean", "final_success", "final_success_lo", "final_success_hi")
"""What a reference's cells CSV holds per cell (``ragen-async bench rllib --csv`` writes it): the measured mean
lag in policy versions, the final success and its 95 % interval (empty with one seed); ``label`` optional."""


def read_reference(path: str | Path) -> pd.DataFrame:
    """A reference's cells (:data:`REFERENCE_COLUMNS`), or :class:`ReportError` naming what is missing."""
    try:
        frame = pd.read_csv(path, comment="#")
    except (OSError, ValueError) as e:
        raise ReportError(f"reference {path}: cannot read it as CSV ({e})") from None
    missing = [c for c in REFERENCE_COLUMNS if c not in frame.columns]
    if missing or frame.empty:
        raise ReportError(f"reference {path}: needs a row per cell with columns {list(REFERENCE_COLUMNS)}"
                          + (f"; missing {missing}" if missing else "; no rows"))
    return frame
