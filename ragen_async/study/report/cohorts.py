"""Cells of runs across cohorts of seeds, for a study's analysis script: which cell a run belongs to, the shape of
the cost along age over a task's cells, and the figure of M per cell with one column of points per cohort.

A **cell** here is (actor lr, bound): ``k<n>`` for a fixed bound n, ``kinf`` unbounded, ``controller`` the
staleness controller started unbounded (:func:`cell_of`; a script may pass its own naming). A **cohort** is a set of
sampling seeds drawn side by side (a study's seeds beside a replication's). M is a run's mean validation success
after step 0 (``RunSummary.mean_val``), its age the realised mean age (``staleness_mean``). No study's seeds, tasks or
floors live here: the scripts pass them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from ragen_async.staleness.collapse import find_collapse
from ragen_async.study import stats
from ragen_async.study.report.figures import save_figure
from ragen_async.study.report.runs import RunData
from ragen_async.study.report.summary import RunSummary

CellOf = Callable[[RunSummary, Sequence[int], str], "str | None"]
"""Names a run's cell given the cohort's seeds and the task (None: the run is in no cell)."""


def cell_of(s: RunSummary, seeds: Sequence[int], task: str) -> str | None:
    """A finished run's cell without correction, among ``seeds`` on ``task`` (its validation environment):
    ``k<n>``, ``kinf``, or ``controller`` for a controller started unbounded; None otherwise."""
    if not s.finished or s.off_policy != "none" or s.seed not in seeds or task not in s.val:
        return None
    if s.lag == "adaptive":
        return "controller" if s.k is None else None
    return None if s.lag != "bounded" else "kinf" if s.k is None else f"k{s.k}"


def cells(summaries: Sequence[RunSummary], seeds: Sequence[int], task: str, name_of: CellOf = cell_of
          ) -> dict[tuple[float, str], list[RunSummary]]:
    """(actor lr, cell) -> the runs of ``seeds`` on ``task`` in it; ``name_of`` names a run's cell."""
    out: dict[tuple[float, str], list[RunSummary]] = {}
    for s in summaries:
        cell = name_of(s, seeds, task)
        if cell is not None:
            out.setdefault((s.actor_lr_key, cell), []).append(s)
    return out


def cell_order(cell: str) -> tuple[int, int]:
    """Bounds in order, then unbounded, then anything else (the controller)."""
    return (0, int(cell[1:])) if cell[1:].isdigit() else (1, 0) if cell == "kinf" else (2, 0)


def lr_name(lr: float) -> str:
    """``2e-4`` for 0.0002."""
    return f"{lr:.0e}".replace("e-0", "e-")


