"""Collapse of a run, as the staleness study defines it: validation success that fell below a fraction
(default one half) of its peak and stayed there for at least ``min_points`` validations (default 2).

:func:`find_collapse` judges a finished series (the collapse must last to its end); :class:`CollapseWatch`
applies the same rule online, validation by validation, to raise an alert while a run is going.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Collapse:
    collapsed: bool
    step: int | None
    peak: float
    peak_step: int | None


def find_collapse(steps: np.ndarray, success: np.ndarray, fraction: float = 0.5, min_points: int = 2) -> Collapse:
    """Whether (and when) validation success collapsed for good: the final stretch below the line,
    after the peak, of at least ``min_points`` validations. A run whose peak is 0 cannot collapse."""
    if not success.size:
        return Collapse(False, None, math.nan, None)
    i_peak = int(np.argmax(success))
    peak = float(success[i_peak])
    if peak <= 0:
        return Collapse(False, None, peak, int(steps[i_peak]))
    below = success < fraction * peak
    # The final stretch of consecutive validations below the line.
    start = len(below)
    while start > 0 and below[start - 1]:
        start -= 1
    collapsed = start > i_peak and len(below) - start >= min_points
    return Collapse(collapsed, int(steps[start]) if collapsed else None, peak, int(steps[i_peak]))


class CollapseWatch:
    """The collapse definition, online: :meth:`update` with each validation returns True when the last
    ``min_points`` validations all lie below ``fraction`` of the peak before them (once per fall; a
    recovery above the line re-arms it). What fires here may still recover later; the report's
    :func:`find_collapse` only calls a collapse one that lasted to the end."""

    def __init__(self, fraction: float = 0.5, min_points: int = 2):
        self.fraction, self.min_points = fraction, min_points
        self.peak = -math.inf
        self.below = 0
        self.fired = False

    def update(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.peak > 0 and value < self.fraction * self.peak:
            self.below += 1
        else:
            self.below, self.fired = 0, False
            self.peak = max(self.peak, value)
        if self.below >= self.min_points and not self.fired:
            self.fired = True
            return True
        return False
