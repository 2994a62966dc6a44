"""Trajectory types: the unit of data that flows from rollout actors to the learner.

A *group* is N episodes played from the same initial state (same env, same seed); it is the wire
unit. Each :class:`Trajectory` holds the exact token ids the inference engine saw and sampled, in
order, so the learner trains on precisely what the behaviour policy produced and never re-tokenises
text. Invariants (checked by :meth:`Trajectory.validate`):

* ``token_ids``, ``loss_mask``, ``behaviour_logprobs`` and ``token_versions`` have the same length;
* ``loss_mask[i] == 1`` exactly where token ``i`` was sampled by the engine;
* ``behaviour_logprobs[i]`` is the engine's log-prob of a sampled token (finite, <= 0), 0 elsewhere;
* every reward and the format penalty are finite numbers;
* ``token_versions[i]`` is the policy version that produced a sampled token, -1 elsewhere.

On the Ray path the driver never holds a :class:`Trajectory`: it receives a :class:`GroupMeta` of
:class:`TrajectoryMeta`\\ s, every scalar fact of the episodes plus the signed summary of their tokens
(count, versions), with the per-token arrays left as the received wire frames. The buffer, the metrics and
provenance read the same names from both kinds; the learner receives real trajectories.

This module is pure data: no ray, zmq, vllm or torch imports (numpy and msgspec only).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, TypeAlias

import msgspec
import numpy as np

NO_VERSION = -1
"""``token_versions`` value of a token that was not sampled (prompt or environment feedback)."""
_LOGPROB_SLACK = 1e-4
"""A sampled token's log-prob may exceed 0 by this much (float rounding of a log-softmax), no more."""


Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""A float that must be a number: where a msgspec struct is decoded (the codec's headers), NaN and the
infinities are refused (the driver filters and normalises on rewards and scores)."""


class TurnRecord(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False):
    """What happened in one turn of an episode (everything except the tokens themselves).

    A msgspec struct: it is also its own wire form, encoded and type-checked by msgspec in C (a group
    carries dozens of them, and checking them field by field in Python was most of the codec's cost). On
    the wire it is an array of its fields in declaration order (``array_like``: a Sokoban group carries 40
    of them, and their field names were most of its header's bytes).
    ``gc=False`` (here and on the other received structs): none holds a reference that could lead back to
    itself, so the cycle collector need not track them, and with the collector on a header decodes faster
    (docs/changelog.md has the measurement).
    """

    reward: Finite
    """Sum of the environment's step rewards for the actions executed this turn."""
    actions: tuple[str, ...]
    """Valid actions parsed from the reply and sent to the environment (canonical spelling)."""
    num_dropped_actions: int
    """Actions in the reply that were unknown, beyond the per-turn cap, or unparseable."""
    format_ok: bool
    """The reply matched ``<think>…</think><answer>…</answer>`` and produced at least one valid action."""
    policy_version: int
    """Version of the weights loaded in the engine when this turn's generation started."""
    end_policy_version: int
    """Version loaded when the generation finished (differs when weights changed mid-turn)."""
    response_tokens: int
    generate_s: float
    env_step_s: float


TRAJECTORY_ARRAYS: dict[str, str] = {
    "token_ids": "<i4",
    "token_versions": "<i4",
    "behaviour_logprobs": "<f4",
    "loss_mask": "|i1",
}
"""The per-token arrays of a trajectory with the one dtype each must have, in the order they lie in its
wire frame (widest first, so every array starts aligned)."""
TOKEN_FRAME_BYTES = sum(np.dtype(d).itemsize for d in TRAJECTORY_ARRAYS.values())
"""Bytes per token of a trajectory's wire frame (its four arrays back to back)."""


def token_arrays(frame: object, num_tokens: int) -> dict[str, np.ndarray]:
    """The four arrays of a trajectory frame of ``num_tokens`` tokens, as read-only zero-copy views."""
    out, offset = {}, 0
    for name, dtype in TRAJECTORY_ARRAYS.items():
        arr = np.frombuffer(frame, dtype=dtype, count=num_tokens, offset=offset)  # type: ignore[call-overload]
        arr.flags.writeable = False
        out[name] = arr
        offset += arr.nbytes
    return out


VersionCounts: TypeAlias = tuple[tuple[int, int], ...]
"""``((version, sampled tokens), ...)`` in ascending version order: the token-version facts in brief."""


class _EpisodeFacts:
    """What :class:`Trajectory` and :class:`TrajectoryMeta` derive alike from their scalar fields."""

    __slots__ = ()
    turns: tuple[TurnRecord, ...]
    format_penalty: float

    @property
    def env_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def score(self) -> float:
        """Scalar training signal: environment reward plus format penalty (RAGEN's last-token score)."""
        return self.env_reward + self.format_penalty

    @property
    def num_dropped_actions(self) -> int:
        return sum(t.num_dropped_actions for t in self.turns)


@dataclass(frozen=True, slots=True)
class Trajectory(_EpisodeFacts):
    """One episode as a single token sequence plus its per-token and per-turn annotations."""

    traj_id: str
    env_tag: str
    seed: int
    group_id: str
    token_ids: np.ndarray
    """int32 [T]: prompt, then per turn the sampled reply and the env feedback appended by the template."""
    loss_mask: np.ndarray
    """int8 [T]: 1 exactly on tokens sampled by the engine."""
    behaviour_logprobs: np.ndarray
    """float32 [T]: engine log-prob of each sampled token, 0 elsewhere."""
    token_versions: np.ndarray
    """int32 [T]: policy version that produced each sampled token, ``NO_VERSION`` elsewhere."""
    turns: tuple[TurnRecord, ...]
    format_penalty: float
    """Sum of the per-turn format penalties (<= 0)."""
    success: bool
    truncated_by_context: bool = False
    """The episode was ended early because the next turn would not fit in the context budget."""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def oldest_version(self) -> int:
        """Version of the oldest sampled token: a trajectory is as stale as its oldest token."""
        sampled = self.token_versions[self.loss_mask.astype(bool)]
        return int(sampled.min()) if sampled.size else NO_VERSION

    @property
    def version_counts(self) -> VersionCounts:
        """How many sampled tokens each policy version produced (see :data:`VersionCounts`)."""
        return _version_counts(self.token_versions, self.loss_mask.astype(bool), [self.num_tokens])[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the per-token arrays."""
        return sum(getattr(self, name).nbytes for name in TRAJECTORY_ARRAYS)

    def validate(self) -> None:
        """Raise ``ValueError`` if the per-token arrays break the invariants in the module docstring."""
        self._check_shapes()
        _check_token_arrays(self.loss_mask, self.token_versions, self.behaviour_logprobs)
        self._check_rewards()

    def _check_shapes(self) -> None:
        n = self.token_ids.shape[0]
        if self.loss_mask.shape == self.behaviour_logprobs.shape == self.token_versions.shape == (n,):
            return  # the normal case, in one comparison (the codec checks every trajectory it sends or reads)
        for name in ("loss_mask", "behaviour_logprobs", "token_versions"):
            arr = getattr(self, name)
            if arr.ndim != 1 or arr.shape[0] != n:
                raise ValueError(f"{name} has shape {arr.shape}, expected ({n},)")

    def _check_rewards(self) -> None:
        if not all(math.isfinite(r) for r in [*(t.reward for t in self.turns), self.format_penalty]):
            raise ValueError("rewards and the format penalty must be finite")


class InvalidTrajectory(ValueError):
    """A trajectory given to :func:`validate_many` breaks an invariant: the message is the one its own
    :meth:`Trajectory.validate` raises, ``index`` its position in the sequence."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


def validate_many(trajs: Sequence[Trajectory]) -> list[VersionCounts]:
    """:meth:`Trajectory.validate` of every one of ``trajs``, and each one's :attr:`~Trajectory.version_counts`,
    in a few whole-array numpy calls over their concatenated arrays (a group's or a shard's: the codec runs
    this on every message at both ends of the wire, where per-trajectory calls cost more than the checks).
    Raises :class:`InvalidTrajectory` naming a trajectory that fails (the first to fail the first check
    that does: shapes, rewards, then the per-token checks)."""
    if not trajs:
        return []
    for i, t in enumerate(trajs):
        _naming(i, t._check_shapes)
    # One sum for all rewards: finite unless one is not (or, rarely, the sum overflows: then each is checked).
    if not math.isfinite(sum([t.format_penalty for t in trajs]) + sum([x.reward for t in trajs for x in t.turns])):
        for i, t in enumerate(trajs):
            _naming(i, t._check_rewards)
    mask, versions, lp = (np.concatenate([getattr(t, name) for t in trajs])
                          for name in ("loss_mask", "token_versions", "behaviour_logprobs"))
    try:
        _check_token_arrays(mask, versions, lp)
    except ValueError:
        for i, t in enumerate(trajs):  # which one: the checks are per token, so one of them fails alone
            _naming(i, t.validate)
        raise
    return _version_counts(versions, _as_bool(mask), [t.num_tokens for t in trajs])


def _naming(index: int, check: Callable[[], None]) -> None:
    """Run ``check``; its failure becomes the :class:`InvalidTrajectory` of trajectory ``index``."""
    try:
        check()
    except (ValueError, TypeError) as exc:
        raise InvalidTrajectory(index, str(exc)) from exc


def _check_token_arrays(loss_mask: np.ndarray, versions: np.ndarray, lp: np.ndarray) -> None:
    """The per-token invariants (module docstring) on 1-D arrays of equal length: one trajectory's, or
    several trajectories' back to back (every check is per token)."""
    n = loss_mask.shape[0]
    if n and np.asarray(loss_mask).view(np.uint8).max() > 1:  # int8 -1 reads as 255
        raise ValueError("loss_mask must be 0/1")
    mask = _as_bool(loss_mask)
    if not np.array_equal(versions >= 0, mask):
        raise ValueError("every sampled token needs a policy version, and no unsampled token may have one")
    if n and versions.min() < NO_VERSION:
        raise ValueError("unsampled tokens must carry NO_VERSION")
    if np.greater(lp != 0, mask).any():
        raise ValueError("behaviour_logprobs must be 0 on unsampled tokens")
    # NaN compares false with everything (and a max or min over a NaN is NaN), so both bounds refuse it.
    if n and not (lp.max() <= _LOGPROB_SLACK and lp.min() > -math.inf):
        raise ValueError("behaviour_logprobs must be finite log-probabilities (<= 0)")


def _as_bool(loss_mask: np.ndarray) -> np.ndarray:
    """A 0/1 mask as booleans (a free view of int8)."""
    return loss_mask.view(bool) if loss_mask.dtype.itemsize == 1 else loss_mask.astype(bool)


def _version_counts(versions: np.ndarray, mask: np.ndarray, lengths: Sequence[int]) -> list[VersionCounts]:
    """:data:`VersionCounts` of each of the trajectories whose ``versions`` and boolean ``mask`` lie back to
    back with ``lengths``. Per-trajectory reductions first (most episodes sample with one or a few
    versions); a trajectory with several is counted on its own."""
    if not lengths:
        return []
    if min(lengths) == 0:  # reduceat needs non-empty segments
        return [_counts_of(versions[a:b], mask[a:b]) for a, b in _spans(lengths)]
    starts = np.fromiter(_starts(lengths), np.intp, len(lengths))
    sampled = np.add.reduceat(mask, starts, dtype=np.int64).tolist()
    high = np.maximum.reduceat(versions, starts).tolist()  # unsampled tokens are NO_VERSION, below any version
    low = np.minimum.reduceat(np.where(mask, versions, np.iinfo(versions.dtype).max), starts).tolist()
    out: list[VersionCounts] = []
    for (a, b), n, lo, hi in zip(_spans(lengths), sampled, low, high, strict=True):
        out.append(() if n == 0 else ((lo, n),) if lo == hi else _counts_of(versions[a:b], mask[a:b]))
    return out


def _starts(lengths: Sequence[int]) -> Iterator[int]:
    at = 0
    for n in lengths:
        yield at
        at += n


def _spans(lengths: Sequence[int]) -> Iterator[tuple[int, int]]:
    for at, n in zip(_starts(lengths), lengths, strict=True):
        yield at, at + n


def _counts_of(versions: np.ndarray, mask: np.ndarray) -> VersionCounts:
    """:data:`VersionCounts` of one trajectory."""
    sampled = versions[mask]
    if not sampled.size:
        return ()
    low, high = int(sampled.min()), int(sampled.max())
    if high - low > 4 * sampled.size:  # versions far apart: no bincount over the whole range
        found, counts = np.unique(sampled, return_counts=True)
        return tuple(zip(found.tolist(), counts.tolist(), strict=True))
    counts = np.bincount(sampled - low)
    present = np.flatnonzero(counts)
    return tuple(zip((present + low).tolist(), counts[present].tolist(), strict=True))


class TrajectoryMeta(msgspec.Struct, _EpisodeFacts, frozen=True, gc=False):
    """A received trajectory as the driver holds it: the scalar facts, the token summary the producer
    signed, and the per-token arrays still as the wire frames (forwarded to a learner untouched).

    Its arrays are zero-copy views made on demand (``token_ids``, ``materialize``); nothing on the driver's
    hot path reads them. A msgspec struct only because it is built for every received trajectory and a
    struct is built several times faster than a frozen dataclass; it never goes on the wire itself.
    """

    traj_id: str
    env_tag: str
    seed: int
    group_id: str
    turns: tuple[TurnRecord, ...]
    format_penalty: float
    success: bool
    truncated_by_context: bool
    timings: dict[str, float]
    num_tokens: int
    """Length of ``token_ids``."""
    version_counts: VersionCounts
    """Sampled tokens per policy version, as the producer declared them; the learner checks the claim
    against the arrays before training on them."""
    source: tuple[object, object]
    """``(signature, header)`` frames of the message this trajectory came in (forwarded with it)."""
    position: int
    """Index of this trajectory in its message's header."""
    frame: object
    """Its per-token arrays as the received buffer (see :func:`token_arrays`)."""

    @property
    def num_response_tokens(self) -> int:
        return sum(count for _, count in self.version_counts)

    @property
    def oldest_version(self) -> int:
        return self.version_counts[0][0] if self.version_counts else NO_VERSION

    @property
    def nbytes(self) -> int:
        return memoryview(self.frame).nbytes  # type: ignore[arg-type]

    @property
    def token_ids(self) -> np.ndarray:
        """A zero-copy view of the token ids (episode logging); :meth:`materialize` gives all four arrays."""
        return np.frombuffer(self.frame, dtype=TRAJECTORY_ARRAYS["token_ids"], count=self.num_tokens)  # type: ignore[call-overload]

    def materialize(self) -> Trajectory:
        """The trajectory itself, its arrays zero-copy views of the frames (episode logging, tests)."""
        return Trajectory(traj_id=self.traj_id, env_tag=self.env_tag, seed=self.seed, group_id=self.group_id,
                          turns=self.turns, format_penalty=self.format_penalty, success=self.success,
                          truncated_by_context=self.truncated_by_context, timings=self.timings,
                          **token_arrays(self.frame, self.num_tokens))


AnyTrajectory: TypeAlias = Trajectory | TrajectoryMeta
"""What the buffer, metrics and provenance accept: they read only the names both kinds have."""


class _GroupFacts:
    __slots__ = ()
    trajectories: Sequence[AnyTrajectory]
    created_at: float
    finished_at: float

    @property
    def scores(self) -> list[float]:
        return [t.score for t in self.trajectories]

    @property
    def oldest_version(self) -> int:
        return min(t.oldest_version for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trajectories)

    def episode_facts(self) -> dict[str, float | int]:
        """What a comparison of groups needs, from the header alone: mean ``turns`` per episode, generated
        (sampled) ``tokens`` summed over the episodes, the share of episodes that ``success``-ed, and the
        seconds the group was in play (``in_flight_s``, finished - created, on the producer's clock)."""
        trajs = self.trajectories
        return {"turns": round(sum(len(t.turns) for t in trajs) / max(len(trajs), 1), 4),
                "tokens": int(sum(t.num_response_tokens for t in trajs)),
                "success": round(sum(bool(t.success) for t in trajs) / max(len(trajs), 1), 4),
                "in_flight_s": round(float(self.finished_at - self.created_at), 4)}


@dataclass(frozen=True, slots=True)
class TrajectoryGroup(_GroupFacts):
    """N trajectories from one initial state: the unit sent on the wire and filtered by StarPO-S."""

    group_id: str
    """A readable label (``g00000042``); :attr:`index` is what every decision uses."""
    index: int
    """Global sequence index handed out by admission control: it fixes the group's env and seed
    (``rollout.worker.assign_group``) and orders batches deterministically."""
    env_tag: str
    seed: int
    trajectories: tuple[Trajectory, ...]
    worker_id: str = ""
    created_at: float = 0.0
    """Wall time the group was admitted (started)."""
    finished_at: float = 0.0
    """Wall time the last episode of the group finished."""


class GroupMeta(msgspec.Struct, _GroupFacts, frozen=True, gc=False):
    """A received group as the driver holds it (see :class:`TrajectoryMeta`); same fields as
    :class:`TrajectoryGroup`."""

    group_id: str
    index: int
    env_tag: str
    seed: int
    trajectories: tuple[TrajectoryMeta, ...]
    worker_id: str
    created_at: float
    finished_at: float

    def materialize(self) -> TrajectoryGroup:
        """The group itself (see :meth:`TrajectoryMeta.materialize`)."""
        return TrajectoryGroup(group_id=self.group_id, index=self.index, env_tag=self.env_tag, seed=self.seed,
                               trajectories=tuple(t.materialize() for t in self.trajectories),
                               worker_id=self.worker_id, created_at=self.created_at, finished_at=self.finished_at)


AnyGroup: TypeAlias = TrajectoryGroup | GroupMeta


@dataclass(frozen=True, slots=True)
class BatchShard:
    """One learner rank's share of a training batch, as assembled by the trajectory buffer.

    The buffer is the only place that sees the whole batch, so it computes the batch-level values
    every rank needs for identical math: group-normalised scores (GRPO) and the global token and
    sequence counts that loss aggregation divides by, so that data-parallel gradients sum to the
    single-process gradient.
    """

    step: int
    """Learner step this batch is for (0-based)."""
    learner_version: int
    """Policy version of the learner that will consume the batch (for staleness)."""
    trajectories: tuple[AnyTrajectory, ...]
    """Real trajectories once received by a learner; on the driver, the metadata of forwarded ones."""
    scores: np.ndarray
    """float32 [n]: raw trajectory score (env reward + format penalty)."""
    normalized_scores: np.ndarray
    """float32 [n]: score normalised within its group (over the whole batch's groups)."""
    batch_num_tokens: int
    """Sampled (loss-mask) tokens in the whole batch, over all shards."""
    batch_num_seqs: int
    """Trajectories in the whole batch, over all shards."""
    rank: int = 0
    world_size: int = 1
