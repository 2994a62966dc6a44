"""Provenance of the data each learner step consumed: which groups, from which worker, made by which
policy versions. One JSON line per step in ``provenance.jsonl`` of the run directory.

Staleness claims are checked against this file rather than against the config: a test (or a
researcher) can recompute every token's staleness from it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ragen_async.protocol import AnyGroup, BatchShard
from ragen_async.records.metrics import current_names


def provenance_record(step: int, learner_version: int, groups: Sequence[AnyGroup],
                      shards: Sequence[BatchShard], dropped: Sequence[dict] = (),
                      bounds: Mapping[int, int | None] | None = None) -> dict:
    """One step: every consumed group (``groups``: index, id, seed, worker, kept, versions, scores, and its
    episode statistics: mean turns, generated tokens, success share, seconds in play) and every group dropped
    while this step's batch was collected (``dropped``: ``staleness.buffer.DropRecord.as_record``: index, reason, where,
    staleness, the bound and how far past it, seconds waited, the level, the same episode statistics and
    scores; files written before these existed hold index, reason, where and staleness only). Under the
    adaptive bound, ``bounds`` gives each consumed group's ``bound``: the one it was held to (in order, the one
    it was admitted under, ``StalenessBound.of``; ``None``: unbounded)."""
    kept = {t.traj_id for s in shards for t in s.trajectories}
    out = []
    for g in groups:
        sampled = [v for t in g.trajectories for v, _ in t.version_counts]
        out.append({
            "index": g.index, "group_id": g.group_id, "env_tag": g.env_tag, "seed": g.seed, "worker": g.worker_id,
            "kept": any(t.traj_id in kept for t in g.trajectories),
            "min_version": min(sampled, default=None),
            "max_version": max(sampled, default=None),
            "scores": [round(float(x), 6) for x in g.scores],
            **g.episode_facts(),
            **({"bound": bounds[g.index]} if bounds is not None else {}),
        })
    return {"step": step, "learner_version": learner_version, "groups": out, "dropped": list(dropped)}


class ProvenanceLog:
    def __init__(self, path: Path | None):
        self._f = Path(path).open("a", buffering=1) if path is not None else None

    def write(self, step: int, learner_version: int, groups: Sequence[AnyGroup],
              shards: Sequence[BatchShard], dropped: Sequence[dict] = (),
              bounds: Mapping[int, int | None] | None = None) -> None:
        if self._f is not None:
            self._f.write(json.dumps(provenance_record(step, learner_version, groups, shards, dropped, bounds)) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def read_provenance(path: Path) -> list[dict]:
    """The records of ``provenance.jsonl``, or of its packed form (``rundir.pack_run``)."""
    from ragen_async.records.rundir import read_record

    return [json.loads(line) for line in read_record(Path(path)).splitlines() if line.strip()]


def rewind_jsonl(path: Path, step: int, key: str) -> int:
    """Drop the records of ``path`` whose ``key`` exceeds ``step`` (a resume from the checkpoint of
    ``step`` runs them again); returns the largest ``key`` the file held before (-1 if none)."""
    path = Path(path)
    if not path.exists():
        return -1
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seen = max((int(r[key]) for r in records if key in r), default=-1)
    kept = [r for r in records if int(r.get(key, -1)) <= step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return seen


def audit(provenance: Sequence[dict], admission: dict, up_to_step: int) -> dict:
    """Account for every group index the run admitted, from its provenance and the admission state of a
    checkpoint taken after step ``up_to_step``: each index must be consumed once, dropped once (with its
    reason), or still outstanding at the checkpoint (in flight or waiting; replayed on resume).

    Returns totals and the problems found: ``duplicates`` (an index consumed or dropped more than once, or
    both) and ``unexplained`` (an index below the admission counter that is none of the three).
    """
    seen: dict[int, list[str]] = {}
    reasons: dict[str, int] = {}
    for record in provenance:
        if record["step"] > up_to_step:
            continue
        for g in record["groups"]:
            seen.setdefault(int(g["index"]), []).append("consumed")
        for d in record.get("dropped", []):
            seen.setdefault(int(d["index"]), []).append("dropped")
            key = f"{d['reason']}@{d['where']}"
            reasons[key] = reasons.get(key, 0) + 1
    outstanding = {int(i) for i in admission["outstanding"]}
    duplicates = sorted(i for i, what in seen.items() if len(what) > 1 or i in outstanding)
    admitted = int(admission["next_index"])
    unexplained = sorted(i for i in range(admitted) if i not in seen and i not in outstanding)
    return {
        "admitted": admitted,
        "consumed": sum(what.count("consumed") for what in seen.values()),
        "dropped": sum(what.count("dropped") for what in seen.values()),
        "drop_reasons": reasons,
        "outstanding": len(outstanding),
        "duplicates": duplicates,
        "unexplained": unexplained,
    }


def bounds_from_metrics(records: Iterable[dict]) -> dict[int, int | None]:
    """The staleness bound in force at each learner step, from ``metrics.jsonl`` records:
    ``staleness/max_staleness`` (``staleness/bound`` in older runs) of the step's record (logged before the
    step's early warnings move it, so it is the bound in force when that step's batch was taken; in order, a group
    admitted earlier may hold a looser one, which provenance records per group);
    ``None`` where it was NaN (unbounded at that step). The last record of a step wins (a resumed run logs it
    again); records without one (validation) are skipped."""
    out: dict[int, int | None] = {}
    for r in records:
        r = current_names(r)
        bound, step = r.get("staleness/max_staleness"), r.get("learner/step")
        if step is None or bound is None:
            continue
        out[int(step)] = int(bound) if math.isfinite(float(bound)) else None
    return out


def audit_staleness(provenance: Sequence[dict], max_staleness: int | None, *, fixed_lag: bool = False,
                    adaptive: bool = False, bounds: Mapping[int, int | None] | None = None,
                    up_to_step: int | None = None) -> dict:
    """Check every consumed group's staleness against the bound in force at its step.

    A group's staleness is ``learner_version - min_version`` (its oldest sampled token; a group that
    sampled nothing counts 0, as in the buffer). The rules, by regime:

    * bounded (``max_staleness = k``): staleness <= k (``max_staleness``); unbounded (``None``): no bound;
    * ``fixed_lag``: oldest and newest token both exactly ``min(k, learner_version)`` old (``fixed_lag``);
    * ``adaptive``: staleness <= ``bounds[step]``, the bound in force at that step (``adaptive_bound``;
      see :func:`bounds_from_metrics`; ``None``: unbounded then), capped by k (the highest bound the
      controller may set); a step with no recorded bound is checked against k, an upper bound only (none when
      k is None), and listed in ``bound_unknown_steps``. A group whose record carries the bound it was held to
      (``bound``: in order, each group keeps the bound it was admitted under) is checked against that instead,
      which must not exceed the loosest bound in force at that step or before (``admitted_bound``).

    In every regime a token newer than the learner's version is a violation (``future_version``).
    Steps above ``up_to_step`` are skipped (as :func:`audit` does). Returns the regime, the number of
    groups checked, the largest staleness, the per-lag table ``lags`` (lag, groups, share of groups) and
    ``violations`` (step, learner_version, index, group_id, staleness, newest_staleness, bound, rule).
    """
    if fixed_lag and max_staleness is None:
        raise ValueError("fixed_lag needs an integer max_staleness")
    regime = ("fixed_lag" if fixed_lag else "adaptive" if adaptive
              else "unbounded" if max_staleness is None else "bounded")
    counts: dict[int, int] = {}
    violations: list[dict] = []
    unknown: set[int] = set()
    loosest = -math.inf  # adaptive: the loosest bound in force so far
    for record in sorted(provenance, key=lambda r: int(r["step"])):
        step, v = int(record["step"]), int(record["learner_version"])
        if up_to_step is not None and step > up_to_step:
            continue
        bound = max_staleness
        if regime == "fixed_lag":
            bound = min(max_staleness, v)
        elif regime == "adaptive":
            if bounds is not None and step in bounds:
                bound = min((b for b in (bounds[step], max_staleness) if b is not None), default=None)
                loosest = max(loosest, math.inf if bound is None else bound)
            else:
                unknown.add(step)
        step_bound = bound
        for g in record["groups"]:
            bound, held_looser = step_bound, False
            if regime == "adaptive" and "bound" in g:  # the bound it was admitted under
                bound = g["bound"]
                held_looser = step not in unknown and (math.inf if bound is None else bound) > loosest
            oldest, newest = g.get("min_version"), g.get("max_version")
            staleness = 0 if oldest is None else v - int(oldest)
            newest_staleness = staleness if newest is None else v - int(newest)
            counts[staleness] = counts.get(staleness, 0) + 1
            if min(staleness, newest_staleness) < 0:
                rule = "future_version"
            elif regime == "fixed_lag" and (staleness != bound or newest_staleness != bound):
                rule = "fixed_lag"
            elif held_looser or (bound is not None and staleness > bound):
                rule = ("admitted_bound" if regime == "adaptive" and "bound" in g
                        else "adaptive_bound" if regime == "adaptive" and step not in unknown else "max_staleness")
            else:
                continue
            violations.append({"step": step, "learner_version": v, "index": int(g["index"]),
                               "group_id": g["group_id"], "staleness": staleness,
                               "newest_staleness": newest_staleness, "bound": bound, "rule": rule})
    total = sum(counts.values())
    return {
        "regime": regime,
        "max_staleness": max_staleness,
        "groups": total,
        "max": max(counts, default=None),
        "lags": [{"lag": lag, "groups": n, "share": n / total} for lag, n in sorted(counts.items())],
        "violations": violations,
        "bound_unknown_steps": sorted(unknown),
    }


def audit_in_order(provenance: Sequence[dict], max_staleness: int | None, *, adaptive: bool = False,
                   bounds: Mapping[int, int | None] | None = None, up_to_step: int | None = None) -> dict:
    """Check a run that consumed in order (``staleness.consume: in_order``) did what that mode promises.

    * ``drops``: under a fixed bound (or none) in-order consumption drops nothing (docs/architecture.md), so
      every drop is listed. Under the adaptive bound a drop is explained only by a tightening: the bound in
      force at its step (``bounds``, :func:`bounds_from_metrics`) is below one in force at an earlier step or
      at the start (``max_staleness``; ``None`` = unbounded), under which the group may have been admitted;
      a drop at a step whose bound is at or above every earlier one is listed. A step without a recorded
      bound explains nothing. A run whose groups carry the bound they were held to (each kept the bound it was
      admitted under, so a tightening drops nothing either) has every drop listed.
    * ``out_of_order``: each step's consumed indices all lie above the previous step's (the head of the line
      only moves up); a step that consumed an index at or below the previous step's largest is listed.

    Steps above ``up_to_step`` are skipped."""
    inf = math.inf

    def level(bound: int | None) -> float:
        return inf if bound is None else float(bound)

    drops: list[dict] = []
    out_of_order: list[dict] = []
    highest = level(max_staleness)  # the loosest bound in force so far (adaptive)
    previous_max: int | None = None
    held = any("bound" in g for r in provenance for g in r["groups"])
    for record in sorted(provenance, key=lambda r: int(r["step"])):
        step = int(record["step"])
        if up_to_step is not None and step > up_to_step:
            continue
        known = bounds is not None and step in bounds
        bound = level(bounds[step]) if known else None
        for d in record.get("dropped", []):
            if not adaptive or held or bound is None or bound >= highest:
                drops.append({"step": step, "index": int(d["index"]), "reason": d.get("reason"),
                              "where": d.get("where"), "staleness": d.get("staleness")})
        if bound is not None:
            highest = max(highest, bound)
        indices = [int(g["index"]) for g in record["groups"]]
        if indices and previous_max is not None and min(indices) <= previous_max:
            out_of_order.append({"step": step, "lowest": min(indices), "previous_highest": previous_max})
        if indices:
            previous_max = max(indices)
    return {"drops": drops, "out_of_order": out_of_order}


class CannotAudit(Exception):
    """The run directory lacks what an audit needs (a complete checkpoint, provenance, readable settings)."""


@dataclass(frozen=True)
class RunAudit:
    """:func:`audit_run_dir`'s verdict on one run directory, up to its latest checkpoint."""

    checkpoint: str
    step: int
    accounting: dict
    """:func:`audit`'s result."""
    staleness: dict
    """:func:`audit_staleness`'s result."""
    rule: str
    """The staleness rule checked, in words."""
    errors: list[str]
    """One line per duplicate/unexplained finding, per staleness violation and per in-order finding."""
    in_order: dict | None = None
    """:func:`audit_in_order`'s result for a run with ``staleness.consume: in_order``; ``None`` otherwise."""

    @property
    def failed(self) -> bool:
        return bool(self.errors)


