#!/usr/bin/env python3
"""Replay an early-warning signal on committed runs: feed each learner step's metrics (``metrics.jsonl``, one record
per step, the latest written) to ``staleness.collapse.EarlyWarning`` and print the steps it fires at, beside the steps the
run itself logged (``warning/<signal>``; runs from before the signal existed logged none).

    .venv/bin/python scripts/replay_warnings.py studies/specimen/bounded/runs/*kinf*/*/
    .venv/bin/python scripts/replay_warnings.py --signal stale_kl RUN_DIR ...

A run is a directory holding ``metrics.jsonl``; directories above runs are searched for them. Prints one markdown
row per run and a total: warnings per 100 learner steps replayed.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ragen_async.staleness.collapse import SIGNALS, EarlyWarning
from ragen_async.study.report.runs import RunData


def replay(run_dir: Path, signal: str) -> tuple[list[int], list[int] | None, int]:
    """The steps ``signal`` fires at replayed, the steps the run logged it (None: never logged), the steps seen."""
    train = RunData.load(run_dir).train
    warning, fired, logged = EarlyWarning(), [], []
    key = f"warning/{signal}"
    for record in train:
        step = int(record["learner/step"])
        if signal in warning.update(record):
            fired.append(step)
        value = record.get(key)
        if value is not None and math.isfinite(value) and value > 0:
            logged.append(step)
    return fired, logged if any(key in r for r in train) else None, len(train)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signal", default="stale_ess", choices=SIGNALS)
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args(argv)
    runs = sorted({p.parent for root in args.paths for p in
                   ([root / "metrics.jsonl"] if (root / "metrics.jsonl").exists() else root.rglob("metrics.jsonl"))})
    if not runs:
        print("no metrics.jsonl under " + " ".join(map(str, args.paths)), file=sys.stderr)
        return 2
    print(f"| run | steps | {args.signal} replayed: steps | logged by the run |")
    print("|---|---|---|---|")
    total_fired = total_steps = 0
    for run in runs:
        fired, logged, steps = replay(run, args.signal)
        total_fired, total_steps = total_fired + len(fired), total_steps + steps
        shown = "not logged" if logged is None else ", ".join(map(str, logged)) or "none"
        print(f"| {run} | {steps} | {', '.join(map(str, fired)) or 'none'} | {shown} |")
    rate = 100 * total_fired / total_steps if total_steps else math.nan
    print(f"\n{len(runs)} runs: {args.signal} fired {total_fired} times in {total_steps} steps replayed "
          f"({rate:.2f} per 100 steps).")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
