"""A config can pin the weights a run starts from (model.sha256); the study's warm start is pinned so
that cells trained on different days and machines start from the same model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ragen_async.cli import app
from ragen_async.config import ConfigError, load_config
from ragen_async.modeldir import model_problem, weights_sha256
from ragen_async.study.sweep import SweepError, run_sweep

WARM_START = Path("studies/specimen/warm_start")


@pytest.mark.parametrize("config, warm_start, sweeps", [
    ("study_specimen.yaml", WARM_START, "study_*.yaml"),
    ("study_specimen_frozen_lake.yaml", Path("studies/specimen_frozen_lake/warm_start"), "confirm_frozen_lake*.yaml"),
])
def test_the_study_starts_from_the_weights_it_pins_and_they_are_in_the_repository(config, warm_start, sweeps):
    cfg = load_config(f"configs/tiny/{config}")
    assert Path(cfg.model.path) == warm_start and cfg.model.sha256 is not None
    assert weights_sha256(warm_start) == cfg.model.sha256
    assert json.loads((warm_start / "build_info.json").read_text())["weights_sha256"] == cfg.model.sha256
    assert model_problem(cfg.model.path, cfg.model.sha256) is None
    # every run of every sweep on it inherits the pin
    from ragen_async.study.sweep import SweepSpec, plan_sweep

    specs = sorted(Path("configs/sweeps").glob(sweeps))
    assert specs
    for spec in specs:
        runs = plan_sweep(SweepSpec.load(spec)).runs
        assert runs and all(r.config.model.sha256 == cfg.model.sha256 for r in runs), spec


def test_other_weights_under_a_pin_are_refused_in_one_line_before_anything_starts(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(WARM_START, model)
    pinned = weights_sha256(model)
    data = bytearray((model / "model.safetensors").read_bytes())
    data[-1] ^= 1  # one bit of one weight
    (model / "model.safetensors").write_bytes(bytes(data))
    problem = model_problem(str(model), pinned)
    assert problem is not None and "model.sha256 pins" in problem and pinned[:16] in problem
    assert model_problem(str(model), weights_sha256(model)) is None and model_problem(str(model)) is None
    assert "not a model directory" in model_problem(str(tmp_path / "nothing"), pinned)

    runs = tmp_path / "runs"
    result = CliRunner().invoke(app, ["train", "configs/tiny/study_specimen.yaml", f"model.path={model}",
                                      f"run_root={runs}"])
    assert result.exit_code == 2 and "model.sha256 pins" in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output and not runs.exists()

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: pinned\nbase: {Path('configs/tiny/study_specimen.yaml').resolve()}\n"
                    f"overrides:\n  model.path: {model}\ngrid:\n  seed: [0, 1]\n")
    trained = []
    with pytest.raises(SweepError, match="model.sha256 pins"):
        run_sweep(spec, out=tmp_path / "sweep", train_fn=lambda *a, **k: trained.append(a))
    assert not trained and not (tmp_path / "sweep").exists()


def test_a_pin_must_be_a_sha256_digest():
    with pytest.raises(ConfigError, match="sha256"):
        load_config("configs/tiny/study_specimen.yaml", ["model.sha256=938482ee"])
