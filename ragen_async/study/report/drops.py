"""The drops: how much of what a run generated the staleness bound threw away, what that cost beside the
speed, and whether the groups thrown away differ from those trained on.

Read from each run's ``provenance.jsonl`` (every consumed group, every dropped group with its reason; a run
without it falls back to the counts in ``metrics.jsonl``: ``rollout/groups`` consumed and
``staleness/dropped_groups`` dropped per step). Per run (:func:`run_drops`, the ``drop_*`` and ``*_level_*``
columns of ``summary.csv``):

* **share dropped**: dropped / (consumed + dropped), of the groups generated whose fate is known;
* **how late**: versions past the bound at the drop (``staleness - bound``; the bound is the drop record's, else
  k, else under the adaptive bound ``staleness/max_staleness`` of the drop's step) and seconds waited in the
  buffer (recorded since the drop records carry it);
* **the charge**: generated groups/s = (consumed + dropped) / training time (the summed ``timing/step_s``) beside
  the consumed (effective) groups/s = consumed / the same time; the share of generated tokens dropped (dropped
  records' ``tokens`` against them plus the consumed groups' ``rollout/generated_tokens``) and of generation
  time dropped (seconds in play, ``in_flight_s``, of dropped against all groups), where the records carry them;
* **dropped against consumed, by level**: a group's level follows from its index (``rollout.seed + index``, the
  environment from ``rollout.envs``: ``rollout.worker.assign_group``), so a dropped level can be looked up
  where *other* runs of the report consumed it, including runs written before drop records carried episode
  statistics. Per drop: the level's mean score in the other runs that consumed it, minus the same for the
  levels this run consumed at the drop's step (the same point in training, which the index also fixes);
  :func:`level_gap` pools those differences, one value per (run, step) so the drops of one step count once;
* **dropped against consumed, in the run**: mean turns, generated tokens, success and score of the dropped
  and the consumed groups, where the records carry them.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps

from ragen_async.config import EnvGroupSpec, RunConfig
from ragen_async.records.provenance import bounds_from_metrics
from ragen_async.records.rundir import read_record, record_file
from ragen_async.study import stats
from ragen_async.study.report.runs import MISSING, RunData

EPISODE = ("turns", "tokens", "success", "score")
"""The episode statistics compared between dropped and consumed groups."""


@dataclass
class RunDrops:
    """One run's consumed and dropped groups (one row each) and its figures (:func:`run_drops`)."""

    consumed: pd.DataFrame
    """step, index, level (``tag|overrides|seed``), score, and where recorded turns, tokens, success, in_flight_s."""
    dropped: pd.DataFrame
    """step, index, level, reason, where, staleness, past_bound, and where recorded waited_s, the episode
    statistics and score."""
    figures: dict[str, float] = field(default_factory=dict)


def _read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file or its packed form; unreadable lines (a half-written last one) are skipped."""
    out = []
    for line in read_record(path).splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def level_of(run: RunData):
    """index -> the level group ``index`` of ``run`` played, ``tag|overrides|seed``: the rule of
    ``rollout.worker.assign_group`` (within each step's block of indices the first ``envs[0].n_groups`` play
    ``envs[0]``, and so on; the seed is ``rollout.seed + index``), restated here so that a report does not
    import the rollout stack (torch)."""
    defaults = RunConfig().rollout
    rollout = run.config.get("rollout") or {}
    envs = [EnvGroupSpec.model_validate(e) for e in rollout.get("envs") or []] or defaults.envs
    base = int(rollout.get("seed", defaults.seed))
    per_step = sum(e.n_groups for e in envs)
    names = [f"{e.tag}|{json.dumps(e.overrides, sort_keys=True)}" for e in envs]
    owner = [name for name, e in zip(names, envs, strict=True) for _ in range(e.n_groups)]

    @functools.cache
    def level(index: int) -> str:
        return f"{owner[index % per_step]}|{base + index}"

    return level


def _mean_score(scores: Any) -> float:
    return sum(scores) / len(scores) if scores else math.nan


def _bound_at(run: RunData) -> dict[int, int | None] | None:
    return bounds_from_metrics(run.train) if run.lag == "adaptive" else None


def load_drops(run: RunData) -> RunDrops | None:
    """The run's consumed and dropped groups from its ``provenance.jsonl`` (``None`` without one)."""
    path = None if run.path is None else run.path / "provenance.jsonl"
    if path is None or record_file(path) is None:
        return None
    level = level_of(run)
    adaptive = _bound_at(run)
    consumed, dropped = [], []
    latest: dict[int, dict] = {}
    for record in _read_jsonl(path):  # a resumed run rewrites its steps after the checkpoint: keep the latest
        if "step" in record:
            latest[int(record["step"])] = record
    for step, record in sorted(latest.items()):
        for g in record.get("groups", []):
            consumed.append({"step": step, "index": int(g["index"]), "level": level(int(g["index"])),
                             "score": _mean_score(g.get("scores")),
                             **{k: g[k] for k in ("turns", "tokens", "success", "in_flight_s") if k in g}})
        for d in record.get("dropped", []):
            bound = d["bound"] if "bound" in d else (adaptive.get(step) if adaptive is not None else run.k)
            staleness = d.get("staleness")
            past = staleness - bound if staleness is not None and bound is not None else math.nan
            dropped.append({"step": step, "index": int(d["index"]), "level": level(int(d["index"])),
                            "reason": d.get("reason"), "where": d.get("where"), "staleness": staleness,
                            "past_bound": past, "score": _mean_score(d.get("scores")),
                            **{k: d[k] for k in ("waited_s", "turns", "tokens", "success", "in_flight_s") if k in d}})
    columns = ["step", "index", "level", "score"]
    return RunDrops(pd.DataFrame(consumed, columns=None if consumed else columns),
                    pd.DataFrame(dropped, columns=None if dropped else [*columns, "reason", "where", "staleness",
                                                                        "past_bound"]))


