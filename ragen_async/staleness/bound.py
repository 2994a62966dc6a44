"""The run's staleness bound, held by one object: :class:`StalenessBound`.

Everything that enforces or reports the bound asks it: the trajectory buffer (the bound a group is held to,
:meth:`StalenessBound.of`), the step record (:attr:`~StalenessBound.current`), the provenance (the bound each
consumed group was admitted under) and the checkpoint (:meth:`~StalenessBound.state`). Only it moves the bound
(:meth:`~StalenessBound.move`): at admission, through the runtime's admission handle (the gate may be a Ray actor
in another process; it keeps a copy that only this call writes, and answers the first index admitted under the new
bound), and for the buffer in the same call. Under adaptive staleness it runs the controller
(``controllers.py``) once per learner step (:meth:`~StalenessBound.decide`).

Per-group bounds: in order (``staleness.consume: in_order``) each group keeps the bound it was admitted under, so a
tightening drops nothing already admitted (those groups drain, and the new bound bites once they are consumed);
in arrival order what a group was admitted under is not tracked, and a new bound applies to every group.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ragen_async.staleness.controllers import AdaptiveBound, KLTargetBound

if TYPE_CHECKING:
    from ragen_async.config import StalenessConfig

__all__ = ["HIST_MAX_UNBOUNDED", "AdmissionHandle", "Move", "StalenessBound"]

HIST_MAX_UNBOUNDED = 16
"""The token-age histogram's last bin before overflow when no bound caps the age (``staleness/token_hist/*``)."""


class AdmissionHandle(Protocol):
    """What :meth:`StalenessBound.move` needs of admission (``runtime.base.Admission``: in-process or a Ray actor)."""

    async def set_max_staleness(self, k: int | None) -> int: ...


@dataclass(frozen=True)
class Move:
    """A change of the bound that :meth:`StalenessBound.decide` made."""

    before: int | None
    after: int | None
    why: str

    def line(self, step: Any) -> str:
        """The console and log line that announces it."""
        return f"adaptive staleness: bound {self.before} -> {self.after} after step {step}: {self.why}"


