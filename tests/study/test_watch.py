"""``ragen-async watch`` on a finished run and on an empty directory."""

import json

import numpy as np
from typer.testing import CliRunner

from ragen_async.cli import app
from ragen_async.study.watch import sparkline


def test_sparkline_scales_between_min_and_max():
    assert sparkline(np.array([0.0, 0.5, 1.0]), 10) == "▁▅█"
    assert sparkline(np.array([2.0, 2.0]), 10) == "▅▅"
    assert sparkline(np.arange(100.0), 5) == "▁▃▅▆█"  # only the last 5 points
    assert sparkline(np.zeros(0), 5) == ""


def test_watch_once_draws_the_curves_and_the_collapse_alert(tmp_path, make_run):
    run = make_run(tmp_path / "k1-s0", steps=20, k=1)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"learner/step": 20, "val/success": 0.1, "alert/collapse": 1.0}) + "\n")
    result = CliRunner().invoke(app, ["watch", str(run), "--once", "--width", "30"])
    assert result.exit_code == 0, result.output
    out = result.output
    for label in ("validation success", "in-group reward std", "entropy", "grad norm", "staleness"):
        assert label in out
    assert "k1-s0: step 20 of 20" in out and "collapse alert at step(s) 20" in out
    assert any(ch in out for ch in "▁█")


def test_watch_explains_an_empty_or_missing_run(tmp_path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["watch", str(tmp_path / "empty"), "--once"])
    assert result.exit_code == 0 and "no metrics yet" in result.output
    result = CliRunner().invoke(app, ["watch", str(tmp_path / "missing"), "--once"])
    assert result.exit_code == 2 and "not a directory" in result.output


def test_watch_shows_the_adaptive_bound_and_why_it_moved(tmp_path, make_run):
    run = make_run(tmp_path / "controller-s0", steps=20, k=4)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    bounds = {s: 4 for s in range(1, 21)} | {s: 2 for s in range(8, 15)} | {s: 3 for s in range(15, 21)}
    for r in records:
        step = r.get("learner/step")
        if "staleness/mean" in r:  # a training record
            r.update({"staleness/max_staleness": float(bounds[step]), "staleness/controller_kl": 1e-3,
                      "staleness/bound_change": float((step == 7) * -1 + (step == 14) * 1), "warning/kl_rise": 0.0})
            if step == 7:
                r["staleness/controller_kl"] = 3.2e-3
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(app, ["watch", str(run), "--once", "--width", "30"])
    assert result.exit_code == 0, result.output
    assert "staleness bound (adaptive)" in result.output and "stale KL (controller)" in result.output
    assert "bound moves: step 7 down to 2 (stale KL 0.0032); step 14 up to 3 (stale KL 0.001)" in " ".join(
        result.output.split())
    fixed = make_run(tmp_path / "k4-s0", steps=5, k=4)
    result = CliRunner().invoke(app, ["watch", str(fixed), "--once"])
    assert "staleness bound" not in result.output and "bound moves" not in result.output
