"""The weight-sync probe stops the run with a clear error when an engine serves other weights."""

from pathlib import Path

import pytest

from ragen_async.weight_sync import WeightSyncDivergence, WeightSyncError, check_probe, probe_tolerance

LEARNER = [0.0, -1.0, -2.5, -0.25, -7.0]


def test_agreement_within_the_tolerance_returns_the_max_abs_diff():
    engines = [[0.0, -1.0002, -2.5, -0.25, -7.0], [0.0, -1.0, -2.5005, -0.25, -7.0]]
    assert check_probe(LEARNER, engines, version=3) == pytest.approx(5e-4)


def test_a_divergent_engine_stops_the_run_with_a_clear_error():
    engines = [LEARNER, [0.0, -1.0, -2.5, -0.25, -6.2]]  # engine 1 serves another head
    with pytest.raises(WeightSyncDivergence) as info:
        check_probe(LEARNER, engines, version=12, dtype="float32")
    msg = str(info.value)
    assert isinstance(info.value, WeightSyncError)
    assert "version 12" in msg and "engine 1: 0.8" in msg and "engine 0" not in msg and "stopping the run" in msg
    assert "0.01 nats (float32)" in msg


def test_nan_or_a_wrong_length_is_a_divergence():
    with pytest.raises(WeightSyncDivergence, match="engine 0: inf"):
        check_probe(LEARNER, [[0.0, float("nan"), -2.5, -0.25, -7.0]], version=1)
    with pytest.raises(WeightSyncDivergence, match="scored 3 positions"):
        check_probe(LEARNER, [[0.0, -1.0, -2.5]], version=1)


def test_tolerance_follows_the_dtype_and_can_be_given():
    assert probe_tolerance("float32") < probe_tolerance("float16") <= probe_tolerance("bfloat16")
    assert probe_tolerance("torch.bfloat16") == probe_tolerance("bfloat16")
    near = [[0.0, -1.0, -2.5, -0.25, -6.7]]  # 0.3 off: bf16 rounding, a float32 divergence
    assert check_probe(LEARNER, near, version=1, dtype="bfloat16") == pytest.approx(0.3)
    with pytest.raises(WeightSyncDivergence):
        check_probe(LEARNER, near, version=1, dtype="float32")
    with pytest.raises(WeightSyncDivergence):
        check_probe(LEARNER, near, version=1, dtype="bfloat16", tolerance=0.1)


def test_the_paper_config_verifies_syncs():
    from ragen_async.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs/paper/base.yaml")
    assert cfg.weight_sync.verify_every > 0
