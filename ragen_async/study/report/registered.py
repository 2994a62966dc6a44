"""Registered predictions as data: a spec file (YAML) names each prediction's statistic over cells of runs, and this
module decides them on the runs a report reads, by the spec's rule. No study's constants live here.

A spec (``studies/newlevels/predictions.yaml`` is one)::

    name: New levels                  # the section of PREDICTIONS.md the spec transcribes
    seeds: [6, 7, 8]                  # the runs' sampling seeds; other runs are not read
    alpha: 0.05
    decide_on: holm                   # holm: the Holm-adjusted p within each family decides; raw: the p itself
    families:
      - name: Sokoban
        task: SimpleSokoban           # the validation environment that tells a family's runs apart
        floor: 0.180                  # the fall rule's floor (staleness.collapse.find_collapse), for the falls per cell
        predictions:
          - {name: N1, claim: "...", slope: ["1e-4/k0", "1e-4/k2", "1e-4/kinf"]}   # M on Age, negative
          - {name: N2, claim: "...", welch: ["1e-4/k0", "1e-4/k2"]}               # M(first) - M(second) > 0
          - {name: N5, claim: "...", gap_of_gaps: [["2e-4/k0", "2e-4/kinf"], ["1e-4/k0", "1e-4/kinf"]]}

Those three are tests (a one-sided p, Holm-adjusted within the family). A goal is decided on point values instead,
outside the Holm family::

          - {name: Ga1, no_falls: "2e-4/adaptive"}                         # no run of the cell fell
          - {name: Ga2, mean_at_least: ["2e-4/adaptive", "2e-4/k4"]}       # mean M(first) >= mean M(second)
          - {name: A2, mean_at_least: ["2e-4/kinf/opsm", "2e-4/k0", 0.02]}  # mean M(first) >= mean M(second) - 0.02
          - {name: Ga3, age_at_least: ["2e-4/adaptive", "2e-4/kinf", 0.5]}  # mean Age(first) >= 0.5 mean Age(second)
          - {name: A4, age_at_least: ["2e-4/kinf/opsm", 5]}                 # mean Age(first) >= 5 versions
          - {name: Gd, drops_at_most: ["2e-4/adaptive", 0.02]}            # every run dropped <= 2 % of its groups
          - {name: C1, drops_at_most: ["2e-4/kinf/opsm", 0]}              # no run dropped a group
          - {name: Ga, all_of: [Ga1, Ga2, Ga3]}                           # every named one held (tests: by the rule)
          - {name: D1, ratio_of: [["2e-4/kinf/opsm"], ["2e-4/k0"]]}       # groups/s ratio, reported, deciding nothing
          - {name: H6c, mean_at_least: ["2e-4/adaptive", 0.3753]}         # against a number
          - {name: F0, gain_at_least: ["1e-4/k0", 0.08]}     # mean gain (last two validations over step 0)
          - {name: H7, warnings_at_most: ["1e-4/kinf", stale_ess, 1.0]}   # per 100 steps, runs that did not fall
          - {name: H8, ratio_below: [["1e-4/k2", "1e-4/kinf"], ["1e-4/k0"], 1.15]}  # groups/s, upper end of 95 %
          - {name: F1, gate: F0, slope: [...]}                            # "not run" when F0 failed

An ``all_of`` fails when one of its parts failed, waits while one is pending, and holds when all held; it is decided
after every family's tests (a test part counts by the spec's rule, Holm-adjusted), and may name any earlier
prediction of the spec, in its family or an earlier one (a goal over both tasks). A ``ratio_of`` is ``reported``: it
decides nothing and no ``all_of`` may name it.

A cell is ``<actor lr>/<k0 | k<n> | kinf | adaptive | lag<n>>[/<correction>]``: the finished runs of the family's task
at that actor learning rate and bound (``adaptive``: the runs whose bound moved, ``staleness.adaptive``; ``lag<n>``:
the runs at a fixed lag of n, ``staleness.fixed_lag``, which ``k<n>`` never holds) and with that
correction (``algo.off_policy``; none written: ``none``), among the spec's seeds. M is a run's mean validation success after step 0 (``RunSummary.mean_val``), Age its realised mean age
(``staleness_mean``), a run's drops its share of generated groups dropped (``drops["drop_share"]``). A prediction
whose cells hold fewer than two runs each is ``pending``; one decided while a cell holds fewer runs than the spec has
seeds is ``held (interim)`` or ``failed (interim)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy import stats as scipy_stats

from ragen_async.staleness.collapse import SIGNALS, find_collapse
from ragen_async.study import stats
from ragen_async.study.report.runs import RunData
from ragen_async.study.report.summary import CORRECTIONS, RunSummary
from ragen_async.study.report.tables import table

TESTS = ("slope", "welch", "gap_of_gaps")
"""The tests a prediction may name (module docstring)."""
POINTS = ("no_falls", "mean_at_least", "age_at_least", "drops_at_most", "gain_at_least", "warnings_at_most",
          "ratio_below", "all_of")
"""The point comparisons a goal may name (module docstring)."""
REPORTED = ("ratio_of",)
"""Figures a spec registers to be reported beside its verdicts, deciding nothing (module docstring)."""
KINDS = TESTS + POINTS + REPORTED


class SpecError(ValueError):
    """A predictions spec that cannot be read as one (what is wrong, and where)."""


@dataclass(frozen=True)
class Prediction:
    name: str
    claim: str
    kind: str
    """One of :data:`KINDS`."""
    cells: tuple[Any, ...]
    """``slope``: cell names; ``welch``: (greater, than); ``mean_at_least``: (greater, than, margin) with margin 0
    unless given; ``gap_of_gaps``: ((a, b), (c, d)) for (a - b) - (c - d); ``no_falls``: (cell,); ``age_at_least``:
    (cell, of, fraction), or (cell, versions) against a number; ``drops_at_most``: (cell, share); ``gain_at_least``:
    (cell, gain); ``warnings_at_most``: (cell, signal, per 100 steps); ``ratio_below``: (cells, reference cells,
    limit); ``ratio_of``: (cells, reference cells); ``all_of``: prediction names."""
    gate: str | None = None
    """A prediction of the family that must not have failed for this one to be decided (else ``not run``)."""


@dataclass(frozen=True)
class Family:
    name: str
    task: str
    floor: float
    predictions: tuple[Prediction, ...]


@dataclass(frozen=True)
class Spec:
    name: str
    seeds: tuple[int, ...]
    alpha: float
    decide_on: str
    families: tuple[Family, ...]


@dataclass(frozen=True)
class Outcome:
    name: str
    claim: str
    statistic: str
    p: float
    p_holm: float
    verdict: str
    kind: str = ""
    """The prediction's kind (:data:`KINDS`): a test's verdict is worded "shown", a goal's "met"."""
    estimate: str = ""
    """A test's estimate with its 95 % interval, ``value [low, high]`` as the statistic prints it."""

    @property
    def words(self) -> str:
        """What its rule allows a text to say of it: a held test "shown", a failed one "not shown" with its estimate
        and interval; a held goal "met", a failed one "not met"; a reported figure "reported" with its value;
        anything else (pending, interim, not run) "not decided"."""
        test = self.kind in TESTS
        if self.verdict == "reported":
            return f"reported: {self.statistic}"
        if self.verdict == "held":
            return "shown" if test else "met"
        if self.verdict == "failed":
            return f"not shown: estimate {self.estimate}" if test else f"not met: {self.statistic}"
        return "not decided"