def _aic(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares of ``y`` on the columns ``x`` (an intercept added): RSS and AIC = n ln(RSS / n) + 2 (columns +
    1), the report's convention (``stats.cost_models``)."""
    design = np.column_stack([np.ones(y.size), x])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    rss = float(np.sum((y - design @ coef) ** 2))
    return rss, y.size * math.log(rss / y.size) + 2 * (design.shape[1] + 1) if rss > 0 else -math.inf


def cost_shape(summaries: Sequence[RunSummary], seeds: Sequence[int], tasks: Sequence[str],
               aic_digits: int = 1) -> list[str]:
    """Per task and actor lr with a synchronous cell and at least two stale ones (bounds, then unbounded; two runs
    each, the controller not among them), the shape of the cost along the realised mean age: the cost per version
    of age between neighbouring cells' means; AIC of three one-coefficient models of M (a step: one constant cost
    of any staleness; a line in age; a line in log(1 + age)); and the step's lack of fit against one mean per cell
    (an F test; the step is nested in it, the two lines are not). The runs of ``seeds`` on ``tasks``; AICs to
    ``aic_digits`` decimals. Describes; decides nothing."""
    lines = []
    for task in tasks:
        by_lr: dict[float, dict[str, list[RunSummary]]] = {}
        for (lr, cell), members in cells(summaries, seeds, task).items():
            if cell != "controller" and len(members) >= 2:
                by_lr.setdefault(lr, {})[cell] = members
        for lr, c in sorted(by_lr.items()):
            names = sorted(c, key=cell_order)
            if len(names) < 3 or names[0] != "k0":
                continue
            members = [(name, s) for name in names for s in c[name]]
            y = np.array([s.mean_val for _, s in members])
            age = np.array([s.staleness_mean for _, s in members])
            if not (np.isfinite(y).all() and np.isfinite(age).all()):
                continue
            means = {name: (float(np.mean([s.mean_val for s in c[name]])),
                            float(np.mean([s.staleness_mean for s in c[name]]))) for name in names}
            label = {name: "unbounded" if name == "kinf" else f"k = {name[1:]}" for name in names}
            segments = ", ".join(
                f"{(means[b][0] - means[a][0]) / (means[b][1] - means[a][1]):+.4f} from {label[a]} to {label[b]} "
                f"(mean age {means[a][1]:.2f} to {means[b][1]:.2f})" for a, b in itertools.pairwise(names))
            stale = np.array([float(name != "k0") for name, _ in members])
            fits = {"log(1 + age)": _aic(np.log1p(age), y), "line": _aic(age, y), "step": _aic(stale, y)}
            dummies = np.column_stack([[float(name == cell) for name, _ in members] for cell in names[1:]])
            rss_cells, _ = _aic(dummies, y)
            df1, df2 = len(names) - 2, y.size - len(names)
            f = (fits["step"][0] - rss_cells) / df1 / (rss_cells / df2) if rss_cells > 0 and df2 > 0 else math.nan
            lack = (f"p = {scipy_stats.f.sf(f, df1, df2):.3f} (F {f:.2f} on {df1} and {df2} degrees of freedom)"
                    if math.isfinite(f) else "not measurable")
            aics = ", ".join(f"{name} {fit[1]:.{aic_digits}f}" for name, fit in sorted(fits.items(), key=lambda kv: kv[1][1]))
            lines.append(f"- {task} at actor lr {lr_name(lr)} ({y.size} runs): per version of mean age {segments}; "
                         f"AIC {aics}; the step's lack of fit against the cells' means {lack}.")
    return lines


Cohort = tuple[Sequence[int], str, str, "str | None", dict[str, float]]
"""(seeds, label, colour, face colour (None: filled), the fall rule's floor per task)."""


def plot_cohorts(runs: Sequence[RunData], summaries: Sequence[RunSummary], out: Path, *,
                 panels: Sequence[tuple[str, float]], cohorts: Sequence[Cohort], anchor: int = 0,
                 name_of: CellOf = cell_of, name: str = "cohorts.png") -> Path | None:
    """Per (task, actor lr) in ``panels`` a panel of M per cell, one column of points per cohort (left to right),
    each run a point (a cross over it: the run fell by :func:`~ragen_async.staleness.collapse.find_collapse` with its
    cohort's floor for the task), each cohort's cell mean with its 95 % interval. Cells (``name_of``): every bound a
    cohort ran there, unbounded and the controller. A panel where cohort ``anchor`` has no run is left out; None
    when none is left. Written to ``out``/``name``."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    by_name = {r.name: r for r in runs}
    drawn = [(task, lr, [cells(summaries, seeds, task, name_of) for seeds, *_ in cohorts]) for task, lr in panels]
    drawn = [p for p in drawn if any(key[0] == p[1] for key in p[2][anchor])]
    if not drawn:
        return None
    offsets = np.linspace(-0.15, 0.15, len(cohorts)) if len(cohorts) > 1 else np.zeros(1)
    fig = Figure(figsize=(5.5 * len(drawn), 4.2), layout="constrained")
    for ax, (task, lr, by_cohort) in zip(np.atleast_1d(fig.subplots(1, len(drawn))), drawn, strict=True):
        names = sorted({cell for c in by_cohort for (rate, cell) in c if rate == lr}, key=cell_order)
        for x, cell in enumerate(names):
            for c, (_, _, color, face, floors), offset in zip(by_cohort, cohorts, offsets, strict=True):
                members = [s for s in c.get((lr, cell), []) if math.isfinite(s.mean_val)]
                if not members:
                    continue
                ys = [s.mean_val for s in members]
                ax.scatter([x + offset] * len(ys), ys, s=30, alpha=0.8, edgecolors=color, facecolors=face or color)
                fell = [s.mean_val for s in members
                        if find_collapse(*by_name[s.name].val_success(), floor=floors[task]).fell is not None]
                ax.scatter([x + offset] * len(fell), fell, s=70, marker="x", color="tab:red")
                mean, below, above = stats.error_bar(ys, 0.0, 1.0)
                ax.errorbar([x + offset + 0.08 * (np.sign(offset) or 1)], [mean], yerr=[[below], [above]],
                            color=color, marker="_", markersize=14, capsize=4)
        labels = {"kinf": "∞", "controller": "controller"}
        ax.set_xticks(range(len(names)), [labels.get(n, n[1:]) for n in names])
        ax.set(xlabel="max staleness k", ylabel="M: mean validation success after step 0",
               title=f"{task}, actor lr {lr_name(lr)}", ylim=(0.0, None))
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=color, marker="o", ls="", markerfacecolor=face or color, label=label)
               for _, label, color, face, _ in cohorts]
    handles.append(Line2D([], [], color="tab:red", marker="x", ls="", label="the run fell"))
    fig.axes[-1].legend(handles=handles, fontsize=8, frameon=False, loc="best")
    return save_figure(fig, out / name)
