"""A report's tables: the markdown sections (overview, cells, against synchronous training, equal time, one
section per run) and the per-run CSV rows. Statistics come from :mod:`ragen_async.study.stats`.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ragen_async.staleness.collapse import SIGNALS, Collapse
from ragen_async.study import stats
from ragen_async.study.report.runs import MISSING, RunData
from ragen_async.study.report.summary import LAGS, RunSummary, correction_order


def fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None or not math.isfinite(value):
        return MISSING
    return format(value, spec)


def _at(value: float, step: int | None, spec: str) -> str:
    return fmt(value, spec) + (f" (step {step})" if step is not None and math.isfinite(value) else "")


def _trend(first: float, last: float) -> str:
    if not (math.isfinite(first) and math.isfinite(last)):
        return MISSING
    change = f" ({(last - first) / first:+.0%})" if first > 0 else ""
    return f"{first:.3f} → {last:.3f}{change}"


def _steps(s: RunSummary) -> str:
    return f"{s.steps}/{s.total_steps}" if s.total_steps is not None else str(s.steps)


def cell_text(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell_text(c) for c in row) + " |" for row in rows]
    return lines


OVERVIEW = ("run", "k", "lag", "correction", "seed", "status", "steps", "first val", "final val", "best val",
            "val ≥ {t} at", "fell at", "degraded from", "staleness mean / max", "max grad norm", "min entropy",
            "reward std first → last 10%", "k3 mismatch", "step s")


def _fell(c: Collapse) -> str:
    """The first fall's step, and whether the run stayed down (collapsed) or came back."""
    return MISSING if c.fell is None else f"{c.fell} ({'collapsed' if c.collapsed else 'recovered'})"


def overview_row(s: RunSummary) -> list[str]:
    return [s.name, s.k_label, s.lag, s.off_policy, MISSING if s.seed is None else str(s.seed), s.status,
            _steps(s), fmt(s.first_val), fmt(s.final_val), fmt(s.best_val), MISSING if s.reached_at is None else str(s.reached_at),
            _fell(s.collapse), MISSING if s.degraded is None else str(s.degraded),
            f"{fmt(s.staleness_mean, '.2f')} / {fmt(s.staleness_max, '.0f')}", fmt(s.grad_norm_max, '.3g'),
            fmt(s.entropy_min, '.3g'), _trend(s.reward_std_first, s.reward_std_last), fmt(s.k3_mismatch, '.2e'),
            fmt(s.step_time, '.2f')]


def run_section(run: RunData, s: RunSummary, threshold: float) -> list[str]:
    lines = [f"### {s.name}", ""]
    where = f"`{run.path}`" if run.path is not None else "no run directory yet"
    settings = (f"k = {s.k_label}, {s.lag}, correction {s.off_policy}, seed {s.seed}" if s.k_known
                else "settings unknown (no config.yaml)")
    lines += [f"{where} · {s.status} · {_steps(s)} steps · {settings}", ""]
    if s.val:
        rows = [(env, fmt(v.first), fmt(v.final), fmt(v.best), MISSING if v.reached_at is None else v.reached_at)
                for env, v in s.val.items()]
        lines += table(("validation env", "first success", "final success", "best success",
                         f"first step ≥ {threshold:g}"), rows)
    else:
        lines.append("No validation records.")
    lines.append("")
    rows = [
        ("staleness mean / max (versions)", f"{fmt(s.staleness_mean, '.2f')} / {fmt(s.staleness_max, '.0f')}"),
        ("trained tokens by age (versions)", ", ".join(f"{b}: {100 * v:.0f} %" for b, v in s.lag_shares.items()
                                                       if v >= 0.005) or MISSING),
        ("max grad norm", _at(s.grad_norm_max, s.grad_norm_max_step, ".3g")),
        ("min entropy", _at(s.entropy_min, s.entropy_min_step, ".3g")),
        ("in-group reward std, first → last 10% of steps", _trend(s.reward_std_first, s.reward_std_last)),
        ("behaviour/learner k3 mismatch, mean", fmt(s.k3_mismatch, ".2e")),
        ("mean step time (s)", fmt(s.step_time, ".2f")),
    ]
    lines += table(("indicator", "value"), rows)
    return [*lines, ""]


