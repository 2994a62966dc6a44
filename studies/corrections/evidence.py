"""What the committed runs say about thresholds for the stale-sample corrections (issue 69, item 2).

Reads only committed per-step metrics (studies/*/runs/**/metrics.jsonl.gz); no per-token log-probs are stored, so
everything about individual trajectories is modelled, not measured (said where it is). Prints four tables:

1. per study cell and lag: the token-weighted mean k3 KL(mu || pi_old) per token, its 90th percentile over steps,
   the lag's share of the trained tokens and of the summed |advantage|, the share of tokens outside the clip band;
2. the same KL for unbounded runs that fell and unbounded runs that did not;
3. the KL by lag at the two Sokoban step sizes (does KL follow age x step size?);
4. the masked share of negative-advantage trajectories that OPSM would give per lag for a few deltas, under a model:
   a trajectory's mean log(mu / pi_old) D ~ Normal(KL_s, 2 KL_s / L) (second order: E[d] = KL ~ Var(d) / 2; tokens
   independent; L = the run's mean trained tokens per trajectory). Correlated tokens within a trajectory widen D,
   so the shares at deltas above KL_s are lower bounds.

    .venv/bin/python studies/corrections/evidence.py
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from ragen_async.staleness.collapse import find_collapse

ROOT = Path(__file__).resolve().parents[2]
STUDIES = {  # study cell directory -> (task, actor lr, fall floor: the registered one)
    "newlevels/lr1e4": ("Sokoban", 1e-4, 0.180),
    "newlevels/lr2e4": ("Sokoban", 2e-4, 0.180),
    "newlevels/countdown": ("SmallCountdown", 1e-4, 0.0),
    "confirm/lr1e4": ("Sokoban", 1e-4, 0.176),
    "confirm/lr2e4": ("Sokoban", 2e-4, 0.176),
    "confirm/countdown": ("SmallCountdown", 1e-4, 0.0),
}
LAG_ORDER = [str(s) for s in range(8)] + ["8+"]
DELTAS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.5)


def _runs():
    for cell, (task, lr, floor) in STUDIES.items():
        for path in sorted((ROOT / "studies" / cell / "runs").glob("*/*/metrics.jsonl.gz")):
            name = path.parts[-3]
            k = re.search(r"-(k\w+)$", name)
            yield cell, task, lr, floor, name, (k.group(1) if k else "?"), path


def load() -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per run and lag: KL, shares; per run: fell, tokens per trajectory)."""
    lag_rows, run_rows = [], []
    for cell, task, lr, floor, name, k, path in _runs():
        with gzip.open(path, "rt") as f:
            records = [json.loads(line) for line in f]
        train = [r for r in records if "batch/num_seqs" in r]
        val = [(r["learner/step"], r["val/success"]) for r in records if "val/success" in r]
        steps, success = (np.array(v, dtype=float) for v in zip(*val, strict=True))
        fall = find_collapse(steps, success, floor=floor)
        tokens_per_traj = np.mean([r["batch/num_loss_tokens"] / r["batch/num_seqs"] for r in train])
        run_rows.append({"cell": cell, "task": task, "lr": lr, "k": k, "run": name, "fell": fall.fell is not None,
                         "fell_at": fall.fell, "tokens_per_traj": tokens_per_traj})
        total_tokens = sum(r.get(f"lag/{s}/tokens", 0.0) for r in train for s in LAG_ORDER)
        for s in LAG_ORDER:
            rows = [r for r in train if r.get(f"lag/{s}/tokens")]
            if not rows:
                continue
            n = np.array([r[f"lag/{s}/tokens"] for r in rows])
            kl = np.array([r[f"lag/{s}/k3_kl"] for r in rows])
            # before the fall (the whole run if it never fell): what a threshold would have seen in time
            before = np.array([fall.fell is None or r["learner/step"] < fall.fell for r in rows])
            n_before = n[before].sum()
            lag_rows.append({"cell": cell, "task": task, "lr": lr, "k": k, "run": name, "lag": s,
                             "tokens": n.sum(), "token_share": n.sum() / total_tokens,
                             "kl": float((kl * n).sum() / n.sum()), "kl_p90": float(np.percentile(kl, 90)),
                             # over all the run's steps (0 where the lag was absent), so shares add up over lags
                             "adv_share": sum(r[f"lag/{s}/adv_share"] for r in rows) / len(train),
                             "outside_clip": float((np.array([r[f"lag/{s}/is_outside_clip"] for r in rows]) * n).sum()
                                                   / n.sum()),
                             "tokens_per_traj": tokens_per_traj, "fell": fall.fell is not None,
                             "tokens_before": n_before,
                             "kl_before": float((kl * n)[before].sum() / n_before) if n_before else np.nan})
    return pd.DataFrame(lag_rows), pd.DataFrame(run_rows)


