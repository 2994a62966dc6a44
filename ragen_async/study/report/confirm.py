"""The confirmation's verdicts: each hypothesis of ``studies/confirm/PREDICTIONS.md`` decided on the runs given.

The statistics, directions and decision rules are the prediction file's, fixed before the runs; this module only
computes them, on the confirmation's seeds (3, 4, 5) only. The runs are told apart by task (the validation
environment: Sokoban for H1-H8, FrozenLake for F0-F4, SmallCountdown (Countdown on single-digit numbers) for C0-C4),
actor learning rate (1e-4, 2e-4) and cell: a bound k
(``k0``, ``k2``, ``k4``), unbounded (``kinf``), and the staleness controller (``staleness.adaptive`` from
unbounded). A hypothesis whose cells do not yet hold two finished runs each is ``pending``; one decided while a
cell holds fewer than the three seeds is ``held (interim)`` or ``failed (interim)``.

Beside the verdicts, not deciding them (PREDICTIONS.md registers no correction for multiplicity): each p adjusted
by Holm's step-down over its task's predictions that have one (:func:`holm`), and the shape of the cost along age
on each task's three cells (:func:`cost_shape`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from ragen_async.collapse import find_collapse
from ragen_async.study import stats
from ragen_async.study.report.figures import save_figure
from ragen_async.study.report.runs import RunData
from ragen_async.study.report.summary import RunSummary
from ragen_async.study.report.tables import table

SOKOBAN, FROZEN_LAKE, COUNTDOWN = "SimpleSokoban", "FrozenLake", "SmallCountdown"
"""The tasks, by validation environment: H1-H8 are decided on Sokoban runs, F0-F4 on FrozenLake, C0-C4 on
SmallCountdown (Countdown on single-digit numbers; PREDICTIONS.md calls it Countdown)."""
SECOND_TASKS = {FROZEN_LAKE: ("F", "FrozenLake"), COUNTDOWN: ("C", "SmallCountdown")}
"""The second task's candidates in the order they were tried: their predictions' letter and name. Each has its
gate (``<letter>0``) and four predictions decided only if it passed."""
FLOORS = {SOKOBAN: 0.176, FROZEN_LAKE: 0.0, COUNTDOWN: 0.0}
"""Per task, the floor of the fall rule (PREDICTIONS.md, "Fell"): the verdicts use it whatever the report's
``--collapse-floor``."""
K4_LR2E4_MEAN_VAL = 0.3753
"""H6 (c): the study's lr 2e-4 k = 4 cell, mean M over seeds 0-2 (PREDICTIONS.md)."""
ALARMS_PER_100 = 1.0
"""H7, F4, C4: at most this many ``stale_ess`` warnings per 100 learner steps."""
SPEED_LIMIT = 1.15
"""H8: the upper end of the speed ratio's 95 % interval below this."""
GATE_GAIN = 0.08
"""F0, C0: the k = 0 cell's mean gain (last two validations over step 0) at least this."""
ALPHA = 0.05
SEEDS = (3, 4, 5)
"""The confirmation's seeds: runs of other seeds (the study's 0-2) never enter a verdict."""
STUDY_SEEDS = (0, 1, 2)
"""The original study's seeds, drawn beside the confirmation's in its figure."""


@dataclass(frozen=True)
class Verdict:
    name: str
    claim: str
    statistic: str
    """The value with its 95 % interval, in words."""
    p: float
    """One-sided p in the predicted direction (NaN for the threshold rules)."""
    verdict: str
    """``held``, ``failed``, ``pending`` (not enough runs yet) or ``not run`` (F1-F4, C1-C4 when their gate failed);
    ``held (interim)`` or ``failed (interim)`` while a cell it reads has fewer runs than ``SEEDS``."""
    p_holm: float = math.nan
    """``p`` adjusted by Holm's step-down within its task's family (:func:`holm`); shown beside, never deciding
    (NaN where ``p`` is)."""


holm = stats.holm
"""Holm's step-down adjustment (:func:`ragen_async.study.stats.holm`)."""


def with_holm(vs: Sequence[Verdict]) -> list[Verdict]:
    """``vs`` with ``p_holm`` set, each family (the predictions of one task: the first letter of the name, H, F
    or C) adjusted apart."""
    vs, out = list(vs), list(vs)
    for family in dict.fromkeys(v.name[0] for v in vs):
        members = [i for i, v in enumerate(vs) if v.name[0] == family]
        for i, adjusted in zip(members, holm([vs[i].p for i in members]), strict=True):
            out[i] = replace(vs[i], p_holm=adjusted)
    return out