def csv_rows(summaries: Sequence[RunSummary]) -> list[dict[str, Any]]:
    rows = []
    for s in summaries:
        row: dict[str, Any] = {
            "run": s.name, "k": s.k_label, "lag": s.lag, "off_policy": s.off_policy,
            "actor_lr": s.actor_lr, "seed": s.seed, "status": s.status, "steps": s.steps,
            "total_steps": s.total_steps, "first_val": s.first_val, "final_val": s.final_val,
            "best_val": s.best_val, "mean_val": s.mean_val, "val_reached": float(s.reached_at is not None), "val_reached_at": s.reached_at,
            "staleness_mean": s.staleness_mean,
            "staleness_max": s.staleness_max, "grad_norm_max": s.grad_norm_max, "entropy_min": s.entropy_min,
            "reward_std_first": s.reward_std_first, "reward_std_last": s.reward_std_last,
            "k3_mismatch": s.k3_mismatch, "step_time_s": s.step_time, "tokens_per_s": s.tokens_per_s,
            "groups_per_s": s.groups_per_s,
            "fell": float(s.collapse.fell is not None), "fell_step": s.collapse.fell,
            "collapsed": float(s.collapse.collapsed), "collapse_step": s.collapse.step,
            "degraded": float(s.degraded is not None), "degraded_step": s.degraded,
            **{f"lead_{sig}": s.lead.get(sig) for sig in SIGNALS},
            **{f"false_alarms_{sig}": s.false_alarms.get(sig) for sig in SIGNALS},
            **{f"tokens_lag_{b}": v for b, v in s.lag_shares.items()},
            **s.drops,
        }
        for env, v in s.val.items():
            row[f"val_{env}_first"], row[f"val_{env}_final"], row[f"val_{env}_best"] = v.first, v.final, v.best
        rows.append(row)
    return rows


CELL_VALUES = (("final_val", "final val", ".3f", stats.UNIT), ("best_val", "best val", ".3f", stats.UNIT),
               ("mean_val", "mean val after step 0", ".3f", stats.UNIT),
               ("val_reached", "reached threshold (share)", ".2f", stats.SHARE),
               ("val_reached_at", "first step ≥ threshold (runs that reached it)", ".1f", stats.POSITIVE),
               ("groups_per_s", "groups/s", ".2f", stats.POSITIVE), ("tokens_per_s", "tokens/s", ".0f", stats.POSITIVE),
               ("staleness_mean", "staleness mean", ".2f", stats.POSITIVE),
               ("fell", "fell (share)", ".2f", stats.SHARE), ("collapsed", "collapsed (share)", ".2f", stats.SHARE),
               ("degraded", "degraded (share)", ".2f", stats.SHARE),
               *((f"lead_{sig}", f"lead: {sig.replace('_', ' ')} (steps)", ".1f", (0.0, float(stats.HORIZON)))
                 for sig in SIGNALS),
               *((f"false_alarms_{sig}", f"false alarms: {sig.replace('_', ' ')} (/100 steps)", ".2f", stats.POSITIVE)
                 for sig in SIGNALS))
"""The cells table's columns: summary key, header, format, and the range its interval is clipped to
(``stats.SHARE``: a share of runs, Wilson's interval)."""