def _cell_names(kind: str, value: Any, where: str) -> tuple[Any, ...]:
    def name(cell: Any) -> str:
        if not isinstance(cell, str) or "/" not in cell:
            raise SpecError(f"{where}: a cell is '<actor lr>/<k0|k<n>|kinf|adaptive|lag<n>>[/<correction>]', "
                            f"got {cell!r}")
        lr, k, *correction = cell.split("/")
        try:
            float(lr)
        except ValueError:
            raise SpecError(f"{where}: {cell!r}: {lr!r} is not a learning rate") from None
        if (k not in ("kinf", "adaptive") and not (k.startswith("k") and k[1:].isdigit())
                and not (k.startswith("lag") and k[3:].isdigit() and int(k[3:]) >= 1)):
            raise SpecError(f"{where}: {cell!r}: the bound is k0, k<n>, kinf, adaptive or lag<n> with n >= 1")
        if correction and (len(correction) > 1 or correction[0] not in CORRECTIONS[1:]):
            raise SpecError(f"{where}: {cell!r}: the correction is one of {', '.join(CORRECTIONS[1:])} "
                            "(none: leave it out)")
        return cell

    def number(v: Any, at_least: float = 0.0, open_: bool = True) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool)
                and (v > at_least if open_ else v >= at_least))

    def cell_or_number(v: Any) -> bool:
        return isinstance(v, str) or number(v, open_=False)

    shapes = {"slope": lambda v: isinstance(v, list) and len(v) >= 2,
              "welch": lambda v: isinstance(v, list) and len(v) == 2,
              "gap_of_gaps": lambda v: isinstance(v, list) and len(v) == 2
              and all(isinstance(p, list) and len(p) == 2 for p in v),
              "no_falls": lambda v: isinstance(v, str),
              "mean_at_least": lambda v: isinstance(v, list) and (len(v) == 2 and cell_or_number(v[1]) or len(v) == 3
                                                                  and isinstance(v[1], str) and number(v[2], open_=False)),
              "gain_at_least": lambda v: isinstance(v, list) and len(v) == 2 and isinstance(v[1], (int, float)),
              "warnings_at_most": lambda v: isinstance(v, list) and len(v) == 3 and isinstance(v[1], str)
              and number(v[2]),
              "ratio_below": lambda v: isinstance(v, list) and len(v) == 3 and all(isinstance(x, list) and x for x in v[:2])
              and number(v[2]),
              "ratio_of": lambda v: isinstance(v, list) and len(v) == 2 and all(isinstance(x, list) and x for x in v),
              "age_at_least": lambda v: isinstance(v, list) and (len(v) == 3 and isinstance(v[1], str) and number(v[2])
                                                                 or len(v) == 2 and number(v[1])),
              "drops_at_most": lambda v: isinstance(v, list) and len(v) == 2 and number(v[1], open_=False),
              "all_of": lambda v: isinstance(v, list) and v and all(isinstance(n, str) for n in v)}
    if not shapes[kind](value):
        raise SpecError(f"{where}: {kind} takes " + {"slope": "a list of two or more cells",
                                                      "welch": "[greater, than]",
                                                      "gap_of_gaps": "[[a, b], [c, d]]",
                                                      "no_falls": "a cell",
                                                      "mean_at_least": "[greater, than (a cell or a number)] or "
                                                                       "[greater, than (a cell), margin >= 0]",
                                                      "gain_at_least": "[cell, gain]",
                                                      "warnings_at_most": "[cell, signal, per 100 steps > 0]",
                                                      "ratio_below": "[[cells], [reference cells], limit > 0]",
                                                      "ratio_of": "[[cells], [reference cells]]",
                                                      "age_at_least": "[cell, of, fraction > 0] or [cell, versions > 0]",
                                                      "drops_at_most": "[cell, share >= 0]",
                                                      "all_of": "a list of prediction names"}[kind])
    if kind == "gap_of_gaps":
        return tuple(tuple(name(c) for c in pair) for pair in value)
    if kind == "no_falls":
        return (name(value),)
    if kind == "age_at_least":
        if len(value) == 2:
            return name(value[0]), float(value[1])
        return name(value[0]), name(value[1]), float(value[2])
    if kind == "drops_at_most":
        return name(value[0]), float(value[1])
    if kind == "all_of":
        return tuple(value)
    if kind == "mean_at_least":
        if isinstance(value[1], (int, float)):
            return name(value[0]), float(value[1]), 0.0
        return name(value[0]), name(value[1]), float(value[2]) if len(value) == 3 else 0.0
    if kind == "gain_at_least":
        return name(value[0]), float(value[1])
    if kind == "warnings_at_most":
        if value[1] not in SIGNALS:
            raise SpecError(f"{where}: {value[1]!r} is not a signal ({', '.join(SIGNALS)})")
        return name(value[0]), value[1], float(value[2])
    if kind == "ratio_below":
        return tuple(name(c) for c in value[0]), tuple(name(c) for c in value[1]), float(value[2])
    if kind == "ratio_of":
        return tuple(name(c) for c in value[0]), tuple(name(c) for c in value[1])
    return tuple(name(c) for c in value)


