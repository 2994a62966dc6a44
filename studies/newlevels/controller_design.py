"""The KL-target controller's design read on the committed runs (studies/specimen, studies/confirm), before any
of its own runs: where each candidate target would have had it act, open loop (the runs' own KL, as if acting
had not changed it).

    .venv/bin/python studies/newlevels/controller_design.py [--target 2e-3 ...]

For every stale run (realised mean age > 0) of Sokoban and SmallCountdown: whether it fell (the PREDICTIONS.md
rule, floor 0.176 on Sokoban) and its onset (the earlier of the fall and the first step whose 5-step mean
valid-action rate is below 0.9); then, per target, how many steps before the onset the averaged stale KL first
stood over the target (``lead``), the share of steps it stood over it in each cell that never fell, and the
bound ``KLTargetBound`` (start 4, 1 .. 16, patience 5) would have reached by the onset or at the end. Also the
``kl_rise`` warning replayed: its first firing within 30 steps before each onset and its alarm episodes per 100
steps on runs that never fell.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd

from ragen_async.staleness.collapse import EarlyWarning, find_collapse, stale_tokens
from ragen_async.staleness.controllers import KLTargetBound

ROOT = Path(__file__).resolve().parents[1]
READ = ("specimen", "confirm")
FLOOR = {"SimpleSokoban": 0.176, "SmallCountdown": 0.0}


def runs() -> list[dict]:
    out = []
    for path in sorted(p for d in READ for p in (ROOT / d).rglob("metrics.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        train = [r for r in records if "staleness/mean" in r]
        if not train or max(r["staleness/mean"] for r in train) == 0:
            continue
        task = next((k.split("/")[1] for r in records for k in r if k.startswith("val/") and k.count("/") == 2), None)
        val = [(r["learner/step"], r[f"val/{task}/success"]) for r in records if f"val/{task}/success" in r]
        steps = np.array([r["learner/step"] for r in train])
        fell = find_collapse(np.array([v[0] for v in val]), np.array([v[1] for v in val]), floor=FLOOR[task]).fell
        onset = fell
        if fell is not None:
            var = pd.Series([r.get("rollout/valid_action_rate", 1.0) for r in train]).rolling(5).mean().to_numpy()
            below = steps[var < 0.9]
            onset = min(fell, int(below[0])) if below.size else fell
        kl = np.array([r.get("stale/k3_kl", stale_tokens(r).get("stale/k3_kl", np.nan)) for r in train], float)
        rel = path.parent.relative_to(ROOT).parts
        seed_cell = rel[rel.index("runs") + 1] if "runs" in rel else rel[-1]
        cell = "/".join(rel[:rel.index("runs")] if "runs" in rel else rel[:-1]) + "/" + re.sub(r"^s\d+-?", "", seed_cell)
        lr = re.search(r"actor_lr:\s*([0-9.e-]+)", (path.parent / "config.yaml").read_text()).group(1)
        out.append({"run": "/".join(rel[:-1]), "cell": cell.rstrip("/"), "task": task, "lr": float(lr), "steps": steps,
                    "kl": kl, "age": float(np.mean([r["staleness/mean"] for r in train])), "fell": fell, "onset": onset})
    return out


def over_target(kl: np.ndarray, target: float, span: int = 5) -> np.ndarray:
    alpha, average, out = 2.0 / (span + 1), None, []
    for x in kl:
        if x > 0:
            average = np.log(x) if average is None else alpha * np.log(x) + (1 - alpha) * average
        out.append(average is not None and average > np.log(target))
    return np.array(out)


def open_loop_bounds(kl: np.ndarray, target: float) -> np.ndarray:
    bound = KLTargetBound(target, start=4, lowest=1, highest=16, patience=5)
    return np.array([bound.update(float(x) if np.isfinite(x) else None) for x in kl])


def kl_rise(kl: np.ndarray) -> np.ndarray:
    warning = EarlyWarning()
    return np.array(["kl_rise" in warning.update({"stale/k3_kl": float(x)}) for x in kl])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, action="append", help="KL targets to read (default 1e-3, 2e-3, 4e-3)")
    targets = parser.parse_args().target or [1e-3, 2e-3, 4e-3]
    data = runs()
    events = [r for r in data if r["onset"] is not None]
    print(f"{len(data)} stale runs, {len(events)} fell (all on {', '.join(sorted({r['task'] for r in events}))})\n")
    rows = []
    for r in events:
        row = {"run": r["run"], "lr": r["lr"], "age": round(r["age"], 2), "onset": r["onset"]}
        before = r["steps"] <= r["onset"]
        fired = r["steps"][kl_rise(r["kl"]) & before & (r["steps"] >= r["onset"] - 30)]
        row["kl_rise lead"] = int(r["onset"] - fired[0]) if fired.size else None
        for t in targets:
            over = r["steps"][over_target(r["kl"], t) & before]
            row[f"lead {t:g}"] = int(r["onset"] - over[0]) if over.size else None
            row[f"bound at onset {t:g}"] = int(open_loop_bounds(r["kl"], t)[before][-1])
        rows.append(row)
    print("Falls: steps the averaged stale KL stood over each target before the onset, the bound the controller\n"
          "would have set by then (open loop), and kl_rise's lead within 30 steps:\n")
    print(pd.DataFrame(rows).to_string(index=False))
    cells: dict[str, list[dict]] = defaultdict(list)
    for r in data:
        if r["onset"] is None:
            cells[r["cell"]].append(r)
    rows = []
    for cell, rs in sorted(cells.items()):
        alarms = [sum(1 for i, f in enumerate(fs) if f and (i == 0 or not fs[i - 1])) / len(fs) * 100
                  for fs in (kl_rise(r["kl"]) for r in rs)]
        row = {"cell (never fell)": cell, "runs": len(rs), "lr": rs[0]["lr"], "age": round(np.mean([r["age"] for r in rs]), 2),
               "kl_rise alarms /100": round(float(np.mean(alarms)), 2)}
        for t in targets:
            row[f"over {t:g}"] = round(float(np.mean([over_target(r["kl"], t).mean() for r in rs])), 2)
            row[f"mean bound {t:g}"] = round(float(np.mean([open_loop_bounds(r["kl"], t).mean() for r in rs])), 1)
        rows.append(row)
    print("\nRuns that never fell, per cell: share of steps over each target, the mean bound the controller would\n"
          "have set (open loop), and kl_rise's alarm episodes per 100 steps:\n")
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
