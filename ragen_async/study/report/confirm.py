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

import numpy as np
from scipy import stats as scipy_stats

from ragen_async.study import stats
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


def _cell(s: RunSummary) -> str | None:
    if not s.finished or s.off_policy != "none" or s.seed not in SEEDS:
        return None
    if s.lag == "adaptive":
        return "controller" if s.k is None else None
    return {0: "k0", 2: "k2", None: "kinf"}.get(s.k) if s.lag == "bounded" else None


def cells(summaries: Sequence[RunSummary]) -> dict[tuple[float, str], list[RunSummary]]:
    """The confirmation's cells: (actor lr, ``k0`` | ``k2`` | ``kinf`` | ``controller``) -> finished runs."""
    out: dict[tuple[float, str], list[RunSummary]] = {}
    for s in summaries:
        cell = _cell(s)
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
