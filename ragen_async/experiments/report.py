"""Reports: what a run, or a sweep of runs, says about staleness and stability.

``write_report(paths, out)`` reads the ``metrics.jsonl`` of every run it finds under ``paths`` (run
directories, sweep directories, or folders holding either) and writes into ``out``:

* ``report.md``: an overview table (one row per run); the cells (runs that differ only in their seed, pooled: mean and
  95 % interval, clipped to the quantity's range, Wilson's for a share of runs, of final and best
  validation success, throughput, staleness, the share of runs that fell and that collapsed, the lead time
  and false-alarm rate of each early-warning signal; definitions in :mod:`ragen_async.collapse` and
  :mod:`.study`; finished runs only); then a table per run: final and best
  validation success per environment, the step validation first reached the threshold, staleness,
  the collapse indicators (largest gradient norm, smallest entropy, in-group reward std early vs
  late), the behaviour/learner k3 mismatch and the mean step time;
* ``summary.csv``: the overview as numbers (fall and collapse steps, lead times, false alarms), for analysis;
* ``curves_*.png``: validation success, rollout reward, in-group reward std, entropy, gradient norm,
  valid-action rate, behaviour/learner KL and mean staleness against the learner step, one line per run, coloured by ``max_staleness`` (solid
  = bounded, dashed = fixed lag, dotted = adaptive bound);
* ``staleness_stability.png``: final and mean validation success and largest gradient norm against k, one
  marker shape per off-policy correction (filled: bounded; hollow: fixed lag; lightly filled: adaptive bound), each
  (k, correction, lag, step size) as its mean over seeds with a 95 % interval;
* ``cells_val_success.png``: validation success per cell (mean over seeds, 95 % band) against the
  learner step and against training wall-clock.

Runs may be of different lengths, still running (a half-written last line is skipped with a
warning), resumed (a replayed step keeps its latest record), or missing any metric (shown as —).
"""

from __future__ import annotations

import csv
import functools
import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from pydantic import ValidationError

from ragen_async.collapse import SIGNAL_KEYS, SIGNALS, Collapse, find_collapse, stale_tokens
from ragen_async.config import EnvGroupSpec, RunConfig
from ragen_async.experiments import study

if TYPE_CHECKING:
    import pandas as pd

STEP = "learner/step"
MISSING = "—"
FINISHED = ("done", "complete", "time budget")
"""Run statuses that mean its budget was spent (a sweep's ``done``; a lone run's ``complete`` or ``time budget``)."""
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
    import pandas as pd

    return pd.json_normalize(RunConfig().model_dump(mode="json"), sep=".").iloc[0].to_dict()


class ReportError(ValueError):
    """Nothing to report on; the message says what was looked at."""


# ---------------------------------------------------------------------------- reading runs
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
        text = path.read_text(errors="replace")
    except OSError as e:
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
            records.append(record)
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
        if metrics.is_file():
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
        import pandas as pd

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


# ---------------------------------------------------------------------------- finding runs
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
        elif (given / "metrics.jsonl").is_file() or (given / "config.yaml").is_file():
            add(given)
        elif given.is_dir():
            before = len(runs)
            for manifest in sorted(given.rglob("sweep.json")):
                add_sweep(manifest.parent)
            for path in sorted({p.parent for p in given.rglob("metrics.jsonl")}):
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


# ---------------------------------------------------------------------------- summaries
@dataclass
class EnvValidation:
    first: float = math.nan
    """At the first validation (normally step 0: the base policy)."""
    final: float = math.nan
    best: float = math.nan
    reached_at: int | None = None
    """First validation step with success >= the threshold."""


def _nanmean(values: Iterable[float]) -> float:
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    return float(arr.mean()) if arr.size else math.nan


def _nanmax(values: np.ndarray) -> float:
    return float(values.max()) if values.size else math.nan


@dataclass
class RunSummary:
    name: str
    status: str
    k: int | None
    k_known: bool
    lag: str
    """``bounded``, ``fixed`` or ``adaptive`` (``RunData.lag``)."""
    off_policy: str
    seed: Any
    steps: int
    total_steps: int | None
    val: dict[str, EnvValidation]
    first_val: float
    final_val: float
    best_val: float
    mean_val: float
    """Mean validation success over the validations after the first (the area under the curve, per validation):
    eight validations averaged vary less across seeds than the last one alone."""
    reached_at: int | None
    staleness_mean: float
    staleness_max: float
    grad_norm_max: float
    grad_norm_max_step: int | None
    entropy_min: float
    entropy_min_step: int | None
    reward_std_first: float
    reward_std_last: float
    k3_mismatch: float
    step_time: float
    tokens_per_s: float = math.nan
    groups_per_s: float = math.nan
    actor_lr: float = math.nan
    """The actor's learning rate (NaN where the config does not say): the study's step-size arm."""
    collapse: Collapse = Collapse(False, None, math.nan, None)
    degraded: int | None = None
    """The first validation of a lasting shortfall against the k = 0 cell at the same step size
    (``study.degraded_from``); None: none, or no such reference."""
    lead: dict[str, int | None] = field(default_factory=dict)
    """Per early-warning signal, steps from its first firing to the run's first event, a fall or a degradation
    (``study.lead_times``)."""
    false_alarms: dict[str, float] = field(default_factory=dict)
    """Per early-warning signal, firings no event followed, per 100 steps (``study.false_alarms``)."""
    lag_shares: dict[str, float] = field(default_factory=dict)
    """The realised staleness distribution: per age bucket (``0`` .. ``7``, ``8+`` versions), its share of all
    the tokens the run trained on (from ``lag/{s}/tokens``)."""
    cell: dict[str, str] = field(default_factory=dict)
    """The run's settings other than its seed (flattened config): runs with equal cells are seeds of one cell."""

    @property
    def cell_key(self) -> str:
        """The cell as one string (``name=value|...``): the key seeds of one cell share."""
        return "|".join(f"{k}={v}" for k, v in self.cell.items())

    @property
    def k_label(self) -> str:
        return "?" if not self.k_known else "∞" if self.k is None else str(self.k)

    @property
    def plain(self) -> bool:
        """Bounded, uncorrected: the runs the staleness trend is fitted on."""
        return self.lag == "bounded" and self.off_policy == "none"

    @property
    def event(self) -> int | None:
        """The step early warnings are measured against: the first fall or degradation, whichever is earlier."""
        return _first_event(self.collapse, self.degraded)

    @property
    def actor_lr_key(self) -> float:
        """The step size as a dict key (-1 where the config does not say)."""
        return -1.0 if math.isnan(self.actor_lr) else self.actor_lr

    @property
    def is_reference(self) -> bool:
        """A synchronous run of the plain objective: what degradation is measured against."""
        return self.k == 0 and self.k_known and self.plain and self.finished

    @property
    def finished(self) -> bool:
        """Whether the run spent its budget (steps or time): only finished runs are pooled into cells and
        the summary figure, so a cell compares equal budgets, never a run still going."""
        return self.status in FINISHED


