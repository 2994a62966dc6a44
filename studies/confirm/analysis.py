"""The confirmation's analyses beside its verdicts (studies/confirm/PREDICTIONS.md), a study script:

    .venv/bin/python studies/confirm/analysis.py [PATHS ...] [--out report/confirm]

The verdicts (H1-H8, F0-F4, C0-C4) are the registered evaluator's on ``predictions.yaml`` beside this file
(``ragen-async report --registered``, ``ragen_async/study/report/registered.py``), on the confirmation's seeds
(3, 4, 5). Beside them, deciding nothing: H4's falls with Fisher's exact test, each controller cell against its
unbounded and synchronous (or k = 4) cells, the shape of the cost along age on each task's cells (:func:`cost_shape`),
the stale-ESS warnings before each fall (:func:`leads`), and the figure of the confirmation beside the study's own
cells and the new levels' (:func:`plot_confirmation`). PATHS default to the specimen study's bounded and step-size
arms (seeds 0-2), ``studies/confirm/*`` and the new levels' reference sweeps (seeds 6-8), the first and last drawn
in the figure only. ``--out`` gets ``confirmation.md`` and ``confirmation.png``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from ragen_async.collapse import find_collapse
from ragen_async.study import stats
from ragen_async.study.report import study_script
from ragen_async.study.report.figures import save_figure
from ragen_async.study.report.registered import load_spec, registered_section
from ragen_async.study.report.runs import RunData
from ragen_async.study.report.summary import RunSummary

SOKOBAN, FROZEN_LAKE, COUNTDOWN = "SimpleSokoban", "FrozenLake", "SmallCountdown"
"""The tasks, by validation environment: H1-H8 are decided on Sokoban runs, F0-F4 on FrozenLake, C0-C4 on
SmallCountdown (Countdown on single-digit numbers; PREDICTIONS.md calls it Countdown)."""
SECOND_TASKS = {FROZEN_LAKE: ("F", "FrozenLake"), COUNTDOWN: ("C", "SmallCountdown")}
"""The second task's candidates in the order they were tried: their predictions' letter and name. Each has its
gate (``<letter>0``) and four predictions decided only if it passed."""
FLOORS = {SOKOBAN: 0.176, FROZEN_LAKE: 0.0, COUNTDOWN: 0.0}
"""Per task, the floor of the fall rule (PREDICTIONS.md, "Fell"): the verdicts use it whatever the report's
``--collapse-floor``."""
SEEDS = (3, 4, 5)
"""The confirmation's seeds: runs of other seeds (the study's 0-2) never enter a verdict."""
STUDY_SEEDS = (0, 1, 2)
"""The original study's seeds, drawn beside the confirmation's in its figure."""
SPEC = Path(__file__).with_name("predictions.yaml")
"""The confirmation's predictions as data, decided by ``report --registered``'s evaluator."""
STUDIES = Path(__file__).resolve().parents[1]
NEW_LEVELS = STUDIES / "newlevels"
DEFAULT_PATHS = (STUDIES / "specimen" / "bounded", STUDIES / "specimen" / "step_size", *sorted(
    p for p in (STUDIES / "confirm").iterdir() if p.is_dir()), *(NEW_LEVELS / n for n in ("lr1e4", "lr2e4", "countdown")))
"""The study's bounded and step-size arms (seeds 0-2), every sweep of the confirmation, and the new levels'
reference cells (seeds 6-8); the verdicts here read seeds 3-5 only, the figure all three cohorts."""


def _cell(s: RunSummary, seeds: Sequence[int], task: str) -> str | None:
    if not s.finished or s.off_policy != "none" or s.seed not in seeds or task not in s.val:
        return None
    if s.lag == "adaptive":
        return "controller" if s.k is None else None
    return None if s.lag != "bounded" else "kinf" if s.k is None else f"k{s.k}"


def cells(summaries: Sequence[RunSummary], seeds: Sequence[int] = SEEDS, task: str = SOKOBAN,
          cell_of: Callable[[RunSummary, Sequence[int], str], str | None] = _cell
          ) -> dict[tuple[float, str], list[RunSummary]]:
    """The cells of ``seeds``' finished runs on ``task`` without correction: (actor lr, ``k<n>`` for a bound n |
    ``kinf`` (unbounded) | ``controller`` (the staleness controller from unbounded)) -> runs; ``cell_of`` names a
    run's cell (None: in none)."""
    out: dict[tuple[float, str], list[RunSummary]] = {}
    for s in summaries:
        cell = cell_of(s, seeds, task)
        if cell is not None:
            out.setdefault((s.actor_lr_key, cell), []).append(s)
    return out


