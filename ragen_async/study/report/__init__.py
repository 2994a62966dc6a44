"""Reports: what a run, or a sweep of runs, says about staleness and stability.

``write_report(paths, out)`` reads the ``metrics.jsonl`` of every run it finds under ``paths`` (run
directories, sweep directories, or folders holding either) and writes into ``out``:

* ``report.md``: an overview table (one row per run); the cells (runs that differ only in their seed, pooled: mean and
  95 % interval, clipped to the quantity's range, Wilson's for a share of runs, of final and best
  validation success, throughput, staleness, the share of runs that fell and that collapsed, the lead time
  and false-alarm rate of each early-warning signal; definitions in :mod:`ragen_async.staleness.collapse` and
  :mod:`ragen_async.study.stats`; finished runs only); each cell against synchronous training and the
  trend in mean staleness; the sections a headline quotes (:mod:`.headline`: the cost as a step or a line,
  how much steeper a larger step size makes it, speed inside the runs beside the idle-machine figures);
  success at equal time (``throughput``); then a table per run: final and best
  validation success per environment, the step validation first reached the threshold, staleness,
  the collapse indicators (largest gradient norm, smallest entropy, in-group reward std early vs
  late), the behaviour/learner k3 mismatch and the mean step time; and the drops (:mod:`.drops`), per cell: the
  share of generated groups the bound threw away, how late they were, generated against consumed groups/s and
  the share of generated tokens and generation time dropped, and the dropped groups against the consumed ones
  (by level, where other runs consumed the same level, and by their own episode statistics where recorded);
* ``summary.csv``: the overview as numbers (fall and collapse steps, lead times, false alarms, the drops), for
  analysis;
* ``curves_*.png``: validation success, rollout reward, in-group reward std, entropy, gradient norm,
  valid-action rate, behaviour/learner KL and mean staleness against the learner step, one line per run, coloured by ``max_staleness`` (solid
  = bounded, dashed = fixed lag, dotted = adaptive bound);
* ``staleness_stability.png``: final and mean validation success and largest gradient norm against k, one
  marker shape per off-policy correction (filled: bounded; hollow: fixed lag; lightly filled: adaptive bound), each
  (k, correction, lag, step size) as its mean over seeds with a 95 % interval;
* ``cells_val_success.png``: validation success per cell (mean over seeds, 95 % band) against the
  learner step and against training wall-clock.

Runs may be of different lengths, still running (a half-written last line is skipped with a
warning), resumed (a replayed step keeps its latest record), or missing any metric (shown as —).

The work is split by concern: :mod:`.runs` loads runs, :mod:`.summary` gives one run's numbers,
:mod:`ragen_async.study.stats` the statistics over runs, :mod:`.tables` the markdown and CSV,
:mod:`.headline` the sections a headline quotes, and :mod:`.figures` the plots; this module puts them
together and re-exports what callers use.
"""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ragen_async.study.report import drops, headline, tables
from ragen_async.study.report.figures import plot_cells, plot_curves, plot_lag_sensitivity, plot_staleness_summary
from ragen_async.study.report.registered import SpecError, decide, load_spec, registered_section
from ragen_async.study.report.runs import (
    MISSING,
    REFERENCE_COLUMNS,
    ReportError,
    RunData,
    find_runs,
    read_metrics,
    read_reference,
    val_success_vs_time,
)
from ragen_async.study.report.summary import RunSummary, reference_bands, summarize

__all__ = ["REFERENCE_COLUMNS", "Report", "ReportError", "RunData", "RunSummary", "find_runs", "plot_cells",
           "plot_curves", "plot_lag_sensitivity", "plot_staleness_summary", "read_metrics", "read_reference",
           "read_runs", "study_script", "summarize", "val_success_vs_time", "write_report"]


@dataclass
class Report:
    markdown: Path
    csv: Path
    plots: list[Path]
    summaries: list[RunSummary]
    warnings: list[str]
    drops: list[str] = field(default_factory=list)
    """One line per cell that dropped groups (the drops section's figures), for the console."""
    verdicts: list[str] = field(default_factory=list)
    """With ``registered``: one line per prediction, its verdict and the words its rule allows, for the console."""


def read_runs(paths: Sequence[str | Path]) -> tuple[list[RunData], list[RunSummary], list[str]]:
    """The runs under ``paths``, their summaries with the drop figures attached (:func:`.drops.attach`), and
    the warnings of finding them: what a study's analysis script reads before its own sections."""
    runs, warnings = find_runs(paths)
    summaries = [summarize(r) for r in runs]
    drops.attach(runs, summaries)
    return runs, summaries, warnings


