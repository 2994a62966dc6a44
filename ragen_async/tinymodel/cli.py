"""``ragen-async make-model``: build (or reuse) the tiny model and print the builder's sanity report.

The project CLI wires :func:`make_model` as its ``make-model`` command; ``python -m
ragen_async.tinymodel`` runs the same thing through :func:`main`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ragen_async.tinymodel.build import DEFAULT_OUT_DIR, TinyModelConfig, ensure_tiny_model


def make_model(out_dir: Path | str = DEFAULT_OUT_DIR, seed: int = 0, force: bool = False,
               sft_steps: int | None = None, report: bool = True, seeds_per_tag: int = 64) -> Path:
    """Build the tiny model into ``out_dir`` unless a complete build of the same config is there, then
    (``report``) evaluate the base policy with the transformers engine and print a table."""
    overrides = {} if sft_steps is None else {"sft_steps": sft_steps}
    path = ensure_tiny_model(Path(out_dir), seed=seed, config=TinyModelConfig(**overrides), force=force)
    if report:
        from ragen_async.tinymodel.report import report_base_policy

        report_base_policy(path, seeds_per_tag=seeds_per_tag)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ragen-async make-model", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where the model goes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="build seed (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build of the same config exists")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start steps (default: the config's)")
    parser.add_argument("--no-report", action="store_true", help="skip the base-policy report")
    parser.add_argument("--seeds-per-tag", type=int, default=64, help="episodes per env tag in the report")
    args = parser.parse_args(argv)
    make_model(args.out_dir, seed=args.seed, force=args.force, sft_steps=args.sft_steps,
               report=not args.no_report, seeds_per_tag=args.seeds_per_tag)
    return 0
