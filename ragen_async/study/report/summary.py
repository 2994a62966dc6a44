"""One run's numbers (:class:`RunSummary`): validation, staleness, collapse and its early warnings, speed.

Definitions of a fall, a collapse, degradation, lead times and false alarms: :mod:`ragen_async.staleness.collapse` and
:mod:`ragen_async.study.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ragen_async.staleness.collapse import SIGNAL_KEYS, Collapse, find_collapse
from ragen_async.study import stats
from ragen_async.study.report.runs import RunData

FINISHED = ("done", "complete", "time budget")
"""Run statuses that mean its budget was spent (a sweep's ``done``; a lone run's ``complete`` or ``time budget``)."""
LAGS = ("bounded", "fixed", "adaptive")
"""How staleness is set (``RunData.lag``), in the order tables and legends list them."""
CORRECTIONS = ("none", "tis", "decoupled", "opsm", "geo_mask", "geo_tis", "age")
"""Off-policy corrections (``algo.off_policy``, ``algo.corrections.OFF_POLICY_MODES``), in the order tables and legends
list them."""


def correction_order(mode: str) -> int:
    """Where a correction sorts in tables and legends: as in :data:`CORRECTIONS`, unknown last."""
    return CORRECTIONS.index(mode) if mode in CORRECTIONS else len(CORRECTIONS)


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
    placement: str = "shared"
    """``pinned`` or ``shared`` (``RunData.placement``): speeds compare within a placement."""
    actor_lr: float = math.nan
    """The actor's learning rate (NaN where the config does not say): the study's step-size arm."""
    collapse: Collapse = Collapse(False, None, math.nan, None)
    degraded: int | None = None
    """The first validation of a lasting shortfall against the k = 0 cell at the same step size
    (``stats.degraded_from``); None: none, or no such reference."""
    lead: dict[str, int | None] = field(default_factory=dict)
    """Per early-warning signal, steps from its first firing to the run's first event, a fall or a degradation
    (``stats.lead_times``)."""
    false_alarms: dict[str, float] = field(default_factory=dict)
    """Per early-warning signal, firings no event followed, per 100 steps (``stats.false_alarms``)."""
    lag_shares: dict[str, float] = field(default_factory=dict)
    """The realised staleness distribution: per age bucket (``0`` .. ``7``, ``8+`` versions), its share of all
    the tokens the run trained on (from ``lag/{s}/tokens``)."""
    cell: dict[str, str] = field(default_factory=dict)
    """The run's settings other than its seed (flattened config): runs with equal cells are seeds of one cell."""
    drops: dict[str, float] = field(default_factory=dict)
    """What the bound threw away and what it cost (:func:`ragen_async.study.report.drops.attach`: share dropped,
    versions past the bound, generated and consumed groups/s, dropped vs consumed groups); empty without data."""

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
    """One run's numbers; ``band`` (``stats.reference_band`` of the k = 0 cell at the run's step size) makes
    degradation measurable."""
    collapse = find_collapse(*run.val_success(), floor=collapse_floor)
    degraded = stats.degraded_from(*run.val_success(), band) if band else None
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
        groups_per_s=_nanmean(run.series("throughput/groups_per_s")[1]), placement=run.placement,
        collapse=collapse, degraded=degraded,
        lead=stats.lead_times(signals, event), false_alarms=stats.false_alarms(signals, event),
        lag_shares=_lag_shares(run),
        cell=run.cell,
    )


def reference_bands(runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> dict[float, dict[int, float]]:
    """Per actor learning rate: the lower 95 % band of the finished synchronous runs' validation success
    (``stats.reference_band``; a rate with fewer than two such runs has none)."""
    curves: dict[float, list[tuple[np.ndarray, np.ndarray]]] = {}
    for run, s in zip(runs, summaries, strict=True):
        if s.is_reference:
            curves.setdefault(s.actor_lr_key, []).append(run.val_success())
    return {lr: band for lr, c in curves.items() if (band := stats.reference_band(c))}