def study_script(argv: Sequence[str] | None, *, description: str, default_paths: Sequence[Path], out: Path,
                 markdown: str, section: Callable[[list[RunData], list[RunSummary]], list[str]],
                 figure: Callable[[list[RunData], list[RunSummary], Path], Path | None] | None = None) -> None:
    """A study's analysis script from the command line: the runs under the given paths (``default_paths`` when
    none), ``section(runs, summaries)`` written to ``--out``/``markdown`` and printed, ``figure(runs, summaries,
    out)`` drawn there if given; then a closing line (how many runs, their warnings, the files)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("paths", nargs="*", type=Path, help="runs or sweeps (default: the script's own)")
    parser.add_argument("--out", type=Path, default=out, help=f"where {markdown} (and any figure) goes")
    args = parser.parse_args(argv)
    runs, summaries, warnings = read_runs(args.paths or default_paths)
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(section(runs, summaries))
    (args.out / markdown).write_text(text)
    print(text)
    drawn = figure(runs, summaries, args.out) if figure is not None else None
    print(f"{len(runs)} runs ({len(warnings)} warnings); {args.out / markdown}" + (f", {drawn}" if drawn else ""))


def write_report(paths: Sequence[str | Path], out: str | Path, *, threshold: float = 0.9,
                 smooth: int = 1, title: str | None = None, baselines: dict[str, float] | None = None,
                 collapse_floor: float = 0.0, throughput: dict[int | None, float] | None = None,
                 references: dict[str, str | Path] | None = None,
                 registered: str | Path | Sequence[str | Path] | None = None) -> Report:
    """Read every run under ``paths`` and write ``report.md``, ``summary.csv`` and the plots into ``out``;
    ``baselines`` (name -> validation success, e.g. the random and oracle policies) are drawn as lines
    on every validation-success plot; ``collapse_floor`` is the success a fall is measured towards
    (:mod:`ragen_async.staleness.collapse`; the random policy's, for a run that starts well above 0);
    ``throughput`` (k, ``None`` = unbounded -> groups/s measured by ``bench pipeline``) adds the
    equal-time table; ``references`` (name -> cells CSV, :func:`read_reference`) adds the figure of success
    against measured lag beside them;
    ``registered`` (one predictions spec or several) each of their predictions decided on the runs
    (:mod:`.registered`)."""
    if isinstance(registered, (str, Path)):
        registered = [registered]
    try:
        specs = [load_spec(path) for path in registered or ()]
    except SpecError as e:
        raise ReportError(str(e)) from None
    reference_frames = {name: read_reference(path) for name, path in (references or {}).items()}
    runs, warnings = find_runs(paths)
    if not runs:
        raise ReportError("no runs found under " + ", ".join(map(str, paths)) +
                          ("; " + "; ".join(warnings) if warnings else ""))
    warnings += [f"{r.name}: {w}" for r in runs for w in r.warnings]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r, threshold, collapse_floor) for r in runs]
    bands = reference_bands(runs, summaries)
    summaries = [summarize(r, threshold, collapse_floor, bands.get(s.actor_lr_key))
                 if s.actor_lr_key in bands and not s.is_reference else s for r, s in zip(runs, summaries, strict=True)]
    level_differences = drops.attach(runs, summaries)
    with_data = [r for r in runs if r.train or r.val]
    plots = plot_curves(with_data, out, smooth=smooth, baselines=baselines) if with_data else []
    stability = plot_staleness_summary([s for s, r in zip(summaries, runs, strict=True) if r.train or r.val], out)
    if stability is not None:
        plots.append(stability)
    cells_plot = plot_cells(runs, summaries, out, baselines=baselines)
    if cells_plot is not None:
        plots.append(cells_plot)
    lag_plot = plot_lag_sensitivity(summaries, reference_frames, out)
    if lag_plot is not None:
        plots.append(lag_plot)

    sources = ", ".join(f"`{p}`" for p in paths)
    lines = [f"# {title or 'ragen_async report'}", "",
             f"{len(runs)} runs from {sources}, {time.strftime('%Y-%m-%d %H:%M')}. "
             f"Validation threshold {threshold:g}; reward-std trend = mean of the first vs last 10% of steps; "
             f"{MISSING} = not logged.", "", "## Overview", ""]
    header = [h.format(t=f"{threshold:g}") for h in tables.OVERVIEW]
    lines += [*tables.table(header, (tables.overview_row(s) for s in summaries)), ""]
    lines += tables.cells_section(summaries, collapse_floor)
    lines += tables.bound_section(runs)
    drop_lines, drop_console = drops.drops_section(summaries, level_differences)
    lines += drop_lines
    lines += tables.against_sync_section(summaries)
    lines += headline.shape_section(summaries)
    lines += headline.step_size_section(summaries)
    lines += tables.equal_time_section(runs, summaries, throughput or {})
    lines += headline.speed_section(summaries, throughput or {})
    verdicts = []
    for spec in specs:
        lines += [*registered_section(spec, runs, summaries), ""]
        verdicts += [f"{o.name}: {o.verdict}; may be written: {o.words}" for o in decide(spec, summaries, runs)]
    if plots:
        lines += ["## Curves", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots if p.name.startswith("curves_")]
        if stability is not None:
            lines += ["", "## Staleness vs stability", "", f"![staleness vs stability]({stability.name})"]
        if cells_plot is not None:
            lines += ["", "## Cells over steps and wall-clock", "", f"![cells]({cells_plot.name})"]
        if lag_plot is not None:
            lines += ["", "## Beside the reference", "", f"References: {', '.join(sorted(reference_frames))}.", "",
                      f"![lag sensitivity]({lag_plot.name})"]
        lines.append("")
    lines += ["## Runs", ""]
    for run, s in zip(runs, summaries, strict=True):
        lines += tables.run_section(run, s, threshold)
    if warnings:
        lines += ["## Warnings", "", *[f"- {tables.cell_text(w)}" for w in warnings], ""]
    markdown = out / "report.md"
    markdown.write_text("\n".join(lines))

    rows = tables.csv_rows(summaries)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    csv_path = out / "summary.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return Report(markdown, csv_path, plots, summaries, warnings, drop_console, verdicts)
