"""The staleness study's statistics: collapse, its early warnings, and cells of seeds with 95 % intervals.

Definitions (the report states them next to its tables):

* **Collapse.** A run collapses when its validation success, after reaching its peak, falls below
  ``fraction`` (default one half) of that peak and stays below it at every later validation, for at
  least ``min_points`` validations (default 2; one low last point is not a collapse). The collapse step
  is the first validation step of that final stretch. A run whose peak is 0 cannot collapse.
* **Early warnings** (RAGEN's Echo-Trap signals), each on the training series smoothed by a trailing
  rolling mean of ``window`` steps:

  - ``reward_std``: the in-group reward std falls below ``fraction`` of its highest smoothed value so far;
  - ``entropy``: the policy entropy falls below ``fraction`` of its mean over the first ``window`` steps;
  - ``grad_norm``: a gradient norm above ``spike`` (default 3) times the median of the previous
    ``window`` steps.

  A signal's **lead time** is the collapse step minus the first step the signal fired at or before it
  (``None``: it never fired before the collapse, or there was no collapse).
* **Cells.** Runs that differ only in their seed form a cell; a cell reports the mean and the 95 %
  interval half-width ``t(0.975, n - 1) * sd / sqrt(n)`` of each statistic over its seeds (no interval
  with one seed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats

from ragen_async.collapse import Collapse, CollapseWatch, find_collapse

__all__ = ["SIGNALS", "SIGNAL_KEYS", "Collapse", "CollapseWatch", "find_collapse", "signal_steps", "lead_times",
           "interval", "cell_table", "format_mean_ci"]

SIGNALS = ("reward_std", "entropy", "grad_norm")
"""The early-warning signals, in report order."""
SIGNAL_KEYS = {"reward_std": "rollout/in_group_reward_std", "entropy": "actor/entropy", "grad_norm": "actor/grad_norm"}
"""The metric each signal reads."""


def signal_steps(steps: np.ndarray, values: np.ndarray, signal: str, window: int = 5, fraction: float = 0.5,
                 spike: float = 3.0) -> np.ndarray:
    """The steps at which ``signal`` fires on the series ``(steps, values)`` (see the module docstring)."""
    if signal not in SIGNALS:
        raise ValueError(f"unknown signal {signal!r}; known: {SIGNALS}")
    if not values.size:
        return np.zeros(0, dtype=int)
    series = pd.Series(values, index=steps)
    smooth = series.rolling(window, min_periods=1).mean()
    if signal == "reward_std":
        fired = smooth < fraction * smooth.cummax()
    elif signal == "entropy":
        fired = smooth < fraction * series.iloc[:window].mean()
    else:
        previous = series.shift(1).rolling(window, min_periods=window).median()
        fired = series > spike * previous
    return np.asarray(series.index[fired.to_numpy()], dtype=int)


def lead_times(train_steps: dict[str, tuple[np.ndarray, np.ndarray]], collapse: Collapse, window: int = 5
               ) -> dict[str, int | None]:
    """Per signal: collapse step minus the first step it fired at or before the collapse."""
    out: dict[str, int | None] = {}
    for signal in SIGNALS:
        steps, values = train_steps.get(signal, (np.zeros(0), np.zeros(0)))
        fired = signal_steps(steps, values, signal, window)
        before = fired[fired <= collapse.step] if collapse.collapsed and collapse.step is not None else fired[:0]
        out[signal] = int(collapse.step - before[0]) if before.size else None
    return out


def interval(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, 95 % half-width, n) over the finite values; half-width NaN below two values."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    n = int(x.size)
    if n == 0:
        return math.nan, math.nan, 0
    if n == 1:
        return float(x[0]), math.nan, 1
    half = float(stats.t.ppf(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return float(x.mean()), half, n


def cell_table(runs: pd.DataFrame, cell_columns: Sequence[str], value_columns: Sequence[str]) -> pd.DataFrame:
    """One row per cell (``runs`` grouped by ``cell_columns``, missing values as their own cell):
    ``n`` and, per value column, ``<col>`` (mean), ``<col>_ci`` (95 % half-width)."""
    rows = []
    for key, group in runs.groupby(list(cell_columns), dropna=False, sort=True):
        row = dict(zip(cell_columns, key if isinstance(key, tuple) else (key,), strict=True))
        row["n"] = len(group)
        for col in value_columns:
            mean, half, _ = interval(group[col].tolist())
            row[col], row[f"{col}_ci"] = mean, half
        rows.append(row)
    return pd.DataFrame(rows)


def format_mean_ci(mean: float, half: float, spec: str = ".3f") -> str:
    if not math.isfinite(mean):
        return "—"
    return f"{mean:{spec}}" if not math.isfinite(half) else f"{mean:{spec}} ± {half:{spec}}"
