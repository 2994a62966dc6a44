"""The sections behind a study's headline: the shape of the cost (a step or a line in the tokens' age), how
much steeper a larger step size makes it, and speed as the runs measured it beside the idle-machine figures.

Every number a headline quotes is printed here, with what it was computed on. The runs are those of the
trend (:func:`~ragen_async.study.report.tables.against_sync_section`): finished, bounded, without
correction, one set per actor learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ragen_async.study import stats
from ragen_async.study.report.runs import MISSING
from ragen_async.study.report.summary import RunSummary
from ragen_async.study.report.tables import fmt, table

SPEED_FROM_K = 2
"""The speed line compares the bounds from this k on with k = 0."""


def _lr(lr: float) -> str:
    return "?" if lr < 0 else f"{lr:g}"


def _k_order(s: RunSummary) -> tuple[bool, int]:
    return s.k is None, s.k or 0


def plain_runs(summaries: Sequence[RunSummary]) -> dict[float, list[RunSummary]]:
    """Per step size (``actor_lr_key``), ascending: the finished bounded runs without correction, where at
    least one is synchronous (k = 0)."""
    by_lr: dict[float, list[RunSummary]] = {}
    for s in summaries:
        if s.cell and s.finished and s.k_known and s.plain:
            by_lr.setdefault(s.actor_lr_key, []).append(s)
    return {lr: sorted(runs, key=_k_order) for lr, runs in sorted(by_lr.items()) if any(s.k == 0 for s in runs)}


def _fits(runs: Sequence[RunSummary]) -> list[stats.ModelFit]:
    return stats.cost_models([s.k for s in runs], [s.staleness_mean for s in runs], [s.mean_val for s in runs])


def _terms(fit: stats.ModelFit) -> str:
    return "; ".join(f"{name}: {c:+.4f} [{lo:+.4f}, {hi:+.4f}]" for name, (c, lo, hi) in fit.terms.items())


def _verdict(lr: float, fits: dict[str, stats.ModelFit]) -> str:
    """Which of step and linear the data prefer, by AIC and by leave-one-cell-out error."""
    step, line = fits.get("step"), fits.get("linear")
    if step is None or line is None:
        return ""
    better, worse = (line, step) if line.aic <= step.aic else (step, line)
    gap = worse.aic - better.aic
    text = (f"At actor lr {_lr(lr)} ({line.n} runs): AIC prefers the {better.model} model by {gap:.1f} (the "
            f"{worse.model} model's likelihood relative to it: {math.exp(-gap / 2):.2f})")
    if math.isfinite(line.loco_rmse) and math.isfinite(step.loco_rmse):
        first, second = (line, step) if line.loco_rmse <= step.loco_rmse else (step, line)
        text += ("; leave-one-cell-out, " + ("it also" if first is better else f"the {first.model} model")
                 + f" predicts a stale cell's mean better: within {first.loco_rmse:.3f} (root mean square over "
                 f"{first.loco_cells} cells) against {second.loco_rmse:.3f}")
    return text + "."


def shape_section(summaries: Sequence[RunSummary]) -> list[str]:
    """The step model against the linear one (and both together), per step size."""
    rows, verdicts = [], []
    for lr, runs in plain_runs(summaries).items():
        fits = {f.model: f for f in _fits(runs)}
        if not fits:
            continue
        best = min(f.aic for f in fits.values())
        weights = {m: math.exp(-(f.aic - best) / 2) for m, f in fits.items()}
        total = sum(weights.values())
        for model, f in fits.items():
            rows.append([_lr(lr), model, f.n, _terms(f), f"{f.aic:.1f}", f"{f.aic - best:.1f}",
                         f"{weights[model] / total:.2f}", fmt(f.loco_rmse) + f" ({f.loco_cells} cells)"])
        verdicts.append(_verdict(lr, fits))
    if not rows:
        return []
    lines = ["## The shape of the cost: a step or a line", "",
             "The mean validation success after step 0 of the bounded runs without correction (the trend's runs), "
             "per step size, fitted by least squares (`stats.cost_models`) three ways: **step**, any staleness "
             "(k ≥ 1) costs one constant against k = 0 (k ≥ 1: that constant); **linear**, the cost is "
             "proportional to the run's realised mean age (per version: the trend's slope); and both together. "
             "Coefficients with their 95 % intervals. AIC = n ln(RSS / n) + 2 (coefficients + 1), lower is better; "
             "ΔAIC to the best of the three; Akaike weight: each model's share of the evidence among them. "
             "Leave-one-cell-out: each stale cell (one k) left out in turn, the model fitted on the other cells "
             "predicts its mean; the root mean square of those errors (k = 0 is never left out: without it the step "
             "model has no reference; — where a model cannot be fitted without a cell).", ""]
    lines += table(["actor lr", "model", "runs", "coefficients [95 %]", "AIC", "ΔAIC", "Akaike weight",
                    "leave-one-cell-out error"], rows)
    return [*lines, *(line for v in verdicts if v for line in ("", v)), ""]


def _subsets(base: Sequence[RunSummary], other: Sequence[RunSummary]
             ) -> list[tuple[str, Callable[[RunSummary], bool]]]:
    """The cells a slope is compared on: all, all but k = ∞, the ks both step sizes ran, and those but k = ∞."""
    common = {s.k for s in base} & {s.k for s in other}
    names = ", ".join(("∞" if k is None else str(k)) for k in sorted(common, key=lambda k: (k is None, k or 0)))
    finite = ", ".join(str(k) for k in sorted(k for k in common if k is not None))
    return [("all cells", lambda s: True), ("all cells but k = ∞", lambda s: s.k is not None),
            (f"the cells both ran (k = {names})", lambda s: s.k in common),
            (f"the cells both ran but k = ∞ (k = {finite})", lambda s: s.k in common and s.k is not None)]


def _slope(runs: Sequence[RunSummary]) -> tuple[float, str]:
    slope, low, high, _, n = stats.trend([s.staleness_mean for s in runs], [s.mean_val for s in runs])
    fell = sum(1 for s in runs if s.collapse.fell is not None)
    if not math.isfinite(slope):
        return math.nan, MISSING
    return slope, f"{slope:+.4f} [{low:+.4f}, {high:+.4f}] ({n} runs, {fell} fell)"


def step_size_section(summaries: Sequence[RunSummary]) -> list[str]:
    """Each larger step size's trend slope against the smallest one's, with and without the unbounded cell."""
    by_lr = {lr: runs for lr, runs in plain_runs(summaries).items() if lr >= 0}
    if len(by_lr) < 2:
        return []
    base_lr, *others = by_lr
    rows, seen = [], set()
    for lr in others:
        base, other = by_lr[base_lr], by_lr[lr]
        for name, keep in _subsets(base, other):
            a, b = [s for s in base if keep(s)], [s for s in other if keep(s)]
            key = (lr, tuple(s.name for s in a), tuple(s.name for s in b))
            if key in seen:
                continue
            seen.add(key)
            (sa, ta), (sb, tb) = _slope(a), _slope(b)
            factor = f"{sb / sa:.1f}×" if math.isfinite(sa) and math.isfinite(sb) and sa != 0 else MISSING
            rows.append([_lr(lr), name, ta, tb, factor])
    lines = ["## Step size: how much steeper the cost", "",
             f"The trend's slope (mean validation success after step 0 per version of realised mean age, the bounded "
             f"runs without correction, 95 % interval, `stats.trend`) at each larger step size against actor lr "
             f"{_lr(base_lr)}: the factor is the ratio of the two slopes, on all cells, without the unbounded one "
             "(where a run that falls is likeliest), and on the cells both step sizes ran. Fell: runs with a fall "
             "(section \"Cells\").", ""]
    lines += table(["actor lr", "cells", f"slope at lr {_lr(base_lr)}", "slope at this lr", "factor"], rows)
    return [*lines, ""]


def _speeds(runs: Sequence[RunSummary]) -> tuple[float, float, float, int]:
    return stats.bounds([s.groups_per_s for s in runs], stats.POSITIVE)


def speed_section(summaries: Sequence[RunSummary], throughput: dict[int | None, float]) -> list[str]:
    """Groups per second inside the runs (their own ``throughput/groups_per_s``) beside the idle-machine figures
    (``--throughput``), per step size, k and placement; then k >= :data:`SPEED_FROM_K` against k = 0."""
    rows, summary = [], []
    bench0 = throughput.get(0)
    for lr, runs in plain_runs(summaries).items():
        sync = [s for s in runs if s.k == 0 and math.isfinite(s.groups_per_s)]
        if not sync:
            continue
        sync_mean = _speeds(sync)[0]
        groups: dict[tuple[int | None, str], list[RunSummary]] = {}
        for s in runs:
            if math.isfinite(s.groups_per_s):
                groups.setdefault((s.k, s.placement), []).append(s)
        for (k, placement), members in sorted(groups.items(), key=lambda kv: (_k_order(kv[1][0]), kv[0][1])):
            mean, low, high, n = _speeds(members)
            bench = throughput.get(k)
            rows.append([_lr(lr), members[0].k_label, placement, n, stats.format_bounds(mean, low, high, ".2f"),
                         f"{mean / sync_mean:.2f}×", fmt(bench, ".3f"),
                         f"{bench / bench0:.2f}×" if bench is not None and bench0 else MISSING])
        for placement in sorted({s.placement for s in runs if s.k is None or s.k >= SPEED_FROM_K}):
            stale = [s for s in runs if (s.k is None or s.k >= SPEED_FROM_K) and s.placement == placement
                     and math.isfinite(s.groups_per_s)]
            if not stale:
                continue
            mean, low, high, n = _speeds(stale)
            diff = stats.welch_difference([s.groups_per_s for s in stale], [s.groups_per_s for s in sync])
            text = (f"At actor lr {_lr(lr)}, inside the runs: k ≥ {SPEED_FROM_K} ({placement}, {n} runs) "
                    f"{stats.format_bounds(mean, low, high, '.2f')} groups/s against k = 0's "
                    f"{stats.format_bounds(*_speeds(sync)[:3], '.2f')} ({len(sync)} runs): {mean / sync_mean:.2f}× "
                    f"(difference {stats.format_bounds(*diff, '+.2f')})")
            bench = [v for k, v in throughput.items() if k is None or k >= SPEED_FROM_K]
            if bench and bench0:
                text += (f"; on the idle machine (`--throughput`) k ≥ {SPEED_FROM_K}: {min(bench):.3f}–{max(bench):.3f} "
                         f"groups/s against {bench0:.3f}: {min(bench) / bench0:.2f}–{max(bench) / bench0:.2f}×")
            summary.append(text + ".")
    if not rows:
        return []
    lines = ["## Speed: inside the runs and on the idle machine", "",
             "Groups per second as each run measured it (`throughput/groups_per_s`, its mean over the run's steps; "
             "mean [95 % interval] over runs), bounded runs without correction, per step size, k and placement "
             "(pinned: the rollout engine and the learner each on its own cores, `rollout.cpu_affinity` / "
             "`learner.cpu_affinity`; shared: every process on every core), against the k = 0 runs at the same step "
             "size; beside it the figure given for that k (`--throughput`, `ragen-async bench pipeline` on an idle "
             "machine) against the one given for k = 0.", ""]
    lines += table(["actor lr", "k", "placement", "runs", "groups/s in the runs", "× k = 0 in the runs",
                    "idle machine (--throughput)", "× k = 0 on the idle machine"], rows)
    return [*lines, *(line for text in summary for line in ("", text)), ""]