def _validation(steps: np.ndarray, values: np.ndarray, threshold: float) -> EnvValidation:
    if not values.size:
        return EnvValidation()
    reached = np.nonzero(values >= threshold)[0]
    return EnvValidation(first=float(values[0]), final=float(values[-1]), best=float(values.max()),
                         reached_at=int(steps[reached[0]]) if reached.size else None)


def _extreme(run: RunData, key: str, pick) -> tuple[float, int | None]:
    steps, values = run.series(key)
    if not values.size:
        return math.nan, None
    i = int(pick(values))
    return float(values[i]), int(steps[i])


def _early_late(values: np.ndarray, fraction: float = 0.1) -> tuple[float, float]:
    """Means of the first and last ``fraction`` of the values (at least one value each)."""
    if not values.size:
        return math.nan, math.nan
    n = max(1, math.ceil(fraction * values.size))
    return float(values[:n].mean()), float(values[-n:].mean())


def _lag_shares(run: RunData) -> dict[str, float]:
    buckets = sorted({k.split("/")[1] for r in run.train for k in r if k.startswith("lag/") and k.endswith("/tokens")},
                     key=lambda b: (b.endswith("+"), int(b.rstrip("+"))))
    totals = {b: float(run.series(f"lag/{b}/tokens")[1].sum()) for b in buckets}
    everything = sum(totals.values())
    return {b: t / everything for b, t in totals.items()} if everything > 0 else {}


def _first_event(collapse: Collapse, degraded: int | None) -> int | None:
    return min((x for x in (collapse.fell, degraded) if x is not None), default=None)


def summarize(run: RunData, threshold: float = 0.9, collapse_floor: float = 0.0,
              band: dict[int, float] | None = None) -> RunSummary:
    """One run's numbers; ``band`` (``study.reference_band`` of the k = 0 cell at the run's step size) makes
    degradation measurable."""
    collapse = find_collapse(*run.val_success(), floor=collapse_floor)
    degraded = study.degraded_from(*run.val_success(), band) if band else None
    event = _first_event(collapse, degraded)
    signals = {sig: run.series(key) for sig, key in SIGNAL_KEYS.items()}
    envs = {tag: _validation(*run.series(f"val/{tag}/success", validation=True), threshold)
            for tag in run.val_envs}
    if not envs and run.series("val/success", validation=True)[0].size:
        envs = {"all": _validation(*run.series("val/success", validation=True), threshold)}
    overall = _validation(*run.val_success(), threshold)
    gmax, gmax_step = _extreme(run, "actor/grad_norm", np.argmax)
    emin, emin_step = _extreme(run, "actor/entropy", np.argmin)
    std_first, std_last = _early_late(run.series("rollout/in_group_reward_std")[1])
    total = run.total_steps
    status = run.status or ("no metrics" if not run.train and not run.val
                            else "complete" if total is not None and run.last_step >= total
                            else "time budget" if run.budget_spent else "partial")
    return RunSummary(
        name=run.name, status=status, k=run.k, k_known=run.has_config, lag=run.lag,
        off_policy=run.off_policy, actor_lr=run.actor_lr, seed=run.seed, steps=run.last_step, total_steps=total,
        val=envs,
        first_val=overall.first, final_val=overall.final, best_val=overall.best, reached_at=overall.reached_at,
        mean_val=_nanmean(run.val_success()[1][1:]),
        staleness_mean=_nanmean(run.series("staleness/mean")[1]),
        staleness_max=_nanmax(run.series("staleness/max")[1]),
        grad_norm_max=gmax, grad_norm_max_step=gmax_step, entropy_min=emin, entropy_min_step=emin_step,
        reward_std_first=std_first, reward_std_last=std_last,
        k3_mismatch=_nanmean(run.series("mismatch/k3_kl")[1]),
        step_time=_nanmean(run.series("timing/step_s")[1]),
        tokens_per_s=_nanmean(run.series("throughput/tokens_per_s")[1]),
        groups_per_s=_nanmean(run.series("throughput/groups_per_s")[1]),
        collapse=collapse, degraded=degraded,
        lead=study.lead_times(signals, event), false_alarms=study.false_alarms(signals, event),
        lag_shares=_lag_shares(run),
        cell=run.cell,
    )


