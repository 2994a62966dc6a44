"""The adaptive bound's rules: what the next bound is, given one verdict per learner step.

:class:`AdaptiveBound` follows the early warnings (``staleness.collapse.EarlyWarning``), :class:`KLTargetBound` the stale
tokens' KL against a target. Both are pure and deterministic; :class:`~ragen_async.staleness.bound.StalenessBound`
feeds them and carries out what they decide.
"""

from __future__ import annotations

import math

__all__ = ["AdaptiveBound", "KLTargetBound"]


class AdaptiveBound:
    """Adaptive staleness: the bound ``max_staleness`` halves (down to ``lowest``) at a step where an
    early-warning signal fired, and grows by one (up to ``start``, where it starts) after ``patience`` quiet
    steps in a row.

    With ``start`` ``None`` it starts unbounded (``max_staleness`` is ``None``): the first warning sets the
    bound to ``engage``, later ones halve it, and the quiet step that would raise it past ``engage`` lifts it
    (unbounded again). Pure and deterministic: the caller feeds one verdict per learner step."""

    def __init__(self, start: int | None, lowest: int = 0, patience: int = 10, engage: int | None = None) -> None:
        top = engage if start is None else start
        if top is None or not 0 <= lowest <= top or patience < 1:
            raise ValueError(f"need 0 <= lowest <= start (or engage, when starting unbounded) and patience >= 1 "
                             f"(got lowest {lowest}, start {start}, engage {engage}, patience {patience})")
        self.start, self.lowest, self.patience, self.engage = start, lowest, patience, engage
        self.max_staleness: int | None = start
        self.quiet = 0
        self.reason = ""
        """Why the last :meth:`update` moved the bound (``""``: it did not)."""

    def update(self, warned: bool) -> int | None:
        """The bound for the next steps (``None``: unbounded), after a step with (``warned``) or without a
        warning."""
        bound = self.max_staleness
        if warned:
            self.max_staleness, self.quiet = max(self.lowest, self.engage if bound is None else bound // 2), 0
        else:
            self.quiet += 1
            if bound is not None and self.quiet >= self.patience:
                if self.start is None and bound >= self.engage:
                    self.max_staleness, self.quiet = None, 0
                elif self.start is None or bound < self.start:
                    self.max_staleness, self.quiet = bound + 1, 0
        self.reason = ("" if self.max_staleness == bound else "a warning" if warned
                       else f"no warning for {self.patience} steps")
        return self.max_staleness

    def state(self) -> dict[str, int | None]:
        return {"max_staleness": self.max_staleness, "quiet": self.quiet}

    def restore(self, state: dict) -> None:
        bound = state["max_staleness"] if "max_staleness" in state else state["k"]  # "k": older checkpoints
        self.max_staleness = None if bound is None else int(bound)
        self.quiet = int(state["quiet"])


class KLTargetBound:
    """Staleness held to a drift target: the bound moves so that the stale tokens' behaviour/learner KL
    (``stale/k3_kl``, :func:`ragen_async.staleness.collapse.stale_tokens`) stays under ``target``.

    Each learner step with stale tokens updates a moving average of log KL (span ``span``). Above ``log target``
    the bound is cut at once to ``floor(bound * sqrt(target / KL))`` (at least one lower; KL grows about as the
    square of the age), then held while the groups admitted under the old bound drain (in order they are consumed
    first, at their old age, so the cut shows in the KL only then) and for ``span`` steps after: only a step whose
    consumed groups were all admitted under the current bound or a tighter one (``consumed_bound``) counts towards
    the hold. After ``patience`` steps in a row under half the target it rises by one. It stays within ``lowest`` .. ``highest`` and starts at ``start``: always finite,
    so at most ``(bound + 1) * groups_per_step`` groups are in flight and a cut bites within ``bound`` steps.
    A step without stale tokens (none consumed yet) decides nothing. Pure and deterministic:
    the caller feeds one KL (or ``None``) per learner step and reads :attr:`reason` for the change it made."""

    def __init__(self, target: float, start: int, lowest: int = 1, highest: int | None = None, patience: int = 10,
                 span: int = 5) -> None:
        highest = start if highest is None else highest
        if not target > 0 or not 0 <= lowest <= start <= highest or patience < 1 or span < 1:
            raise ValueError(f"need target > 0, 0 <= lowest <= start <= highest, patience >= 1 and span >= 1 "
                             f"(got target {target}, lowest {lowest}, start {start}, highest {highest}, "
                             f"patience {patience}, span {span})")
        self.target, self.lowest, self.highest, self.patience, self.span = target, lowest, highest, patience, span
        self.max_staleness: int = start
        self.average: float | None = None
        """The moving average of log KL (``None`` before the first step with stale tokens)."""
        self.quiet = 0
        self.hold = 0
        self.reason = ""
        """Why the last :meth:`update` moved the bound (``""``: it did not)."""

    @property
    def kl(self) -> float | None:
        """The averaged KL the controller compares with its target."""
        return None if self.average is None else math.exp(self.average)

    def update(self, kl: float | None, consumed_bound: int | None = None) -> int:
        """The bound for the next steps after a step whose stale tokens' KL was ``kl`` (``None``: none stale) and
        whose consumed groups were admitted under bounds up to ``consumed_bound`` (``None``: not known, the step
        counts as measured under the current bound)."""
        bound, self.reason = self.max_staleness, ""
        if consumed_bound is None or consumed_bound <= bound:
            self.hold = max(0, self.hold - 1)
        if kl is None or not math.isfinite(kl) or kl <= 0:
            return bound  # nothing measured: nothing decided
        alpha = 2.0 / (self.span + 1)
        self.average = math.log(kl) if self.average is None else alpha * math.log(kl) + (1 - alpha) * self.average
        over = self.average > math.log(self.target)
        if over and self.hold == 0 and bound > self.lowest:
            scaled = math.floor(bound * math.sqrt(self.target / math.exp(self.average)) + 1e-9)
            self.max_staleness = max(self.lowest, min(bound - 1, scaled))
            self.hold, self.quiet = self.span, 0
            self.reason = f"stale KL {math.exp(self.average):.2e} over the target {self.target:.2e}"
        elif self.average < math.log(self.target / 2):
            self.quiet += 1
            if self.quiet >= self.patience and bound < self.highest:
                self.max_staleness, self.quiet = bound + 1, 0
                self.reason = f"stale KL under half the target for {self.patience} steps"
        else:
            self.quiet = 0
        return self.max_staleness

    def state(self) -> dict[str, float | int | None]:
        return {"max_staleness": self.max_staleness, "average": self.average, "quiet": self.quiet, "hold": self.hold}

    def restore(self, state: dict) -> None:
        self.max_staleness = int(state["max_staleness"])
        self.average = None if state["average"] is None else float(state["average"])
        self.quiet, self.hold = int(state["quiet"]), int(state["hold"])