def cells_section(summaries: Sequence[RunSummary], collapse_floor: float = 0.0) -> list[str]:
    """Seeds pooled: one row per cell with the mean ± 95 % interval of each statistic."""
    known = [s for s in summaries if s.cell and s.finished]
    unfinished = sum(1 for s in summaries if s.cell and not s.finished)
    if not known:
        return []
    cells = pd.DataFrame([s.cell for s in known]).fillna(MISSING)
    if "staleness.max_staleness" in cells:
        cells["staleness.max_staleness"] = cells["staleness.max_staleness"].replace("None", "∞")
    varying = [c for c in cells.columns if cells[c].nunique() > 1]
    frame = pd.concat([cells[varying].reset_index(drop=True),
                       pd.DataFrame(csv_rows(known))[[c for c, *_ in CELL_VALUES]].astype(float)], axis=1)
    frame["_cell"] = cells.astype(str).agg("|".join, axis=1)
    pooled = stats.cell_table(frame, ["_cell", *varying], [c for c, *_ in CELL_VALUES],
                              {c: span for c, _, _, span in CELL_VALUES})
    lines = ["## Cells (seeds pooled)", "",
             "Runs whose settings differ only in their seed form a cell: mean [95 % interval] over the cell's "
             "runs (t distribution, clipped to the quantity's range; no interval with one run); a share of runs "
             "(reached, fell, collapsed, degraded) with Wilson's 95 % interval for a proportion. Threshold: the first "
             "validation with success at or above the report's threshold (`--threshold`). Fell: at least two "
             f"validations in a row below the line half-way from {collapse_floor:g} (`--collapse-floor`) to the peak "
             "so far; collapsed: fell and stayed below to the end. Degraded: from some validation to the last (two "
             "or more) below the lower end of the 95 % interval of the synchronous runs (k = 0, bounded, no "
             "correction, same learning rate) at the same step. Lead: steps from a signal's first firing within "
             f"{stats.HORIZON} steps before the run's first event (fall or degradation) to it, over runs with an "
             "event where it fired "
             "(in-group reward std below half its running peak; entropy below half its start; a gradient norm "
             "above 3× the median of the previous 5 steps). False alarms: firings that no event followed within "
             f"{stats.HORIZON} steps, per 100 steps watched (`ragen_async/study/stats.py`)."
             + (f" Only finished runs are pooled; {unfinished} unfinished left out (overview only)." if unfinished
                else ""), ""]
    header = [*(varying or ["cell"]), "runs", *(label for _, label, *_ in CELL_VALUES)]
    rows = []
    for _, r in pooled.iterrows():
        settings = [r[c] for c in varying] or ["all runs"]
        rows.append([*settings, int(r["n"]),
                     *(stats.format_bounds(r[c], r[f"{c}_lo"], r[f"{c}_hi"], spec) for c, _, spec, _ in CELL_VALUES)])
    return [*lines, *table(header, rows), ""]