def reference_bands(runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> dict[float, dict[int, float]]:
    """Per actor learning rate: the lower 95 % band of the finished synchronous runs' validation success
    (``study.reference_band``; a rate with fewer than two such runs has none)."""
    curves: dict[float, list[tuple[np.ndarray, np.ndarray]]] = {}
    for run, s in zip(runs, summaries, strict=True):
        if s.is_reference:
            curves.setdefault(s.actor_lr_key, []).append(run.val_success())
    return {lr: band for lr, c in curves.items() if (band := study.reference_band(c))}


# ---------------------------------------------------------------------------- formatting
def _f(value: float | None, spec: str = ".3f") -> str:
    if value is None or not math.isfinite(value):
        return MISSING
    return format(value, spec)


def _at(value: float, step: int | None, spec: str) -> str:
    return _f(value, spec) + (f" (step {step})" if step is not None and math.isfinite(value) else "")


def _trend(first: float, last: float) -> str:
    if not (math.isfinite(first) and math.isfinite(last)):
        return MISSING
    change = f" ({(last - first) / first:+.0%})" if first > 0 else ""
    return f"{first:.3f} → {last:.3f}{change}"


def _steps(s: RunSummary) -> str:
    return f"{s.steps}/{s.total_steps}" if s.total_steps is not None else str(s.steps)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


OVERVIEW = ("run", "k", "lag", "correction", "seed", "status", "steps", "first val", "final val", "best val",
            "val ≥ {t} at", "fell at", "degraded from", "staleness mean / max", "max grad norm", "min entropy",
            "reward std first → last 10%", "k3 mismatch", "step s")


def _fell(c: Collapse) -> str:
    """The first fall's step, and whether the run stayed down (collapsed) or came back."""
    return MISSING if c.fell is None else f"{c.fell} ({'collapsed' if c.collapsed else 'recovered'})"


def _overview_row(s: RunSummary) -> list[str]:
    return [s.name, s.k_label, s.lag, s.off_policy, MISSING if s.seed is None else str(s.seed), s.status,
            _steps(s), _f(s.first_val), _f(s.final_val), _f(s.best_val), MISSING if s.reached_at is None else str(s.reached_at),
            _fell(s.collapse), MISSING if s.degraded is None else str(s.degraded),
            f"{_f(s.staleness_mean, '.2f')} / {_f(s.staleness_max, '.0f')}", _f(s.grad_norm_max, '.3g'),
            _f(s.entropy_min, '.3g'), _trend(s.reward_std_first, s.reward_std_last), _f(s.k3_mismatch, '.2e'),
            _f(s.step_time, '.2f')]


def _run_section(run: RunData, s: RunSummary, threshold: float) -> list[str]:
    lines = [f"### {s.name}", ""]
    where = f"`{run.path}`" if run.path is not None else "no run directory yet"
    settings = (f"k = {s.k_label}, {s.lag}, correction {s.off_policy}, seed {s.seed}" if s.k_known
                else "settings unknown (no config.yaml)")
    lines += [f"{where} · {s.status} · {_steps(s)} steps · {settings}", ""]
    if s.val:
        rows = [(env, _f(v.first), _f(v.final), _f(v.best), MISSING if v.reached_at is None else v.reached_at)
                for env, v in s.val.items()]
        lines += _table(("validation env", "first success", "final success", "best success",
                         f"first step ≥ {threshold:g}"), rows)
    else:
        lines.append("No validation records.")
    lines.append("")
    rows = [
        ("staleness mean / max (versions)", f"{_f(s.staleness_mean, '.2f')} / {_f(s.staleness_max, '.0f')}"),
        ("trained tokens by age (versions)", ", ".join(f"{b}: {100 * v:.0f} %" for b, v in s.lag_shares.items()
                                                       if v >= 0.005) or MISSING),
        ("max grad norm", _at(s.grad_norm_max, s.grad_norm_max_step, ".3g")),
        ("min entropy", _at(s.entropy_min, s.entropy_min_step, ".3g")),
        ("in-group reward std, first → last 10% of steps", _trend(s.reward_std_first, s.reward_std_last)),
        ("behaviour/learner k3 mismatch, mean", _f(s.k3_mismatch, ".2e")),
        ("mean step time (s)", _f(s.step_time, ".2f")),
    ]
    lines += _table(("indicator", "value"), rows)
    return [*lines, ""]


def _csv_rows(summaries: Sequence[RunSummary]) -> list[dict[str, Any]]:
    rows = []
    for s in summaries:
        row: dict[str, Any] = {
            "run": s.name, "k": s.k_label, "lag": s.lag, "off_policy": s.off_policy,
            "actor_lr": s.actor_lr, "seed": s.seed, "status": s.status, "steps": s.steps,
            "total_steps": s.total_steps, "first_val": s.first_val, "final_val": s.final_val,
            "best_val": s.best_val, "mean_val": s.mean_val, "val_reached": float(s.reached_at is not None), "val_reached_at": s.reached_at,
            "staleness_mean": s.staleness_mean,
            "staleness_max": s.staleness_max, "grad_norm_max": s.grad_norm_max, "entropy_min": s.entropy_min,
            "reward_std_first": s.reward_std_first, "reward_std_last": s.reward_std_last,
            "k3_mismatch": s.k3_mismatch, "step_time_s": s.step_time, "tokens_per_s": s.tokens_per_s,
            "groups_per_s": s.groups_per_s,
            "fell": float(s.collapse.fell is not None), "fell_step": s.collapse.fell,
            "collapsed": float(s.collapse.collapsed), "collapse_step": s.collapse.step,
            "degraded": float(s.degraded is not None), "degraded_step": s.degraded,
            **{f"lead_{sig}": s.lead.get(sig) for sig in SIGNALS},
            **{f"false_alarms_{sig}": s.false_alarms.get(sig) for sig in SIGNALS},
            **{f"tokens_lag_{b}": v for b, v in s.lag_shares.items()},
        }
        for env, v in s.val.items():
            row[f"val_{env}_first"], row[f"val_{env}_final"], row[f"val_{env}_best"] = v.first, v.final, v.best
        rows.append(row)
    return rows


CELL_VALUES = (("final_val", "final val", ".3f", study.UNIT), ("best_val", "best val", ".3f", study.UNIT),
               ("mean_val", "mean val after step 0", ".3f", study.UNIT),
               ("val_reached", "reached threshold (share)", ".2f", study.SHARE),
               ("val_reached_at", "first step ≥ threshold (runs that reached it)", ".1f", study.POSITIVE),
               ("groups_per_s", "groups/s", ".2f", study.POSITIVE), ("tokens_per_s", "tokens/s", ".0f", study.POSITIVE),
               ("staleness_mean", "staleness mean", ".2f", study.POSITIVE),
               ("fell", "fell (share)", ".2f", study.SHARE), ("collapsed", "collapsed (share)", ".2f", study.SHARE),
               ("degraded", "degraded (share)", ".2f", study.SHARE),
               *((f"lead_{sig}", f"lead: {sig.replace('_', ' ')} (steps)", ".1f", (0.0, float(study.HORIZON)))
                 for sig in SIGNALS),
               *((f"false_alarms_{sig}", f"false alarms: {sig.replace('_', ' ')} (/100 steps)", ".2f", study.POSITIVE)
                 for sig in SIGNALS))
"""The cells table's columns: summary key, header, format, and the range its interval is clipped to
(``study.SHARE``: a share of runs, Wilson's interval)."""


def _cells_section(summaries: Sequence[RunSummary], collapse_floor: float = 0.0) -> list[str]:
    """Seeds pooled: one row per cell with the mean ± 95 % interval of each statistic."""
    import pandas as pd

    known = [s for s in summaries if s.cell and s.finished]
    unfinished = sum(1 for s in summaries if s.cell and not s.finished)
    if not known:
        return []
    cells = pd.DataFrame([s.cell for s in known]).fillna(MISSING)
    if "staleness.max_staleness" in cells:
        cells["staleness.max_staleness"] = cells["staleness.max_staleness"].replace("None", "∞")
    varying = [c for c in cells.columns if cells[c].nunique() > 1]
    frame = pd.concat([cells[varying].reset_index(drop=True),
                       pd.DataFrame(_csv_rows(known))[[c for c, *_ in CELL_VALUES]].astype(float)], axis=1)
    frame["_cell"] = cells.astype(str).agg("|".join, axis=1)
    table = study.cell_table(frame, ["_cell", *varying], [c for c, *_ in CELL_VALUES],
                             {c: span for c, _, _, span in CELL_VALUES})
    lines = ["## Cells (seeds pooled)", "",
             "Runs whose settings differ only in their seed form a cell: mean [95 % interval] over the cell's "
             "runs (t distribution, clipped to the quantity's range; no interval with one run); a share of runs "
             "(reached, fell, collapsed, degraded) with Wilson's 95 % interval for a proportion. Threshold: the first "
             "validation with success at or above the report's threshold (`--threshold`). Fell: at least two "
             f"validations in a row below the line half-way from {collapse_floor:g} (`--collapse-floor`) to the peak "
             "so far; collapsed: fell and stayed below to the end. Degraded: from some validation to the last (two "
             "or more) below the lower end of the 95 % interval of the synchronous runs (k = 0, bounded, no "
             "correction, same learning rate) at the same step. Lead: steps from a signal's first firing within "
             f"{study.HORIZON} steps before the run's first event (fall or degradation) to it, over runs with an "
             "event where it fired "
             "(in-group reward std below half its running peak; entropy below half its start; a gradient norm "
             "above 3× the median of the previous 5 steps). False alarms: firings that no event followed within "
             f"{study.HORIZON} steps, per 100 steps watched (`ragen_async/experiments/study.py`)."
             + (f" Only finished runs are pooled; {unfinished} unfinished left out (overview only)." if unfinished
                else ""), ""]
    header = [*(varying or ["cell"]), "runs", *(label for _, label, *_ in CELL_VALUES)]
    rows = []
    for _, r in table.iterrows():
        settings = [r[c] for c in varying] or ["all runs"]
        rows.append([*settings, int(r["n"]),
                     *(study.format_bounds(r[c], r[f"{c}_lo"], r[f"{c}_hi"], spec) for c, _, spec, _ in CELL_VALUES)])
    return [*lines, *_table(header, rows), ""]


def _against_sync_section(summaries: Sequence[RunSummary]) -> list[str]:
    """Per step size with a synchronous reference (two or more finished k = 0 runs, bounded, no correction):
    each other cell's difference from it in mean and final validation success (Welch's 95 % interval), and
    the trend of both over the bounded uncorrected runs' realised mean staleness."""
    finished = [s for s in summaries if s.cell and s.finished and s.k_known]
    lines: list[str] = []
    for lr in sorted({s.actor_lr_key for s in finished}):
        at_lr = [s for s in finished if s.actor_lr_key == lr]
        reference = [s for s in at_lr if s.is_reference]
        if len(reference) < 2:
            continue
        cells: dict[str, list[RunSummary]] = {}
        for s in at_lr:
            if not s.is_reference:
                cells.setdefault(s.cell_key, []).append(s)
        plain = [s for s in at_lr if s.plain]
        uncorrected: dict[tuple[int | None, str], list[float]] = defaultdict(list)
        for s in at_lr:
            if s.off_policy == "none":
                uncorrected[(s.k, s.lag)].append(s.mean_val)
        rows = []
        for group in sorted(cells.values(), key=lambda g: (LAGS.index(g[0].lag), _correction_order(g[0].off_policy),
                                                          g[0].off_policy, g[0].k is None, g[0].k or 0)):
            s0 = group[0]
            diffs = [study.welch_difference([getattr(s, a) for s in group], [getattr(r, a) for r in reference])
                     for a in ("mean_val", "final_val")]
            age = float(np.mean([s.staleness_mean for s in group]))
            predicted = MISSING if s0.plain else study.format_bounds(*study.predicted_mean(
                [s.staleness_mean for s in plain], [s.mean_val for s in plain], age, len(group)), ".3f")
            # What a correction buys back (the uncorrected runs at its k and lag), or an adaptive bound against
            # the fixed bound it starts from (bounded, uncorrected, same k).
            against = ((s0.k, s0.lag) if s0.off_policy != "none" else (s0.k, "bounded") if s0.lag == "adaptive"
                       else None)
            same_k = uncorrected.get(against, []) if against else []
            against_none = (study.format_bounds(*study.welch_difference([s.mean_val for s in group], same_k), "+.3f")
                            if same_k else MISSING)
            rows.append([s0.k_label, s0.lag, s0.off_policy, len(group), _f(age, ".2f"),
                         *(study.format_bounds(*d, "+.3f") for d in diffs),
                         _f(float(np.mean([s.mean_val for s in group]))), predicted, against_none])
        trends = [study.trend([s.staleness_mean for s in plain], [getattr(s, a) for s in plain])
                  for a in ("mean_val", "final_val")]
        step = "" if lr < 0 else f" (actor lr {lr:g})"
        lines += [f"## Against synchronous training{step}", "",
                  f"Reference: the {len(reference)} finished runs at k = 0 (bounded, no correction). Per cell, the "
                  "difference of its mean from the reference's, with Welch's 95 % interval (`study.welch_difference`),"
                  " of the mean validation success after step 0 and of the final one. Trend: the least-squares slope "
                  "of each on a run's realised mean staleness over the bounded runs without correction, per version "
                  "of mean age, with its 95 % interval and p-value (`study.trend`). Predicted: for a cell outside "
                  "those runs (fixed lag, a correction, an adaptive bound), the mean validation success after step 0 "
                  "that trend predicts at the cell's mean age, with the 95 % prediction interval for the mean of as "
                  "many runs (`study.predicted_mean`): a cell inside it behaves as its staleness alone predicts. "
                  "Against the same k: for a corrected cell, the difference of its mean validation success after "
                  "step 0 from that of the uncorrected runs at the same k and lag (Welch's 95 % interval): what the "
                  "correction buys back; for an adaptive bound, from that of the fixed bound it starts from (bounded, "
                  "no correction, the same k).", ""]
        lines += _table(["k", "lag", "correction", "runs", "staleness mean", "Δ mean val after step 0", "Δ final val",
                         "mean val after step 0", "predicted by the bounded trend",
                         "Δ mean val vs same k (uncorrected; adaptive: fixed bound)"], rows) if rows else []
        for (slope, low, high, p, n), what in zip(trends, ("mean validation success after step 0",
                                                           "final validation success"), strict=True):
            if math.isfinite(slope):
                lines += ["", f"Trend of the {what} on realised mean staleness ({n} runs): {slope:+.4f} per version "
                          f"[{low:+.4f}, {high:+.4f}], p = {p:.3f}."]
        lines.append("")
    return lines


def _equal_time_section(runs: Sequence[RunData], summaries: Sequence[RunSummary],
                        throughput: dict[int | None, float]) -> list[str]:
    """The practical answer: per bounded cell whose k has a measured throughput (``--throughput``, groups/s
    from ``bench pipeline`` on an idle machine), the time its step budget takes at that rate, its gain per
    100 learner steps and its success at equal time: at the minutes the fastest of these cells needs for
    its budget, each run's validation success interpolated at the step its k reaches by then."""
    import pandas as pd

    members: dict[str, list[tuple[RunData, RunSummary]]] = {}
    for run, s in zip(runs, summaries, strict=True):
        if s.cell and s.finished and s.k_known and s.lag == "bounded" and s.k in throughput and run.val_success()[0].size:
            members.setdefault(s.cell_key, []).append((run, s))
    if not members:
        return []

    def minutes_per_step(run: RunData, s: RunSummary) -> float:
        return max(run.groups_per_step, 1) / throughput[s.k] / 60.0

    budget = {key: max(r.last_step for r, _ in group) * minutes_per_step(*group[0]) for key, group in members.items()}
    equal = min(budget.values())
    labels = pd.DataFrame([group[0][1].cell for group in members.values()], index=list(members))
    varying = [c for c in labels.columns if labels[c].nunique() > 1 and c != "staleness.max_staleness"]
    rows = []
    for key, group in sorted(members.items(), key=lambda kv: (kv[1][0][1].k is None, kv[1][0][1].k or 0, kv[0])):
        s0 = group[0][1]
        steps_at = equal / minutes_per_step(*group[0])
        gain = [100.0 * (s.final_val - s.first_val) / max(r.val_success()[0][-1], 1) for r, s in group]
        at_time = [float(np.interp(steps_at, *r.val_success())) for r, _ in group]
        settings = ", ".join(f"{c.rsplit('.', 1)[-1]} {labels.at[key, c]}" for c in varying)
        rows.append([s0.k_label + (f" ({settings})" if settings else ""), len(group), f"{throughput[s0.k]:.2f}",
                     f"{budget[key]:.1f}", study.format_bounds(*study.bounds([s.final_val for _, s in group],
                                                                             study.UNIT)[:3], ".3f"),
                     study.format_bounds(*study.bounds(gain)[:3], "+.3f"), f"{steps_at:.0f}",
                     study.format_bounds(*study.bounds(at_time, study.UNIT)[:3], ".3f")])
    lines = ["## At equal time (the practical answer)", "",
             "Per bounded cell with a measured throughput (`--throughput K=GROUPS_PER_S`, from `ragen-async bench "
             "pipeline` on an idle machine; the runs themselves may have shared theirs): the minutes its step "
             "budget takes at that rate, the final success, the gain over its first validation per 100 learner "
             f"steps, and the success at equal time: at {equal:.1f} min (the fastest cell's budget) each run's "
             "validation success interpolated at the step its k reaches by then. Mean [95 % interval] over seeds.", ""]
    header = ["k", "runs", "groups/s", "minutes for the budget", "final val", "gain per 100 steps",
              f"step reached at {equal:.1f} min", f"val at {equal:.1f} min"]
    return [*lines, *_table(header, rows), ""]


# ---------------------------------------------------------------------------- plots
CURVES = (
    ("val_success", "validation success", None),
    ("rollout_reward", "rollout reward (mean)", "rollout/reward_mean"),
    ("in_group_reward_std", "in-group reward std", "rollout/in_group_reward_std"),
    ("entropy", "policy entropy", "actor/entropy"),
    ("grad_norm", "gradient norm", "actor/grad_norm"),
    ("valid_action_rate", "rollout valid-action rate", "rollout/valid_action_rate"),
    ("k3_mismatch", "behaviour/learner KL (k3)", "mismatch/k3_kl"),
    ("staleness_mean", "staleness, mean (versions)", "staleness/mean"),
    ("staleness_bound", "staleness bound k (adaptive runs)", "staleness/bound"),
)
LOG_CURVES = frozenset({"grad_norm", "k3_mismatch"})
"""Curves drawn on a log scale when positive and spanning more than a factor of 50."""
MARKERS = {"none": "o", "tis": "s", "decoupled": "^"}
"""A marker per correction (``algo.off_policy``)."""


def _correction_order(mode: str) -> int:
    """Where a correction sorts in tables and legends: none first, then as in :data:`MARKERS`, unknown last."""
    return list(MARKERS).index(mode) if mode in MARKERS else len(MARKERS)


LAGS = ("bounded", "fixed", "adaptive")
LINESTYLES = {"bounded": "-", "fixed": "--", "adaptive": ":"}
LAG_NAMES = {"bounded": "bounded", "fixed": "fixed lag", "adaptive": "adaptive bound"}
MAX_RUN_LEGEND = 12


def _run_colors(runs: Sequence[RunData]) -> dict[Any, Any]:
    """A colour per ``max_staleness``: viridis over the finite k, red for unbounded, grey for unknown;
    a colour per run instead when every run has the same k."""
    from matplotlib import colormaps

    ks = sorted({r.k for r in runs if r.has_config and r.k is not None})
    cmap = colormaps["viridis"]
    colors: dict[Any, Any] = {k: cmap(x) for k, x in zip(ks, np.linspace(0.05, 0.85, max(len(ks), 1)), strict=False)}
    colors[None], colors["?"] = "tab:red", "0.55"
    if len({r.k if r.has_config else "?" for r in runs}) == 1 and len(runs) <= MAX_RUN_LEGEND:
        # One k for all (a method or seed comparison): colour by k would draw every run alike, and
        # the legend names each run, so give each its own colour.
        tab10 = colormaps["tab10"]
        colors.update({("run", r.name): tab10(i % 10) for i, r in enumerate(runs)})
    return colors


def _color(run: RunData, colors: dict[Any, Any]) -> Any:
    if ("run", run.name) in colors:
        return colors["run", run.name]
    return colors[run.k] if run.has_config else colors["?"]


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (the first points average what there is)."""
    if window <= 1 or values.size < 2:
        return values
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def _save(fig, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)
    return path


def _legend(ax, runs: Sequence[RunData], colors: dict[Any, Any]) -> None:
    from matplotlib.lines import Line2D

    if len(runs) <= MAX_RUN_LEGEND:
        ax.legend(fontsize=7, frameon=False, loc="best")
        return
    handles = [Line2D([], [], color=_color(r, colors), label=f"k = {_k_text(r)}")
               for r in {_k_text(r): r for r in runs}.values()]
    if len({r.lag for r in runs}) > 1:
        handles += [Line2D([], [], color="0.3", ls=LINESTYLES[lag], label=LAG_NAMES[lag])
                    for lag in LAGS if any(r.lag == lag for r in runs)]
    handles += [line for line in ax.get_lines() if line.get_gid() == "baseline"]
    ax.legend(handles=handles, fontsize=7, frameon=False, loc="best")


def _k_text(run: RunData) -> str:
    return "?" if not run.has_config else "∞" if run.k is None else str(run.k)


def _draw_baselines(ax, baselines: dict[str, float] | None) -> None:
    """Reference levels of validation success (e.g. the random and the oracle policy) as labelled lines."""
    for i, (name, value) in enumerate(sorted((baselines or {}).items(), key=lambda kv: kv[1])):
        ax.axhline(value, color="0.35", ls=(0, (1, 2 + i)), lw=1.1, label=f"{name} ({value:g})", gid="baseline")


def plot_curves(runs: Sequence[RunData], out: Path, smooth: int = 1,
                baselines: dict[str, float] | None = None) -> list[Path]:
    """One PNG per curve in :data:`CURVES` that any run has data for (the bound: adaptive runs only, the
    others' is their constant k); ``baselines`` are drawn on the validation-success plot."""
    from matplotlib.figure import Figure

    colors = _run_colors(runs)
    ordered = sorted(runs, key=lambda r: (not r.has_config, math.inf if r.k is None else r.k, r.name))
    written = []
    for slug, title, key in CURVES:
        fig = Figure(figsize=(7.5, 4.2), layout="constrained")
        ax = fig.add_subplot()
        drawn: list[RunData] = []
        positive = True
        for run in ordered:
            if slug == "staleness_bound" and run.lag != "adaptive":
                continue
            steps, values = run.val_success() if key is None else run.series(key)
            if not values.size:
                continue
            if key is not None:
                values = _smooth(values, smooth)
            positive &= bool(np.all(values > 0))
            ax.plot(steps, values, color=_color(run, colors), ls=LINESTYLES[run.lag], lw=1.4,
                    alpha=0.9, marker="o" if key is None else None, ms=3, label=run.name)
            drawn.append(run)
        if not drawn:
            continue
        if key is None:
            _draw_baselines(ax, baselines)
        if slug in LOG_CURVES and positive:
            lo, hi = ax.get_ylim()
            if hi / max(lo, 1e-12) > 50:
                ax.set_yscale("log")
        ax.set(xlabel="learner step", ylabel=title,
               title=title + (f" (trailing mean over {smooth} steps)" if smooth > 1 and key else ""))
        ax.grid(alpha=0.3)
        _legend(ax, drawn, colors)
        written.append(_save(fig, out / f"curves_{slug}.png"))
    return written


def _cell_label(cell: dict[str, str], varying: Sequence[str]) -> str:
    def value(key: str) -> str:
        text = cell.get(key, MISSING)
        return "∞" if key == "staleness.max_staleness" and text == "None" else text

    return ", ".join(f"{k.rsplit('.', 1)[-1]}={value(k)}" for k in varying) or "all runs"


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


def plot_cells(runs: Sequence[RunData], summaries: Sequence[RunSummary], out: Path, points: int = 50,
               baselines: dict[str, float] | None = None) -> Path | None:
    """Validation success of each cell (runs differing only in their seed) against the learner step and
    against training wall-clock: the mean over seeds, and a band of its 95 % interval where a cell has
    two or more seeds (each seed interpolated onto a common grid within the range all seeds cover);
    finished runs only."""
    from matplotlib.figure import Figure

    cells: dict[str, list[RunData]] = {}
    labels: dict[str, dict[str, str]] = {}
    for run, s in zip(runs, summaries, strict=True):
        if s.cell and s.finished and run.val_success()[0].size >= 2:
            cells.setdefault(s.cell_key, []).append(run)
            labels[s.cell_key] = s.cell
    if not cells:
        return None
    varying = [k for k in dict.fromkeys(k for c in labels.values() for k in c)
               if len({c.get(k) for c in labels.values()}) > 1]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    palette = [f"C{i}" for i in range(10)]
    for i, (key, members) in enumerate(sorted(cells.items())):
        color = palette[i % len(palette)]
        for ax, series in ((axes[0], RunData.val_success), (axes[1], val_success_vs_time)):
            curves = [series(r) for r in members]
            lo, hi = max(c[0][0] for c in curves), min(c[0][-1] for c in curves)
            if hi <= lo:
                continue
            grid = np.linspace(lo, hi, points)
            ys = np.array([np.interp(grid, x, y) for x, y in curves])
            mean = ys.mean(axis=0)
            label = f"{_cell_label(labels[key], varying)} (n={len(members)})"
            ax.plot(grid, mean, color=color, lw=1.6, label=label)
            if len(members) >= 2:
                half = study.t95(len(members)) * ys.std(axis=0, ddof=1) / math.sqrt(len(members))
                ax.fill_between(grid, np.clip(mean - half, 0.0, 1.0), np.clip(mean + half, 0.0, 1.0),
                                color=color, alpha=0.2, lw=0)
    axes[0].set(xlabel="learner step", ylabel="validation success", title="per cell: mean over seeds, 95 % band")
    axes[1].set(xlabel="training wall-clock (minutes, validation excluded)", title="the same against time")
    for ax in axes:
        _draw_baselines(ax, baselines)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, frameon=False, loc="best")
    return _save(fig, out / "cells_val_success.png")


SUMMARY_PANELS = (("final_val", "final validation success", (0.0, 1.0)),
                  ("mean_val", "mean validation success after step 0", (0.0, 1.0)),
                  ("grad_norm_max", "max gradient norm", (0.0, math.inf)))
"""The summary plot's panels: attribute, label, and the range its intervals are clipped to."""


def _face(color: str, lag: str) -> Any:
    """A marker's fill by lag mode: filled for bounded, hollow for fixed lag, lightly filled for an adaptive
    bound (at one k a fixed-lag and an adaptive cell would otherwise look alike)."""
    from matplotlib.colors import to_rgba

    return color if lag == "bounded" else "none" if lag == "fixed" else to_rgba(color, 0.3)


def plot_staleness_summary(summaries: Sequence[RunSummary], out: Path) -> Path | None:
    """Final validation success, mean validation success after step 0 and largest gradient norm against k:
    every run as a point, and per
    (correction, lag, step size) the mean over seeds at each k with its 95 % interval, clipped to the
    quantity's range (a success stays in [0, 1], a norm above 0). A marker shape per correction, filled
    for bounded, hollow for fixed lag, lightly filled for an adaptive bound (``_face``), a line style per lag
    mode (``LINESTYLES``); the step size is named in the legend where it varies. Finished runs only."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    known = [s for s in summaries if s.k_known and s.finished]
    if not known or not any(math.isfinite(s.final_val) or math.isfinite(s.grad_norm_max) for s in known):
        return None
    finite = sorted({s.k for s in known if s.k is not None})
    unbounded_x = (max(finite) + 1) if finite else 0

    def arm(s: RunSummary) -> tuple[str, str, float]:
        return s.off_policy, s.lag, s.actor_lr_key

    # No correction first: its colour stays the same as arms are added.
    groups = sorted({arm(s) for s in known}, key=lambda g: (_correction_order(g[0]), g[0], LAGS.index(g[1]), g[2]))
    several_lr = len({g[2] for g in groups}) > 1
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
    colors = sorted({(g[0], g[2]) for g in groups}, key=lambda c: (_correction_order(c[0]), c))
    group_color = {c: palette[i % len(palette)] for i, c in enumerate(colors)}
    spacing = min(0.25, 0.8 / len(groups))  # the arms side by side at a k, all within 0.8 of it
    offsets = {g: (i - (len(groups) - 1) / 2) * spacing for i, g in enumerate(groups)}

    fig = Figure(figsize=(14, 4.2), layout="constrained")
    axes = fig.subplots(1, len(SUMMARY_PANELS))
    for ax, (attr, label, (low, high)) in zip(axes, SUMMARY_PANELS, strict=True):
        for group in groups:
            mode, lag, lr = group
            members = [s for s in known if arm(s) == group and math.isfinite(getattr(s, attr))]
            if not members:
                continue
            xs = np.array([unbounded_x if s.k is None else s.k for s in members], dtype=float)
            ys = np.array([getattr(s, attr) for s in members])
            color = group_color[(mode, lr)]
            ax.scatter(xs + offsets[group], ys, marker=MARKERS.get(mode, "D"), s=36, alpha=0.8,
                       facecolors=_face(color, lag), edgecolors=color)
            cells = [(x + offsets[group], *study.error_bar(ys[xs == x].tolist(), low, high)) for x in np.unique(xs)]
            ax.errorbar([c[0] for c in cells], [c[1] for c in cells], yerr=[[c[2] for c in cells], [c[3] for c in cells]],
                        color=color, ls=LINESTYLES[lag], lw=1, alpha=0.8, capsize=4)
        ticks = finite + ([unbounded_x] if any(s.k is None for s in known) else [])
        ax.set_xticks(ticks, [str(k) for k in finite] + (["∞"] if len(ticks) > len(finite) else []))
        ax.set(xlabel="max staleness k (policy versions)", ylabel=label, title=label + " vs k")
        ax.grid(alpha=0.3)

    def legend(mode: str, lag: str, lr: float) -> str:
        step = f" · lr {lr:g}" if several_lr and lr >= 0 else ""
        return f"{mode} · {LAG_NAMES[lag]}{step}"

    handles = [Line2D([], [], color=group_color[(m, lr)], marker=MARKERS.get(m, "D"), ls=LINESTYLES[lag],
                      markerfacecolor=_face(group_color[(m, lr)], lag), label=legend(m, lag, lr))
               for m, lag, lr in groups]
    axes[-1].legend(handles=handles, fontsize=8, frameon=False, loc="best")
    return _save(fig, out / "staleness_stability.png")


REFERENCE_COLUMNS = ("lag_mean", "final_success", "final_success_lo", "final_success_hi")
"""What a reference's cells CSV holds per cell (``ragen-async bench rllib --csv`` writes it): the measured mean
lag in policy versions, the final success and its 95 % interval (empty with one seed); ``label`` optional."""


def read_reference(path: str | Path) -> pd.DataFrame:
    """A reference's cells (:data:`REFERENCE_COLUMNS`), or :class:`ReportError` naming what is missing."""
    import pandas as pd

    try:
        frame = pd.read_csv(path, comment="#")
    except (OSError, ValueError) as e:
        raise ReportError(f"reference {path}: cannot read it as CSV ({e})") from None
    missing = [c for c in REFERENCE_COLUMNS if c not in frame.columns]
    if missing or frame.empty:
        raise ReportError(f"reference {path}: needs a row per cell with columns {list(REFERENCE_COLUMNS)}"
                          + (f"; missing {missing}" if missing else "; no rows"))
    return frame


def plot_lag_sensitivity(summaries: Sequence[RunSummary], references: dict[str, pd.DataFrame], out: Path
                         ) -> Path | None:
    """Final success against the *measured* mean lag (policy versions), ours beside each reference (e.g.
    RLlib APPO on the same levels): every finished run of ours as a point, each of our cells (k, correction,
    lag mode, step size) at its mean lag with its success interval, each reference cell with its interval.
    Measured lag, not k, is the common axis: a k means different lags in different systems."""
    from matplotlib.figure import Figure

    known = [s for s in summaries if s.k_known and s.finished and math.isfinite(s.staleness_mean)
             and math.isfinite(s.final_val)]
    if not known or not references:
        return None
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    arms: dict[tuple[Any, ...], list[RunSummary]] = {}
    for s in known:
        arms.setdefault((s.off_policy, s.lag, s.actor_lr_key), []).append(s)
    for i, ((mode, lag, lr), members) in enumerate(sorted(arms.items())):
        color = f"C{i}"
        ax.scatter([s.staleness_mean for s in members], [s.final_val for s in members], s=14, alpha=0.5,
                   color=color, marker=MARKERS.get(mode, "D"))
        cells: dict[str, list[RunSummary]] = {}
        for s in members:
            cells.setdefault(s.k_label, []).append(s)
        xs, ys, below, above = [], [], [], []
        for group in sorted(cells.values(), key=lambda g: np.mean([s.staleness_mean for s in g])):
            mean, low, high = study.error_bar([s.final_val for s in group], 0.0, 1.0)
            xs.append(float(np.mean([s.staleness_mean for s in group])))
            ys.append(mean)
            below.append(low)
            above.append(high)
        step = f", lr {lr:g}" if len(arms) > 1 and lr >= 0 else ""
        ax.errorbar(xs, ys, yerr=[below, above], color=color, ls=LINESTYLES[lag], capsize=4, lw=1.4,
                    marker=MARKERS.get(mode, "D"), label=f"ours: {mode}, {LAG_NAMES[lag]}{step}")
    for j, (name, frame) in enumerate(sorted(references.items())):
        frame = frame.sort_values("lag_mean")
        y = frame["final_success"].to_numpy(float)
        lo = np.nan_to_num(y - frame["final_success_lo"].to_numpy(float))
        hi = np.nan_to_num(frame["final_success_hi"].to_numpy(float) - y)
        ax.errorbar(frame["lag_mean"], y, yerr=[lo, hi], color=("black", "dimgray", "gray")[j % 3], ls=":",
                    marker="s", capsize=4, lw=1.4, label=name)
    ax.set(xlabel="measured mean lag of the trained data (policy versions)", ylabel="final success",
           title="final success vs measured lag, beside the reference")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False, loc="best")
    return _save(fig, out / "lag_sensitivity.png")