def fell_at(run: RunData, task: str) -> int | None:
    """The step a run fell at by PREDICTIONS.md's rule with its task's floor (``FLOORS``); None: it did not."""
    return find_collapse(*run.val_success(), floor=FLOORS[task]).fell


def _falls(runs: Sequence[RunData], c: dict[tuple[float, str], list[RunSummary]], task: str
           ) -> tuple[dict[str, RunData], dict[str, int | None]]:
    """The runs by name, and the step each run of the cells ``c`` fell at (:func:`fell_at`)."""
    by_name = {r.name: r for r in runs}
    return by_name, {s.name: fell_at(by_name[s.name], task) for members in c.values() for s in members}


def leads(runs: Sequence[RunData], summaries: Sequence[RunSummary], watched: Sequence[tuple[str, float]] = (
        (SOKOBAN, 2e-4), *((task, 1e-4) for task in SECOND_TASKS))) -> list[str]:
    """For each unbounded or controller run that fell, on the (task, actor lr) pairs ``watched``: the steps from
    its first ``stale_ess`` warning to the fall (none if the first warning came at or after it)."""
    by_name = {r.name: r for r in runs}
    lines = []
    for task, rate in watched:
        for (lr, cell), members in sorted(cells(summaries, task=task).items()):
            if lr != rate or cell not in ("kinf", "controller"):
                continue
            for s in members:
                fell = fell_at(by_name[s.name], task)
                if fell is None:
                    continue
                steps, fired = by_name[s.name].series("warning/stale_ess")
                steps = steps[fired > 0].astype(int)
                before = steps[steps < fell]
                lead = f"{fell - before.min()} steps" if before.size else "none (first warning at or after it)"
                lines.append(f"- {s.name} ({task}, {cell}): fell at step {fell}; stale_ess warned first at "
                             f"{steps.min() if steps.size else '—'}: lead {lead}")
    return lines


def beside_the_controller(summaries: Sequence[RunSummary], hi: float = 2e-4, task: str = SOKOBAN, name: str = "H6",
                          against: Sequence[tuple[str, str]] = (("kinf", "unbounded"), ("k0", "synchronous (k = 0)"))
                          ) -> list[str]:
    """H6's "reported beside it, not decided" (and the same beside a second task's controller prediction, X3,
    against its unbounded and k = 4 cells): the controller cell's M against the cells ``against`` at lr ``hi``
    on ``task`` (Welch differences with 95 % intervals)."""
    c = cells(summaries, task=task)
    ctrl = [s.mean_val for s in c.get((hi, "controller"), [])]
    rows = []
    for cell, label in against:
        other = [s.mean_val for s in c.get((hi, cell), [])]
        if len(ctrl) >= 2 and len(other) >= 2:
            d, low, high = stats.welch_difference(ctrl, other)
            rows.append(f"M(controller) {np.mean(ctrl):.3f} - M({label}) {np.mean(other):.3f} = {d:+.3f} [{low:+.3f}, {high:+.3f}]")
    return ["", f"Beside {name} (reported, not decided): " + "; ".join(rows) + "."] if rows else []


