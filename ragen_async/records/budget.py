"""A wall-clock training budget: "train for 20 minutes" as a stopping rule, not a timeout.

Comparisons such as StarPO vs StarPO-S on a fixed budget need both runs to stop at a step boundary,
validate and checkpoint exactly as a step-count run does. Validation time is not charged to the
budget (it is the same for every run and would otherwise punish frequent evaluation).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TrainingBudget:
    """Counts training wall time (excluding paused spans) against an optional limit in minutes."""

    def __init__(self, minutes: float | None, clock: Callable[[], float] = time.monotonic):
        self.limit_s = None if minutes is None else float(minutes) * 60.0
        self._clock = clock
        self._spent_s = 0.0
        self._started: float | None = None

    def start(self) -> None:
        if self._started is None:
            self._started = self._clock()

    def pause(self) -> None:
        """Stop charging time (call before validation); ``start`` resumes."""
        if self._started is not None:
            self._spent_s += self._clock() - self._started
            self._started = None

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps (taken between steps, while paused): the training time already spent."""
        return {"spent_s": self.spent_s}

    def restore(self, state: dict[str, float]) -> None:
        """Continue a resumed run's budget where its checkpoint left it, paused."""
        self._spent_s, self._started = float(state["spent_s"]), None

    @property
    def spent_s(self) -> float:
        running = 0.0 if self._started is None else self._clock() - self._started
        return self._spent_s + running

    @property
    def exhausted(self) -> bool:
        return self.limit_s is not None and self.spent_s >= self.limit_s

    def end_reason(self, done: int, total_steps: int) -> str | None:
        """Why training ends after ``done`` steps (the step count is reached or the budget is spent), or
        ``None`` while it goes on: the line a run prints when it stops, naming the limit that ended it."""
        if done >= total_steps:
            return f"stopped after step {done}: total_steps={total_steps} reached"
        if self.exhausted:
            return (f"stopped after step {done} of total_steps={total_steps}: time_budget_minutes="
                    f"{self.limit_s / 60.0:g} spent ({self.spent_s / 60.0:.1f} min of training)")
        return None