def _cell(s: RunSummary, seeds: Sequence[int], task: str) -> str | None:
    if not s.finished or s.off_policy != "none" or s.seed not in seeds or task not in s.val:
        return None
    if s.lag == "adaptive":
        return "controller" if s.k is None else None
    return None if s.lag != "bounded" else "kinf" if s.k is None else f"k{s.k}"


def cells(summaries: Sequence[RunSummary], seeds: Sequence[int] = SEEDS, task: str = SOKOBAN
          ) -> dict[tuple[float, str], list[RunSummary]]:
    """The cells of ``seeds``' finished runs on ``task`` without correction: (actor lr, ``k<n>`` for a bound n |
    ``kinf`` (unbounded) | ``controller`` (the staleness controller from unbounded)) -> runs."""
    out: dict[tuple[float, str], list[RunSummary]] = {}
    for s in summaries:
        cell = _cell(s, seeds, task)
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


def fell_at(run: RunData, task: str) -> int | None:
    """The step a run fell at by PREDICTIONS.md's rule with its task's floor (``FLOORS``); None: it did not."""
    return find_collapse(*run.val_success(), floor=FLOORS[task]).fell


def _falls(runs: Sequence[RunData], c: dict[tuple[float, str], list[RunSummary]], task: str
           ) -> tuple[dict[str, RunData], dict[str, int | None]]:
    """The runs by name, and the step each run of the cells ``c`` fell at (:func:`fell_at`)."""
    by_name = {r.name: r for r in runs}
    return by_name, {s.name: fell_at(by_name[s.name], task) for members in c.values() for s in members}


def gain(run: RunData) -> float:
    """F0's and C0's Gain: the mean of the run's last two validations minus its first (step 0)."""
    _, values = run.val_success()
    return float(values[-2:].mean() - values[0]) if values.size >= 3 else math.nan


def _slope(members: Sequence[RunSummary]) -> tuple[str, float, bool]:
    fit = scipy_stats.linregress([s.staleness_mean for s in members], [s.mean_val for s in members])
    p = fit.pvalue / 2 if fit.slope < 0 else 1 - fit.pvalue / 2
    t = scipy_stats.t.ppf(0.975, len(members) - 2)
    return (f"slope {fit.slope:+.4f} per version [{fit.slope - t * fit.stderr:+.4f}, "
            f"{fit.slope + t * fit.stderr:+.4f}], {len(members)} runs", p, p < ALPHA)


def _controller_goal(ctrl: Sequence[RunSummary], unb: Sequence[RunSummary], m_ref: float, m_ref_name: str,
                     falls: dict[str, int | None]) -> tuple[str, float, bool | None]:
    """H6 and F3: (a) no controller run fell, (b) its mean age at least half the unbounded cell's, (c) its mean M
    at least ``m_ref``; one part failed decides, all three held meet the goal, else it waits (None)."""
    fell = sum(falls[s.name] is not None for s in ctrl)
    age = float(np.mean([s.staleness_mean for s in ctrl]))
    val = float(np.mean([s.mean_val for s in ctrl]))
    half = float(np.mean([s.staleness_mean for s in unb])) / 2 if len(unb) >= 2 else math.nan
    ref = m_ref if math.isfinite(m_ref) else None
    parts = {"a": fell == 0, "b": None if math.isnan(half) else age >= half, "c": None if ref is None else val >= ref}
    text = (f"(a) {fell} of {len(ctrl)} fell; (b) mean age {age:.2f} against half the unbounded's "
            + (f"{half:.2f}" if not math.isnan(half) else "(pending: no unbounded cell yet)")
            + f"; (c) mean M {val:.3f} against {m_ref_name} "
            + (f"{ref:.3f}" if ref is not None else "(pending)") + ": "
            + ", ".join(f"({n}) {'pending' if ok is None else 'held' if ok else 'failed'}" for n, ok in parts.items()))
    return text, math.nan, False if False in parts.values() else True if all(parts.values()) else None


