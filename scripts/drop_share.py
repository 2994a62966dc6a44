#!/usr/bin/env python3
"""The groups a run's buffer dropped, from its committed ``provenance.jsonl`` and ``metrics.jsonl``: per run and per
cell, the share of its generated groups (consumed, the std filter's rejects included, plus dropped) that were
dropped, by reason, and how many of the drops came at a step where the bound had just engaged or tightened.

    .venv/bin/python scripts/drop_share.py studies/confirm/*/

A run is a directory holding ``provenance.jsonl`` (each learner step's record lists the groups it consumed and
``dropped``: index, reason, where); its cell is its sweep directory and its cell directory without the seed
(``lr1e4/k2`` from ``lr1e4/runs/s3-k2/<run>``; ``controller`` from ``controller/runs/s3/<run>``). A tightening:
a step whose bound in force (``staleness/max_staleness``, ``provenance.bounds_from_metrics``) is smaller than the
previous step's, or finite after an unbounded one (a step that logged no bound was unbounded); its drops are those recorded in that step's provenance record
(dropped while its batch was collected). Groups still in flight when the run ended were neither consumed nor
dropped and are not counted. Prints a markdown table per run and one per cell (mean, with the runs' lowest and
highest share).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

from ragen_async.records.provenance import bounds_from_metrics


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_drops(run_dir: Path) -> dict:
    """One run: groups consumed and dropped, drop reasons, tightenings and the drops at them."""
    consumed, dropped, reasons, at_step = 0, 0, Counter(), {}
    for record in _records(run_dir / "provenance.jsonl"):
        drops = record.get("dropped", [])
        consumed += len(record["groups"])
        dropped += len(drops)
        reasons.update(f"{d['reason']}@{d['where']}" for d in drops)
        at_step[int(record["step"])] = at_step.get(int(record["step"]), 0) + len(drops)
    bounds = bounds_from_metrics(_records(run_dir / "metrics.jsonl"))  # a step without one: unbounded then
    steps = sorted(at_step)
    tightenings = [s for prev, s in zip(steps, steps[1:], strict=False) if bounds.get(s) is not None
                   and (bounds.get(prev) is None or bounds[s] < bounds[prev])]
    return {"consumed": consumed, "dropped": dropped, "reasons": dict(reasons),
            "share": dropped / (consumed + dropped) if consumed + dropped else float("nan"),
            "tightenings": len(tightenings), "dropped_at_tightenings": sum(at_step.get(s, 0) for s in tightenings)}


def cell_of(run_dir: Path) -> str:
    """``<sweep>/<cell>`` (the cell directory without its seed), or ``<sweep>`` when the seed is all it names."""
    parts = run_dir.parts
    if len(parts) >= 4 and parts[-3] == "runs":
        cell = re.sub(r"^s\d+-?", "", parts[-2])
        return f"{parts[-4]}/{cell}" if cell else parts[-4]
    return run_dir.name


def main(argv: list[str]) -> int:
    runs = sorted({p.parent for root in map(Path, argv) for p in
                   ([root / "provenance.jsonl"] if (root / "provenance.jsonl").exists() else root.rglob("provenance.jsonl"))})
    if not runs:
        print("no provenance.jsonl under " + " ".join(argv), file=sys.stderr)
        return 2
    print("| run | cell | generated | dropped | share | reasons | tightenings | dropped at them |")
    print("|---|---|---|---|---|---|---|---|")
    cells: dict[str, list[dict]] = {}
    for run in runs:
        d = run_drops(run)
        cells.setdefault(cell_of(run), []).append(d)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(d["reasons"].items())) or "—"
        print(f"| {run} | {cell_of(run)} | {d['consumed'] + d['dropped']} | {d['dropped']} | {100 * d['share']:.1f} % "
              f"| {reasons} | {d['tightenings']} | {d['dropped_at_tightenings']} |")
    print()
    print("| cell | runs | generated | dropped | share: mean (lowest-highest) | tightenings | dropped at them |")
    print("|---|---|---|---|---|---|---|")
    for cell, members in sorted(cells.items()):
        shares = [100 * m["share"] for m in members]
        print(f"| {cell} | {len(members)} | {sum(m['consumed'] + m['dropped'] for m in members)} "
              f"| {sum(m['dropped'] for m in members)} | {sum(shares) / len(shares):.1f} % ({min(shares):.1f}-"
              f"{max(shares):.1f} %) | {sum(m['tightenings'] for m in members)} "
              f"| {sum(m['dropped_at_tightenings'] for m in members)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
