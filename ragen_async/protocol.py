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

This module is pure data: no ray, zmq, vllm or torch imports (numpy only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NO_VERSION = -1
"""``token_versions`` value of a token that was not sampled (prompt or environment feedback)."""
_LOGPROB_SLACK = 1e-4
"""A sampled token's log-prob may exceed 0 by this much (float rounding of a log-softmax), no more."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """What happened in one turn of an episode (everything except the tokens themselves)."""

    reward: float
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


@dataclass(frozen=True, slots=True)
class Trajectory:
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
    def env_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def score(self) -> float:
        """Scalar training signal: environment reward plus format penalty (RAGEN's last-token score)."""
        return self.env_reward + self.format_penalty

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
    def num_actions(self) -> int:
        return sum(len(t.actions) for t in self.turns)

    @property
    def num_dropped_actions(self) -> int:
        return sum(t.num_dropped_actions for t in self.turns)

    def validate(self) -> None:
        """Raise ``ValueError`` if the per-token arrays break the invariants in the module docstring."""
        n = self.token_ids.shape[0]
        for name in ("loss_mask", "behaviour_logprobs", "token_versions"):
            arr = getattr(self, name)
            if arr.ndim != 1 or arr.shape[0] != n:
                raise ValueError(f"{name} has shape {arr.shape}, expected ({n},)")
        mask = self.loss_mask.astype(bool)
        if not np.all((self.loss_mask == 0) | (self.loss_mask == 1)):
            raise ValueError("loss_mask must be 0/1")
        if np.any(self.token_versions[mask] < 0):
            raise ValueError("every sampled token needs a policy version")
        if np.any(self.token_versions[~mask] != NO_VERSION):
            raise ValueError("unsampled tokens must carry NO_VERSION")
        if np.any(self.behaviour_logprobs[~mask] != 0):
            raise ValueError("behaviour_logprobs must be 0 on unsampled tokens")
        # NaN compares false with everything, so test finiteness first: one NaN would poison a whole batch.
        if not np.all(np.isfinite(self.behaviour_logprobs)) or np.any(self.behaviour_logprobs > _LOGPROB_SLACK):
            raise ValueError("behaviour_logprobs must be finite log-probabilities (<= 0)")
        rewards = [t.reward for t in self.turns] + [self.format_penalty]
        if not all(np.isfinite(r) for r in rewards):
            raise ValueError("rewards and the format penalty must be finite")


@dataclass(frozen=True, slots=True)
class TrajectoryGroup:
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

    @property
    def scores(self) -> list[float]:
        return [t.score for t in self.trajectories]

    @property
    def oldest_version(self) -> int:
        return min(t.oldest_version for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trajectories)


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
    trajectories: tuple[Trajectory, ...]
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