def _col(frame: pd.DataFrame, name: str) -> pd.Series:
    """A column as floats (all NaN where the records did not carry it)."""
    return pd.to_numeric(frame[name], errors="coerce") if name in frame else pd.Series(np.nan, index=frame.index)


def _mean(series: pd.Series) -> float:
    series = series.dropna()
    return float(series.mean()) if len(series) else math.nan


def _share(part: float, other: float) -> float:
    return part / (part + other) if part + other > 0 else math.nan


def run_figures(run: RunData, drops: RunDrops | None) -> dict[str, float]:
    """The run's share dropped, how late, the charge and the in-run episode comparison (module docstring);
    NaN where the records do not say."""
    _, step_s = run.series("timing/step_s")
    seconds = float(step_s.sum()) if step_s.size else math.nan
    if drops is None:  # no provenance: the counts the metrics keep
        consumed = float(run.series("rollout/groups")[1].sum())
        dropped = float(run.series("staleness/dropped_groups")[1].sum())
        if consumed == 0:
            return {}
        out = {"groups_consumed": consumed, "groups_dropped": dropped, "drop_share": _share(dropped, consumed)}
    else:
        c, d = drops.consumed, drops.dropped
        consumed, dropped = float(len(c)), float(len(d))
        if consumed + dropped == 0:
            return {}
        consumed_tokens = _col(c, "tokens")
        if consumed_tokens.isna().any():  # older records: the consumed tokens the metrics summed per step
            consumed_tokens = pd.Series(run.series("rollout/generated_tokens")[1])
        dropped_tokens, d_flight, c_flight = _col(d, "tokens"), _col(d, "in_flight_s"), _col(c, "in_flight_s")
        known_tokens = dropped == 0 or not dropped_tokens.isna().any()
        known_time = not d_flight.isna().any() and not c_flight.isna().any()
        out = {"groups_consumed": consumed, "groups_dropped": dropped, "drop_share": _share(dropped, consumed),
               "drop_past_bound": _mean(_col(d, "past_bound")), "drop_waited_s": _mean(_col(d, "waited_s")),
               "dropped_token_share": (_share(float(dropped_tokens.sum()), float(consumed_tokens.sum()))
                                       if known_tokens and len(consumed_tokens) else math.nan),
               "dropped_time_share": (0.0 if dropped == 0 else _share(float(d_flight.sum()), float(c_flight.sum()))
                                      if known_time else math.nan)}
        for name in EPISODE:
            out[f"dropped_{name}"], out[f"consumed_{name}"] = _mean(_col(d, name)), _mean(_col(c, name))
    out["generated_groups_per_s"] = (consumed + dropped) / seconds if seconds > 0 else math.nan
    out["consumed_groups_per_s"] = consumed / seconds if seconds > 0 else math.nan
    return out


