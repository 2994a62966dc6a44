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


REPO = Path(__file__).resolve().parents[2]
DELTA_COUNTDOWN = 0.01
"""SmallCountdown's registered opsm_delta."""


def _used_elsewhere() -> tuple[set, set, set]:
    """Sampling seeds, training and validation level seeds of every committed config and run outside the
    corrections study (configs/, studies/**/config.yaml, sweep specs' grids and overrides)."""
    import yaml

    seeds, rollout, validation = set(), set(), set()
    files = [*REPO.glob("configs/**/*.yaml"), *REPO.glob("studies/**/config.yaml"), *REPO.glob("studies/**/spec.yaml")]
    for path in files:
        if path.name.startswith("corrections_") or "corrections" in path.relative_to(REPO).parts[:2]:
            continue
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            continue
        seeds.update([data["seed"]] if "seed" in data else [])
        seeds.update((data.get("grid") or {}).get("seed", []))
        rollout.add((data.get("rollout") or {}).get("seed"))
        validation.add((data.get("validation") or {}).get("seed"))
        overrides = data.get("overrides") or {}
        rollout.add(overrides.get("rollout.seed"))
        validation.add(overrides.get("validation.seed"))
    return seeds, rollout - {None}, validation - {None}


def test_the_corrections_sweeps_have_the_registered_shape_on_unused_levels():
    """studies/confirm/PREDICTIONS.md, "Corrections of stale samples": four cells of five seeds a task, each in its
    study placement, on levels and seeds no other committed config or run uses."""
    seeds, rollout, validation = _used_elsewhere()
    assert 10000 in rollout and 2000000 in rollout and {123, 1000000} <= validation and 8 in seeds  # it reads them
    for stem, lr, delta, tau in (("corrections_sokoban", 2e-4, 0.01, 1.0),
                                 ("corrections_countdown", 1e-4, DELTA_COUNTDOWN, 2.0)):
        plan = plan_sweep(SweepSpec.load(REPO / "configs" / "sweeps" / f"{stem}.yaml"))
        cells = {}
        for run in plan.runs:
            cfg = run.config
            assert (cfg.rollout.seed, cfg.validation.seed, cfg.learner.actor_lr) == (3000000, 4000000, lr)
            assert cfg.staleness.consume == "in_order" and cfg.total_steps == 200
            assert (cfg.algo.opsm_delta, cfg.algo.age_tau, cfg.algo.age_negatives_only) == (delta, tau, True)
            assert tau == pytest.approx(2e-4 / lr)  # the registered rule
            pinned = bool(cfg.rollout.cpu_affinity and cfg.learner.cpu_affinity)
            assert pinned == (cfg.staleness.max_staleness is None), f"{run.name}: not in its study placement"
            cells.setdefault((cfg.staleness.max_staleness, cfg.algo.off_policy), []).append(cfg.seed)
        assert cells == {(0, "none"): [9, 10, 11, 12, 13], (None, "none"): [9, 10, 11, 12, 13],
                         (None, "opsm"): [9, 10, 11, 12, 13], (None, "age"): [9, 10, 11, 12, 13]}
        assert not {9, 10, 11, 12, 13} & seeds and 3000000 not in rollout and 4000000 not in validation


def test_the_fixed_lag_corrections_sweep_has_the_registered_shape_on_levels_no_run_used():
    """studies/confirm/PREDICTIONS.md, "Corrections at a fixed lag": Sokoban at actor lr 2e-4, k = 0 and a fixed lag
    of 8 with none, opsm and age, five seeds a cell, each in its study placement, on levels and seeds that neither
    the configs and runs outside the corrections study nor the unbounded corrections sweeps use."""
    seeds, rollout, validation = _used_elsewhere()
    unbounded = [plan_sweep(SweepSpec.load(REPO / "configs" / "sweeps" / f"{stem}.yaml"))
                 for stem in ("corrections_sokoban", "corrections_countdown")]
    seeds |= {run.config.seed for plan in unbounded for run in plan.runs}
    rollout |= {run.config.rollout.seed for plan in unbounded for run in plan.runs}
    validation |= {run.config.validation.seed for plan in unbounded for run in plan.runs}
    plan = plan_sweep(SweepSpec.load(REPO / "configs" / "sweeps" / "corrections_fixed_lag.yaml"))
    cells = {}
    for run in plan.runs:
        cfg = run.config
        assert (cfg.rollout.seed, cfg.validation.seed, cfg.learner.actor_lr) == (5000000, 6000000, 2e-4)
        assert cfg.staleness.consume == "in_order" and cfg.total_steps == 200
        assert (cfg.algo.opsm_delta, cfg.algo.age_tau, cfg.algo.age_negatives_only) == (0.01, 1.0, True)
        assert cfg.staleness.fixed_lag == (cfg.staleness.max_staleness == 8)
        pinned = bool(cfg.rollout.cpu_affinity and cfg.learner.cpu_affinity)
        assert pinned == cfg.staleness.fixed_lag, f"{run.name}: not in its study placement"
        cells.setdefault((cfg.staleness.max_staleness, cfg.algo.off_policy), []).append(cfg.seed)
    assert cells == {(0, "none"): [14, 15, 16, 17, 18], (8, "none"): [14, 15, 16, 17, 18],
                     (8, "opsm"): [14, 15, 16, 17, 18], (8, "age"): [14, 15, 16, 17, 18]}
    assert not {14, 15, 16, 17, 18} & seeds and 5000000 not in rollout and 6000000 not in validation
    assert {3000000, 10000} <= rollout and 4000000 in validation and 13 in seeds  # it reads the others
