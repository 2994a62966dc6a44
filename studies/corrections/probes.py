"""What a correction did in a probe run, per lag (issue 69, item 2: exploration on the study's levels, not evidence of
the goal). For each run directory given: per lag bucket, the bucket's share of the trained tokens, the token-weighted
k3 KL(mu || pi_old) per token, the shares of tokens the correction masked and truncated, the share of trajectories
with a masked / truncated token, and for ``opsm`` the masked share the evidence's model predicts for the bucket's KL
(``evidence.opsm_share`` with the run's own trained tokens per trajectory, times the masked share at the run's most
stale buckets as the share of negative-advantage tokens, which is what ``opsm`` can mask at most).

    .venv/bin/python studies/corrections/probes.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import LAG_ORDER, opsm_share  # noqa: E402


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl.gz" if (run / "metrics.jsonl.gz").exists() else run / "metrics.jsonl"
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(run: Path) -> tuple[dict, pd.DataFrame]:
    config = yaml.safe_load((run / "config.yaml").read_text())
    algo = config.get("algo", {})
    train = [r for r in _records(run) if "batch/num_seqs" in r]
    length = float(np.mean([r["batch/num_loss_tokens"] / r["batch/num_seqs"] for r in train]))
    total = sum(r.get(f"lag/{s}/tokens", 0.0) for r in train for s in LAG_ORDER)
    rows = []
    for s in LAG_ORDER:
        steps = [r for r in train if r.get(f"lag/{s}/tokens")]
        if not steps:
            continue
        n = np.array([r[f"lag/{s}/tokens"] for r in steps])

        def weighted(key: str, steps=steps, n=n) -> float:
            values = np.array([r.get(key, np.nan) for r in steps], dtype=float)
            return float((values * n).sum() / n.sum())

        rows.append({"lag": s, "tokens": n.sum() / total, "kl": weighted(f"lag/{s}/k3_kl"),
                     "masked": weighted(f"lag/{s}/corr_masked"), "truncated": weighted(f"lag/{s}/corr_truncated"),
                     "masked_seqs": float(np.mean([r.get(f"lag/{s}/corr_masked_seqs", np.nan) for r in steps])),
                     "truncated_seqs": float(np.mean([r.get(f"lag/{s}/corr_truncated_seqs", np.nan) for r in steps])),
                     "weight": weighted(f"lag/{s}/corr_weight")})
    table = pd.DataFrame(rows).set_index("lag")
    info = {"run": run.name, "off_policy": algo.get("off_policy"), "opsm_delta": algo.get("opsm_delta"),
            "age_tau": algo.get("age_tau"), "actor_lr": config.get("learner", {}).get("actor_lr"),
            "steps": len(train), "tokens_per_traj": round(length, 1),
            "age": round(float(np.mean([r["staleness/mean"] for r in train if "staleness/mean" in r])), 2),
            "masked": float(np.mean([r.get("correction/masked", np.nan) for r in train])),
            "truncated": float(np.mean([r.get("correction/truncated", np.nan) for r in train]))}
    if info["off_policy"] == "opsm":
        negative = table.masked[table.kl > 0.02].max() if (table.kl > 0.02).any() else np.nan
        table["model"] = [negative * opsm_share(kl, length, info["opsm_delta"]) for kl in table.kl]
    return info, table


def main() -> None:
    pd.set_option("display.width", 200, "display.float_format", "{:.4g}".format)
    for arg in sys.argv[1:]:
        run = Path(arg)
        runs = [run] if (run / "config.yaml").exists() else sorted(p.parent for p in run.glob("*/config.yaml"))
        for r in runs:
            info, table = summary(r)
            print(info)
            print(table.to_string(), "\n")


if __name__ == "__main__":
    main()