def falls_beside_h4(runs: Sequence[RunData], summaries: Sequence[RunSummary], hi: float = 2e-4) -> list[str]:
    """H4's "reported beside it, not tested": the falls of the unbounded and synchronous cells at lr ``hi``
    (:func:`fell_at`), with Fisher's exact test, one-sided (more falls unbounded), to say what three runs a cell
    can tell."""
    c = cells(summaries)
    unb, sync = c.get((hi, "kinf"), []), c.get((hi, "k0"), [])
    if len(unb) < 2 or len(sync) < 2:
        return []
    by_name = {r.name: r for r in runs}
    fell = [sum(fell_at(by_name[s.name], SOKOBAN) is not None for s in members) for members in (unb, sync)]
    p = scipy_stats.fisher_exact([[fell[0], len(unb) - fell[0]], [fell[1], len(sync) - fell[1]]],
                                 alternative="greater").pvalue
    return ["", f"Beside H4 (reported, not decided): falls at lr {_lr_name(hi)}, unbounded {fell[0]} of {len(unb)}, "
            f"synchronous (k = 0) {fell[1]} of {len(sync)}; Fisher's exact test, one-sided (more falls unbounded): "
            f"p = {p:.3f}."]


def _lr_name(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def _aic(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares of ``y`` on the columns ``x`` (an intercept added): RSS and AIC = n ln(RSS / n) + 2 (columns +
    1), the report's convention (``stats.cost_models``)."""
    design = np.column_stack([np.ones(y.size), x])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    rss = float(np.sum((y - design @ coef) ** 2))
    return rss, y.size * math.log(rss / y.size) + 2 * (design.shape[1] + 1) if rss > 0 else -math.inf


def cost_shape(summaries: Sequence[RunSummary], seeds: Sequence[int] = SEEDS, tasks: Sequence[str] = tuple(FLOORS),
               aic_digits: int = 1) -> list[str]:
    """Beside the verdicts, not deciding any: per task and actor lr with a synchronous cell and at least two stale
    ones (bounds, then unbounded; two runs each, the controller not among them), the shape of the cost along the
    realised mean age: the cost per version of age between neighbouring cells' means; AIC of three one-coefficient
    models of M (a step: one constant cost of any staleness; a line in age; a line in log(1 + age)); and the step's
    lack of fit against one mean per cell (an F test; the step is nested in it, the two lines are not). The runs of
    ``seeds`` on ``tasks`` (the new-level replication's script passes its own); AICs to ``aic_digits`` decimals."""
    lines = []
    for task in tasks:
        by_lr: dict[float, dict[str, list[RunSummary]]] = {}
        for (lr, cell), members in cells(summaries, seeds, task).items():
            if cell != "controller" and len(members) >= 2:
                by_lr.setdefault(lr, {})[cell] = members
        for lr, c in sorted(by_lr.items()):
            names = sorted(c, key=_cell_order)
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
            lines.append(f"- {task} at actor lr {_lr_name(lr)} ({y.size} runs): per version of mean age {segments}; "
                         f"AIC {aics}; the step's lack of fit against the cells' means {lack}.")
    return lines


def section(runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> list[str]:
    """The verdicts (the registered evaluator on :data:`SPEC`), then what is reported beside them."""
    lines = ["# The confirmation (studies/confirm/PREDICTIONS.md)", "",
             "Verdicts by the registered rule (the one-sided p; Holm's adjustment within each task's family shown "
             "beside, not deciding). Falls by PREDICTIONS.md's rule, floor " +
             ", ".join(f"{f:g} on {t}" for t, f in FLOORS.items()) + "."]
    lines += registered_section(load_spec(SPEC), runs, summaries)
    lines += falls_beside_h4(runs, summaries)
    lines += beside_the_controller(summaries)
    for task, (x, _) in SECOND_TASKS.items():
        lines += beside_the_controller(summaries, 1e-4, task, f"{x}3", (("kinf", "unbounded"), ("k4", "k = 4")))
    shape = cost_shape(summaries)
    if shape:
        lines += ["", "The shape of the cost along age (reported beside H1-H3, F1-F2, C1-C2, not decided): M of the "
                  "synchronous and stale cells without the controller. Per version: the difference of neighbouring "
                  "cells' mean M over that of their mean ages. AIC = n ln(RSS / n) + 2 (coefficients + 1), lower is "
                  "better, of M = a + b x with x the step (1 at any staleness, k ≥ 1), the mean age, or log(1 + mean "
                  "age). Lack of fit: the step against one mean per cell (F test); a small p says the stale cells "
                  "differ beyond one constant cost.", "", *shape]
    falls = leads(runs, summaries)
    if falls:
        lines += ["", "Falls of unbounded and controller runs (Sokoban at lr 2e-4, the second tasks at 1e-4) and the stale ESS "
                  "warning before them:", "", *falls]
    return [*lines, ""]


def _cell_order(cell: str) -> tuple[int, int]:
    return (0, int(cell[1:])) if cell[1:].isdigit() else (1, 0) if cell == "kinf" else (2, 0)


PANELS = ((SOKOBAN, 1e-4), (SOKOBAN, 2e-4), *((task, 1e-4) for task in SECOND_TASKS))
"""The confirmation figure's panels: (task, actor lr)."""


COHORTS = ((STUDY_SEEDS, "study, seeds 0-2", "tab:gray", "none", FLOORS),
           (SEEDS, "confirmation, seeds 3-5", "tab:blue", None, FLOORS),
           ((6, 7, 8), "new levels, seeds 6-8", "tab:green", None, {SOKOBAN: 0.180, COUNTDOWN: 0.0}))
"""The confirmation figure's cohorts, left to right: (seeds, label, colour, face colour (None: filled), the fall
rule's floor per task). The study and the confirmation played the study's levels; seeds 6-8 the new levels
(PREDICTIONS.md, "New levels", whose floor on Sokoban is the random policy's there)."""


def plot_confirmation(runs: Sequence[RunData], summaries: Sequence[RunSummary], out: Path, *,
                      panels: Sequence[tuple[str, float]] = PANELS, cohorts: Sequence[tuple] = COHORTS,
                      cell_of: Callable = _cell, name: str = "confirmation.png") -> Path | None:
    """The confirmation beside the original study and the new levels: per task and step size (``panels``) a panel
    of M (mean validation success after step 0) per cell, one column of points per cohort (``cohorts``: the
    study's seeds 0-2 hollow, then the confirmation's 3-5 and the new levels' 6-8 filled), each run a point (a
    cross over it: the run fell by PREDICTIONS.md's rule with its cohort's floor), each cohort's cell mean with its
    95 % interval. Cells (``cell_of``): every bound a cohort ran there, unbounded and the staleness controller.
    Panels without a confirmation run (``cohorts[1]``) are left out; None without any."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    by_name = {r.name: r for r in runs}
    panels = [(task, lr, [cells(summaries, seeds, task, cell_of) for seeds, *_ in cohorts]) for task, lr in panels]
    panels = [p for p in panels if any(key[0] == p[1] for key in p[2][min(1, len(cohorts) - 1)])]
    if not panels:
        return None
    offsets = np.linspace(-0.15, 0.15, len(cohorts)) if len(cohorts) > 1 else np.zeros(1)
    fig = Figure(figsize=(5.5 * len(panels), 4.2), layout="constrained")
    for ax, (task, lr, by_cohort) in zip(np.atleast_1d(fig.subplots(1, len(panels))), panels, strict=True):
        names = sorted({cell for c in by_cohort for (rate, cell) in c if rate == lr}, key=_cell_order)
        for x, name_ in enumerate(names):
            for c, (_, _, color, face, floors), offset in zip(by_cohort, cohorts, offsets, strict=True):
                members = [s for s in c.get((lr, name_), []) if math.isfinite(s.mean_val)]
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
               title=f"{task}, actor lr " + f"{lr:.0e}".replace("e-0", "e-"), ylim=(0.0, None))
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=color, marker="o", ls="", markerfacecolor=face or color, label=label)
               for _, label, color, face, _ in cohorts]
    handles.append(Line2D([], [], color="tab:red", marker="x", ls="", label="the run fell"))
    fig.axes[-1].legend(handles=handles, fontsize=8, frameon=False, loc="best")
    return save_figure(fig, out / name)


def main(argv: Sequence[str] | None = None) -> None:
    study_script(argv, description="The confirmation's verdicts and what is reported beside them.",
                 default_paths=DEFAULT_PATHS, out=Path("report/confirm"), markdown="confirmation.md", section=section,
                 figure=plot_confirmation)

if __name__ == "__main__":
    main()