def level_differences(all_drops: dict[str, RunDrops]) -> dict[str, pd.DataFrame]:
    """Per run (by name): one row per step with drops whose levels other runs consumed: ``dropped`` (the
    dropped levels' mean score where the other runs consumed them), ``consumed`` (the same for the levels
    this run consumed at that step) and ``gap`` = dropped - consumed (module docstring)."""
    rows = []
    for name, rd in all_drops.items():
        if len(rd.consumed):
            rows.append(rd.consumed[["level", "score"]].assign(run=name))
    if not rows:
        return {}
    played = pd.concat(rows, ignore_index=True).dropna(subset=["score"])
    totals = played.groupby("level")["score"].agg(["sum", "count"])
    own = played.groupby(["run", "level"])["score"].agg(["sum", "count"])
    out: dict[str, pd.DataFrame] = {}
    for name, rd in all_drops.items():
        if not len(rd.dropped):
            continue

        def elsewhere(levels: pd.Series, name: str = name) -> pd.Series:
            """Each level's mean score over the runs other than ``name`` that consumed it (NaN: none did)."""
            total = totals.reindex(levels.tolist())
            mine = own.reindex(pd.MultiIndex.from_arrays([[name] * len(levels), levels.tolist()])).fillna(0.0)
            n = total["count"].to_numpy() - mine["count"].to_numpy()
            with np.errstate(invalid="ignore", divide="ignore"):
                return pd.Series(np.where(n > 0, (total["sum"].to_numpy() - mine["sum"].to_numpy()) / n, np.nan),
                                 index=levels.index)

        dropped = rd.dropped.assign(elsewhere=elsewhere(rd.dropped["level"])).groupby("step")["elsewhere"].mean()
        consumed = rd.consumed.assign(elsewhere=elsewhere(rd.consumed["level"])).groupby("step")["elsewhere"].mean()
        frame = pd.DataFrame({"dropped": dropped, "consumed": consumed.reindex(dropped.index)}).dropna()
        out[name] = frame.assign(gap=frame["dropped"] - frame["consumed"])
    return out


def level_gap(frames: Sequence[pd.DataFrame]) -> tuple[float, float, float, float, int]:
    """(mean gap, 95 % low, high, two-sided p of a zero mean, number of (run, step) values) over ``frames``
    (:func:`level_differences`): a t interval and a one-sample t-test (``scipy.stats.ttest_1samp``)."""
    gaps = np.concatenate([f["gap"].to_numpy(float) for f in frames]) if frames else np.zeros(0)
    mean, low, high, n = stats.bounds(gaps.tolist())
    p = float(sps.ttest_1samp(gaps, 0.0).pvalue) if n >= 2 and np.ptp(gaps) > 0 else math.nan
    return mean, low, high, p, n


def attach(runs: Sequence[RunData], summaries: Sequence[Any]) -> dict[str, pd.DataFrame]:
    """Fill each summary's ``drops`` (:func:`run_figures` plus the run's mean level scores and gap) and return
    the per-run level differences (:func:`level_differences`) for :func:`drops_section`."""
    loaded = {r.name: load_drops(r) for r in runs}
    differences = level_differences({name: d for name, d in loaded.items() if d is not None})
    for run, s in zip(runs, summaries, strict=True):
        s.drops = run_figures(run, loaded[run.name])
        frame = differences.get(run.name)
        if s.drops and frame is not None and len(frame):
            s.drops.update({"dropped_level_score": float(frame["dropped"].mean()),
                            "consumed_level_score": float(frame["consumed"].mean()),
                            "level_gap": float(frame["gap"].mean())})
    return differences


DROP_VALUES = (("drop_share", "dropped (share of generated groups)", ".3f", stats.UNIT),
               ("drop_past_bound", "versions past the bound", ".2f", stats.POSITIVE),
               ("generated_groups_per_s", "generated groups/s", ".2f", stats.POSITIVE),
               ("consumed_groups_per_s", "consumed groups/s", ".2f", stats.POSITIVE),
               ("dropped_token_share", "generated tokens dropped (share)", ".3f", stats.UNIT),
               ("dropped_time_share", "generation time dropped (share)", ".3f", stats.UNIT))
"""The drops table's pooled columns: summary key, header, format, range (as ``tables.CELL_VALUES``)."""


def _pair(a: float, b: float, spec: str) -> str:
    if not (math.isfinite(a) or math.isfinite(b)):
        return MISSING
    return f"{format(a, spec) if math.isfinite(a) else MISSING} / {format(b, spec) if math.isfinite(b) else MISSING}"


