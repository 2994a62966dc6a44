"""``ragen-async make-model``: build (or reuse) the tiny model and print the builder's sanity report.

The project CLI (``ragen_async.cli``) is the only command line: ``ragen-async make-model`` runs
:func:`make_model`.
"""

from __future__ import annotations

from pathlib import Path

from ragen_async.tinymodel.build import DEFAULT_OUT_DIR, TinyModelConfig, ensure_tiny_model


def make_model(out_dir: Path | str = DEFAULT_OUT_DIR, seed: int = 0, force: bool = False,
               sft_steps: int | None = None, report: bool = True, seeds_per_tag: int = 64) -> Path:
    """Build the tiny model into ``out_dir`` unless a complete build of the same config is there, then
    print the base model's exact bandit arm probabilities and (``report``) a table of how it plays
    every env tag (transformers engine, a few minutes on 2 cores)."""
    overrides = {} if sft_steps is None else {"sft_steps": sft_steps}
    path = ensure_tiny_model(Path(out_dir), seed=seed, config=TinyModelConfig(**overrides), force=force)
    from ragen_async.tinymodel.report import report_arm_probabilities, report_base_policy

    if report:
        report_base_policy(path, seeds_per_tag=seeds_per_tag)
    else:
        report_arm_probabilities(path)
    return path
