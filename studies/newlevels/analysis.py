"""The new-level replication's analyses beside its verdicts (studies/confirm/PREDICTIONS.md, "New levels"), a
study script:

    .venv/bin/python studies/newlevels/analysis.py [PATHS ...] [--out report/newlevels]

The verdicts N1-N8 are the registered evaluator's on ``predictions.yaml`` beside this file (``ragen-async report
--registered``). Beside them, deciding nothing, what the section registers as reported: **Paired**, for each Welch
prediction the mean of the three per-seed differences of M (runs with the same sampling seed play the same levels)
with its t-interval; the falls of the unbounded and synchronous cells at lr 2e-4 with Fisher's exact test (beside
N4); and **the shape**, the AIC of three fits of M on Age (a step at Age > 0, the line, log(1 + Age)) on each task's
cells (:func:`ragen_async.study.report.cohorts.cost_shape`, on seeds 6-8). And a figure of M per cell, each run a
point (:func:`plot`). PATHS default to the three reference sweeps and the controller's where they exist; ``--out`` gets
``newlevels.md`` and ``newlevels.png``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from scipy import stats as scipy_stats

from ragen_async.staleness.collapse import find_collapse
from ragen_async.study import stats
from ragen_async.study.report import cohorts, study_script
from ragen_async.study.report.registered import Spec, cells, load_spec, registered_section
from ragen_async.study.report.runs import RunData
from ragen_async.study.report.summary import RunSummary

HERE = Path(__file__).resolve().parent
SPEC = HERE / "predictions.yaml"
"""N1-N8 as data, committed before the first run here."""
DEFAULT_PATHS = tuple(HERE / name for name in ("lr1e4", "lr2e4", "countdown", "controller", "controller_countdown")
                      if (HERE / name).is_dir())
"""The reference cells (Sokoban at actor lr 1e-4 and 2e-4, SmallCountdown at 1e-4) and the controller's runs."""
SOKOBAN, COUNTDOWN = "SimpleSokoban", "SmallCountdown"
"""The tasks, by validation environment (the spec's families)."""


def paired(spec: Spec, summaries: Sequence[RunSummary]) -> list[str]:
    """Per Welch prediction: M(a) - M(b) seed by seed, their mean and its 95 % t-interval (seeds with a run in both
    cells only)."""
    lines = []
    for family in spec.families:
        by_cell = cells(spec, family, summaries)
        for p in family.predictions:
            if p.kind != "welch":
                continue
            a, b = ({s.seed: s.mean_val for s in by_cell[c]} for c in p.cells)
            seeds = sorted(set(a) & set(b))
            diffs = [a[seed] - b[seed] for seed in seeds]
            mean, half, n = stats.interval(diffs)
            each = ", ".join(f"{d:+.3f}" for d in diffs)
            lines.append(f"- {p.name}, M({p.cells[0]}) - M({p.cells[1]}), paired over seeds "
                         f"{', '.join(map(str, seeds)) or '—'}: {each or '—'}; mean "
                         f"{stats.format_bounds(mean, mean - half, mean + half, '+.3f')}")
    return lines


def falls_beside_n4(spec: Spec, runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> list[str]:
    """Falls (the Sokoban family's floor) of the unbounded and synchronous cells at lr 2e-4, with Fisher's exact
    test, one-sided (more falls unbounded)."""
    (family,) = [f for f in spec.families if f.task == SOKOBAN]
    by_cell, by_name = cells(spec, family, summaries), {r.name: r for r in runs}
    unb, sync = by_cell["2e-4/kinf"], by_cell["2e-4/k0"]
    if len(unb) < 2 or len(sync) < 2:
        return []
    fell = [sum(find_collapse(*by_name[s.name].val_success(), floor=family.floor).fell is not None for s in members)
            for members in (unb, sync)]
    p = scipy_stats.fisher_exact([[fell[0], len(unb) - fell[0]], [fell[1], len(sync) - fell[1]]],
                                 alternative="greater").pvalue
    return [f"Beside N4 (reported, not decided): falls at lr 2e-4 (floor {family.floor:g}), unbounded {fell[0]} of "
            f"{len(unb)}, synchronous (k = 0) {fell[1]} of {len(sync)}; Fisher's exact test, one-sided (more falls "
            f"unbounded): p = {p:.3f}."]


def section(runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> list[str]:
    """The verdicts (the registered evaluator on :data:`SPEC`), then what is reported beside them."""
    spec = load_spec(SPEC)
    lines = ["# The new-level replication (studies/confirm/PREDICTIONS.md, \"New levels\")", *registered_section(
        spec, runs, summaries), "", "Paired differences (reported beside the Welch predictions, never deciding): "
        "M of each seed's run in the first cell minus that in the second, the mean with its 95 % t-interval.", "",
        *paired(spec, summaries)]
    lines += ["", *falls_beside_n4(spec, runs, summaries)]
    shape = cohorts.cost_shape(summaries, spec.seeds, [f.task for f in spec.families], aic_digits=3)
    if shape:
        lines += ["", "The shape of the cost along age (described, not tested): per version, the difference of "
                  "neighbouring cells' mean M over that of their mean ages; AIC = n ln(RSS / n) + 2 (coefficients + "
                  "1), lower is better, of M = a + b x with x the step (1 at any staleness), the mean age, or log(1 + "
                  "mean age); the step's lack of fit against one mean per cell (F test).", "", *shape]
    return [*lines, ""]


def _cell(s: RunSummary, seeds: Sequence[int], task: str) -> str | None:
    """A run's cell in the figure: :func:`ragen_async.study.report.cohorts.cell_of`, and ``controller`` for the
    KL-target controller (adaptive from a bound)."""
    if s.lag == "adaptive" and s.finished and s.off_policy == "none" and s.seed in seeds and task in s.val:
        return "controller"
    return cohorts.cell_of(s, seeds, task)


def plot(runs: Sequence[RunData], summaries: Sequence[RunSummary], out: Path) -> Path | None:
    """M per cell on the new levels (seeds 6-8), each run a point, a cross where it fell (its family's floor), the
    cell's mean with its 95 % interval; Sokoban at both step sizes and SmallCountdown, the controller beside the
    reference cells once it has run."""
    spec = load_spec(SPEC)
    return cohorts.plot_cohorts(
        runs, summaries, out, panels=((SOKOBAN, 1e-4), (SOKOBAN, 2e-4), (COUNTDOWN, 1e-4)),
        cohorts=((spec.seeds, "new levels, seeds " + "-".join(map(str, (spec.seeds[0], spec.seeds[-1]))),
                  "tab:green", None, {f.task: f.floor for f in spec.families}),), name_of=_cell, name="newlevels.png")


def main(argv: Sequence[str] | None = None) -> None:
    study_script(argv, description="The new-level verdicts and what is reported beside them.",
                 default_paths=DEFAULT_PATHS, out=Path("report/newlevels"), markdown="newlevels.md", section=section,
                 figure=plot)

if __name__ == "__main__":
    main()
