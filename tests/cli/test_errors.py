"""Bad input is one clear line and exit 2, found before anything is created or loaded."""

from __future__ import annotations

from typer.testing import CliRunner

from ragen_async.cli import app


def test_unknown_env_tag_or_option_fails_before_the_run_directory_exists(tmp_path):
    for override, message in [("rollout.envs=[{tag: Bandti, n_groups: 8}]", "unknown env tag 'Bandti'"),
                              ("validation.envs=[{tag: SimpleSokoban, n_groups: 8, overrides: {difficulty: easy}}]",
                               "difficulty must be one of")]:
        result = CliRunner().invoke(app, ["train", "configs/tiny/starpo_s_bandit.yaml", override,
                                          f"run_root={tmp_path / 'runs'}"])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output
        assert not (tmp_path / "runs").exists()


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("ragen-async ")


def test_report_baseline_must_be_name_equals_success(tmp_path):
    for bad in ("random", "random=lots", "=0.2"):
        result = CliRunner().invoke(app, ["report", str(tmp_path), "--baseline", bad, "--out", str(tmp_path / "r")])
        assert result.exit_code == 2 and "expected NAME=SUCCESS" in result.output, result.output
        assert not (tmp_path / "r").exists()
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--collapse-floor", "1.5", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "--collapse-floor" in result.output, result.output
    assert not (tmp_path / "r").exists()
    for bad in ("appo", "=x.csv", "appo="):
        result = CliRunner().invoke(app, ["report", str(tmp_path), "--reference", bad, "--out", str(tmp_path / "r")])
        assert result.exit_code == 2 and "expected NAME=CSV" in result.output, result.output
    for bad in ("0", "0=fast", "-1=2.0", "eight=2.0", "4=0", "inf=nan"):
        result = CliRunner().invoke(app, ["report", str(tmp_path), "--throughput", bad, "--out", str(tmp_path / "r")])
        assert result.exit_code == 2 and "expected K=GROUPS_PER_S" in result.output, result.output
        assert not (tmp_path / "r").exists()


def test_training_the_specimen_without_its_model_names_the_command_that_builds_it(tmp_path, monkeypatch):
    from pathlib import Path

    configs = {name: Path(f"configs/tiny/specimen_{name}.yaml").resolve() for name in ("sokoban", "frozen_lake")}
    monkeypatch.chdir(tmp_path)  # no artifacts/ here
    for name, config in configs.items():
        result = CliRunner().invoke(app, ["train", str(config), f"run_root={tmp_path / 'runs'}"])
        assert result.exit_code == 2, result.output
        assert f"`ragen-async make-model --warm-start {name}`" in " ".join(result.output.split()), result.output
        assert not (tmp_path / "runs").exists()
    result = CliRunner().invoke(app, ["make-model", "--warm-start", "sokobon"])
    assert result.exit_code == 2 and "--warm-start must be one of sokoban, frozen_lake" in result.output, result.output
    result = CliRunner().invoke(app, ["make-model", "--eps", "0.2"])
    assert result.exit_code == 2 and "--warm-start builds only" in result.output, result.output
