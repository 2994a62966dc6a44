"""``bench peer`` end to end on a very small configuration: both sides train two steps on Bandit (ours on Ray with a
vLLM engine, TRL's GRPOTrainer in the test process), both are validated by our validator, and the table and the per-step
CSV come out (about 80 s on 2 busy cores: Ray, two vLLM engines, TRL's import). The command runs in its own process, as
a user runs it: TRL, Ray and the engines' output stay out of the test worker (in-process, under pytest-xdist, pytest's
capture met a closed file at the test's end)."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

pytestmark = [pytest.mark.ray_lane, pytest.mark.vllm, pytest.mark.slow]


def test_both_sides_train_and_are_validated(tiny_model_path, tmp_path):
    csv, out = tmp_path / "steps.csv", tmp_path / "peer.md"
    result = subprocess.run([
        sys.executable, "-m", "ragen_async.cli",
        "bench", "peer", "--env", "bandit", "--seeds", "1", "--steps", "2", "--warmup", "0", "--k", "0",
        "--reuse", "2", "--val-episodes", "4", "--model", tiny_model_path, "--run-root", str(tmp_path / "runs"), "--csv",
        str(csv), "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    output = result.stdout
    assert result.returncode == 0, output[-4000:]
    rows = {line.split("|")[2].strip() + " " + line.split("|")[3].strip(): line for line in output.splitlines()
            if line.startswith("| bandit |")}
    assert set(rows) == {"ours k=0", "trl reuse=2"}, output[-4000:]
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