def load_spec(path: str | Path) -> Spec:
    """Read and check a predictions spec (module docstring); :class:`SpecError` says what is wrong."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(f"{path}: cannot read it: {e}") from None
    if not isinstance(data, dict) or not data.get("families"):
        raise SpecError(f"{path}: a spec is a mapping with name, seeds, alpha, decide_on and families")
    decide_on = data.get("decide_on", "raw")
    if decide_on not in ("holm", "raw"):
        raise SpecError(f"{path}: decide_on is holm or raw, got {decide_on!r}")
    families, names = [], set()
    for f in data["families"]:
        predictions = []
        for p in f.get("predictions") or []:
            kinds = [k for k in KINDS if k in p]
            where = f"{path}: {p.get('name', '?')}"
            if len(kinds) != 1 or not p.get("name") or p["name"] in names:
                raise SpecError(f"{where}: each prediction has a unique name and exactly one of {', '.join(KINDS)}")
            names.add(p["name"])
            predictions.append(Prediction(str(p["name"]), str(p.get("claim", "")), kinds[0],
                                          _cell_names(kinds[0], p[kinds[0]], where),
                                          None if p.get("gate") is None else str(p["gate"])))
        if not predictions or "task" not in f:
            raise SpecError(f"{path}: family {f.get('name', '?')!r} needs a task and predictions")
        families.append(Family(str(f.get("name", f["task"])), str(f["task"]), float(f.get("floor", 0.0)),
                               tuple(predictions)))
    earlier: set[str] = set()
    for family in families:
        for i, p in enumerate(family.predictions):
            unknown = [n for n in p.cells if p.kind == "all_of" and n not in earlier]
            if unknown:
                raise SpecError(f"{path}: {p.name}: all_of names no earlier prediction of the spec: "
                                f"{', '.join(unknown)}")
            if p.kind not in REPORTED:
                earlier.add(p.name)
            gates = {q.name for q in family.predictions[:i] if q.kind in POINTS and q.kind != "all_of"}
            if p.gate is not None and p.gate not in gates:
                raise SpecError(f"{path}: {p.name}: its gate {p.gate} is no earlier goal of its family (a point "
                                "comparison, not a test, all_of or reported figure: those are decided last)")
    return Spec(str(data.get("name", Path(path).stem)), tuple(int(s) for s in data.get("seeds") or ()),
                float(data.get("alpha", 0.05)), decide_on, tuple(families))


def _label(s: RunSummary) -> str | None:
    """The run's cell without its learning rate (``kinf``, ``k4/opsm``, ``lag8``), or None for a run no cell holds."""
    if not s.finished or s.lag not in ("bounded", "adaptive", "fixed"):
        return None
    bound = ("adaptive" if s.lag == "adaptive" else f"lag{s.k}" if s.lag == "fixed"
             else "kinf" if s.k is None else f"k{s.k}")
    return bound if s.off_policy == "none" else f"{bound}/{s.off_policy}"


