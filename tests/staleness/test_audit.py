"""`ragen-async audit` checks staleness too: every consumed group's staleness (learner version - its oldest
token's version) against the bound in force at its step (k, unbounded, exactly min(k, v) under fixed lag,
or the adaptive bound logged as ``staleness/max_staleness``), with a per-lag table. Provenance is built by hand."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ragen_async.cli import app
from ragen_async.config import load_config
from ragen_async.records.rundir import DRIVER_STATE, RunDir, finalize_checkpoint, staging_path

B = 2  # groups per step


def _group(index: int, min_version: int | None, max_version: int | None = None) -> dict:
    return {"index": index, "group_id": f"g{index:08d}", "env_tag": "Bandit", "seed": index, "worker": "w0",
            "kept": True, "min_version": min_version,
            "max_version": min_version if max_version is None else max_version, "scores": [0.0, 1.0]}


def _records(lags: list[list[int]]) -> list[dict]:
    """Step s (1-based) trains at learner version s - 1 on one group per entry of ``lags[s - 1]``, each
    that many versions old (all its tokens from one version)."""
    out, index = [], 0
    for step, step_lags in enumerate(lags, start=1):
        v = step - 1
        groups = []
        for lag in step_lags:
            groups.append(_group(index, v - lag))
            index += 1
        out.append({"step": step, "learner_version": v, "groups": groups, "dropped": []})
    return out


def _run_dir(tmp_path, staleness: list[str], records: list[dict], bounds: list[float] | None = None) -> RunDir:
    """A run directory as a finished run leaves it: config.yaml, provenance.jsonl, a final checkpoint
    with the admission state, and (``bounds``) a metrics.jsonl with ``staleness/max_staleness`` per step."""
    cfg = load_config(None, ["runtime=ray", "validation.every=0", f"total_steps={len(records)}", "algo.filter_mode=none",
                             f"rollout.envs=[{{tag: Bandit, n_groups: {B}}}]", *staleness])
    rd = RunDir.create(cfg, tmp_path / "run")
    (rd.path / "provenance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if bounds is not None:
        lines = [{"learner/step": 0, "val/success": 0.5}]  # a validation record: no bound
        lines += [{"learner/step": s, "policy_version": s, "staleness/max_staleness": b} for s, b in enumerate(bounds, 1)]
        rd.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    n = sum(len(r["groups"]) for r in records)
    step = len(records)
    path = staging_path(rd, step)
    admission = {"next_index": n, "outstanding": [], "dropped": 0, "consumed": n, "published_version": step,
                 "refusals": 0}
    (path / DRIVER_STATE).write_text(json.dumps({"step": step, "version": step, "syncs": step,
                                                 "admission": admission}))
    finalize_checkpoint(rd, path, step)
    return rd


def _audit(rd: RunDir):
    result = CliRunner().invoke(app, ["audit", str(rd.path)])
    return result, result.output


def _json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def _with_lag(records: list[dict], step: int, position: int, lag: int) -> dict:
    """Make one group of ``step`` ``lag`` versions old (all its tokens); returns that group."""
    group = records[step - 1]["groups"][position]
    group["min_version"] = group["max_version"] = records[step - 1]["learner_version"] - lag
    return group


BOUNDED = [[0, 0], [0, 1], [1, 2], [2, 2]]  # k = 2: lag 0 three times, 1 twice, 2 three times


def test_a_clean_bounded_run_passes_with_its_per_lag_table(tmp_path):
    rd = _run_dir(tmp_path, ["staleness.max_staleness=2"], _records(BOUNDED))
    result, output = _audit(rd)
    assert result.exit_code == 0, output
    totals = _json(output)
    assert totals["consumed"] == 8 and totals["duplicates"] == [] and totals["unexplained"] == []
    s = totals["staleness"]
    assert s["regime"] == "bounded" and s["violations"] == [] and s["groups"] == 8 and s["max"] == 2
    assert s["lags"] == [{"lag": 0, "groups": 3, "share": 0.375}, {"lag": 1, "groups": 2, "share": 0.25},
                         {"lag": 2, "groups": 3, "share": 0.375}]
    assert "lag" in output and "37.5%" in output and "no violation" in output


def test_a_group_one_version_too_old_is_caught_and_named(tmp_path):
    records = _records(BOUNDED)
    stale = _with_lag(records, 4, 1, 3)  # k = 2, and this one is 3 versions old
    result, output = _audit(_run_dir(tmp_path, ["staleness.max_staleness=2"], records))
    assert result.exit_code == 1, output
    assert f"step 4 group {stale['group_id']}" in output and "staleness 3 > 2" in output
    totals = _json([line for line in output.splitlines() if line.startswith("{")][-1])
    assert totals["consumed"] == 8 and totals["duplicates"] == [] and totals["unexplained"] == []
    assert totals["staleness"]["violations"] == [
        {"step": 4, "learner_version": 3, "index": stale["index"], "group_id": stale["group_id"], "staleness": 3,
         "newest_staleness": 3, "bound": 2, "rule": "max_staleness"}]


def test_unbounded_and_synchronous_runs(tmp_path):
    from ragen_async.records.provenance import audit_staleness

    records = _records([[0, 0], [1, 0], [2, 2], [3, 1]])
    result = audit_staleness(records, None)
    assert result["regime"] == "unbounded" and result["violations"] == [] and result["max"] == 3
    assert [row["lag"] for row in result["lags"]] == [0, 1, 2, 3]
    sync = audit_staleness(records, 0)  # k = 0: only lag-0 groups are allowed
    assert [(v["step"], v["staleness"], v["bound"]) for v in sync["violations"]] == [(2, 1, 0), (3, 2, 0), (3, 2, 0),
                                                                                      (4, 3, 0), (4, 1, 0)]
    rd = _run_dir(tmp_path, ["staleness.max_staleness=null"], records)
    result, output = _audit(rd)
    assert result.exit_code == 0, output
    assert _json(output)["staleness"]["regime"] == "unbounded"


FIXED = [[0, 0], [1, 1], [2, 2], [2, 2]]  # k = 2 under fixed lag: exactly min(2, v) at v = 0, 1, 2, 3


def test_fixed_lag_exact_passes_and_one_group_off_by_one_is_caught(tmp_path):
    from ragen_async.records.provenance import audit_staleness

    fixed = ["staleness.max_staleness=2", "staleness.fixed_lag=true"]
    result, output = _audit(_run_dir(tmp_path / "exact", fixed, _records(FIXED)))
    assert result.exit_code == 0, output
    s = _json(output)["staleness"]
    assert s["regime"] == "fixed_lag" and s["violations"] == []
    assert s["lags"] == [{"lag": 0, "groups": 2, "share": 0.25}, {"lag": 1, "groups": 2, "share": 0.25},
                         {"lag": 2, "groups": 4, "share": 0.5}]

    records = _records(FIXED)
    young = _with_lag(records, 3, 0, 1)  # within k = 2, yet not exactly 2 versions old
    result, output = _audit(_run_dir(tmp_path / "young", fixed, records))
    assert result.exit_code == 1, output
    assert f"step 3 group {young['group_id']}" in output and "fixed_lag" in output

    records = _records(FIXED)
    mixed = records[3]["groups"][1]
    mixed["max_version"] += 1  # oldest token exactly 2 old, newest only 1: not every token is k old
    violations = audit_staleness(records, 2, fixed_lag=True)["violations"]
    assert [(v["step"], v["group_id"], v["staleness"], v["newest_staleness"], v["bound"], v["rule"])
            for v in violations] == [(4, mixed["group_id"], 2, 1, 2, "fixed_lag")]


ADAPTIVE = [[0, 0], [1, 1], [1, 1], [1, 0]]
ADAPTIVE_K = ["staleness.max_staleness=3", "staleness.adaptive=true", "staleness.adaptive_min_staleness=0"]


def test_adaptive_a_group_within_max_staleness_but_above_the_bound_in_force_is_caught(tmp_path):
    from ragen_async.records.provenance import audit_staleness, bounds_from_metrics

    result, output = _audit(_run_dir(tmp_path / "clean", ADAPTIVE_K, _records(ADAPTIVE), bounds=[3, 1, 1, 1]))
    assert result.exit_code == 0, output
    assert _json(output)["staleness"]["bound_unknown_steps"] == []

    records = _records(ADAPTIVE)
    stale = _with_lag(records, 3, 1, 2)  # 2 <= max_staleness 3, but the bound was halved to 1 after step 1
    rd = _run_dir(tmp_path / "stale", ADAPTIVE_K, records, bounds=[3, 1, 1, 1])
    result, output = _audit(rd)
    assert result.exit_code == 1, output
    assert f"step 3 group {stale['group_id']}" in output and "staleness 2 > 1" in output
    violation, = _json([line for line in output.splitlines() if line.startswith("{")][-1])["staleness"]["violations"]
    assert (violation["step"], violation["bound"], violation["rule"]) == (3, 1, "adaptive_bound")

    # Without a logged bound the audit can only check max_staleness, an upper bound, and says so.
    rd.metrics_path.unlink()
    result, output = _audit(rd)
    assert result.exit_code == 0, output
    assert "upper bound" in output and _json(output)["staleness"]["bound_unknown_steps"] == [1, 2, 3, 4]

    # The last record of a step wins (a resumed run re-logs it); a NaN bound is unbounded at that step; an older
    # run's staleness/bound is read as staleness/max_staleness.
    metrics = [{"learner/step": 1, "staleness/max_staleness": 3.0}, {"learner/step": 1, "staleness/bound": 1.0},
               {"learner/step": 2, "staleness/max_staleness": float("nan")}, {"learner/step": 3, "val/success": 1.0}]
    assert bounds_from_metrics(metrics) == {1: 1, 2: None}
    partial = audit_staleness(records, 3, adaptive=True, bounds={1: 3, 2: 1})
    assert partial["violations"] == [] and partial["bound_unknown_steps"] == [3, 4]

    # Adaptive from unbounded (max_staleness None): unbounded steps check nothing, bounded ones their bound.
    from_unbounded = audit_staleness(records, None, adaptive=True, bounds={1: None, 2: None, 3: 1, 4: None})
    assert from_unbounded["regime"] == "adaptive"
    assert [(v["step"], v["bound"], v["rule"]) for v in from_unbounded["violations"]] == [(3, 1, "adaptive_bound")]
    assert audit_staleness(records, None, adaptive=True, bounds={1: None, 2: None, 3: None, 4: None})["violations"] == []


def test_a_simulated_adaptive_run_audits_clean_against_the_bound_it_logged(tmp_path):
    """The real loop (test_loop's simulator, scripted warnings) under adaptive staleness: the bound logged
    as ``staleness/max_staleness`` at step s is the one its batch was taken under, so the audit passes, although
    groups older than a later, lowered bound were consumed before it was lowered."""
    import asyncio

    from ragen_async.orchestrator import Trainer
    from ragen_async.records.metrics import JsonlSink
    from ragen_async.records.provenance import bounds_from_metrics, read_provenance
    from tests.fakes import TickRuntime

    cfg = load_config(None, [f"run_root={tmp_path}", "runtime=ray", "total_steps=24", "validation.every=0",
                             "checkpoint_every=0", "algo.filter_mode=none", "rollout.envs=[{tag: Bandit, n_groups: 4}]",
                             "rollout.group_size=2", "learner.num_ranks=1", "logging.console=false",
                             "staleness.max_staleness=3", "staleness.adaptive=true", "staleness.adaptive_min_staleness=1",
                             "staleness.adaptive_patience=3"])
    rd = RunDir.create(cfg)
    trainer = Trainer(cfg, rd, JsonlSink(rd.metrics_path), TickRuntime(3, groups_per_step=4, producers=12, seed=5))
    fired = iter([step in (6, 7, 15) for step in range(1, 25)])
    trainer.warnings.update = lambda record: {"grad_norm"} if next(fired) else set()
    asyncio.run(trainer.run())
    trainer.close()
    trainer.sink.close()

    bounds = bounds_from_metrics(json.loads(line) for line in rd.metrics_path.read_text().splitlines())
    assert min(bounds.values()) == 1 and max(bounds.values()) == 3  # the bound moved
    provenance = read_provenance(rd.path / "provenance.jsonl")
    oldest = {r["step"]: max(r["learner_version"] - g["min_version"] for g in r["groups"]) for r in provenance}
    assert any(oldest[s] > bounds[s + 1] for s in range(1, 24))  # a step consumed what the next would not
    result, output = _audit(rd)
    assert result.exit_code == 0, output
    s = _json(output)["staleness"]
    assert s["regime"] == "adaptive" and s["bound_unknown_steps"] == [] and s["groups"] == 24 * 4
