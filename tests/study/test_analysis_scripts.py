"""The study's scripts on committed runs: scripts/drop_share.py (the share of a run's generated groups its buffer
dropped, per run and per cell, and the drops where the bound engaged or tightened, from provenance.jsonl and
metrics.jsonl) and scripts/replay_warnings.py (an early-warning signal replayed on a run's metrics.jsonl)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(root: Path, cell_dir: str, steps: list[tuple[int, int, list[str], float | None]]) -> None:
    """A run under ``root/runs/cell_dir``: per step (step, groups consumed, reasons of its drops, bound in force;
    None: unbounded, no bound logged)."""
    run = root / "runs" / cell_dir / "run-20261206-000000"
    run.mkdir(parents=True)
    index = iter(range(10_000))
    prov, metrics = [], []
    for step, consumed, drops, bound in steps:
        prov.append({"step": step, "learner_version": step - 1,
                     "groups": [{"index": next(index)} for _ in range(consumed)],
                     "dropped": [{"index": next(index), "reason": r, "where": "add", "staleness": 9} for r in drops]})
        metrics.append({"learner/step": step, **({} if bound is None else {"staleness/max_staleness": bound})})
    (run / "provenance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prov))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))


def test_drops_are_shared_out_of_the_generated_groups_per_run_and_cell(tmp_path):
    sweep = tmp_path / "ctrl"
    # Unbounded for two steps, the bound engages at step 3 (6 dropped), halves at step 5 (2 dropped), one more drop
    # at step 4: 9 of 8 x 5 + 9 = 49 generated groups.
    _run(sweep, "s3", [(1, 8, [], None), (2, 8, [], None), (3, 8, ["stale"] * 6, 4), (4, 8, ["stale"], 4),
                       (5, 8, ["stale"] * 2, 2)])
    # A fixed bound logged at every step: no tightening, its one drop not at one.
    _run(sweep, "s4", [(1, 8, [], 2), (2, 8, ["stale"], 2)])
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "drop_share.py"), str(sweep)], capture_output=True,
                         text=True, check=True, cwd=REPO).stdout
    assert "| ctrl | 49 | 9 | 18.4 % | stale@add 9 | 2 | 8 |" in out
    assert "| ctrl | 17 | 1 | 5.9 % | stale@add 1 | 0 | 0 |" in out
    # The cell: both runs (no cell name left once the seed is stripped), mean share with lowest and highest.
    assert "| ctrl | 2 | 66 | 10 | 12.1 % (5.9-18.4 %) | 2 | 8 |" in out
    empty = subprocess.run([sys.executable, str(REPO / "scripts" / "drop_share.py"), str(tmp_path / "none")],
                           capture_output=True, text=True, cwd=REPO)
    assert empty.returncode == 2 and "no provenance.jsonl" in empty.stderr


def test_a_signal_is_replayed_on_a_runs_metrics_beside_what_the_run_logged(tmp_path):
    run = tmp_path / "sweep" / "runs" / "s0-kinf" / "run-20261204-000000"
    run.mkdir(parents=True)
    # Stale tokens' ESS (token-weighted over the stale lags) below half at steps 3 and 5 only; step 4 has none stale.
    ess = {1: (0.9, 0.8), 2: (0.7, 0.6), 3: (0.4, 0.5), 4: None, 5: (0.2, 0.9)}
    records = []
    for step, pair in ess.items():
        r = {"learner/step": step, "lag/0/tokens": 50}
        if pair is not None:
            r.update({"lag/1/tokens": 30, "lag/1/is_ess": pair[0], "lag/2/tokens": 10, "lag/2/is_ess": pair[1]})
        records.append(r)
    records.append({"learner/step": 5, "val/success": 0.3})  # validation: not a step of its own
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    logged = tmp_path / "logged"
    logged.mkdir()
    (logged / "metrics.jsonl").write_text("".join(json.dumps({**r, "warning/stale_ess": float(r["learner/step"] == 2)})
                                                  + "\n" for r in records if "val/success" not in r))
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_warnings.py"), str(tmp_path / "sweep"),
                          str(logged)], capture_output=True, text=True, check=True, cwd=REPO).stdout
    # Step 5: (30 x 0.2 + 10 x 0.9) / 40 = 0.375 < 0.5; step 3: 0.425.
    assert f"| {run} | 5 | 3, 5 | not logged |" in out
    assert f"| {logged} | 5 | 3, 5 | 2 |" in out
    assert "2 runs: stale_ess fired 4 times in 10 steps replayed (40.00 per 100 steps)." in out
