"""The staleness study's statistics: collapse, its early warnings, and cells of seeds with 95 % intervals.

Collapse and the early-warning signals are defined once, in :mod:`ragen_async.staleness.collapse` (the run's
online alert and the adaptive staleness bound use the same rules). Here:

* A signal's **lead time** is the event step (the first validation of the first fall, ``Collapse.fell``,
  whether or not the run recovered, or of a degradation, below) minus the first step the signal fired within the ``horizon`` steps up
  to it (``None``: it did not fire there, or the run never fell). The horizon (default 25, the specimen
  study's validation interval) keeps a spike long before the fall from counting as its warning.
* A run **degrades** (:func:`degraded_from`) when its validation success stays below the synchronous
  reference (the k = 0 cell at the same step size: the lower end of the 95 % interval of its runs'
  success at each validation step) from some validation to its last, for at least two validations: a
  lasting shortfall against k = 0, where a fall (:mod:`ragen_async.staleness.collapse`) is a drop against the run's own
  peak. Leads and false alarms count against the run's first *event*: its first fall or the start of its
  degradation, whichever is earlier.
* A **false alarm** is a firing that no fall follows within ``horizon`` steps (every firing of a run that
  never fell); :func:`false_alarms` counts them, the report gives them per 100 learner steps.
* **Against k = 0.** A cell's difference from the synchronous cell is the difference of the means with
  Welch's 95 % interval (unequal variances, Welch-Satterthwaite degrees of freedom); the **trend** is the
  least-squares slope of a per-run statistic on the run's realised mean staleness, with its 95 % interval
  (t with n - 2 degrees of freedom): how much success one version of mean age costs.
* **Cells.** Runs that differ only in their seed form a cell; a cell reports the mean and the 95 %
  interval half-width ``t(0.975, n - 1) * sd / sqrt(n)`` of each statistic over its seeds (no interval
  with one seed), and where the statistic has a range (a success rate in [0, 1], a rate or a norm above 0)
  the interval clipped to it. A share of runs (how many fell) is a binomial proportion: its interval is
  Wilson's score interval, which stays in [0, 1] and is not empty at 0 of n or n of n.
* **The shape of the cost** (:func:`cost_models`). Two least-squares models of a per-run statistic on
  staleness: *step*, any staleness (k >= 1) costs one constant against k = 0; *linear*, the cost is
  proportional to the run's realised mean age; and both together. Each is judged by AIC (Gaussian
  likelihood, ``n ln(RSS / n) + 2 (coefficients + 1)``) and by its leave-one-cell-out error: each stale
  cell left out in turn, the model refitted on the other cells predicts the cell's mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from ragen_async.staleness.collapse import SIGNAL_KEYS, SIGNALS, EarlyWarning

__all__ = ["welch_difference", "ratio_interval", "trend", "predicted_mean", "signal_steps", "reference_band", "degraded_from", "lead_times", "false_alarms", "interval", "error_bar", "t95", "wilson", "bounds",
           "cell_table", "format_mean_ci", "format_bounds", "SHARE", "UNIT", "POSITIVE", "COST_MODELS", "ModelFit",
           "cost_models"]


def signal_steps(steps: np.ndarray, values: np.ndarray, signal: str, window: int = 5) -> np.ndarray:
    """The steps at which ``signal`` fires on the series ``(steps, values)``: the series replayed
    through :class:`~ragen_async.staleness.collapse.EarlyWarning`, the rule the adaptive bound uses online."""
    if signal not in SIGNALS:
        raise ValueError(f"unknown signal {signal!r}; known: {SIGNALS}")
    warning, key = EarlyWarning(window), SIGNAL_KEYS[signal]
    return np.asarray([int(s) for s, v in zip(steps, values, strict=True) if signal in warning.update({key: float(v)})],
                      dtype=int)


HORIZON = 25
"""Steps before a fall within which a signal's firing counts as its warning."""