def against_sync_section(summaries: Sequence[RunSummary]) -> list[str]:
    """Per step size with a synchronous reference (two or more finished k = 0 runs, bounded, no correction):
    each other cell's difference from it in mean and final validation success (Welch's 95 % interval), and
    the trend of both over the bounded uncorrected runs' realised mean staleness."""
    finished = [s for s in summaries if s.cell and s.finished and s.k_known]
    lines: list[str] = []
    for lr in sorted({s.actor_lr_key for s in finished}):
        at_lr = [s for s in finished if s.actor_lr_key == lr]
        reference = [s for s in at_lr if s.is_reference]
        if len(reference) < 2:
            continue
        cells: dict[str, list[RunSummary]] = {}
        for s in at_lr:
            if not s.is_reference:
                cells.setdefault(s.cell_key, []).append(s)
        plain = [s for s in at_lr if s.plain]
        uncorrected: dict[tuple[int | None, str], list[float]] = defaultdict(list)
        for s in at_lr:
            if s.off_policy == "none":
                uncorrected[(s.k, s.lag)].append(s.mean_val)
        rows = []
        for group in sorted(cells.values(), key=lambda g: (LAGS.index(g[0].lag), correction_order(g[0].off_policy),
                                                          g[0].off_policy, g[0].k is None, g[0].k or 0)):
            s0 = group[0]
            diffs = [stats.welch_difference([getattr(s, a) for s in group], [getattr(r, a) for r in reference])
                     for a in ("mean_val", "final_val")]
            age = float(np.mean([s.staleness_mean for s in group]))
            predicted = MISSING if s0.plain else stats.format_bounds(*stats.predicted_mean(
                [s.staleness_mean for s in plain], [s.mean_val for s in plain], age, len(group)), ".3f")
            # What a correction buys back (the uncorrected runs at its k and lag), or an adaptive bound against
            # the fixed bound it starts from (bounded, uncorrected, same k).
            against = ((s0.k, s0.lag) if s0.off_policy != "none" else (s0.k, "bounded") if s0.lag == "adaptive"
                       else None)
            same_k = uncorrected.get(against, []) if against else []
            against_none = (stats.format_bounds(*stats.welch_difference([s.mean_val for s in group], same_k), "+.3f")
                            if same_k else MISSING)
            rows.append([s0.k_label, s0.lag, s0.off_policy, len(group), fmt(age, ".2f"),
                         *(stats.format_bounds(*d, "+.3f") for d in diffs),
                         fmt(float(np.mean([s.mean_val for s in group]))), predicted, against_none])
        trends = [stats.trend([s.staleness_mean for s in plain], [getattr(s, a) for s in plain])
                  for a in ("mean_val", "final_val")]
        step = "" if lr < 0 else f" (actor lr {lr:g})"
        lines += [f"## Against synchronous training{step}", "",
                  f"Reference: the {len(reference)} finished runs at k = 0 (bounded, no correction). Per cell, the "
                  "difference of its mean from the reference's, with Welch's 95 % interval (`stats.welch_difference`),"
                  " of the mean validation success after step 0 and of the final one. Trend: the least-squares slope "
                  "of each on a run's realised mean staleness over the bounded runs without correction, per version "
                  "of mean age, with its 95 % interval and p-value (`stats.trend`). Predicted: for a cell outside "
                  "those runs (fixed lag, a correction, an adaptive bound), the mean validation success after step 0 "
                  "that trend predicts at the cell's mean age, with the 95 % prediction interval for the mean of as "
                  "many runs (`stats.predicted_mean`): a cell inside it behaves as its staleness alone predicts. "
                  "Against the same k: for a corrected cell, the difference of its mean validation success after "
                  "step 0 from that of the uncorrected runs at the same k and lag (Welch's 95 % interval): what the "
                  "correction buys back; for an adaptive bound, from that of the fixed bound it starts from (bounded, "
                  "no correction, the same k).", ""]
        lines += table(["k", "lag", "correction", "runs", "staleness mean", "Δ mean val after step 0", "Δ final val",
                         "mean val after step 0", "predicted by the bounded trend",
                         "Δ mean val vs same k (uncorrected; adaptive: fixed bound)"], rows) if rows else []
        for (slope, low, high, p, n), what in zip(trends, ("mean validation success after step 0",
                                                           "final validation success"), strict=True):
            if math.isfinite(slope):
                lines += ["", f"Trend of the {what} on realised mean staleness ({n} runs): {slope:+.4f} per version "
                          f"[{low:+.4f}, {high:+.4f}], p = {p:.3f}."]
        lines.append("")
    return lines