def _rule(regime: str, k: int | None) -> str:
    return {"unbounded": "unbounded (max_staleness: null)", "bounded": f"bounded by k = {k}",
            "fixed_lag": f"fixed lag: exactly min(k = {k}, learner version) old",
            "adaptive": "adaptive: the bound in force at each step, from metrics.jsonl staleness/max_staleness, "
                        + (f"at most k = {k}" if k is not None else "starting unbounded")}[regime]


def _violation_line(v: dict) -> str:
    where = f"step {v['step']} group {v['group_id']} (index {v['index']}, learner version {v['learner_version']})"
    if v["rule"] == "fixed_lag":
        what = f"oldest token {v['staleness']}, newest {v['newest_staleness']} versions old, not exactly {v['bound']}"
    elif v["rule"] == "future_version":
        what = f"a token {-min(v['staleness'], v['newest_staleness'])} version(s) newer than the learner"
    elif v["rule"] == "admitted_bound":
        what = (f"staleness {v['staleness']} against the bound it was held to, {v['bound']} (over it, or looser than "
                "any bound in force by then)")
    else:
        what = f"staleness {v['staleness']} > {v['bound']}"
    return f"{where}: {what} ({v['rule']})"


def audit_run_dir(path: Path) -> RunAudit:
    """Audit a run directory up to its latest checkpoint: its accounting (:func:`audit`, against the
    checkpoint's admission state) and every consumed group's staleness against the bound in force at its
    step (:func:`audit_staleness`: the settings of its ``config.yaml``, the adaptive bound from its
    ``metrics.jsonl``). Raises :class:`CannotAudit` when the directory lacks what that needs."""
    import yaml
    from pydantic import ValidationError

    from ragen_async.config import ConfigError, StalenessConfig, saved_run_config
    from ragen_async.records.rundir import DRIVER_STATE, RunDir, read_record, record_file

    rd = RunDir(path)
    checkpoint = rd.latest_checkpoint() if rd.checkpoints.is_dir() else None
    if checkpoint is None or record_file(rd.path / "provenance.jsonl") is None:
        raise CannotAudit(f"{path} has no complete checkpoint and provenance.jsonl to audit")
    if not rd.config_path.is_file():
        raise CannotAudit(f"{path} has no config.yaml: the staleness bound to audit against is unknown")
    try:
        s = StalenessConfig.model_validate(saved_run_config(rd.config_path)["staleness"])
    except (yaml.YAMLError, ValidationError, ConfigError) as e:
        raise CannotAudit(f"{rd.config_path}: cannot read its staleness settings: {e}") from e
    state = json.loads((checkpoint / DRIVER_STATE).read_text())
    step = int(state["step"])
    provenance = read_provenance(rd.path / "provenance.jsonl")
    accounting = audit(provenance, state["admission"], step)
    bounds = None
    if s.adaptive and record_file(rd.metrics_path) is not None:
        records = []
        for line in read_record(rd.metrics_path).splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
        bounds = bounds_from_metrics(records)
    top = s.adaptive_max_staleness if s.adaptive_max_staleness is not None else s.max_staleness  # the highest bound it may set
    stale = audit_staleness(provenance, top, fixed_lag=s.fixed_lag, adaptive=s.adaptive, bounds=bounds,
                            up_to_step=step)
    errors = []
    if accounting["duplicates"] or accounting["unexplained"]:
        errors.append(f"duplicates {accounting['duplicates'][:20]}, unexplained {accounting['unexplained'][:20]}")
    errors += [_violation_line(v) for v in stale["violations"]]
    in_order = None
    if s.consume == "in_order":
        in_order = audit_in_order(provenance, s.max_staleness, adaptive=s.adaptive, bounds=bounds, up_to_step=step)
        errors += [f"step {d['step']} dropped group index {d['index']} ({d['reason']}@{d['where']}, staleness "
                   f"{d['staleness']}) in an in-order run" + (" at a step whose bound had not tightened"
                                                               if s.adaptive else "") + " (in_order_drop)"
                   for d in in_order["drops"]]
        errors += [f"step {o['step']} consumed index {o['lowest']}, not above the previous step's {o['previous_highest']} "
                   "in an in-order run (in_order_order)" for o in in_order["out_of_order"]]
    return RunAudit(checkpoint.name, step, accounting, stale, _rule(stale["regime"], top), errors,
                    in_order)