class StalenessBound:
    """The bound ``max_staleness`` (``None``: unbounded) of one run; see the module docstring.

    Args:
        max_staleness: the bound the run starts with (``None``: unbounded).
        per_group: each group keeps the bound it was admitted under (in-order consumption).
        fixed_lag: the bound is an exact lag (``staleness.fixed_lag``); it cannot move.
        controller: the adaptive bound's rule (``staleness.adaptive``), or ``None`` for a fixed bound.
        hist_max: the token-age histogram's last bin (default: the bound, or :data:`HIST_MAX_UNBOUNDED`).
    """

    def __init__(self, max_staleness: int | None, *, per_group: bool = True, fixed_lag: bool = False,
                 controller: AdaptiveBound | KLTargetBound | None = None, hist_max: int | None = None) -> None:
        _check_bound(max_staleness)
        if fixed_lag and max_staleness is None:
            raise ValueError("fixed_lag needs a finite max_staleness (the lag)")
        if fixed_lag and controller is not None:
            raise ValueError("a fixed lag cannot move: no adaptive controller with fixed_lag")
        self.per_group = per_group
        self.fixed_lag = fixed_lag
        self.controller = controller
        """The adaptive bound's rule, fed by :meth:`decide` (``None``: the bound never moves)."""
        self.hist_max = (hist_max if hist_max is not None
                         else HIST_MAX_UNBOUNDED if max_staleness is None else max_staleness)
        self.revision = 0
        """Counts the moves: a cached judgement made under an older revision is stale."""
        self.consumed_bound: int | None = None
        """Adaptive: the loosest bound the last batch's groups were admitted under (``staleness/consumed_bound``)."""
        self._bounds: list[tuple[int, int | None]] = [(0, max_staleness)]
        """The bound by first admitted index, ascending: a group is held to the last entry at or below its index."""

    @classmethod
    def from_config(cls, s: StalenessConfig) -> StalenessBound:
        """The bound a run's ``staleness`` section describes, with its controller when ``adaptive``."""
        controller: AdaptiveBound | KLTargetBound | None = None
        if s.adaptive and s.kl_target is not None:
            controller = KLTargetBound(s.kl_target, s.max_staleness, s.adaptive_min_staleness, s.adaptive_max_staleness,
                                       s.adaptive_patience)
        elif s.adaptive:
            controller = AdaptiveBound(s.max_staleness, s.adaptive_min_staleness, s.adaptive_patience,
                                       s.adaptive_engage_staleness)
        return cls(s.max_staleness, per_group=s.consume == "in_order", fixed_lag=s.fixed_lag, controller=controller,
                   hist_max=s.adaptive_max_staleness if s.adaptive else None)

    # -- what the others ask -----------------------------------------------------------------------

    @property
    def current(self) -> int | None:
        """The bound for groups admitted from now on."""
        return self._bounds[-1][1]

    @property
    def adaptive(self) -> bool:
        return self.controller is not None

    def of(self, index: int) -> int | None:
        """The bound group ``index`` is held to."""
        if not self.per_group:
            return self.current
        at = bisect.bisect_right([i for i, _ in self._bounds], index) - 1
        return self._bounds[max(at, 0)][1]

    def consumed(self, indices: Iterable[int]) -> dict[int, int | None] | None:
        """A batch of these groups was taken: under adaptive staleness, the bound of each (for the provenance),
        and :attr:`consumed_bound` is the loosest of them; ``None`` for a fixed bound."""
        if not self.adaptive:
            return None
        bounds = {i: self.of(i) for i in indices}
        self.consumed_bound = max((b for b in bounds.values() if b is not None), default=None)
        return bounds

    # -- moving it ---------------------------------------------------------------------------------

    def decide(self, record: dict[str, Any], fired: set[str]) -> Move | None:
        """Under adaptive staleness, the controller's verdict after a learner step whose ``record`` holds the
        stale tokens' KL (``stale/k3_kl``) and whose early warnings ``fired``: the move to make, or ``None``.
        Writes ``staleness/consumed_bound``, ``staleness/controller_kl`` (KL target) and ``staleness/bound_change``
        into ``record``. The caller carries the move out (:meth:`move`)."""
        if self.controller is None:
            return None
        before = self.current
        if self.consumed_bound is not None:
            record["staleness/consumed_bound"] = float(self.consumed_bound)
        if isinstance(self.controller, KLTargetBound):
            after = self.controller.update(record.get("stale/k3_kl"), self.consumed_bound)
            record["staleness/controller_kl"] = math.nan if self.controller.kl is None else self.controller.kl
        else:
            after = self.controller.update(bool(fired))
        raised = after is None or (before is not None and after > before)
        record["staleness/bound_change"] = 0.0 if after == before else 1.0 if raised else -1.0
        if after == before:
            return None
        reason = self.controller.reason
        why = reason + (f" ({', '.join(sorted(fired))})" if fired and reason == "a warning" else "")
        return Move(before, after, why)

    async def move(self, k: int | None, admission: AdmissionHandle) -> None:
        """Move the bound for groups admitted from now on to ``k`` (``None`` lifts it): at admission first, whose
        answer (the first index admitted under ``k``) fixes which groups keep the old bound."""
        self._check_movable(k)
        self.moved(k, await admission.set_max_staleness(k))

    def moved(self, k: int | None, first_index: int) -> None:
        """Record a move that admission (held in-process by the caller, ``AdmissionController.set_max_staleness``)
        has made from ``first_index`` on; :meth:`move` is the same with admission behind a handle."""
        self._check_movable(k)
        if self.per_group:
            self._bounds = [(i, b) for i, b in self._bounds if i < first_index] + [(first_index, k)]
        else:
            self._bounds = [(0, k)]
        self.revision += 1

    def _check_movable(self, k: int | None) -> None:
        if self.fixed_lag:
            raise ValueError("a fixed lag cannot move its bound")
        _check_bound(k)

    # -- checkpoints -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The controller's state (``adaptive``) and the bounds by first admitted index (``bounds``), for a
        checkpoint's driver state (:meth:`restore`)."""
        return {"adaptive": self.controller.state() if self.controller is not None else None,
                "bounds": [[i, b] for i, b in self._bounds]}

    async def restore(self, state: dict[str, Any], admission: AdmissionHandle) -> None:
        """Continue a checkpoint's driver state (:meth:`state`'s keys): the controller where it was, admission
        at its bound, and replayed groups (in order) at the bound they were admitted under."""
        if self.controller is None or not state.get("adaptive"):
            return
        self.controller.restore(state["adaptive"])
        k = self.controller.max_staleness
        await admission.set_max_staleness(k)
        if state.get("bounds") and self.per_group:
            self._bounds = [(int(i), None if b is None else int(b)) for i, b in state["bounds"]]
        else:
            self._bounds = [(0, k)]
        self.revision += 1


def _check_bound(k: Any) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"a bound is an integer >= 0 or None (unbounded), got {k!r}")
