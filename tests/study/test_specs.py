"""Every sweep spec shipped in configs/sweeps expands to valid, uniquely named configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_async.study.sweep import SweepSpec, plan_sweep

SPECS = sorted((Path(__file__).resolve().parents[2] / "configs" / "sweeps").glob("*.yaml"))


def test_the_shipped_specs_are_there():
    assert {p.stem for p in SPECS} >= {"staleness_bandit", "correction_bandit", "staleness_sokoban_paper"}


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_spec_expands_to_valid_configs(path):
    plan = plan_sweep(SweepSpec.load(path))
    names = [run.name for run in plan.runs]
    assert names and len(set(names)) == len(names)
    for run in plan.runs:
        cfg = run.config
        assert cfg.name == f"{plan.spec.name}-{run.name}"
        if cfg.staleness.max_staleness or cfg.staleness.fixed_lag:
            assert cfg.runtime == "ray", f"{run.name}: staleness > 0 needs the ray runtime"
        if cfg.staleness.max_staleness == 0:
            assert not cfg.staleness.fixed_lag, f"{run.name}: k = 0 fixed lag duplicates the bounded run"


def test_the_bandit_studies_have_the_documented_shape():
    plans = {p.stem: plan_sweep(SweepSpec.load(p)) for p in SPECS}
    staleness = plans["staleness_bandit"].runs
    assert sorted({r.config.staleness.max_staleness for r in staleness}) == [0, 1, 2, 4]
    assert {r.config.staleness.fixed_lag for r in staleness} == {False, True}
    correction = plans["correction_bandit"].runs
    assert {r.config.algo.off_policy for r in correction} == {"none", "tis", "decoupled"}
    assert all(r.config.staleness.max_staleness == 4 and r.config.staleness.fixed_lag for r in correction)
