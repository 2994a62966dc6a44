"""Age accounting: how many versions old a token, a trajectory and a group are, and each step's statistics.

Policy version v = weights after v learner steps. A sampled token produced by version u and trained on at
version v has *staleness* (age) v - u; a trajectory is as stale as its oldest sampled token, a group as its
stalest trajectory (what the buffer's drop rule compares with the bound). Pure: times are passed in, never read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ragen_async.protocol import NO_VERSION, AnyGroup, AnyTrajectory

__all__ = ["StalenessStats", "group_staleness", "staleness_of", "trajectory_staleness"]


def staleness_of(oldest_versions: Sequence[int], learner_version: int) -> int:
    """Staleness of the stalest of some trajectories, given each one's oldest sampled version
    (``Trajectory.oldest_version``); a trajectory that sampled nothing counts 0 (nothing to train on)."""
    return max(0 if oldest == NO_VERSION else learner_version - oldest for oldest in oldest_versions)


def trajectory_staleness(traj: AnyTrajectory, learner_version: int) -> int:
    """Staleness of the trajectory's oldest sampled token; 0 if it sampled nothing (nothing to train on)."""
    return staleness_of([traj.oldest_version], learner_version)


def group_staleness(group: AnyGroup, learner_version: int) -> int:
    """Staleness of the group's stalest trajectory (what the buffer's drop rule compares with k)."""
    return staleness_of([t.oldest_version for t in group.trajectories], learner_version)


def _mean(values: list[float] | list[int]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _max(values: Iterable[float]) -> float:
    return float(max(values, default=0.0))


class StalenessStats:
    """Per-learner-step staleness accounting of the groups a batch trains on.

    Record each consumed group with :meth:`record_group` and each dropped group with
    :meth:`record_dropped`; :meth:`summary` returns the step's metrics and resets. The key set is fixed
    (zeros when nothing was recorded) so dashboards line up across steps and runs:

    * ``staleness/mean|max|min``, ``staleness/tokens``: over consumed sampled tokens (token-weighted).
    * ``staleness/token_hist/{i}`` for i = 0..``hist_max`` and ``staleness/token_hist/overflow``: the
      fraction of those tokens with staleness i (negative staleness, which would be a version-accounting
      bug, lands in bin 0 and shows up in ``staleness/min``).
    * ``staleness/traj_mean|traj_max``: per trajectory (its oldest token).
    * ``staleness/turn_mean|turn_max``: per turn, from the version loaded when the turn started.
    * ``staleness/age_in_flight_s`` (finished_at − created_at) and ``staleness/age_queued_s``
      (consumed_at − finished_at), means over groups, plus their ``_max_s``. The two clocks belong to
      different hosts; keep them NTP-synchronised for the queued age to mean anything across machines.
    * ``staleness/groups``, ``staleness/dropped_groups``: groups consumed and dropped since the last summary.
    """

    def __init__(self, hist_max: int = 8) -> None:
        if hist_max < 0:
            raise ValueError(f"hist_max must be >= 0, got {hist_max}")
        self.hist_max = hist_max
        self._reset()

    def _reset(self) -> None:
        self._hist = np.zeros(self.hist_max + 2, dtype=np.int64)  # bins 0..hist_max, then overflow
        self._token_sum = 0
        self._token_count = 0
        self._token_max: int | None = None
        self._token_min: int | None = None
        self._traj: list[int] = []
        self._turn: list[int] = []
        self._in_flight: list[float] = []
        self._queued: list[float] = []
        self._dropped = 0

    def record_group(self, group: AnyGroup, learner_version: int, consumed_at: float) -> None:
        """Account for a group trained on at ``learner_version``, taken from the buffer at ``consumed_at``.

        Token staleness comes from each trajectory's ``version_counts`` (sampled tokens per version), the
        summary the driver holds without the per-token arrays."""
        for traj in group.trajectories:
            if traj.version_counts:
                versions, counts = np.array(traj.version_counts, dtype=np.int64).T
                s = learner_version - versions
                self._hist += np.bincount(np.clip(s, 0, self.hist_max + 1), weights=counts,
                                          minlength=self.hist_max + 2).astype(np.int64)
                self._token_sum += int((s * counts).sum())
                self._token_count += int(counts.sum())
                hi, lo = int(s.max()), int(s.min())
                self._token_max = hi if self._token_max is None else max(self._token_max, hi)
                self._token_min = lo if self._token_min is None else min(self._token_min, lo)
            self._traj.append(trajectory_staleness(traj, learner_version))
            self._turn.extend(learner_version - turn.policy_version for turn in traj.turns)
        self._in_flight.append(group.finished_at - group.created_at)
        self._queued.append(consumed_at - group.finished_at)

    def record_dropped(self, n: int = 1) -> None:
        self._dropped += n

    def summary(self) -> dict[str, float]:
        """This step's metrics (see the class docstring); resets the accumulators."""
        tokens = self._token_count
        out: dict[str, float] = {
            "staleness/mean": self._token_sum / tokens if tokens else 0.0,
            "staleness/max": float(self._token_max or 0),
            "staleness/min": float(self._token_min or 0),
            "staleness/tokens": float(tokens),
        }
        fractions = self._hist / tokens if tokens else np.zeros_like(self._hist, dtype=np.float64)
        for i in range(self.hist_max + 1):
            out[f"staleness/token_hist/{i}"] = float(fractions[i])
        out["staleness/token_hist/overflow"] = float(fractions[-1])
        out.update(
            {
                "staleness/traj_mean": _mean(self._traj),
                "staleness/traj_max": _max(self._traj),
                "staleness/turn_mean": _mean(self._turn),
                "staleness/turn_max": _max(self._turn),
                "staleness/age_in_flight_s": _mean(self._in_flight),
                "staleness/age_in_flight_max_s": _max(self._in_flight),
                "staleness/age_queued_s": _mean(self._queued),
                "staleness/age_queued_max_s": _max(self._queued),
                "staleness/groups": float(len(self._in_flight)),
                "staleness/dropped_groups": float(self._dropped),
            }
        )
        self._reset()
        return out
