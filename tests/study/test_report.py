"""Reports on synthetic runs: tables, numbers, plots, and the runs a real cluster leaves behind
(still writing, resumed, without validation, with NaN or missing metrics)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from ragen_async.study.report import (
    ReportError,
    RunData,
    find_runs,
    read_metrics,
    summarize,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def sweep_like(tmp_path, make_run):
    """Four runs: complete (k=0), complete fixed-lag with TIS (k=2), still writing (k=4), no validation."""
    root = tmp_path / "runs"
    make_run(root / "k0-s0", steps=20, k=0)
    make_run(root / "k2-fixed-tis-s0", steps=20, k=2, fixed_lag=True, off_policy="tis",
             val_curve=lambda step, total: 0.2 + 0.5 * step / total)  # never reaches 0.9
    make_run(root / "k4-s0", steps=12, k=4, partial_last_line=True)
    make_run(root / "novalidation", steps=8, k=1, val_every=0)
    return root


def test_the_report_has_a_row_and_a_section_per_run(sweep_like, tmp_path):
    result = write_report([sweep_like], tmp_path / "out")
    md = result.markdown.read_text()
    for name in ("k0-s0", "k2-fixed-tis-s0", "k4-s0", "novalidation"):
        assert f"| {name} |" in md and f"### {name}" in md
    overview = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
                for line in md.split("## Curves")[0].splitlines() if line.startswith("| ") and "---" not in line}
    header = overview.pop("run")
    row = dict(zip(header, overview["k0-s0"], strict=True))
    assert row["k"] == "0" and row["lag"] == "bounded" and row["steps"] == "20/20" and row["status"] == "complete"
    assert row["val ≥ 0.9 at"] == "15"  # 0.3 + step/20 first reaches 0.9 at the step-15 validation
    assert row["first val"] == "0.300" and row["final val"] == "1.000"
    fixed = dict(zip(header, overview["k2-fixed-tis-s0"], strict=True))
    assert (fixed["lag"], fixed["correction"], fixed["val ≥ 0.9 at"]) == ("fixed", "tis", "—")
    assert fixed["staleness mean / max"] == "1.00 / 2"
    partial = dict(zip(header, overview["k4-s0"], strict=True))
    assert partial["steps"] == "12/12"  # the half-written 13th step is not counted
    novalid = dict(zip(header, overview["novalidation"], strict=True))
    assert novalid["final val"] == "—" and novalid["best val"] == "—"
    assert "No validation records." in md.split("### novalidation")[1]
    assert any("partial last line" in w and w.startswith("k4-s0") for w in result.warnings)
    assert "## Warnings" in md and "partial last line" in md


def test_per_run_tables_hold_the_collapse_indicators(sweep_like, tmp_path):
    md = write_report([sweep_like / "k0-s0"], tmp_path / "out").markdown.read_text()
    section = md.split("### k0-s0")[1]
    assert "| Bandit | 0.300 | 1.000 | 1.000 | 15 |" in section
    assert "| max grad norm | 2.5 (step 10) |" in section
    assert "| min entropy | 0.5 (step 20) |" in section
    assert "| in-group reward std, first → last 10% of steps | 0.470 → 0.110 (-77%) |" in section
    assert "| behaviour/learner k3 mismatch, mean | 1.00e-04 |" in section
    assert "| mean step time (s) | 2.00 |" in section


def test_plots_are_written_and_not_empty(sweep_like, tmp_path):
    result = write_report([sweep_like], tmp_path / "out", smooth=3)
    names = sorted(p.name for p in result.plots)
    assert names == sorted(["curves_val_success.png", "curves_rollout_reward.png", "curves_in_group_reward_std.png",
                            "curves_entropy.png", "curves_grad_norm.png", "curves_staleness_mean.png",
                            "curves_valid_action_rate.png", "curves_k3_mismatch.png",
                            "staleness_stability.png", "cells_val_success.png"])
    for path in result.plots:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000
    md = result.markdown.read_text()
    assert "![curves_entropy](curves_entropy.png)" in md and "(staleness_stability.png)" in md
    assert (tmp_path / "out" / "summary.csv").read_text().startswith("run,k,lag,off_policy")


def test_many_runs_get_a_legend_by_k(tmp_path, make_run):
    for k in (0, 1, 2, 4, None):
        for seed in range(3):
            make_run(tmp_path / "runs" / f"k{k}-s{seed}", steps=6, k=k, seed=seed)
    result = write_report([tmp_path / "runs"], tmp_path / "out")
    assert len(result.summaries) == 15
    assert "| k0-s0 | 0 |" in result.markdown.read_text()
    assert "| kNone-s0 | ∞ |" in result.markdown.read_text()


def test_a_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"learner/step": 1, "actor/entropy": 1.0}\n{"learner/step": 2, "actor/ent')
    records, warnings = read_metrics(path)
    assert records == [{"learner/step": 1, "actor/entropy": 1.0}]
    assert warnings == ["skipped a partial last line of metrics.jsonl (run still writing?)"]
    path.write_text('{"learner/step": 1}\ngarbage\n{"learner/step": 2}\n')
    records, warnings = read_metrics(path)
    assert len(records) == 2 and warnings == ["skipped unreadable line 2 of metrics.jsonl"]


def test_nan_null_missing_keys_and_replayed_steps(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [
        {"learner/step": 1, "actor/grad_norm": 1.0, "actor/entropy": None},
        {"learner/step": 2, "actor/grad_norm": float("nan"), "actor/entropy": 0.7},
        {"learner/step": 3, "actor/grad_norm": 9.0},  # crashed after this; resumed from step 2
        {"learner/step": 3, "actor/grad_norm": 2.0, "actor/entropy": 0.6},
        {"learner/step": 4, "actor/grad_norm": "oops"},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = RunData.load(run_dir)
    s = summarize(run)
    assert [r["learner/step"] for r in run.train] == [1, 2, 3, 4]
    assert (s.grad_norm_max, s.grad_norm_max_step) == (2.0, 3)
    assert (s.entropy_min, s.entropy_min_step) == (0.6, 3)
    assert math.isnan(s.staleness_mean) and math.isnan(s.final_val) and s.reached_at is None
    assert not s.k_known and s.status == "partial"
    md = write_report([run_dir], tmp_path / "out").markdown.read_text()
    assert "| run | ? | bounded |" in md and "settings unknown" in md


def test_a_sweep_directory_reads_names_and_statuses_from_its_manifest(tmp_path, make_run):
    sweep = tmp_path / "sweep"
    make_run(sweep / "runs" / "k1-s0" / "t-k1-s0-2026", steps=6, k=1)
    manifest = {"name": "t", "runs": {
        "k1-s0": {"status": "done", "run_dir": "runs/k1-s0/t-k1-s0-2026"},
        "k2-s0": {"status": "pending", "run_dir": None},
    }}
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    runs, warnings = find_runs([sweep])
    assert [(r.name, r.status) for r in runs] == [("k1-s0", "done"), ("k2-s0", "pending")]
    md = write_report([sweep], tmp_path / "out").markdown.read_text()
    assert "| k1-s0 | 1 | bounded | none | 0 | done |" in md
    assert "| k2-s0 |" in md and "no run directory yet" in md


def test_nothing_to_report_is_an_error(tmp_path):
    with pytest.raises(ReportError, match="no runs found"):
        write_report([tmp_path], tmp_path / "out")


def test_a_folder_of_sweeps_keeps_manifest_names_and_tells_clashes_apart(tmp_path, make_run):
    for sweep in ("sweep-a", "sweep-b"):
        make_run(tmp_path / sweep / "runs" / "k1-s0" / "x-2026", steps=4, k=1)
        (tmp_path / sweep / "sweep.json").write_text(json.dumps(
            {"runs": {"k1-s0": {"status": "done", "run_dir": "runs/k1-s0/x-2026"}}}))
    make_run(tmp_path / "loose-run", steps=4, k=2)
    runs, _ = find_runs([tmp_path])
    assert sorted(r.name for r in runs) == ["loose-run", "sweep-a/k1-s0", "sweep-b/k1-s0"]
    assert {r.status for r in runs if "k1" in r.name} == {"done"}


def test_a_run_stopped_by_its_time_budget_is_not_called_partial(tmp_path, make_run):
    spent = {step: {"timing/budget_spent_s": 20.0 * step} for step in range(1, 7)}
    path = make_run(tmp_path / "budget", steps=6, extra=spent)
    config = yaml.safe_load((path / "config.yaml").read_text())
    (path / "config.yaml").write_text(yaml.safe_dump({**config, "total_steps": 1000, "time_budget_minutes": 2}))
    assert summarize(RunData.load(path)).status == "time budget"  # 6 steps x 20 s = the 2 minutes
    (path / "config.yaml").write_text(yaml.safe_dump({**config, "total_steps": 1000, "time_budget_minutes": 3}))
    assert summarize(RunData.load(path)).status == "partial"  # stopped before its budget: crashed or killed


def test_curves_colour_by_k_and_by_run_when_k_is_shared(tmp_path, make_run):
    from ragen_async.study.report.figures import _color, _run_colors

    def runs(*ks):
        return [RunData.load(make_run(tmp_path / f"r{i}-k{k}", steps=2, k=k)) for i, k in enumerate(ks)]

    mixed = runs(0, 0, 2)  # a staleness comparison: colour says k
    colors = _run_colors(mixed)
    assert _color(mixed[0], colors) == _color(mixed[1], colors) != _color(mixed[2], colors)
    shared = runs(1, 1, 1)
    colors = _run_colors(shared)  # a method comparison at one k: each run its own colour
    assert len({_color(r, colors) for r in shared}) == 3


def test_baselines_are_drawn_on_every_validation_plot(sweep_like, tmp_path, monkeypatch):
    from ragen_async.study.report import figures

    saved = {}
    real_save = figures.save_figure
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: saved.setdefault(path.name, fig) and real_save(fig, path))
    write_report([sweep_like], tmp_path / "out", baselines={"random": 0.211, "oracle": 1.0})

    def levels(ax):
        return sorted(line.get_ydata()[0] for line in ax.get_lines() if line.get_gid() == "baseline")

    val_axes = [saved["curves_val_success.png"].axes[0], *saved["cells_val_success.png"].axes]
    assert all(levels(ax) == [0.211, 1.0] for ax in val_axes)
    legend = [t.get_text() for t in saved["curves_val_success.png"].axes[0].get_legend().get_texts()]
    assert "random (0.211)" in legend and "oracle (1)" in legend
    assert levels(saved["curves_entropy.png"].axes[0]) == []  # not on the other curves


def test_the_report_gives_each_adaptive_runs_bound_and_its_moves(tmp_path, make_run):
    from ragen_async.study.report import find_runs
    from ragen_async.study.report.tables import bound_section

    bounds = {s: 4 if s < 8 else 2 if s < 15 else 3 for s in range(1, 21)}
    moved = make_run(tmp_path / "kl-s0", steps=20, k=4, config={"staleness": {"max_staleness": 4, "adaptive": True}},
                     extra={s: {"staleness/max_staleness": float(b), "staleness/bound_change":
                                float(-(s == 7) + (s == 14))} for s, b in bounds.items()})
    older = make_run(tmp_path / "ess-s0", steps=20, k=None, config={"staleness": {"max_staleness": None, "adaptive": True}},
                     extra={s: {"staleness/max_staleness": float("nan") if s < 10 else 4.0} for s in range(1, 21)})
    make_run(tmp_path / "k4-s0", steps=20, k=4)  # a fixed bound: not listed
    runs, _ = find_runs([moved, older, tmp_path / "k4-s0"])
    text = "\n".join(bound_section(runs))
    assert "| kl-s0 | 3.00 | 2 - 4 | 0 | 1 | 1 |" in text  # (7 x 4 + 7 x 2 + 6 x 3) / 20
    assert "| ess-s0 | 4.00 | 4 - 4 | 9 | 1 | 0 |" in text  # engaged from unbounded: lowered once
    assert "k4-s0" not in text