def drops_section(summaries: Sequence[Any], differences: dict[str, pd.DataFrame]) -> tuple[list[str], list[str]]:
    """The report's drops section (one row per cell of finished runs, seeds pooled) and one console line per
    cell that dropped anything."""
    from ragen_async.study.report.tables import table

    known = [s for s in summaries if s.cell and s.finished and s.drops]
    if not known:
        return [], []
    cells = pd.DataFrame([s.cell for s in known]).fillna(MISSING)
    if "staleness.max_staleness" in cells:
        cells["staleness.max_staleness"] = cells["staleness.max_staleness"].replace("None", "∞")
    varying = [c for c in cells.columns if cells[c].nunique() > 1]
    values = pd.DataFrame([{c: s.drops.get(c, math.nan) for c, *_ in DROP_VALUES} for s in known]).astype(float)
    frame = pd.concat([cells[varying].reset_index(drop=True), values], axis=1)
    frame["_cell"] = cells.astype(str).agg("|".join, axis=1)
    for c, *_ in DROP_VALUES:  # a figure some of a cell's runs did not record is not the others' mean
        frame.loc[frame.groupby("_cell")[c].transform(lambda x: x.isna().any()), c] = math.nan
    frame["_run"] = [s.name for s in known]
    pooled = stats.cell_table(frame, ["_cell", *varying], [c for c, *_ in DROP_VALUES],
                              {c: span for c, _, _, span in DROP_VALUES})
    rows, console = [], []
    for _, r in pooled.iterrows():
        members = [s for s, cell in zip(known, frame["_cell"], strict=True) if cell == r["_cell"]]
        settings = [r[c] for c in varying] or ["all runs"]
        dropped = sum(s.drops.get("groups_dropped", 0.0) for s in members)
        mean, low, high, p, n = level_gap([differences[s.name] for s in members if s.name in differences])
        gap = (MISSING if not math.isfinite(mean) else stats.format_bounds(mean, low, high, "+.3f")
               + (f", p = {p:.3f}" if math.isfinite(p) else "") + f" ({n} steps)")

        def pooled_mean(key: str, members: list = members) -> float:
            return _mean(pd.Series([s.drops.get(key, math.nan) for s in members], dtype=float))

        episode = [_pair(pooled_mean(f"dropped_{e}"), pooled_mean(f"consumed_{e}"), spec)
                   for e, spec in zip(EPISODE, (".2f", ".0f", ".3f", ".2f"), strict=True)]
        rows.append([*settings, int(r["n"]), int(dropped),
                     *(stats.format_bounds(r[c], r[f"{c}_lo"], r[f"{c}_hi"], spec) for c, _, spec, _ in DROP_VALUES),
                     _pair(pooled_mean("dropped_level_score"), pooled_mean("consumed_level_score"), ".2f"), gap,
                     *episode])
        if dropped:
            s0 = members[0]
            tags = ",".join(re.findall(r"'tag': '([^']+)'", s0.cell.get("rollout.envs", "")))
            label = f"{tags or 'runs'} k = {s0.k_label} ({s0.lag}), actor lr {s0.actor_lr:g}, {len(members)} runs"
            console.append(f"drops: {label}: {r['drop_share']:.1%} of generated groups dropped ({int(dropped)}); "
                           f"consumed {r['consumed_groups_per_s']:.2f} of {r['generated_groups_per_s']:.2f} generated "
                           f"groups/s; level score dropped - consumed {gap}")
    lines = ["## Drops (seeds pooled)", "",
             "What the bound threw away, per cell of finished runs (`ragen_async/study/report/drops.py`). Dropped: "
             "dropped / (consumed + dropped) groups, mean [95 % interval] over the cell's runs. Versions past the "
             "bound: the drops' staleness minus the bound in force. Generated groups/s: (consumed + dropped) / "
             "training time; consumed groups/s: what training used of it, the effective rate. Generated tokens "
             "and generation time dropped: the dropped groups' share of sampled tokens and of seconds in play "
             "(— where the drop records predate those fields). Level score: a group's level is rollout.seed + its "
             "index, so each dropped level's mean score where the other runs of this report consumed it, against "
             "the same for the levels the run consumed at the drop's step (dropped / consumed); Δ: their "
             "difference, mean [95 % interval] over (run, step) with a one-sample t-test. Turns, tokens, success, "
             "score: the dropped and the consumed groups' own means (dropped / consumed), where recorded.", ""]
    header = [*(varying or ["cell"]), "runs", "groups dropped", *(label for _, label, *_ in DROP_VALUES),
              "level score elsewhere (dropped / consumed)", "Δ level score", "turns", "tokens per group",
              "success", "score"]
    return [*lines, *table(header, rows), ""], console