def reference_band(curves: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[int, float]:
    """Per validation step that every curve has: the lower end of the 95 % t interval of their values
    (empty with fewer than two curves: no interval, no reference)."""
    if len(curves) < 2:
        return {}
    common = sorted(set.intersection(*(set(int(x) for x in steps) for steps, _ in curves)))
    values = [dict(zip((int(x) for x in steps), values, strict=True)) for steps, values in curves]
    band = {}
    for step in common:
        mean, half, _ = interval([v[step] for v in values])
        band[step] = mean - half
    return band


def degraded_from(steps: np.ndarray, values: np.ndarray, band: dict[int, float], min_points: int = 2) -> int | None:
    """The first validation of the final stretch (at least ``min_points`` validations, ending with the run's
    last one on the band) in which success lies below ``band`` (:func:`reference_band`); None if there is none."""
    on_band = [(int(x), float(v)) for x, v in zip(steps, values, strict=True) if int(x) in band]
    start = None
    for step, value in reversed(on_band):
        if value >= band[step]:
            break
        start = step
    below = sum(1 for step, _ in on_band if start is not None and step >= start)
    return start if start is not None and below >= min_points else None


def _fired(train_steps: dict[str, tuple[np.ndarray, np.ndarray]], signal: str, window: int) -> np.ndarray:
    steps, values = train_steps.get(signal, (np.zeros(0), np.zeros(0)))
    return signal_steps(steps, values, signal, window)


def lead_times(train_steps: dict[str, tuple[np.ndarray, np.ndarray]], event: int | None, window: int = 5,
               horizon: int = HORIZON) -> dict[str, int | None]:
    """Per signal: the ``event`` step (a run's first fall or degradation; ``None``: none) minus the first step
    it fired within ``horizon`` steps up to it."""
    out: dict[str, int | None] = {}
    for signal in SIGNALS:
        fired = _fired(train_steps, signal, window)
        ahead = fired[(fired <= event) & (fired >= event - horizon)] if event is not None else fired[:0]
        out[signal] = int(event - ahead[0]) if ahead.size else None
    return out


def false_alarms(train_steps: dict[str, tuple[np.ndarray, np.ndarray]], event: int | None, window: int = 5,
                 horizon: int = HORIZON) -> dict[str, float]:
    """Per signal: its firings that no event followed within ``horizon`` steps, per 100 of the steps it
    watched (all of a run without an event; before ``event - horizon`` in one with: a run's first event
    ends the count). NaN where it watched no step."""
    out: dict[str, float] = {}
    for signal in SIGNALS:
        steps = train_steps.get(signal, (np.zeros(0), np.zeros(0)))[0]
        fired = _fired(train_steps, signal, window)
        if event is not None:
            steps, fired = steps[steps < event - horizon], fired[fired < event - horizon]
        out[signal] = 100.0 * fired.size / steps.size if steps.size else math.nan
    return out


def t95(n: int) -> float:
    """The t quantile of a two-sided 95 % interval over ``n`` >= 2 values."""
    return float(stats.t.ppf(0.975, n - 1))


def interval(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, 95 % half-width, n) over the finite values; half-width NaN below two values."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    n = int(x.size)
    if n == 0:
        return math.nan, math.nan, 0
    if n == 1:
        return float(x[0]), math.nan, 1
    return float(x.mean()), t95(n) * float(stats.sem(x)), n


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of the p-values ``ps`` (one family): sorted ascending, the i-th smallest
    (i = 0, 1, ...) times m - i, kept non-decreasing along the order and capped at 1, where m counts the finite
    ones. A NaN (a prediction decided by a threshold, or not decided) stays NaN and does not count in m."""
    finite = sorted((p, i) for i, p in enumerate(ps) if math.isfinite(p))
    out, running = [math.nan] * len(ps), 0.0
    for rank, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (len(finite) - rank) * p))
        out[i] = running
    return out


UNIT = (0.0, 1.0)
"""The range of a success rate."""
POSITIVE = (0.0, math.inf)
"""The range of a rate, a norm, a count or an age."""
SHARE = "share"
"""Marks a column of 0/1 values per run whose cell statistic is the share of runs (Wilson interval)."""


def wilson(hits: float, n: int) -> tuple[float, float]:
    """Wilson's 95 % score interval of a share ``hits / n`` (``scipy.stats.binomtest``; NaN, NaN with no trial)."""
    if n <= 0:
        return math.nan, math.nan
    ci = stats.binomtest(round(hits), n).proportion_ci(0.95, method="wilson")
    return float(ci.low), float(ci.high)


def bounds(values: Sequence[float], span: tuple[float, float] | str = (-math.inf, math.inf)
           ) -> tuple[float, float, float, int]:
    """(mean, low, high, n) of the finite ``values``: the t interval clipped to ``span`` (the quantity's
    range), or with ``span=SHARE`` the share of true values and its Wilson interval. Low and high are NaN
    where there is no interval (one value of a continuous quantity, or none)."""
    if span == SHARE:
        x = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not x:
            return math.nan, math.nan, math.nan, 0
        return sum(x) / len(x), *wilson(sum(x), len(x)), len(x)
    mean, half, n = interval(values)
    if not math.isfinite(half):
        return mean, math.nan, math.nan, n
    low, high = span
    return mean, max(low, mean - half), min(high, mean + half), n


def error_bar(values: Sequence[float], low: float = -math.inf, high: float = math.inf) -> tuple[float, float, float]:
    """(mean, length below, length above) of the 95 % interval over ``values``, clipped to the quantity's
    range [low, high] (a success rate cannot leave [0, 1], a norm cannot go below 0); zero lengths with
    fewer than two values."""
    mean, lo, hi, _ = bounds(values, (low, high))
    return (mean, 0.0, 0.0) if not math.isfinite(lo) else (mean, mean - lo, hi - mean)


def cell_table(runs: pd.DataFrame, cell_columns: Sequence[str], value_columns: Sequence[str],
               spans: dict[str, tuple[float, float] | str] | None = None) -> pd.DataFrame:
    """One row per cell (``runs`` grouped by ``cell_columns``, missing values as their own cell):
    ``n`` and, per value column, ``<col>`` (mean), ``<col>_ci`` (95 % half-width), and for the columns
    ``spans`` names, ``<col>_lo`` and ``<col>_hi`` (:func:`bounds`: clipped to the range, or Wilson's
    interval for a share)."""
    spans = spans or {}
    rows = []
    for key, group in runs.groupby(list(cell_columns), dropna=False, sort=True):
        row = dict(zip(cell_columns, key if isinstance(key, tuple) else (key,), strict=True))
        row["n"] = len(group)
        for col in value_columns:
            mean, half, _ = interval(group[col].tolist())
            row[col], row[f"{col}_ci"] = mean, half
            if col in spans:
                row[col], row[f"{col}_lo"], row[f"{col}_hi"], _ = bounds(group[col].tolist(), spans[col])
        rows.append(row)
    return pd.DataFrame(rows)


def format_mean_ci(mean: float, half: float, spec: str = ".3f") -> str:
    if not math.isfinite(mean):
        return "—"
    return f"{mean:{spec}}" if not math.isfinite(half) else f"{mean:{spec}} ± {half:{spec}}"


def format_bounds(mean: float, low: float, high: float, spec: str = ".3f") -> str:
    """``mean [low, high]``; the mean alone without an interval, ``—`` without a value."""
    if not math.isfinite(mean):
        return "—"
    return f"{mean:{spec}}" if not math.isfinite(low) else f"{mean:{spec}} [{low:{spec}}, {high:{spec}}]"


def ratio_interval(values: Sequence[float], reference: Sequence[float]) -> tuple[float, float, float]:
    """(mean(values) / mean(reference), low, high): a 95 % interval by the delta method on the log of the ratio,
    with Welch-Satterthwaite degrees of freedom (two or more values a side)."""
    a, b = np.asarray(values, dtype=float), np.asarray(reference, dtype=float)
    parts = [a.var(ddof=1) / (a.size * a.mean() ** 2), b.var(ddof=1) / (b.size * b.mean() ** 2)]
    se = math.sqrt(sum(parts))
    df = sum(parts) ** 2 / sum(p * p / (n - 1) for p, n in zip(parts, (a.size, b.size), strict=True))
    r, t = a.mean() / b.mean(), stats.t.ppf(0.975, df)
    return float(r), float(r * math.exp(-t * se)), float(r * math.exp(t * se))


def welch_difference(values: Sequence[float], reference: Sequence[float]) -> tuple[float, float, float]:
    """(mean(values) - mean(reference), low, high): Welch's 95 % interval of a difference of means
    (``scipy.stats.ttest_ind`` with unequal variances); NaN bounds with fewer than two finite values on a
    side, and a zero-width interval when both sides are constant."""
    a = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    b = np.asarray([v for v in reference if math.isfinite(v)], dtype=float)
    if a.size == 0 or b.size == 0:
        return math.nan, math.nan, math.nan
    diff = float(a.mean() - b.mean())
    if a.size < 2 or b.size < 2:
        return diff, math.nan, math.nan
    if a.var(ddof=1) + b.var(ddof=1) == 0:
        return diff, diff, diff
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    return diff, float(ci.low), float(ci.high)


def predicted_mean(x: Sequence[float], y: Sequence[float], at: float, m: int) -> tuple[float, float, float]:
    """(mean, low, high): what the least-squares line of ``y`` on ``x`` predicts for the mean of ``m`` new
    runs at ``at``, with its 95 % prediction interval, t(0.975, n - 2) · s · sqrt(1/m + 1/n + (at - x̄)² / Sxx)
    (s the residual standard deviation); NaN where :func:`trend` has no slope."""
    pairs = np.asarray([(a, b) for a, b in zip(x, y, strict=True) if math.isfinite(a) and math.isfinite(b)],
                       dtype=float).reshape(-1, 2)
    n = len(pairs)
    if n < 3 or np.ptp(pairs[:, 0]) == 0 or m < 1 or not math.isfinite(at):
        return math.nan, math.nan, math.nan
    fit = stats.linregress(pairs[:, 0], pairs[:, 1])
    residuals = pairs[:, 1] - (fit.intercept + fit.slope * pairs[:, 0])
    s = math.sqrt(float(residuals @ residuals) / (n - 2))
    sxx = float(((pairs[:, 0] - pairs[:, 0].mean()) ** 2).sum())
    mean = float(fit.intercept + fit.slope * at)
    half = float(stats.t.ppf(0.975, n - 2)) * s * math.sqrt(1 / m + 1 / n + (at - pairs[:, 0].mean()) ** 2 / sxx)
    return mean, mean - half, mean + half


def trend(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float, float, int]:
    """(slope, low, high, p, n): the least-squares slope of ``y`` on ``x`` over the pairs where both are
    finite, its 95 % interval and the two-sided p-value of a zero slope; NaN with fewer than three pairs
    or no spread in ``x``."""
    pairs = np.asarray([(a, b) for a, b in zip(x, y, strict=True) if math.isfinite(a) and math.isfinite(b)],
                       dtype=float).reshape(-1, 2)
    n = len(pairs)
    if n < 3 or np.ptp(pairs[:, 0]) == 0:
        return math.nan, math.nan, math.nan, math.nan, n
    fit = stats.linregress(pairs[:, 0], pairs[:, 1])
    half = float(stats.t.ppf(0.975, n - 2)) * float(fit.stderr)
    return float(fit.slope), float(fit.slope) - half, float(fit.slope) + half, float(fit.pvalue), n


COST_MODELS = ("step", "linear", "step + linear")
"""The shapes :func:`cost_models` fits: a constant cost of any staleness, a cost per version of mean age, both."""
TERMS = {"step": ("k ≥ 1",), "linear": ("per version",), "step + linear": ("k ≥ 1", "per version")}
"""Each model's terms after the intercept: the cost of any staleness, the cost per version of mean age."""


@dataclass(frozen=True)
class ModelFit:
    """One model of :func:`cost_models`: its terms' coefficients with 95 % intervals, its fit and its
    out-of-cell prediction error."""

    model: str
    intercept: float
    terms: dict[str, tuple[float, float, float]]
    """Per term (:data:`TERMS`): (coefficient, low, high), the t interval with n - coefficients degrees of freedom."""
    n: int
    rss: float
    aic: float
    loco_rmse: float
    """Root mean square of the errors in each stale cell's mean predicted with that cell left out; NaN where the
    model cannot be fitted without some cell (fewer other cells than coefficients)."""
    loco_cells: int


def _design(model: str, stale: np.ndarray, age: np.ndarray) -> np.ndarray:
    columns = {"step": [stale], "linear": [age], "step + linear": [stale, age]}[model]
    return np.column_stack([np.ones_like(age), *columns])


def _ols(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(coefficients, their 95 % half-widths, residual sum of squares) of the least-squares fit of y on x."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residuals = y - x @ coef
    rss = float(residuals @ residuals)
    dof = len(y) - x.shape[1]
    if dof < 1:
        return coef, np.full(x.shape[1], math.nan), rss
    cov = rss / dof * np.linalg.pinv(x.T @ x)
    return coef, float(stats.t.ppf(0.975, dof)) * np.sqrt(np.diag(cov)), rss


def cost_models(k: Sequence[int | None], age: Sequence[float], y: Sequence[float]) -> list[ModelFit]:
    """Per run its bound ``k`` (0: synchronous; ``None``: unbounded), realised mean ``age`` and statistic ``y``:
    each of :data:`COST_MODELS` with no more coefficients than cells, fitted by least squares over the runs
    where age and y are finite, in that order; an empty list without both a synchronous and a stale cell, or
    with fewer than four runs. The runs
    of one ``k`` are a cell; only stale cells are left out (without k = 0 the step model has no reference)."""
    rows = [(kk, a, b) for kk, a, b in zip(k, age, y, strict=True) if math.isfinite(a) and math.isfinite(b)]
    cells = np.asarray(["∞" if kk is None else str(kk) for kk, _, _ in rows])
    stale = np.asarray([float(kk != 0) for kk, _, _ in rows])
    ages = np.asarray([a for _, a, _ in rows], dtype=float)
    values = np.asarray([b for _, _, b in rows], dtype=float)
    if len(rows) < 4 or stale.all() or not stale.any():
        return []
    fits = []
    for model in COST_MODELS:
        x = _design(model, stale, ages)
        n, p = len(values), x.shape[1]
        if len(set(cells)) < p:  # one coefficient per cell at most: more would fit the seeds' noise
            continue
        coef, half, rss = _ols(x, values)
        errors = []
        for cell in sorted(set(cells[stale == 1])):
            keep = cells != cell
            if len(set(cells[keep])) < p:
                break
            fitted, _, _ = _ols(x[keep], values[keep])
            errors.append(float((x[~keep] @ fitted).mean() - values[~keep].mean()))
        stale_cells = len(set(cells[stale == 1]))
        rmse = math.sqrt(float(np.mean(np.square(errors)))) if len(errors) == stale_cells else math.nan
        terms = {name: (float(c), float(c - h), float(c + h)) for name, c, h in zip(TERMS[model], coef[1:], half[1:],
                                                                                     strict=True)}
        aic = n * math.log(rss / n) + 2 * (p + 1) if rss > 0 else -math.inf
        fits.append(ModelFit(model, float(coef[0]), terms, n, rss, aic, rmse, stale_cells))
    return fits

