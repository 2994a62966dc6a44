"""``ragen-async sweep`` and ``ragen-async report`` through the command line (typer's CliRunner)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ragen_async.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def test_sweep_help():
    result = runner.invoke(app, ["sweep", "--help"], env=WIDE)
    assert result.exit_code == 0
    for option in ("--dry-run", "--resume", "--out", "--no-report"):
        assert option in result.output


def test_report_help():
    result = runner.invoke(app, ["report", "--help"], env=WIDE)
    assert result.exit_code == 0
    for option in ("--out", "--threshold", "--smooth"):
        assert option in result.output


def test_sweep_dry_run_prints_the_plan(tmp_path):
    spec = REPO / "configs" / "sweeps" / "correction_bandit.yaml"
    result = runner.invoke(app, ["sweep", str(spec), "total_steps=5", "--dry-run", "--out", str(tmp_path / "s")],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    assert "sweep correction_bandit: 9 runs" in result.output and "total_steps=5" in result.output
    for name in ("nocorr-s0", "tis-s1", "decoupled-s2"):
        assert name in result.output
    assert not (tmp_path / "s").exists()


def test_sweep_errors_exit_2_with_the_reason(tmp_path):
    spec = REPO / "configs" / "sweeps" / "correction_bandit.yaml"
    result = runner.invoke(app, ["sweep", str(spec), "algo.clip_eps_hgih=1", "--dry-run"], env=WIDE)
    assert result.exit_code == 2 and "algo.clip_eps_hgih" in result.output
    result = runner.invoke(app, ["sweep"], env=WIDE)
    assert result.exit_code == 2 and "either a sweep spec or --resume" in result.output


def test_report_writes_into_the_run_folder_by_default(tmp_path, make_run):
    run_dir = make_run(tmp_path / "k1-s0", steps=6, k=1)
    result = runner.invoke(app, ["report", str(run_dir)], env=WIDE)
    assert result.exit_code == 0, result.output
    assert (run_dir / "report" / "report.md").is_file()
    assert str(run_dir / "report" / "report.md") in result.stdout
    missing = runner.invoke(app, ["report", str(tmp_path / "nothing-here")], env=WIDE)
    assert missing.exit_code == 2 and "no runs found" in missing.output