# ---------------------------------------------------------------------------- the report
@dataclass
class Report:
    markdown: Path
    csv: Path
    plots: list[Path]
    summaries: list[RunSummary]
    warnings: list[str]


def write_report(paths: Sequence[str | Path], out: str | Path, *, threshold: float = 0.9,
                 smooth: int = 1, title: str | None = None, baselines: dict[str, float] | None = None,
                 collapse_floor: float = 0.0, throughput: dict[int | None, float] | None = None,
                 references: dict[str, str | Path] | None = None) -> Report:
    """Read every run under ``paths`` and write ``report.md``, ``summary.csv`` and the plots into ``out``;
    ``baselines`` (name -> validation success, e.g. the random and oracle policies) are drawn as lines
    on every validation-success plot; ``collapse_floor`` is the success a fall is measured towards
    (:mod:`ragen_async.collapse`; the random policy's, for a run that starts well above 0);
    ``throughput`` (k, ``None`` = unbounded -> groups/s measured by ``bench pipeline``) adds the
    equal-time table; ``references`` (name -> cells CSV, :func:`read_reference`) adds the figure of success
    against measured lag beside them."""
    reference_frames = {name: read_reference(path) for name, path in (references or {}).items()}
    runs, warnings = find_runs(paths)
    if not runs:
        raise ReportError("no runs found under " + ", ".join(map(str, paths)) +
                          ("; " + "; ".join(warnings) if warnings else ""))
    warnings += [f"{r.name}: {w}" for r in runs for w in r.warnings]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r, threshold, collapse_floor) for r in runs]
    bands = reference_bands(runs, summaries)
    summaries = [summarize(r, threshold, collapse_floor, bands.get(s.actor_lr_key))
                 if s.actor_lr_key in bands and not s.is_reference else s for r, s in zip(runs, summaries, strict=True)]
    with_data = [r for r in runs if r.train or r.val]
    plots = plot_curves(with_data, out, smooth=smooth, baselines=baselines) if with_data else []
    stability = plot_staleness_summary([s for s, r in zip(summaries, runs, strict=True) if r.train or r.val], out)
    if stability is not None:
        plots.append(stability)
    cells_plot = plot_cells(runs, summaries, out, baselines=baselines)
    if cells_plot is not None:
        plots.append(cells_plot)
    lag_plot = plot_lag_sensitivity(summaries, reference_frames, out)
    if lag_plot is not None:
        plots.append(lag_plot)

    sources = ", ".join(f"`{p}`" for p in paths)
    lines = [f"# {title or 'ragen_async report'}", "",
             f"{len(runs)} runs from {sources}, {time.strftime('%Y-%m-%d %H:%M')}. "
             f"Validation threshold {threshold:g}; reward-std trend = mean of the first vs last 10% of steps; "
             f"{MISSING} = not logged.", "", "## Overview", ""]
    header = [h.format(t=f"{threshold:g}") for h in OVERVIEW]
    lines += [*_table(header, (_overview_row(s) for s in summaries)), ""]
    lines += _cells_section(summaries, collapse_floor)
    lines += _against_sync_section(summaries)
    lines += _equal_time_section(runs, summaries, throughput or {})
    if plots:
        lines += ["## Curves", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots if p.name.startswith("curves_")]
        if stability is not None:
            lines += ["", "## Staleness vs stability", "", f"![staleness vs stability]({stability.name})"]
        if cells_plot is not None:
            lines += ["", "## Cells over steps and wall-clock", "", f"![cells]({cells_plot.name})"]
        if lag_plot is not None:
            lines += ["", "## Beside the reference", "", f"References: {', '.join(sorted(reference_frames))}.", "",
                      f"![lag sensitivity]({lag_plot.name})"]
        lines.append("")
    lines += ["## Runs", ""]
    for run, s in zip(runs, summaries, strict=True):
        lines += _run_section(run, s, threshold)
    if warnings:
        lines += ["## Warnings", "", *[f"- {_cell(w)}" for w in warnings], ""]
    markdown = out / "report.md"
    markdown.write_text("\n".join(lines))

    rows = _csv_rows(summaries)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    csv_path = out / "summary.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return Report(markdown, csv_path, plots, summaries, warnings)