def _alarm_rate(quiet: Sequence[RunSummary], by_name: dict[str, RunData]) -> tuple[str, float, bool]:
    """H7 and F4: ``stale_ess`` warnings per 100 steps over runs that did not fall."""
    fired = watched = 0
    for s in quiet:
        steps, n = _warnings(by_name[s.name])
        fired, watched = fired + steps.size, watched + n
    rate = 100 * fired / watched if watched else math.nan
    return (f"{rate:.2f} per 100 steps ({fired} in {watched} steps of {len(quiet)} runs that did not fall)",
            math.nan, rate <= ALARMS_PER_100)


class _Decider:
    """Collects verdicts: a hypothesis whose cells lack two finished runs each is pending; one decided while a
    cell holds fewer runs than the predictions' seeds is marked interim."""

    def __init__(self, c: dict[tuple[float, str], list[RunSummary]]):
        self.c, self.out = c, []

    def have(self, *keys: tuple[float, str], runs: int = 2) -> bool:
        return all(len(self.c.get(k, [])) >= runs for k in keys)

    def m(self, key: tuple[float, str]) -> list[float]:
        return [s.mean_val for s in self.c[key]]

    def add(self, name: str, claim: str, keys: Sequence[tuple[float, str]], compute, skip: str | None = None) -> None:
        """Decide ``name`` on the cells ``keys`` with ``compute() -> (statistic, p, held or None)``."""
        if skip is not None:
            self.out.append(Verdict(name, claim, skip, math.nan, "not run"))
        elif not self.have(*keys):
            self.out.append(Verdict(name, claim, "—", math.nan, "pending"))
        else:
            text, p, held = compute()
            verdict = "pending" if held is None else "held" if held else "failed"
            if held is not None and not self.have(*keys, runs=len(SEEDS)):
                verdict += " (interim)"
            self.out.append(Verdict(name, claim, text, p, verdict))

    def welch(self, a: tuple[float, str], b: tuple[float, str]):
        def compute():
            d, low, high, p = _welch_greater(self.m(a), self.m(b))
            return f"{d:+.3f} [{low:+.3f}, {high:+.3f}]", p, p < ALPHA
        return compute


def verdicts(runs: Sequence[RunData], summaries: Sequence[RunSummary], lo: float = 1e-4, hi: float = 2e-4) -> list[Verdict]:
    """H1-H8 on the Sokoban runs, then each second task's (:func:`second_task_verdicts`)."""
    c = cells(summaries)
    by_name, falls = _falls(runs, c, SOKOBAN)
    d = _Decider(c)

    def h5():
        diff, low, high, p = _gap_of_gaps(c, lo, hi)
        return f"{diff:+.3f} [{low:+.3f}, {high:+.3f}]", p, p < ALPHA

    def h8():
        stale = [s.groups_per_s for cell in ("k2", "kinf") for s in c[(lo, cell)]]
        r, low, high = _ratio(stale, [s.groups_per_s for s in c[(lo, "k0")]])
        return f"{r:.2f}× [{low:.2f}, {high:.2f}]", math.nan, high < SPEED_LIMIT

    d.add("H1", "staleness costs success at lr 1e-4 (slope of M on age < 0)", [(lo, x) for x in ("k0", "k2", "kinf")],
          lambda: _slope([s for cell in ("k0", "k2", "kinf") for s in c[(lo, cell)]]))
    d.add("H2", "the cost grows with age: M(k = 2) > M(unbounded), lr 1e-4", [(lo, "k2"), (lo, "kinf")],
          d.welch((lo, "k2"), (lo, "kinf")))
    d.add("H3", "any staleness costs: M(k = 0) > M(k = 2), lr 1e-4", [(lo, "k0"), (lo, "k2")], d.welch((lo, "k0"), (lo, "k2")))
    d.add("H4", "at lr 2e-4 M(k = 0) > M(unbounded)", [(hi, "k0"), (hi, "kinf")], d.welch((hi, "k0"), (hi, "kinf")))
    d.add("H5", "the step size steepens the gap: [M(k = 0) - M(unbounded)] at 2e-4 minus at 1e-4 > 0",
          [(lr, x) for lr in (lo, hi) for x in ("k0", "kinf")], h5)
    d.add("H6", "the controller at lr 2e-4: none falls, age ≥ half the unbounded's, M ≥ the k = 4 cell's",
          [(hi, "controller")], lambda: _controller_goal(
              c[(hi, "controller")], c.get((hi, "kinf"), []), K4_LR2E4_MEAN_VAL, "the study's k = 4 cell", falls))
    d.add("H7", f"stale_ess fires at most {ALARMS_PER_100:g} per 100 steps on lr 1e-4 unbounded runs that did not fall",
          [(lo, "kinf")], lambda: _alarm_rate([s for s in c[(lo, "kinf")] if falls[s.name] is None], by_name))
    d.add("H8", f"asynchrony's speed-up at lr 1e-4 (k = 2 and unbounded over k = 0) below {SPEED_LIMIT}× (upper end)",
          [(lo, "k0"), (lo, "k2"), (lo, "kinf")], h8)
    return with_holm(d.out) + [v for task in SECOND_TASKS for v in second_task_verdicts(runs, summaries, task, lo)]


