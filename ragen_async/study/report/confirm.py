"""The confirmation's verdicts: each hypothesis of ``studies/confirm/PREDICTIONS.md`` decided on the runs given.

The statistics, directions and decision rules are the prediction file's, fixed before the runs; this module only
computes them, on the confirmation's seeds (3, 4, 5) only. The runs are told apart by actor learning rate (1e-4,
2e-4) and cell: synchronous (k = 0), a bound
of 2, unbounded, and the staleness controller (``staleness.adaptive`` from unbounded). A hypothesis whose cells do
not yet hold two finished runs each is ``pending``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from ragen_async.study import stats
from ragen_async.study.report.figures import save_figure
from ragen_async.study.report.runs import RunData
from ragen_async.study.report.summary import RunSummary
from ragen_async.study.report.tables import table

K4_LR2E4_MEAN_VAL = 0.3753
"""H6 (c): the study's lr 2e-4 k = 4 cell, mean M over seeds 0-2 (PREDICTIONS.md)."""
ALARMS_PER_100 = 1.0
"""H7: at most this many ``stale_ess`` warnings per 100 learner steps."""
SPEED_LIMIT = 1.15
"""H8: the upper end of the speed ratio's 95 % interval below this."""
ALPHA = 0.05
SEEDS = (3, 4, 5)
"""The confirmation's seeds: runs of other seeds (the study's 0-2) never enter a verdict."""


@dataclass(frozen=True)
class Verdict:
    name: str
    claim: str
    statistic: str
    """The value with its 95 % interval, in words."""
    p: float
    """One-sided p in the predicted direction (NaN for the threshold rules)."""
    verdict: str
    """``held``, ``failed`` or ``pending`` (not enough runs yet)."""


STUDY_SEEDS = (0, 1, 2)
"""The original study's seeds, drawn beside the confirmation's in its figure."""


def _cell(s: RunSummary, seeds: Sequence[int]) -> str | None:
    if not s.finished or s.off_policy != "none" or s.seed not in seeds:
        return None
    if s.lag == "adaptive":
        return "controller" if s.k is None else None
    return None if s.lag != "bounded" else "kinf" if s.k is None else f"k{s.k}"


def cells(summaries: Sequence[RunSummary], seeds: Sequence[int] = SEEDS) -> dict[tuple[float, str], list[RunSummary]]:
    """The cells of ``seeds``' finished runs without correction: (actor lr, ``k<n>`` for a bound n | ``kinf``
    (unbounded) | ``controller`` (the staleness controller from unbounded)) -> runs."""
    out: dict[tuple[float, str], list[RunSummary]] = {}
    for s in summaries:
        cell = _cell(s, seeds)
        if cell is not None:
            out.setdefault((s.actor_lr_key, cell), []).append(s)
    return out


def _welch_greater(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float, float]:
    """mean(a) - mean(b), its 95 % interval, and the one-sided p of a > b (Welch)."""
    diff, low, high = stats.welch_difference(a, b)
    p = float(scipy_stats.ttest_ind(a, b, equal_var=False, alternative="greater").pvalue)
    return diff, low, high, p


def _gap_of_gaps(c: dict, lo: float, hi: float) -> tuple[float, float, float, float]:
    """[M(k0) - M(kinf)] at ``hi`` minus the same at ``lo``, its 95 % interval and one-sided p (> 0), with
    Welch-Satterthwaite degrees of freedom over the four cells."""
    groups = [np.array([s.mean_val for s in c[(lr, cell)]]) for lr in (hi, lo) for cell in ("k0", "kinf")]
    means = [g.mean() for g in groups]
    d = (means[0] - means[1]) - (means[2] - means[3])
    parts = [g.var(ddof=1) / g.size for g in groups]
    se = math.sqrt(sum(parts))
    df = sum(parts) ** 2 / sum(p * p / (g.size - 1) for p, g in zip(parts, groups, strict=True))
    t = scipy_stats.t.ppf(0.975, df)
    return d, d - t * se, d + t * se, float(scipy_stats.t.sf(d / se, df))


