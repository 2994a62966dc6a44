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