def equal_time_section(runs: Sequence[RunData], summaries: Sequence[RunSummary],
                        throughput: dict[int | None, float]) -> list[str]:
    """The practical answer: per bounded cell whose k has a measured throughput (``--throughput``, groups/s
    from ``bench pipeline`` on an idle machine), the time its step budget takes at that rate, its gain per
    100 learner steps and its success at equal time: at the minutes the fastest of these cells needs for
    its budget, each run's validation success interpolated at the step its k reaches by then."""
    members: dict[str, list[tuple[RunData, RunSummary]]] = {}
    for run, s in zip(runs, summaries, strict=True):
        if s.cell and s.finished and s.k_known and s.lag == "bounded" and s.k in throughput and run.val_success()[0].size:
            members.setdefault(s.cell_key, []).append((run, s))
    if not members:
        return []

    def minutes_per_step(run: RunData, s: RunSummary) -> float:
        return max(run.groups_per_step, 1) / throughput[s.k] / 60.0

    budget = {key: max(r.last_step for r, _ in group) * minutes_per_step(*group[0]) for key, group in members.items()}
    equal = min(budget.values())
    labels = pd.DataFrame([group[0][1].cell for group in members.values()], index=list(members))
    varying = [c for c in labels.columns if labels[c].nunique() > 1 and c != "staleness.max_staleness"]
    rows = []
    for key, group in sorted(members.items(), key=lambda kv: (kv[1][0][1].k is None, kv[1][0][1].k or 0, kv[0])):
        s0 = group[0][1]
        steps_at = equal / minutes_per_step(*group[0])
        gain = [100.0 * (s.final_val - s.first_val) / max(r.val_success()[0][-1], 1) for r, s in group]
        at_time = [float(np.interp(steps_at, *r.val_success())) for r, _ in group]
        settings = ", ".join(f"{c.rsplit('.', 1)[-1]} {labels.at[key, c]}" for c in varying)
        rows.append([s0.k_label + (f" ({settings})" if settings else ""), len(group), f"{throughput[s0.k]:.2f}",
                     f"{budget[key]:.1f}", stats.format_bounds(*stats.bounds([s.final_val for _, s in group],
                                                                             stats.UNIT)[:3], ".3f"),
                     stats.format_bounds(*stats.bounds(gain)[:3], "+.3f"), f"{steps_at:.0f}",
                     stats.format_bounds(*stats.bounds(at_time, stats.UNIT)[:3], ".3f")])
    lines = ["## At equal time (the practical answer)", "",
             "Per bounded cell with a measured throughput (`--throughput K=GROUPS_PER_S`, from `ragen-async bench "
             "pipeline` on an idle machine; the runs themselves may have shared theirs): the minutes its step "
             "budget takes at that rate, the final success, the gain over its first validation per 100 learner "
             f"steps, and the success at equal time: at {equal:.1f} min (the fastest cell's budget) each run's "
             "validation success interpolated at the step its k reaches by then. Mean [95 % interval] over seeds.", ""]
    header = ["k", "runs", "groups/s", "minutes for the budget", "final val", "gain per 100 steps",
              f"step reached at {equal:.1f} min", f"val at {equal:.1f} min"]
    return [*lines, *table(header, rows), ""]


def bound_section(runs: Sequence[RunData]) -> list[str]:
    """Per run whose bound moved (``staleness.adaptive``): the bound over its learner steps (mean, lowest, highest,
    steps unbounded), how often it was lowered and raised (``staleness/bound_change``, or the steps where
    ``staleness/max_staleness`` changed in runs logged before it), and the realised mean age beside it."""
    rows = []
    for run in runs:
        if run.lag != "adaptive" or not run.train:
            continue
        bounds = [r.get("staleness/max_staleness") for r in run.train]
        finite = [float(b) for b in bounds if isinstance(b, (int, float)) and math.isfinite(b)]
        unbounded = len(bounds) - len(finite)
        steps, change = run.series("staleness/bound_change")
        if steps.size:
            down, up = int((change < 0).sum()), int((change > 0).sum())
        else:  # logged before bound_change: the moves are where the logged bound differs from the step before
            level = [math.inf if not (isinstance(b, (int, float)) and math.isfinite(b)) else float(b) for b in bounds]
            down = sum(1 for a, b in itertools.pairwise(level) if b < a)
            up = sum(1 for a, b in itertools.pairwise(level) if b > a)
        _, age = run.series("staleness/mean")
        rows.append([run.name, f"{np.mean(finite):.2f}" if finite else MISSING,
                     f"{min(finite):.0f} - {max(finite):.0f}" if finite else MISSING, str(unbounded), str(down), str(up),
                     f"{age.mean():.2f}" if age.size else MISSING])
    if not rows:
        return []
    return ["## The adaptive bound", "",
            "Per run whose bound moved: the bound over its learner steps (steps unbounded apart), how often it was "
            "lowered and raised, and the tokens' realised mean age.", "",
            *table(["run", "mean bound", "range", "steps unbounded", "lowered", "raised", "mean age"], rows), ""]