def cells(spec: Spec, family: Family, summaries: Sequence[RunSummary]) -> dict[str, list[RunSummary]]:
    """The family's runs by cell name (``<lr>/<k>[/<correction>]``, the lr matched as a number), among the spec's
    seeds."""
    wanted = {c for p in family.predictions for c in _flat(p)}
    out: dict[str, list[RunSummary]] = {c: [] for c in sorted(wanted)}
    for s in summaries:
        label = _label(s)
        if label is None or family.task not in s.val or (spec.seeds and s.seed not in spec.seeds):
            continue
        for c in wanted:
            lr, rest = c.split("/", 1)
            if rest == label and math.isclose(float(lr), s.actor_lr, rel_tol=1e-9):
                out[c].append(s)
    return out


def _flat(p: Prediction) -> list[str]:
    """The cells a prediction reads (none for ``all_of``)."""
    if p.kind == "all_of":
        return []
    if p.kind == "warnings_at_most":
        return [p.cells[0]]
    return [c for item in p.cells for c in (item if isinstance(item, tuple) else (item,)) if isinstance(c, str)]


def _m(members: Sequence[RunSummary]) -> np.ndarray:
    return np.array([s.mean_val for s in members], dtype=float)


def _statistic(p: Prediction, c: dict[str, list[RunSummary]]) -> tuple[str, float, str]:
    """The prediction's statistic in words (value and 95 % interval), its one-sided p in the predicted direction,
    and the estimate with its interval alone (``value [low, high]``)."""
    if p.kind == "slope":
        members = [s for cell in p.cells for s in c[cell]]
        slope, low, high, two_sided, n = stats.trend([s.staleness_mean for s in members], _m(members))
        one_sided = two_sided / 2 if slope < 0 else 1 - two_sided / 2
        estimate = f"{slope:+.4f} [{low:+.4f}, {high:+.4f}]"
        return f"slope {slope:+.4f} per version [{low:+.4f}, {high:+.4f}], {n} runs", float(one_sided), estimate
    if p.kind == "welch":
        a, b = (_m(c[cell]) for cell in p.cells)
        diff, low, high = stats.welch_difference(a, b)
        one_sided = float(scipy_stats.ttest_ind(a, b, equal_var=False, alternative="greater").pvalue)
        estimate = f"{diff:+.3f} [{low:+.3f}, {high:+.3f}]"
        return f"{p.cells[0]} - {p.cells[1]}: {estimate}", one_sided, estimate
    groups = [_m(c[cell]) for pair in p.cells for cell in pair]
    d = (groups[0].mean() - groups[1].mean()) - (groups[2].mean() - groups[3].mean())
    parts = [g.var(ddof=1) / g.size for g in groups]
    se = math.sqrt(sum(parts))
    df = sum(parts) ** 2 / sum(v * v / (g.size - 1) for v, g in zip(parts, groups, strict=True))
    t = scipy_stats.t.ppf(0.975, df)
    (a, b), (x, y) = p.cells
    estimate = f"{d:+.3f} [{d - t * se:+.3f}, {d + t * se:+.3f}]"
    return f"({a} - {b}) - ({x} - {y}): {estimate}", float(scipy_stats.t.sf(d / se, df)), estimate


