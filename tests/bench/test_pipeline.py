"""``bench pipeline``'s configs and table for bounded and unbounded k (the runs themselves: docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ragen_async.bench.pipeline import BenchRow, bench_config, format_table
from ragen_async.cli import app, parse_k
from ragen_async.config import load_config


def test_k_is_an_integer_or_inf():
    assert [parse_k(x) for x in ("0", "8", "inf", "None")] == [0, 8, None, None]
    for bad in ("-1", "eight", "1.5"):
        with pytest.raises(ValueError, match="integer >= 0 or inf"):
            parse_k(bad)
    result = CliRunner().invoke(app, ["bench", "pipeline", "--k", "-2"])
    assert result.exit_code == 2 and "--max-staleness '-2'" in result.output, result.output
    result = CliRunner().invoke(app, ["bench", "pipeline", "--mode", "shared"])
    assert result.exit_code == 2 and "--mode 'shared': expected one of pinned, unpinned, config" in result.output


def test_an_unbounded_run_is_benched_and_labelled_unbounded():
    base = load_config("configs/tiny/study_specimen.yaml")
    cfg = bench_config(base, None, "pinned", steps=8, cpus=[0, 1])
    assert cfg.staleness.max_staleness is None and cfg.name == "bench-kinf-pinned-in_order"
    assert cfg.rollout.cpu_affinity == [0] and cfg.learner.cpu_affinity == [1] and cfg.validation.every == 0
    assert bench_config(base, 0, "unpinned", steps=8, cpus=[0, 1]).staleness.max_staleness == 0

    def row(k, groups_per_s):
        return BenchRow("pinned", k, groups_per_s, 1000.0, 0.1, 0.2, 0.0 if k == 0 else 3.0, 1.0, 1.0, 6, 60.0)

    lines = format_table([row(0, 1.0), row(None, 2.5)]).splitlines()
    assert lines[2].startswith("| pinned | 0 | 1.000 |") and lines[2].endswith("| 1.00 | 2.00 |")
    assert lines[3].startswith("| pinned | ∞ | 2.500 |") and "| 2.50 |" in lines[3]


def test_config_mode_keeps_the_configs_placement():
    """The study's k = 0 runs let both sides use both cores (two threads each); ``--mode config`` measures
    that placement, ``unpinned`` gives each side one thread, ``pinned`` one core each."""
    base = load_config("configs/tiny/study_specimen.yaml")
    shared = bench_config(base, 0, "config", steps=8, cpus=[0, 1])
    assert shared.name == "bench-k0-config-in_order" and shared.rollout.cpu_affinity is None
    assert (shared.rollout.cpus_per_worker, shared.learner.torch_threads) == (base.rollout.cpus_per_worker,
                                                                              base.learner.torch_threads) == (2, 2)
    split = bench_config(load_config("configs/tiny/study_specimen_split.yaml"), 2, "config", steps=8, cpus=[0, 1])
    assert (split.rollout.cpu_affinity, split.learner.cpu_affinity, split.learner.torch_threads) == ([0], [1], 1)
    assert (shared.rollout.threads_per_engine, base.rollout.engine_threads) == (2, None)  # its CPUs' threads
    unpinned = bench_config(base, 0, "unpinned", steps=8, cpus=[0, 1])
    assert (unpinned.rollout.cpus_per_worker, unpinned.learner.torch_threads) == (1, 1)
    wide = bench_config(base, 0, "pinned", steps=8, cpus=list(range(8)))  # thread budgets matched to the CPU sets
    assert (wide.rollout.threads_per_engine, wide.learner.torch_threads) == (4, 4)


def test_both_consumption_modes_are_benched_side_by_side_with_their_drops():
    """``--consume arrival --consume in_order``: the same k under each mode, each compared with k = 0 of its
    own mode, and the share of generated groups each dropped (the measurement itself: docs/benchmarks.md)."""
    base = load_config("configs/tiny/study_specimen.yaml")
    cfg = bench_config(base, 2, "config", steps=8, cpus=[0, 1], consume="in_order")
    assert (cfg.staleness.consume, cfg.staleness.max_staleness, cfg.name) == ("in_order", 2, "bench-k2-config-in_order")
    assert bench_config(base, 2, "config", steps=8, cpus=[0, 1]).staleness.consume == "in_order"  # the config's own
    arrival = load_config("configs/tiny/study_specimen.yaml", ["staleness.consume=arrival"])
    assert bench_config(arrival, 2, "config", steps=8, cpus=[0, 1]).staleness.consume == "arrival"

    def row(k, consume, groups_per_s, dropped):
        return BenchRow("config", k, groups_per_s, 1000.0, 0.1, 0.2, 1.0, 1.0, 1.0, 6, 60.0, consume, dropped)

    lines = format_table([row(0, "arrival", 1.0, 0.0), row(2, "arrival", 1.5, 0.02),
                          row(0, "in_order", 1.0, 0.0), row(2, "in_order", 1.2, 0.0)]).splitlines()
    assert "| dropped |" in lines[0]
    assert lines[3].startswith("| config | 2 | 1.500 |") and "| 2.0 % | 1.50 |" in lines[3]
    assert lines[5].startswith("| config, in order | 2 | 1.200 |") and "| 0.0 % | 1.20 |" in lines[5]
    result = CliRunner().invoke(app, ["bench", "pipeline", "--consume", "fifo"])
    assert result.exit_code == 2 and "--consume 'fifo': expected one of arrival, in_order" in result.output
