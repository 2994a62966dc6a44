"""The FLOP count and the peaks of ``ragen-async bench learner``: the ones a training run logs with.

The count (torchtitan's ``6 · N + 12 · layers · heads · head_dim · L`` per token, ``N`` every parameter but the
embedding), verl's tokens per second per GPU and the table of peaks live in :mod:`ragen_async.learner.flops`,
where the learner uses them for its ``learner/mfu``; the benchmark imports them from here, so both report the
same figure for the same step (see that module for the definitions).
"""

from __future__ import annotations

from ragen_async.learner.flops import (
    NO_PEAK,
    PEAKS,
    ModelDims,
    Peak,
    StepFlops,
    StepPlan,
    device_peak,
    dims_of,
    flops_per_token,
    learner_step_flops,
    tokens_per_s_per_gpu,
    train_flops,
)

__all__ = ["NO_PEAK", "PEAKS", "ModelDims", "Peak", "StepFlops", "StepPlan", "device_peak", "dims_of",
           "flops_per_token", "learner_step_flops", "tokens_per_s_per_gpu", "train_flops"]
