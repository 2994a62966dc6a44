"""The inference seam: token ids in, token ids + log-probs + policy versions out.

Every engine (scripted fake, transformers, vLLM) implements :class:`InferenceEngine`. Engines know
nothing about text: prompts are token ids and so are replies, so the learner trains on exactly the
ids the engine conditioned on and sampled.

Log-probs are those of the **sampling distribution**: ``log_softmax(logits / temperature)`` at each
position (vLLM ``logprobs_mode="processed_logprobs"``). The learner computes its log-probs by dividing
its logits by the same temperature, so engine and learner log-probs of the same weights agree and the
behaviour/learner ratio measures only staleness and numerics. With ``top_p < 1`` or ``top_k > 0`` the
engine's log-prob is the one under the *truncated, renormalised* distribution (that is what sampled the
token); a learner that does not truncate will see a small systematic mismatch — use top_p=1, top_k=-1
for training.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one reply. ``seed`` makes the request reproducible on its own (per request,
    independent of what else is in the batch); ``None`` draws from the engine's generator.
    ``temperature == 0`` is greedy decoding; its log-probs are then reported at temperature 1."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1 (got {self.top_k})")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {self.max_tokens})")


@dataclass(frozen=True)
class Generation:
    """One sampled reply."""

    token_ids: list[int]
    """Sampled ids, in order (a stop token, when one ended the reply, is included)."""
    logprobs: list[float]
    """Log-prob of each sampled token under the sampling distribution (see module docstring)."""
    start_version: int
    """Policy version loaded in the engine when the generation started (engines that track
    per-token versions report the first sampled token's version: a request queued behind a weight
    update starts on the new weights)."""
    end_version: int
    """Policy version loaded when it finished, i.e. the last sampled token's version where tracked
    (> start_version if weights changed mid-reply)."""
    finish_reason: FinishReason
    """``"stop"``: a stop token ended it; ``"length"``: ``max_tokens`` (or the context) was reached."""
    token_versions: list[int] | None = None
    """Version that produced each sampled token, when the engine tracks it (vLLM weight-version
    spans); ``None`` when unknown — then every token lies in [start_version, end_version]."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} log-probs")
        if self.token_versions is not None and len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.token_versions)} versions")


class InferenceEngine(ABC):
    """A policy that samples replies. All methods may be called concurrently from one event loop."""

    @abstractmethod
    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        """Sample one reply to ``prompt_ids``."""

    @abstractmethod
    async def prompt_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-prob of each token given its prefix, under ``log_softmax(logits / temperature)``;
        position 0 (no prefix) gets 0.0. Used to check engine/learner agreement after a weight sync."""

    @property
    @abstractmethod
    def policy_version(self) -> int:
        """Version of the weights currently loaded."""

    @abstractmethod
    async def load_state_dict(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                              version: int) -> None:
        """Replace (some of) the weights in place with checkpoint-format (HF) names and set the
        version. Requests in flight continue on the new weights."""

    async def served_weights(self) -> tuple[int, list]:
        """``(the version served, one ServedEntry per tensor the forward reads)``
        (:mod:`ragen_async.weight_sync.verify`): what the byte-exact weight check compares with the learner's
        published tensors. Engines without weights cannot take part in the check."""
        raise NotImplementedError(f"{type(self).__name__} cannot report the weights it serves, so the byte-exact "
                                  "weight check cannot run on it (weight_sync.verify_first: false and "
                                  "verify_every: 0 turn the checks off)")

    @abstractmethod
    async def pause(self) -> None:
        """Stop scheduling, keeping in-flight requests (they continue after :meth:`resume`)."""

    @abstractmethod
    async def resume(self) -> None:
        """Resume after :meth:`pause`."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the engine's resources. Idempotent."""

    failure: str | None = None
    """Why the engine was declared unusable (:meth:`mark_failed`), or ``None``."""

    def mark_failed(self, reason: str) -> None:
        """Declare the engine unusable for good, e.g. after a weight update that stopped half way left it with
        weights of no version: from now on it is :attr:`dead`, so its rollout actor exits (to be replaced where
        the runtime replaces actors); the vLLM and fake engines also refuse every request. Idempotent: the
        first reason stays."""
        if self.failure is None:
            self.failure = reason

    @property
    def dead(self) -> bool:
        """The engine failed for good (e.g. its engine-core process died, or :meth:`mark_failed`): every call
        will fail."""
        return self.failure is not None


def token_versions_or_default(gen: Generation) -> list[int]:
    """Per-token versions of ``gen``; the start version for every token when the engine did not
    track them (staleness is then never under-estimated)."""
    if gen.token_versions is not None:
        return list(gen.token_versions)
    return [gen.start_version] * len(gen.token_ids)


def model_eos_token_ids(model_path: str) -> tuple[int, ...]:
    """The checkpoint's EOS ids: ``eos_token_id`` of generation_config.json if it has one, else of
    config.json (an int or a list; none -> ``()``). Engines stop at these unless told not to."""
    for fname in ("generation_config.json", "config.json"):
        path = os.path.join(model_path, fname)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return tuple(sorted({int(eos)} if isinstance(eos, int) else {int(e) for e in eos}))
    return ()
