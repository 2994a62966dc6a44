"""Collapse of a run and its early warnings, as the staleness study defines them.

**The line**: a ``fraction`` (default one half) of the way from a ``floor`` to the peak validation success
so far: ``floor + fraction * (peak - floor)``. With ``floor`` 0 (the default) that is half the peak; with
the task's random-policy success it is half the gain over random lost, which is what "fell" means for a
run that starts from a warm start well above random play.

**A fall**: at least ``min_points`` validations in a row (default 2) below the line; its step is the first
of them. :class:`CollapseWatch` applies the rule online, validation by validation, to raise an alert
while a run is going. **A collapse** is a fall that lasted to the end of the run: :func:`find_collapse`
judges a finished series and reports both (a run can fall and recover: that is a fall, not a collapse).

**Early warnings** (RAGEN's Echo-Trap signals), :class:`EarlyWarning`, step by step:

- ``reward_std``: the in-group reward std, as a trailing mean of ``window`` steps, falls below ``fraction``
  of its highest smoothed value so far;
- ``entropy``: the policy entropy, as a trailing mean of ``window`` steps, falls below ``fraction`` of its
  mean over the first ``window`` steps;
- ``grad_norm``: the step's gradient norm above ``spike`` (default 3) times the median of the previous
  ``window`` steps;

and three that read staleness itself, on the step's stale tokens (trained at least one version after the
one that generated them; :func:`stale_tokens` pools them from the per-lag metrics):

- ``stale_kl``: their behaviour/learner KL (k3) above ``spike`` times the median of the previous ``window``
  steps that had stale tokens;
- ``stale_ess``: the step's importance-weight effective sample size of its stale tokens (over the token
  count, 1 = no mismatch) below ``fraction``;
- ``kl_rise``: their KL on a log scale, as an exponential moving average over ``KL_RISE_SPAN`` steps, more than
  ``KL_RISE_MADS`` median absolute deviations above the median of its previous ``KL_RISE_TRAILING`` values
  (after ``KL_RISE_WARMUP`` steps with stale tokens): a rise of the drift against the run's own recent level,
  where ``stale_kl`` compares one step with a fixed multiple. How it fares on the study's runs:
  studies/newlevels/README.md, "The KL-target controller: the design read".

The report replays finished runs through the same class, and the adaptive staleness bound reacts to it
while a run goes (to the signals ``staleness.adaptive_signals`` names), so both read one definition.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import get_args

import numpy as np

from ragen_async.config import EarlyWarningSignal


@dataclass(frozen=True)
class Collapse:
    collapsed: bool
    """Fell and stayed below the line to the end of the run."""
    step: int | None
    """The first validation of the final stretch below the line (collapsed runs)."""
    peak: float
    peak_step: int | None
    fell: int | None = None
    """The first validation of the first fall (``None``: it never fell), collapsed or recovered."""


def find_collapse(steps: np.ndarray, success: np.ndarray, fraction: float = 0.5, min_points: int = 2,
                  floor: float = 0.0) -> Collapse:
    """Whether (and when) validation success fell (:class:`CollapseWatch`'s rule replayed) and whether it
    collapsed for good: the final stretch below the line drawn from the overall peak, after the peak, of at
    least ``min_points`` validations. A run whose peak is not above ``floor`` cannot fall."""
    if not success.size:
        return Collapse(False, None, math.nan, None)
    watch, fell = CollapseWatch(fraction, min_points, floor), None
    for i, value in enumerate(success):
        if watch.update(float(value)) and fell is None:
            fell = int(steps[i - min_points + 1])
    i_peak = int(np.argmax(success))
    peak = float(success[i_peak])
    if peak <= floor:
        return Collapse(False, None, peak, int(steps[i_peak]))
    below = success < floor + fraction * (peak - floor)
    # The final stretch of consecutive validations below the line.
    start = len(below)
    while start > 0 and below[start - 1]:
        start -= 1
    collapsed = start > i_peak and len(below) - start >= min_points
    return Collapse(collapsed, int(steps[start]) if collapsed else None, peak, int(steps[i_peak]), fell)


class CollapseWatch:
    """A fall, online: :meth:`update` with each validation returns True when the last ``min_points``
    validations all lie below the line drawn from the peak before them (once per fall; a recovery above the
    line re-arms it). What fires here may still recover later; the report's :func:`find_collapse` calls a
    collapse only a fall that lasted to the end."""

    def __init__(self, fraction: float = 0.5, min_points: int = 2, floor: float = 0.0):
        self.fraction, self.min_points, self.floor = fraction, min_points, floor
        self.peak = -math.inf
        self.below = 0
        self.fired = False

    def state(self) -> dict[str, float | int | bool | None]:
        """Peak, validations below it and whether the alert fired: what a resumed run must remember."""
        return {"peak": self.peak if math.isfinite(self.peak) else None, "below": self.below, "fired": self.fired}

    def restore(self, state: dict[str, float | int | bool | None]) -> None:
        self.peak = -math.inf if state["peak"] is None else float(state["peak"])
        self.below, self.fired = int(state["below"]), bool(state["fired"])

    @property
    def line(self) -> float:
        """Validation success below which a validation counts towards a fall."""
        return self.floor + self.fraction * (self.peak - self.floor)

    def update(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.peak > self.floor and value < self.line:
            self.below += 1
        else:
            self.below, self.fired = 0, False
            self.peak = max(self.peak, value)
        if self.below >= self.min_points and not self.fired:
            self.fired = True
            return True
        return False


SIGNALS: tuple[str, ...] = get_args(EarlyWarningSignal)
"""The early-warning signals, in report order (the names ``staleness.adaptive_signals`` accepts)."""
SIGNAL_KEYS = {"reward_std": "rollout/in_group_reward_std", "entropy": "actor/entropy", "grad_norm": "actor/grad_norm",
               "stale_kl": "stale/k3_kl", "stale_ess": "stale/is_ess", "kl_rise": "stale/k3_kl"}
"""The step metric each signal reads (``stale/*``: :func:`stale_tokens`)."""
SPIKES = frozenset({"grad_norm", "stale_kl"})
"""Signals that fire on a spike over the median of the previous ``window`` values."""
KL_RISE_SPAN = 5
"""``kl_rise``: span of the moving average of log KL (weight 2 / (span + 1) on the newest step)."""
KL_RISE_TRAILING = 50
"""``kl_rise``: how many previous averages its median and median absolute deviation are taken over."""
KL_RISE_MADS = 2.0
"""``kl_rise``: how many median absolute deviations above that median fire it."""
KL_RISE_WARMUP = 15
"""``kl_rise``: previous averages needed before it may fire."""


def stale_tokens(metrics: dict[str, float]) -> dict[str, float]:
    """A step's stale tokens (age >= 1 version) pooled from its per-lag metrics (``lag/{s}/tokens``,
    ``lag/{s}/k3_kl``, ``lag/{s}/is_ess``, ``algo/diagnostics.lag_metrics``): ``stale/tokens`` and the
    token-weighted means ``stale/k3_kl`` and ``stale/is_ess`` (of the per-lag effective sample sizes);
    empty when none of the step's tokens was stale."""
    tokens = kl = ess = 0.0
    for key, n in metrics.items():
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != "lag" or parts[2] != "tokens" or parts[1] in ("0", "0+") or not n:
            continue
        bucket = f"lag/{parts[1]}"
        tokens += n
        kl += n * metrics.get(f"{bucket}/k3_kl", math.nan)
        ess += n * metrics.get(f"{bucket}/is_ess", math.nan)
    return {"stale/tokens": tokens, "stale/k3_kl": kl / tokens, "stale/is_ess": ess / tokens} if tokens else {}


class EarlyWarning:
    """The early-warning signals, online (see the module docstring): feed each learner step's metrics
    to :meth:`update`, which returns the signals that fire at that step. A missing or non-finite value
    leaves its signal's history unchanged and it does not fire."""

    def __init__(self, window: int = 5, fraction: float = 0.5, spike: float = 3.0):
        if window < 1 or not 0 < fraction < 1 or spike <= 1:
            raise ValueError("window >= 1, 0 < fraction < 1 and spike > 1 are required")
        self.window, self.fraction, self.spike = window, fraction, spike
        self.recent = {s: deque(maxlen=window) for s in SIGNALS}
        self.reward_std_peak = -math.inf
        self.entropy_start: list[float] = []
        self.kl_average: float | None = None
        """``kl_rise``: the moving average of log KL (``None`` before the first step with stale tokens)."""
        self.kl_history: deque[float] = deque(maxlen=KL_RISE_TRAILING)
        """``kl_rise``: the previous averages it compares with."""

    def update(self, metrics: dict[str, float]) -> set[str]:
        fired = set()
        if SIGNAL_KEYS["stale_kl"] not in metrics:
            metrics = {**metrics, **stale_tokens(metrics)}
        for signal, key in SIGNAL_KEYS.items():
            value = metrics.get(key)
            if value is None or not math.isfinite(value):
                continue
            recent = self.recent[signal]
            if signal in SPIKES:
                if len(recent) == self.window and value > self.spike * float(np.median(recent)):
                    fired.add(signal)
                recent.append(value)
                continue
            if signal == "stale_ess":
                if value < self.fraction:
                    fired.add(signal)
                continue
            if signal == "kl_rise":
                if value > 0 and self._kl_rises(math.log(value)):
                    fired.add(signal)
                continue
            recent.append(value)
            smooth = sum(recent) / len(recent)
            if signal == "reward_std":
                self.reward_std_peak = max(self.reward_std_peak, smooth)
                if smooth < self.fraction * self.reward_std_peak:
                    fired.add(signal)
            else:
                if len(self.entropy_start) < self.window:
                    self.entropy_start.append(value)
                if smooth < self.fraction * (sum(self.entropy_start) / len(self.entropy_start)):
                    fired.add(signal)
        return fired

    def _kl_rises(self, log_kl: float) -> bool:
        """``kl_rise`` at a step whose stale tokens' KL is ``exp(log_kl)``: the new average against the previous ones."""
        alpha = 2.0 / (KL_RISE_SPAN + 1)
        average = log_kl if self.kl_average is None else alpha * log_kl + (1 - alpha) * self.kl_average
        history = np.asarray(self.kl_history)
        fires = False
        if history.size >= KL_RISE_WARMUP:
            median = float(np.median(history))
            fires = average > median + KL_RISE_MADS * float(np.median(np.abs(history - median)))
        self.kl_average = average
        self.kl_history.append(average)
        return fires

    def state(self) -> dict:
        """JSON-serialisable, for checkpoints."""
        return {"recent": {s: list(v) for s, v in self.recent.items()}, "reward_std_peak": self.reward_std_peak,
                "entropy_start": self.entropy_start, "kl_average": self.kl_average,
                "kl_history": list(self.kl_history)}

    def restore(self, state: dict) -> None:
        for s, values in state["recent"].items():
            self.recent[s] = deque(values, maxlen=self.window)
        self.reward_std_peak = float(state["reward_std_peak"])
        self.entropy_start = list(state["entropy_start"])
        self.kl_average = state.get("kl_average")  # absent in checkpoints written before kl_rise
        self.kl_history = deque(state.get("kl_history", []), maxlen=KL_RISE_TRAILING)
