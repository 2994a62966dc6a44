"""``bench peer`` end to end on a very small configuration: both sides train two steps on Bandit (ours on Ray with a
vLLM engine, TRL's GRPOTrainer in the test process), both are validated by our validator, and the table and the per-step
CSV come out (about 80 s on 2 busy cores: Ray, two vLLM engines, TRL's import)."""

from __future__ import annotations

import pandas as pd
import pytest
from typer.testing import CliRunner

from ragen_async.cli import app

pytestmark = [pytest.mark.ray_lane, pytest.mark.vllm, pytest.mark.slow]


def test_both_sides_train_and_are_validated(tiny_model_path, tmp_path):
    csv, out = tmp_path / "steps.csv", tmp_path / "peer.md"
    result = CliRunner().invoke(app, [
        "bench", "peer", "--env", "bandit", "--seeds", "1", "--steps", "2", "--warmup", "0", "--k", "0",
        "--reuse", "2", "--val-episodes", "4", "--model", tiny_model_path, "--run-root", str(tmp_path / "runs"), "--csv", str(csv), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = {line.split("|")[2].strip() + " " + line.split("|")[3].strip(): line for line in result.output.splitlines()
            if line.startswith("| bandit |")}
    assert set(rows) == {"ours k=0", "trl reuse=2"}, result.output
    steps = pd.read_csv(csv, comment="#")
    assert len(steps) == 4 and set(steps.side) == {"ours", "trl"}
    trl = steps[steps.side == "trl"].sort_values("step")
    # TRL generated once for its two steps: the second trains on the first's batch, one step old.
    assert trl.generated_tokens.tolist()[1] == 0 and trl.age_max.tolist() == [0.0, 1.0]
    assert (steps.trained_tokens > 0).all() and (steps.episodes == 64).all() and steps.success.between(0, 1).all()
    ours = steps[steps.side == "ours"]
    assert (ours.age_max == 0).all() and (ours.sync_s > 0).all() and (trl.sync_s == 0).all()
    for line in rows.values():  # validation ran on both sides: a success in [0, 1], not "—"
        assert float(line.split("|")[7]) >= 0.0
    assert "| bandit | trl | reuse=2 |" in out.read_text() and "Success per step" not in out.read_text()  # no reuse=1