def second_task_verdicts(runs: Sequence[RunData], summaries: Sequence[RunSummary], task: str, lr: float = 1e-4
                         ) -> list[Verdict]:
    """On ``task`` (a key of ``SECOND_TASKS``, letter X): X0, the gate (the k = 0 cell's mean gain at least
    ``GATE_GAIN``), then X1-X4 (``not run`` if it failed)."""
    x, env = SECOND_TASKS[task]
    c = cells(summaries, task=task)
    by_name, falls = _falls(runs, c, task)
    d = _Decider(c)
    sync = c.get((lr, "k0"), [])

    def f0():
        gains = [gain(by_name[s.name]) for s in sync]
        mean, low, high, _ = stats.bounds(gains)
        return f"mean gain {mean:+.3f} [{low:+.3f}, {high:+.3f}] over {len(gains)} runs", math.nan, mean >= GATE_GAIN

    d.add(f"{x}0", f"the gate: StarPO-S gains at least +{GATE_GAIN:g} on {env} at k = 0 (last two validations "
          "over step 0)", [(lr, "k0")], f0)
    skip = f"the gate {x}0 failed" if d.out[-1].verdict == "failed" else None
    d.add(f"{x}1", f"staleness costs success on {env} (slope of M on age < 0)",
          [(lr, cell) for cell in ("k0", "k4", "kinf")],
          lambda: _slope([s for cell in ("k0", "k4", "kinf") for s in c[(lr, cell)]]), skip)
    d.add(f"{x}2", f"the cost grows with age: M(k = 4) > M(unbounded), {env}", [(lr, "k4"), (lr, "kinf")],
          d.welch((lr, "k4"), (lr, "kinf")), skip)
    d.add(f"{x}3", f"the controller on {env}: none falls, age ≥ half the unbounded's, M ≥ the k = 4 cell's",
          [(lr, "controller")], lambda: _controller_goal(
              c[(lr, "controller")], c.get((lr, "kinf"), []),
              float(np.mean(d.m((lr, "k4")))) if d.have((lr, "k4")) else math.nan, "the k = 4 cell", falls), skip)
    d.add(f"{x}4", f"stale_ess fires at most {ALARMS_PER_100:g} per 100 steps on {env}'s unbounded runs that did not fall",
          [(lr, "kinf")], lambda: _alarm_rate([s for s in c[(lr, "kinf")] if falls[s.name] is None], by_name), skip)
    return with_holm(d.out)


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
                steps, _ = _warnings(by_name[s.name])
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


def cost_shape(summaries: Sequence[RunSummary]) -> list[str]:
    """Beside the verdicts, not deciding any: per task and actor lr with a synchronous cell and at least two stale
    ones (bounds, then unbounded; two runs each, the controller not among them), the shape of the cost along the
    realised mean age: the cost per version of age between neighbouring cells' means; AIC of three one-coefficient
    models of M (a step: one constant cost of any staleness; a line in age; a line in log(1 + age)); and the step's
    lack of fit against one mean per cell (an F test; the step is nested in it, the two lines are not)."""
    lines = []
    for task in FLOORS:
        by_lr: dict[float, dict[str, list[RunSummary]]] = {}
        for (lr, cell), members in cells(summaries, task=task).items():
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
            aics = ", ".join(f"{name} {fit[1]:.1f}" for name, fit in sorted(fits.items(), key=lambda kv: kv[1][1]))
            lines.append(f"- {task} at actor lr {_lr_name(lr)} ({y.size} runs): per version of mean age {segments}; "
                         f"AIC {aics}; the step's lack of fit against the cells' means {lack}.")
    return lines