def _point(p: Prediction, c: dict[str, list[RunSummary]], falls: dict[str, bool], by_name: dict[str, RunData]
           ) -> tuple[str, bool]:
    """A goal's point comparison in words and whether it holds (``falls``: run name -> it fell)."""
    if p.kind == "no_falls":
        (cell,) = p.cells
        fell = sum(falls[s.name] for s in c[cell])
        return f"{cell}: {fell} of {len(c[cell])} fell", fell == 0
    if p.kind == "mean_at_least":
        cell, ref, margin = p.cells
        a = float(_m(c[cell]).mean())
        if not isinstance(ref, str):
            return f"M {cell} {a:.3f} against {ref:.4g}", a >= ref
        b = float(_m(c[ref]).mean())
        if not margin:
            return f"M {cell} {a:.3f} against {ref} {b:.3f}", a >= b
        return f"M {cell} {a:.3f} against {ref} {b:.3f} - {margin:g} = {b - margin:.3f}", a >= b - margin
    if p.kind == "age_at_least":
        if len(p.cells) == 2:
            cell, versions = p.cells
            a = float(np.mean([s.staleness_mean for s in c[cell]]))
            return f"Age {cell} {a:.2f} against {versions:g} versions", a >= versions
        cell, of, fraction = p.cells
        a, b = (float(np.mean([s.staleness_mean for s in c[x]])) for x in (cell, of))
        return f"Age {cell} {a:.2f} against {fraction:g} x {of} {b:.2f} = {fraction * b:.2f}", a >= fraction * b
    if p.kind == "gain_at_least":
        cell, threshold = p.cells
        gains = [_gain(by_name[s.name]) for s in c[cell]]
        mean, low, high, _ = stats.bounds(gains)
        return f"mean gain {mean:+.3f} [{low:+.3f}, {high:+.3f}] over {len(gains)} runs", mean >= threshold
    if p.kind == "warnings_at_most":
        cell, signal, limit = p.cells
        quiet = [s for s in c[cell] if not falls[s.name]]
        fired = watched = 0
        for s in quiet:
            steps, values = by_name[s.name].series(f"warning/{signal}")
            fired, watched = fired + int((values > 0).sum()), watched + int(steps.size)
        rate = 100 * fired / watched if watched else math.nan
        return (f"{rate:.2f} per 100 steps ({fired} in {watched} steps of {len(quiet)} runs that did not fall)",
                bool(rate <= limit))
    if p.kind == "ratio_below":
        cells_a, cells_b, limit = p.cells
        r, low, high = stats.ratio_interval([s.groups_per_s for x in cells_a for s in c[x]],
                                            [s.groups_per_s for x in cells_b for s in c[x]])
        return f"{r:.2f}x [{low:.2f}, {high:.2f}] (groups/s)", high < limit
    cell, share = p.cells
    shares = [s.drops.get("drop_share", math.nan) for s in c[cell]]
    unknown = [s.name for s, x in zip(c[cell], shares, strict=True) if not math.isfinite(x)]
    if unknown:  # a run whose drops are unknown cannot show that it dropped little
        return f"{cell}: share dropped unknown for {', '.join(unknown)}", False
    return f"{cell}: largest share dropped {max(shares):.3f} (at most {share:g})", bool(max(shares) <= share)


