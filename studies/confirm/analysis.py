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

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from ragen_async.staleness.collapse import find_collapse
from ragen_async.study import stats
from ragen_async.study.report import cohorts, study_script
from ragen_async.study.report.cohorts import lr_name
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


def cells(summaries: Sequence[RunSummary], task: str = SOKOBAN) -> dict[tuple[float, str], list[RunSummary]]:
    """The confirmation's cells on ``task`` (seeds 3-5): (actor lr, ``k<n>`` | ``kinf`` | ``controller``) -> runs
    (:func:`ragen_async.study.report.cohorts.cells`)."""
    return cohorts.cells(summaries, SEEDS, task)


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
    return ["", f"Beside H4 (reported, not decided): falls at lr {lr_name(hi)}, unbounded {fell[0]} of {len(unb)}, "
            f"synchronous (k = 0) {fell[1]} of {len(sync)}; Fisher's exact test, one-sided (more falls unbounded): "
            f"p = {p:.3f}."]


def cost_shape(summaries: Sequence[RunSummary]) -> list[str]:
    """Beside the verdicts, not deciding any: the shape of the cost along age on each task's cells of seeds 3-5
    (:func:`ragen_async.study.report.cohorts.cost_shape`)."""
    return cohorts.cost_shape(summaries, SEEDS, tuple(FLOORS))


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


PANELS = ((SOKOBAN, 1e-4), (SOKOBAN, 2e-4), *((task, 1e-4) for task in SECOND_TASKS))
"""The confirmation figure's panels: (task, actor lr)."""


COHORTS = ((STUDY_SEEDS, "study, seeds 0-2", "tab:gray", "none", FLOORS),
           (SEEDS, "confirmation, seeds 3-5", "tab:blue", None, FLOORS),
           ((6, 7, 8), "new levels, seeds 6-8", "tab:green", None, {SOKOBAN: 0.180, COUNTDOWN: 0.0}))
"""The confirmation figure's cohorts, left to right: (seeds, label, colour, face colour (None: filled), the fall
rule's floor per task). The study and the confirmation played the study's levels; seeds 6-8 the new levels
(PREDICTIONS.md, "New levels", whose floor on Sokoban is the random policy's there)."""


def plot_confirmation(runs: Sequence[RunData], summaries: Sequence[RunSummary], out: Path) -> Path | None:
    """The confirmation beside the original study and the new levels (:data:`PANELS`, :data:`COHORTS`;
    :func:`ragen_async.study.report.cohorts.plot_cohorts`): a panel per task and step size the confirmation ran,
    M per cell, each run a point, a cross where it fell by its cohort's floor; None without a confirmation run."""
    return cohorts.plot_cohorts(runs, summaries, out, panels=PANELS, cohorts=COHORTS, anchor=1,
                                name="confirmation.png")


def main(argv: Sequence[str] | None = None) -> None:
    study_script(argv, description="The confirmation's verdicts and what is reported beside them.",
                 default_paths=DEFAULT_PATHS, out=Path("report/confirm"), markdown="confirmation.md", section=section,
                 figure=plot_confirmation)

if __name__ == "__main__":
    main()