def pooled(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Token-weighted KL over the runs of each group; the median of the runs' 90th percentiles."""
    g = df.assign(w=df.kl * df.tokens).groupby(by, sort=False)
    clip = df.outside_clip * df.tokens
    out = pd.DataFrame({"runs": g.run.nunique(), "kl": g.w.sum() / g.tokens.sum(), "kl_p90": g.kl_p90.median(),
                        "token_share": g.token_share.mean(), "adv_share": g.adv_share.mean(),
                        "outside_clip": clip.groupby([df[c] for c in by], sort=False).sum() / g.tokens.sum()})
    return out.reset_index()


def opsm_share(kl: float, length: float, delta: float) -> float:
    """P(D > delta) with D ~ Normal(kl, 2 kl / length) (the model in the module docstring)."""
    if kl <= 0:
        return 0.0
    return float(stats.norm.sf(delta, loc=kl, scale=np.sqrt(2 * kl / length)))


def main() -> None:
    lags, runs = load()
    pd.set_option("display.width", 200, "display.max_rows", 500, "display.float_format", "{:.4g}".format)
    lags["lag"] = pd.Categorical(lags.lag, LAG_ORDER, ordered=True)
    print("runs:", len(runs), "| fell:", runs[runs.fell][["cell", "run", "fell_at"]].to_dict("records"))
    print("mean trained tokens per trajectory:", runs.groupby("task").tokens_per_traj.mean().round(1).to_dict())
    print("\n1. k3 KL(mu || pi_old) per token by cell and lag (pooled over seeds)")
    t1 = pooled(lags.sort_values(["cell", "k", "lag"]), ["cell", "k", "lag"])
    print(t1.pivot_table(index=["cell", "k"], columns="lag", values="kl", observed=True).to_string())
    print("\n   90th percentile over steps (median over runs)")
    print(t1.pivot_table(index=["cell", "k"], columns="lag", values="kl_p90", observed=True).to_string())
    print("\n   share of trained tokens / of summed |advantage| at lags >= 5 (unbounded cells)")
    far = t1[(t1.k == "kinf") & t1.lag.isin(["5", "6", "7", "8+"])].groupby("cell")[["token_share", "adv_share"]]
    print(far.sum().to_string())
    print("\n   share of tokens whose weight pi_old/mu leaves [0.8, 1.28] (unbounded and k4 cells)")
    print(t1[t1.k.isin(["k4", "kinf"])].pivot_table(index=["cell", "k"], columns="lag", values="outside_clip",
                                                     observed=True).to_string())
    print("\n2. KL by lag, unbounded runs that fell vs not (per task and lr)")
    stale = lags[lags.k == "kinf"]
    t2 = pooled(stale, ["task", "lr", "fell", "lag"])
    print(t2.pivot_table(index=["task", "lr", "fell"], columns="lag", values="kl", observed=True).to_string())
    print("\n   the same before each fall (steps before the first validation below the line)")
    before = stale.dropna(subset=["kl_before"])
    before = before.assign(w=before.kl_before * before.tokens_before).groupby(["task", "lr", "fell", "lag"],
                                                                              observed=True)
    t2b = (before.w.sum() / before.tokens_before.sum()).rename("kl").reset_index()
    print(t2b.pivot_table(index=["task", "lr", "fell"], columns="lag", values="kl", observed=True).to_string())
    print("\n3. Sokoban KL by lag and step size (both level sets; unbounded, then bounded cells)")
    sok = lags[lags.task == "Sokoban"]
    for label, cells in (("kinf", sok[sok.k == "kinf"]), ("k2/k4", sok[sok.k.isin(["k2", "k4"])])):
        t3 = pooled(cells, ["lr", "lag"]).assign(k=label)
        print(t3.pivot_table(index=["k", "lr"], columns="lag", values="kl", observed=True).to_string())
    print("\n4. modelled OPSM masked share of negative trajectories per lag (unbounded cells, pooled KL)")
    for (task, lr), cell in lags[lags.k == "kinf"].groupby(["task", "lr"]):
        length = runs[(runs.task == task) & (runs.lr == lr)].tokens_per_traj.mean()
        kl = pooled(cell, ["lag"]).set_index("lag").kl
        table = pd.DataFrame({f"delta={d:g}": [opsm_share(v, length, d) for v in kl] for d in DELTAS},
                             index=kl.index)
        table.insert(0, "kl", kl)
        print(f"\n   {task} lr {lr:g} (L = {length:.0f} trained tokens per trajectory)")
        print(table.to_string())


if __name__ == "__main__":
    main()
