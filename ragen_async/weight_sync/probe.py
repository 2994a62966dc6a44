"""The weight-sync probe's verdict: engines and learner must agree on the log-probs of a fixed sequence.

Every ``weight_sync.verify_every``-th sync the driver has each engine and the learner (under the version
published) score the same probe sequence. :func:`check_probe` turns their log-probs into the logged
``weight_sync/probe_max_abs_diff`` and stops the run with :class:`WeightSyncDivergence` when an engine
disagrees by more than the tolerance of the weights' dtype: a sync that loaded the wrong weights (a tensor
left out, a tied head left at an old version, a TP shard at the wrong rank) then ends the run with a clear
error instead of training on samples of another policy.

Tolerances (:data:`PROBE_TOLERANCE`, max |engine - learner| over the probe's positions, in nats): float32
agrees to about 1e-3 (vLLM vs the learner's forward, CPU and GPU; see the runtime tests), so 1e-2 leaves
room; bf16 / fp16 kernels differ more (different reduction orders over every layer, rare tokens scored
far in the tail), so there the check catches wrong weights, not rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ragen_async.weight_sync.base import WeightSyncError

PROBE_TOLERANCE: dict[str, float] = {"float32": 1e-2, "float16": 0.5, "bfloat16": 1.0}
"""Largest max |engine - learner| log-prob difference a healthy sync shows, by the weights' dtype."""


class WeightSyncDivergence(WeightSyncError):
    """An engine's log-probs disagree with the learner's after a sync: it serves other weights."""


def probe_tolerance(dtype: str) -> float:
    """The tolerance for weights of ``dtype`` (``auto``/unknown: the loosest one)."""
    return PROBE_TOLERANCE.get(str(dtype).removeprefix("torch."), max(PROBE_TOLERANCE.values()))


def probe_diffs(learner_lp: Sequence[float], engine_lps: Sequence[Sequence[float]]) -> list[float]:
    """Each engine's max |engine - learner| over the probe's positions after the first (which has no
    prefix, so both sides report 0.0 there)."""
    ref = np.asarray(learner_lp[1:], dtype=np.float64)
    out = []
    for i, lp in enumerate(engine_lps):
        got = np.asarray(lp[1:], dtype=np.float64)
        if got.shape != ref.shape:
            raise WeightSyncDivergence(f"weight-sync probe: engine {i} scored {len(lp)} positions, the learner "
                                       f"{len(learner_lp)}")
        diff = np.abs(got - ref)
        out.append(float("inf") if np.isnan(diff).any() else float(diff.max(initial=0.0)))
    return out


def check_probe(learner_lp: Sequence[float], engine_lps: Sequence[Sequence[float]], *, version: int,
                dtype: str = "float32", tolerance: float | None = None) -> float:
    """The largest disagreement of any engine with the learner (what ``weight_sync/probe_max_abs_diff``
    logs); raises :class:`WeightSyncDivergence` naming the engines, their disagreement, the version and the
    tolerance when it is above ``tolerance`` (default: :func:`probe_tolerance` of ``dtype``)."""
    tol = probe_tolerance(dtype) if tolerance is None else float(tolerance)
    diffs = probe_diffs(learner_lp, engine_lps)
    bad = {i: d for i, d in enumerate(diffs) if not d <= tol}
    if bad:
        detail = ", ".join(f"engine {i}: {d:.3g}" for i, d in bad.items())
        raise WeightSyncDivergence(
            f"weight-sync probe after publishing version {version}: {len(bad)} of {len(diffs)} engine(s) disagree "
            f"with the learner's log-probs of the probe sequence by more than {tol:g} nats ({dtype}): {detail}. "
            "The engines serve other weights than the learner published (a tensor not loaded, a tied output "
            "head left behind, a mis-ranked tensor-parallel worker); stopping the run")
    return max(diffs, default=0.0)