def confirm_section(runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> list[str]:
    """The report's section: each hypothesis, its statistic with its interval, one-sided p, and verdict."""
    rows = [[v.name, v.claim, v.statistic, "—" if math.isnan(v.p) else f"{v.p:.3f}",
             "—" if math.isnan(v.p_holm) else f"{v.p_holm:.3f}", v.verdict] for v in verdicts(runs, summaries)]
    counts = "; ".join(f"{task}: " + ", ".join(f"{cell} at {lr:g}: {len(members)}" for (lr, cell), members in sorted(c.items()))
                       for task in FLOORS if (c := cells(summaries, task=task)))
    lines = ["## The confirmation's predictions (studies/confirm/PREDICTIONS.md)", "",
             f"Finished runs per cell: {counts or 'none'}. p: one-sided, in the predicted direction; held when "
             f"p < {ALPHA} (H1-H5, F1, F2, C1, C2), or when the threshold rule holds (H6-H8, F0, F3, F4, C0, C3, C4). Pending: a cell has "
             "fewer than two finished runs; interim: one has fewer than three (the verdict can change). Falls by "
             "PREDICTIONS.md's rule, floor " + ", ".join(f"{f:g} on {t}" for t, f in FLOORS.items()) + ", whatever "
             "`--collapse-floor` says. Holm p: p adjusted by Holm's step-down within the task's predictions that have "
             "a p (H1-H5; F1, F2; C1, C2), shown beside: PREDICTIONS.md registers no correction for multiplicity, so "
             "the verdicts use p.", ""]
    lines += table(["", "prediction", "statistic [95 % interval]", "p", "Holm p", "verdict"], rows)
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


def plot_confirmation(runs: Sequence[RunData], summaries: Sequence[RunSummary], out: Path) -> Path | None:
    """The confirmation beside the original study: per task and step size (``PANELS``) a panel of M (mean
    validation success after step 0) per cell, the study's seeds (0-2, hollow) left of the confirmation's (3-5,
    filled), each run a point (a cross over it: the run fell, :func:`fell_at`), each cohort's cell mean with its
    95 % interval. Cells: every bound either cohort ran there, unbounded and the controller. Panels without a
    confirmation run are left out; None without any."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    by_name = {r.name: r for r in runs}
    panels = [(task, lr, cells(summaries, task=task), cells(summaries, STUDY_SEEDS, task)) for task, lr in PANELS]
    panels = [p for p in panels if any(key[0] == p[1] for key in p[2])]
    if not panels:
        return None
    fig = Figure(figsize=(5.5 * len(panels), 4.2), layout="constrained")
    for ax, (task, lr, new, old) in zip(np.atleast_1d(fig.subplots(1, len(panels))), panels, strict=True):
        cohorts = ((old, "tab:gray", "none", -0.15), (new, "tab:blue", None, 0.15))
        names = sorted({cell for c in (new, old) for (rate, cell) in c if rate == lr}, key=_cell_order)
        for x, name in enumerate(names):
            for c, color, face, offset in cohorts:
                members = [s for s in c.get((lr, name), []) if math.isfinite(s.mean_val)]
                if not members:
                    continue
                ys = [s.mean_val for s in members]
                ax.scatter([x + offset] * len(ys), ys, s=30, alpha=0.8, edgecolors=color, facecolors=face or color)
                fell = [s.mean_val for s in members if fell_at(by_name[s.name], task) is not None]
                ax.scatter([x + offset] * len(fell), fell, s=70, marker="x", color="tab:red")
                mean, below, above = stats.error_bar(ys, 0.0, 1.0)
                ax.errorbar([x + offset + 0.08 * np.sign(offset)], [mean], yerr=[[below], [above]], color=color,
                            marker="_", markersize=14, capsize=4)
        labels = {"kinf": "∞", "controller": "controller"}
        ax.set_xticks(range(len(names)), [labels.get(n, n[1:]) for n in names])
        ax.set(xlabel="max staleness k", ylabel="M: mean validation success after step 0",
               title=f"{task}, actor lr " + f"{lr:.0e}".replace("e-0", "e-"), ylim=(0.0, None))
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=color, marker="o", ls="", markerfacecolor=face or color, label=label)
               for label, color, face in (("study, seeds 0-2", "tab:gray", "none"),
                                          ("confirmation, seeds 3-5", "tab:blue", None))]
    handles.append(Line2D([], [], color="tab:red", marker="x", ls="", label="the run fell"))
    fig.axes[-1].legend(handles=handles, fontsize=8, frameon=False, loc="best")
    return save_figure(fig, out / "confirmation.png")