def _ratio(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """mean(a) / mean(b) with a 95 % interval by the delta method on the log ratio (Welch degrees of freedom)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    parts = [a.var(ddof=1) / (a.size * a.mean() ** 2), b.var(ddof=1) / (b.size * b.mean() ** 2)]
    se = math.sqrt(sum(parts))
    df = sum(parts) ** 2 / sum(p * p / (n - 1) for p, n in zip(parts, (a.size, b.size), strict=True))
    r, t = a.mean() / b.mean(), scipy_stats.t.ppf(0.975, df)
    return float(r), float(r * math.exp(-t * se)), float(r * math.exp(t * se))


def _warnings(run: RunData, signal: str = "stale_ess") -> tuple[np.ndarray, int]:
    """Steps at which ``signal`` fired (the run's own ``warning/<signal>``) and the steps watched."""
    steps, fired = run.series(f"warning/{signal}")
    return steps[fired > 0].astype(int), int(steps.size)


def verdicts(runs: Sequence[RunData], summaries: Sequence[RunSummary], lo: float = 1e-4, hi: float = 2e-4) -> list[Verdict]:
    c = cells(summaries)
    by_name = {r.name: r for r in runs}

    def have(*keys: tuple[float, str]) -> bool:
        return all(len(c.get(k, [])) >= 2 for k in keys)

    def m(key: tuple[float, str]) -> list[float]:
        return [s.mean_val for s in c[key]]

    out: list[Verdict] = []

    def add(name: str, claim: str, ready: bool, compute) -> None:
        if not ready:
            out.append(Verdict(name, claim, "—", math.nan, "pending"))
            return
        text, p, held = compute()
        out.append(Verdict(name, claim, text, p, "pending" if held is None else "held" if held else "failed"))

    def h1():
        runs1 = [s for cell in ("k0", "k2", "kinf") for s in c[(lo, cell)]]
        fit = scipy_stats.linregress([s.staleness_mean for s in runs1], [s.mean_val for s in runs1])
        p = fit.pvalue / 2 if fit.slope < 0 else 1 - fit.pvalue / 2
        t = scipy_stats.t.ppf(0.975, len(runs1) - 2)
        return (f"slope {fit.slope:+.4f} per version [{fit.slope - t * fit.stderr:+.4f}, "
                f"{fit.slope + t * fit.stderr:+.4f}], {len(runs1)} runs", p, p < ALPHA)

    def welch(a: tuple[float, str], b: tuple[float, str]):
        def compute():
            d, low, high, p = _welch_greater(m(a), m(b))
            return f"{d:+.3f} [{low:+.3f}, {high:+.3f}]", p, p < ALPHA
        return compute

    def h5():
        d, low, high, p = _gap_of_gaps(c, lo, hi)
        return f"{d:+.3f} [{low:+.3f}, {high:+.3f}]", p, p < ALPHA

    def h6():
        ctrl, unb = c[(hi, "controller")], c.get((hi, "kinf"), [])
        fell = sum(s.collapse.fell is not None for s in ctrl)
        age = float(np.mean([s.staleness_mean for s in ctrl]))
        val = float(np.mean([s.mean_val for s in ctrl]))
        half = float(np.mean([s.staleness_mean for s in unb])) / 2 if len(unb) >= 2 else math.nan
        parts = {"a": fell == 0, "b": None if math.isnan(half) else age >= half, "c": val >= K4_LR2E4_MEAN_VAL}
        text = (f"(a) {fell} of {len(ctrl)} fell; (b) mean age {age:.2f} against half the unbounded's "
                + (f"{half:.2f}" if not math.isnan(half) else "(pending: no unbounded cell yet)")
                + f"; (c) mean M {val:.3f} against {K4_LR2E4_MEAN_VAL:.3f}: "
                + ", ".join(f"({n}) {'pending' if ok is None else 'held' if ok else 'failed'}" for n, ok in parts.items()))
        # One part failed decides the goal; all three held meet it; otherwise it waits for the unbounded cell.
        return text, math.nan, False if False in parts.values() else True if all(parts.values()) else None

    def h7():
        quiet = [s for s in c[(lo, "kinf")] if s.collapse.fell is None]
        fired = watched = 0
        for s in quiet:
            steps, n = _warnings(by_name[s.name])
            fired, watched = fired + steps.size, watched + n
        rate = 100 * fired / watched if watched else math.nan
        return (f"{rate:.2f} per 100 steps ({fired} in {watched} steps of {len(quiet)} runs that did not fall)",
                math.nan, rate <= ALARMS_PER_100)

    def h8():
        stale = [s.groups_per_s for cell in ("k2", "kinf") for s in c[(lo, cell)]]
        r, low, high = _ratio(stale, [s.groups_per_s for s in c[(lo, "k0")]])
        return f"{r:.2f}× [{low:.2f}, {high:.2f}]", math.nan, high < SPEED_LIMIT

    add("H1", "staleness costs success at lr 1e-4 (slope of M on age < 0)", have(*((lo, x) for x in ("k0", "k2", "kinf"))), h1)
    add("H2", "the cost grows with age: M(k = 2) > M(unbounded), lr 1e-4", have((lo, "k2"), (lo, "kinf")),
        welch((lo, "k2"), (lo, "kinf")))
    add("H3", "any staleness costs: M(k = 0) > M(k = 2), lr 1e-4", have((lo, "k0"), (lo, "k2")), welch((lo, "k0"), (lo, "k2")))
    add("H4", "at lr 2e-4 M(k = 0) > M(unbounded)", have((hi, "k0"), (hi, "kinf")), welch((hi, "k0"), (hi, "kinf")))
    add("H5", "the step size steepens the gap: [M(k = 0) - M(unbounded)] at 2e-4 minus at 1e-4 > 0",
        have(*((lr, x) for lr in (lo, hi) for x in ("k0", "kinf"))), h5)
    add("H6", "the controller at lr 2e-4: none falls, age ≥ half the unbounded's, M ≥ the k = 4 cell's",
        have((hi, "controller")), h6)
    add("H7", f"stale_ess fires at most {ALARMS_PER_100:g} per 100 steps on lr 1e-4 unbounded runs that did not fall",
        have((lo, "kinf")), h7)
    add("H8", f"asynchrony's speed-up at lr 1e-4 (k = 2 and unbounded over k = 0) below {SPEED_LIMIT}× (upper end)",
        have((lo, "k0"), (lo, "k2"), (lo, "kinf")), h8)
    return out


def leads(runs: Sequence[RunData], summaries: Sequence[RunSummary], hi: float = 2e-4) -> list[str]:
    """For each lr 2e-4 unbounded or controller run that fell: the steps from its first ``stale_ess`` warning to
    the fall (none if the first warning came at or after it)."""
    by_name = {r.name: r for r in runs}
    lines = []
    for (lr, cell), members in sorted(cells(summaries).items()):
        if lr != hi or cell not in ("kinf", "controller"):
            continue
        for s in members:
            if s.collapse.fell is None:
                continue
            steps, _ = _warnings(by_name[s.name])
            before = steps[steps < s.collapse.fell]
            lead = f"{s.collapse.fell - before.min()} steps" if before.size else "none (first warning at or after it)"
            lines.append(f"- {s.name} ({cell}): fell at step {s.collapse.fell}; stale_ess warned first at "
                         f"{steps.min() if steps.size else '—'}: lead {lead}")
    return lines


def confirm_section(runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> list[str]:
    """The report's section: each hypothesis, its statistic with its interval, one-sided p, and verdict."""
    rows = [[v.name, v.claim, v.statistic, "—" if math.isnan(v.p) else f"{v.p:.3f}", v.verdict]
            for v in verdicts(runs, summaries)]
    c = cells(summaries)
    counts = ", ".join(f"{cell} at {lr:g}: {len(members)}" for (lr, cell), members in sorted(c.items()))
    lines = ["## The confirmation's predictions (studies/confirm/PREDICTIONS.md)", "",
             f"Finished runs per cell: {counts or 'none'}. p: one-sided, in the predicted direction; held when "
             f"p < {ALPHA} (H1-H5), or when the threshold rule holds (H6-H8). Pending: a cell has fewer than two "
             "finished runs.", ""]
    lines += table(["", "prediction", "statistic [95 % interval]", "p", "verdict"], rows)
    falls = leads(runs, summaries)
    if falls:
        lines += ["", "Falls at lr 2e-4 and the stale ESS warning before them:", "", *falls]
    return [*lines, ""]


def _cell_order(cell: str) -> tuple[int, int]:
    return (0, int(cell[1:])) if cell[1:].isdigit() else (1, 0) if cell == "kinf" else (2, 0)


def plot_confirmation(summaries: Sequence[RunSummary], out: Path, lrs: Sequence[float] = (1e-4, 2e-4)) -> Path | None:
    """The confirmation beside the original study: per step size a panel of M (mean validation success after
    step 0) per cell, the study's seeds (0-2, hollow) left of the confirmation's (3-5, filled), each run a point
    (a cross over it: the run fell), each cohort's cell mean with its 95 % interval. Cells: every bound either
    cohort ran at that step size, unbounded and the controller. None without a confirmation run."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    new, old = cells(summaries), cells(summaries, STUDY_SEEDS)
    panels = [lr for lr in lrs if any(key[0] == lr for key in new)]
    if not panels:
        return None
    cohorts = (("study, seeds 0-2", old, "tab:gray", "none", -0.15), ("confirmation, seeds 3-5", new, "tab:blue", None, 0.15))
    fig = Figure(figsize=(6 * len(panels), 4.2), layout="constrained")
    for ax, lr in zip(np.atleast_1d(fig.subplots(1, len(panels))), panels, strict=True):
        names = sorted({cell for c in (new, old) for (rate, cell) in c if rate == lr}, key=_cell_order)
        for x, name in enumerate(names):
            for _, c, color, face, offset in cohorts:
                members = c.get((lr, name), [])
                ys = [s.mean_val for s in members if math.isfinite(s.mean_val)]
                if not ys:
                    continue
                ax.scatter([x + offset] * len(ys), ys, s=30, alpha=0.8, edgecolors=color,
                           facecolors=face or color)
                fell = [s.mean_val for s in members if s.collapse.fell is not None and math.isfinite(s.mean_val)]
                ax.scatter([x + offset] * len(fell), fell, s=70, marker="x", color="tab:red")
                mean, below, above = stats.error_bar(ys, 0.0, 1.0)
                ax.errorbar([x + offset + 0.08 * np.sign(offset)], [mean], yerr=[[below], [above]], color=color,
                            marker="_", markersize=14, capsize=4)
        labels = {"kinf": "∞", "controller": "controller"}
        ax.set_xticks(range(len(names)), [labels.get(n, n[1:]) for n in names])
        ax.set(xlabel="max staleness k", ylabel="M: mean validation success after step 0",
               title=f"actor lr {lr:.0e}".replace("e-0", "e-"), ylim=(0.0, None))
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=color, marker="o", ls="", markerfacecolor=face or color, label=label)
               for label, _, color, face, _ in cohorts]
    handles.append(Line2D([], [], color="tab:red", marker="x", ls="", label="the run fell"))
    fig.axes[-1].legend(handles=handles, fontsize=8, frameon=False, loc="best")
    return save_figure(fig, out / "confirmation.png")
