"""scripts/device_check.sh, the check for a lent GPU machine, in its CPU dry run: every stage runs (small,
without CUDA) and the JSON it hands back holds each stage's status and the learner's figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "device_check.sh"


@pytest.mark.slow
def test_the_device_check_dry_run_runs_every_stage_and_writes_its_json(tmp_path, tiny_model_path):
    env = {**os.environ, "PYTHON": sys.executable, "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path / "out")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    log = (tmp_path / "out" / "device_check.log").read_text()
    assert result.returncode == 0, result.stdout + result.stderr + log[-4000:]
    summary = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert summary["dry_run"] is True and summary["machine"]["cpus"] == os.cpu_count()
    assert [s["stage"] for s in summary["stages"]] == ["learner_cuda_tests", "learner_bench", "transport_bench",
                                                       "weights_bench", "mixed_precision"]
    assert all(s["exit"] == 0 for s in summary["stages"])
    fp32, bf16 = summary["learner"]
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16") and fp32["update_vs_fp32"] == 0.0
    for row in (fp32, bf16):
        assert row["shape"] == "tiny" and row["device"] == "cpu" and row["checkpointing"] is False
        assert row["tokens_per_step"] > 1000 and row["tokens_per_s"] > 0 and row["mfu"] is None  # no MFU on a CPU
        assert row["moved_frac"] > 0.99  # at lr 1e-6 (the paper config's): fp32 masters keep every update
    tables = (tmp_path / "out" / "benchmarks.md").read_text()
    for title in ("Learner benchmark", "Transport benchmark", "Weight-sync benchmark"):
        assert f"## {title}" in tables, title
    assert "skipped" in log  # the CUDA tests skip here (and run on the GPU machine)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["benchmarks.md", "device_check.json",
                                                                    "device_check.log"]