def _reported(p: Prediction, c: dict[str, list[RunSummary]]) -> str:
    """A reported figure in words (``ratio_of``: the groups/s ratio with its 95 % interval and each side's
    placements)."""
    cells_a, cells_b = p.cells
    a, b = ([s for x in side for s in c[x]] for side in (cells_a, cells_b))
    r, low, high = stats.ratio_interval([s.groups_per_s for s in a], [s.groups_per_s for s in b])
    places = ["/".join(sorted({s.placement for s in side})) for side in (a, b)]
    return (f"{'+'.join(cells_a)} / {'+'.join(cells_b)}: {r:.2f}x [{low:.2f}, {high:.2f}] (groups/s; "
            f"{places[0]} / {places[1]})")


def _gain(run: RunData) -> float:
    """A run's gain: the mean of its last two validations minus its first (step 0)."""
    _, values = run.val_success()
    return float(values[-2:].mean() - values[0]) if values.size >= 3 else math.nan


def decide(spec: Spec, summaries: Sequence[RunSummary], runs: Sequence[RunData] = ()) -> list[Outcome]:
    """Every prediction of ``spec`` decided on ``summaries`` by the spec's rule (``runs``: their curves, for the
    falls, gains and warnings the point comparisons read)."""
    by_name = {r.name: r for r in runs}
    decided: dict[str, Outcome] = {}
    for family in spec.families:
        c = cells(spec, family, summaries)
        falls = {s.name: s.name in by_name and
                 find_collapse(*by_name[s.name].val_success(), floor=family.floor).fell is not None
                 for members in c.values() for s in members}
        tested: list[tuple[Prediction, str, float]] = []

        for p in family.predictions:
            if p.kind == "all_of":
                continue  # after every family's tests: a test's verdict is known only after Holm
            if p.gate is not None and decided[p.gate].verdict == "failed":
                decided[p.name] = Outcome(p.name, p.claim, f"the gate {p.gate} failed", math.nan, math.nan, "not run",
                                          p.kind)
            elif (why := _pending(p, c)) is not None:
                decided[p.name] = Outcome(p.name, p.claim, why, math.nan, math.nan, "pending", p.kind)
            elif p.kind in REPORTED:
                decided[p.name] = Outcome(p.name, p.claim, _reported(p, c), math.nan, math.nan, "reported", p.kind)
            elif p.kind in TESTS:
                text, p_value, estimate = _statistic(p, c)
                tested.append((p, text, p_value, estimate))
                decided[p.name] = Outcome(p.name, p.claim, text, p_value, math.nan, "", p.kind, estimate)
            else:
                text, holds = _point(p, c, falls, by_name)
                verdict = ("held" if holds else "failed") + (" (interim)" if _interim(spec, p, c) else "")
                decided[p.name] = Outcome(p.name, p.claim, text, math.nan, math.nan, verdict, p.kind)
        # Holm over the tests decided so far, and the tests still pending in the family (they would count in m)
        waiting = sum(1 for p in family.predictions if p.kind in TESTS and decided[p.name].verdict == "pending")
        adjusted = stats.holm([p_value for _, _, p_value, _ in tested])
        for (p, text, p_value, estimate), p_adj in zip(tested, adjusted, strict=True):
            deciding = p_adj if spec.decide_on == "holm" else p_value
            verdict = "held" if deciding < spec.alpha else "failed"
            if _interim(spec, p, c) or (spec.decide_on == "holm" and waiting):
                verdict += " (interim)"
            decided[p.name] = Outcome(p.name, p.claim, text, p_value, p_adj, verdict, p.kind, estimate)
    for family in spec.families:
        for p in family.predictions:
            if p.kind == "all_of":
                parts = [decided[n].verdict for n in p.cells]
                verdict = ("not run" if all(v == "not run" for v in parts) else
                           "failed" if any(v.startswith("failed") for v in parts) else
                           "pending" if any(v in ("pending", "not run") for v in parts) else "held")
                if verdict != "pending" and any("interim" in v for v in parts):
                    verdict += " (interim)"
                decided[p.name] = Outcome(p.name, p.claim, "all of " + ", ".join(p.cells), math.nan, math.nan, verdict,
                                          p.kind)
    return [decided[p.name] for family in spec.families for p in family.predictions]


def _pending(p: Prediction, c: dict[str, list[RunSummary]]) -> str | None:
    """Why ``p`` is not decided yet (a cell it reads holds fewer than two runs), or ``None``."""
    short = [f"{cell} {len(c[cell])}" for cell in _flat(p) if len(c[cell]) < 2]
    return "cells: " + ", ".join(short) if short else None


def _interim(spec: Spec, p: Prediction, c: dict[str, list[RunSummary]]) -> bool:
    return bool(spec.seeds) and any(len(c[cell]) < len(spec.seeds) for cell in _flat(p))


def cell_lines(spec: Spec, runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> list[str]:
    """Per family and cell: runs, mean M with its 95 % interval, mean Age, and the runs that fell (the family's
    floor)."""
    by_name = {r.name: r for r in runs}
    rows = []
    for family in spec.families:
        for cell, members in cells(spec, family, summaries).items():
            if not members:
                rows.append([family.name, cell, "0", "", "", ""])
                continue
            mean, half, _ = stats.interval(_m(members))
            fell = [s.name for s in members if find_collapse(*by_name[s.name].val_success(), floor=family.floor).fell]
            rows.append([family.name, cell, str(len(members)), stats.format_mean_ci(mean, half),
                         f"{np.mean([s.staleness_mean for s in members]):.2f}", f"{len(fell)} of {len(members)}"])
    return table(["family", "cell", "runs", "M", "Age", "fell"], rows)


def _lag_order(bucket: str) -> tuple[bool, int]:
    return bucket.endswith("+"), int(bucket.rstrip("+"))


def correction_lines(spec: Spec, runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> list[str]:
    """Per family and corrected cell (``<lr>/<k>/<correction>``), per lag bucket: the cell's share of trained tokens
    at that lag, and the shares of them the correction masked and truncated (``lag/{s}/corr_masked``,
    ``lag/{s}/corr_truncated``, weighted by ``lag/{s}/tokens`` over the steps and runs); then over all lags. Empty
    when no cell names a correction."""
    by_name = {r.name: r for r in runs}
    rows = []
    for family in spec.families:
        for cell, members in cells(spec, family, summaries).items():
            if cell.count("/") < 2 or not members:
                continue
            tokens: dict[str, float] = {}
            masked: dict[str, float] = {}
            truncated: dict[str, float] = {}
            for s in members:
                run = by_name.get(s.name)
                for record in run.train if run else ():
                    for key, n in record.items():
                        if not (key.startswith("lag/") and key.endswith("/tokens")) or not n:
                            continue
                        bucket = key.split("/")[1]
                        tokens[bucket] = tokens.get(bucket, 0.0) + n
                        masked[bucket] = masked.get(bucket, 0.0) + n * record.get(f"lag/{bucket}/corr_masked", math.nan)
                        truncated[bucket] = (truncated.get(bucket, 0.0)
                                             + n * record.get(f"lag/{bucket}/corr_truncated", math.nan))
            total = sum(tokens.values())
            for bucket in sorted(tokens, key=_lag_order):
                n = tokens[bucket]
                rows.append([family.name, cell, bucket, f"{n / total:.3f}", f"{masked[bucket] / n:.3f}",
                             f"{truncated[bucket] / n:.3f}"])
            if total:
                rows.append([family.name, cell, "all", "1.000", f"{sum(masked.values()) / total:.3f}",
                             f"{sum(truncated.values()) / total:.3f}"])
    if not rows:
        return []
    return ["", "What each correction did, per lag (versions): the lag's share of the cell's trained tokens and the "
            "shares of those tokens masked and truncated (nan: a run did not log it).", "",
            *table(["family", "cell", "lag", "tokens", "masked", "truncated"], rows)]


def registered_section(spec: Spec, runs: Sequence[RunData], summaries: Sequence[RunSummary]) -> list[str]:
    """The report's section for ``spec``: its cells, then each prediction's statistic, p, Holm p, verdict and the
    words its rule allows a text to use of it (:attr:`Outcome.words`)."""
    outcomes = decide(spec, summaries, runs)
    rule = ("Holm-adjusted one-sided p within each family" if spec.decide_on == "holm" else
            "one-sided p itself (Holm's adjustment within each family shown beside it, deciding nothing)")
    lines = ["", f"## Registered predictions: {spec.name}", "",
             f"Seeds {', '.join(map(str, spec.seeds))}; a test holds if its {rule} is below {spec.alpha:g}, a goal "
             "on its point values. \"may be written\": the words the verdict allows (held: shown, or met; failed: "
             "not shown with the estimate and its interval, or not met).",
             "", *cell_lines(spec, runs, summaries), *correction_lines(spec, runs, summaries), ""]
    lines += table(["", "prediction", "statistic", "p", "Holm p", "verdict", "may be written"],
                   [[o.name, o.claim, o.statistic, f"{o.p:.3f}" if math.isfinite(o.p) else "",
                     f"{o.p_holm:.3f}" if math.isfinite(o.p_holm) else "", o.verdict, o.words] for o in outcomes])
    return lines
