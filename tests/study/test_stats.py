"""The study's statistics on series and runs with known answers: collapse, warning lead times, cells."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from ragen_async.config import RunConfig
from ragen_async.staleness.collapse import SIGNALS, Collapse, find_collapse
from ragen_async.study import stats as study
from ragen_async.study.report import ReportError, write_report


def test_collapse_is_a_fall_below_half_the_peak_for_good():
    steps = np.arange(0, 60, 10)
    collapsed = find_collapse(steps, np.array([0.2, 0.6, 0.8, 0.3, 0.2, 0.1]))
    assert collapsed == Collapse(True, 30, 0.8, 20, fell=30)
    # One low last point is not a fall; a recovery above half the peak is a fall but not a collapse.
    assert find_collapse(steps, np.array([0.2, 0.6, 0.8, 0.7, 0.6, 0.3])) == Collapse(False, None, 0.8, 20)
    recovered = find_collapse(steps, np.array([0.2, 0.8, 0.3, 0.2, 0.5, 0.1]))
    assert recovered == Collapse(False, None, 0.8, 10, fell=20)
    # A run that never learned (peak 0) or never fell cannot collapse.
    assert not find_collapse(steps, np.zeros(6)).collapsed
    assert not find_collapse(steps, np.linspace(0.1, 1.0, 6)).collapsed


def test_a_floor_moves_the_line_to_half_the_gain_over_it():
    """The specimen study's s0-k8: from a warm start at 0.363 down to 0.195-0.230, near the random
    policy's 0.176, and back. Half the peak (0.18) does not see it; half the gain over random does."""
    steps = np.arange(0, 225, 25)
    k8 = np.array([0.363, 0.363, 0.324, 0.195, 0.199, 0.230, 0.406, 0.402, 0.414])
    assert find_collapse(steps, k8).fell is None
    fall = find_collapse(steps, k8, floor=0.176)  # line: 0.176 + 0.5 * (0.363 - 0.176) = 0.2695
    assert fall == Collapse(False, None, 0.414, 200, fell=75)
    # Stayed down: collapsed, at the start of the final stretch below the line from the overall peak.
    down = find_collapse(steps, np.r_[k8[:6], 0.25, 0.2, 0.21], floor=0.176)
    assert down.collapsed and down.step == 75 and down.fell == 75
    # A peak not above the floor cannot fall.
    assert find_collapse(steps, np.full(9, 0.15), floor=0.176) == Collapse(False, None, 0.15, 0)


def test_signals_fire_where_the_definitions_say():
    steps = np.arange(1, 21)
    std = np.r_[np.ones(10), np.full(10, 0.1)]
    # Smoothed over 5 steps: (2 * 1 + 3 * 0.1) / 5 = 0.46 < 0.5 * 1 at the third low step (step 13).
    assert study.signal_steps(steps, std, "reward_std")[0] == 13
    entropy = np.r_[np.ones(10), np.full(10, 0.2)]
    # Against its first-5-step mean 1: (2 + 3 * 0.2) / 5 = 0.52 at step 13, (1 + 4 * 0.2) / 5 = 0.36 at 14.
    assert study.signal_steps(steps, entropy, "entropy")[0] == 14
    grad = np.ones(20)
    grad[8] = 3.5  # step 9: 3.5 > 3 x median(1, 1, 1, 1, 1)
    assert list(study.signal_steps(steps, grad, "grad_norm")) == [9]
    assert study.signal_steps(steps, np.ones(20), "reward_std").size == 0
    with pytest.raises(ValueError, match="unknown signal"):
        study.signal_steps(steps, grad, "loss")


def test_lead_time_counts_steps_from_the_first_warning_to_the_collapse():
    steps = np.arange(1, 31)
    series = {"reward_std": (steps, np.r_[np.ones(10), np.full(20, 0.1)]),
              "entropy": (steps, np.ones(30)),
              "grad_norm": (steps, np.where(steps == 25, 10.0, 1.0))}
    lead = study.lead_times(series, 20)
    assert lead == {"reward_std": 7, "entropy": None, "grad_norm": None,  # the spike came after the fall
                    "stale_kl": None, "stale_ess": None, "kl_rise": None}  # not logged
    # A run without an event (no fall, no degradation) has no lead.
    assert study.lead_times(series, None) == dict.fromkeys(SIGNALS)
    # Only firings within the horizon before the fall count: reward std first fired at 13, 17 steps ahead.
    assert study.lead_times(series, 20, horizon=5)["reward_std"] == 5


def test_false_alarms_are_firings_no_fall_followed():
    steps = np.arange(1, 101)
    grad = np.ones(100)
    grad[[19, 59, 89]] = 10.0  # spikes at steps 20, 60 and 90
    series = {"grad_norm": (steps, grad)}
    # Never fell: all three spikes are false alarms, over 100 steps watched.
    assert study.false_alarms(series, None)["grad_norm"] == pytest.approx(3.0)
    # Fell at 75: the spike at 60 warned of it (within 25 steps); 20 did not; steps from 50 on are not watched.
    fell = 75
    assert study.false_alarms(series, fell)["grad_norm"] == pytest.approx(100 * 1 / 49)
    assert study.lead_times(series, fell)["grad_norm"] == 15
    assert math.isnan(study.false_alarms(series, 10)["grad_norm"])


def test_interval_is_the_t_interval():
    mean, half, n = study.interval([1.0, 2.0, 3.0, math.nan])
    assert (mean, n) == (2.0, 3) and half == pytest.approx(stats.t.ppf(0.975, 2) * 1.0 / math.sqrt(3))
    assert half == pytest.approx(2.484, abs=1e-3)
    assert study.interval([0.5])[:2] == (0.5, pytest.approx(math.nan, nan_ok=True))
    assert study.interval([]) == (pytest.approx(math.nan, nan_ok=True),) * 2 + (0,)


def test_error_bars_stay_within_the_quantity_s_range():
    values = [0.02, 0.05, 0.30]  # a wide interval around a mean near 0
    mean, half, _ = study.interval(values)
    assert mean - half < 0
    m, below, above = study.error_bar(values, 0.0, 1.0)
    assert m == pytest.approx(mean) and below == pytest.approx(mean) and above == pytest.approx(half)
    assert study.error_bar([0.9, 0.99, 1.0], 0.0, 1.0)[2] == pytest.approx(1.0 - np.mean([0.9, 0.99, 1.0]))
    assert study.error_bar([0.4]) == (0.4, 0.0, 0.0)


def test_a_share_of_runs_has_wilson_s_interval():
    # Reference values of the 95 % Wilson score interval (z = 1.96): 1 of 3 -> [0.0615, 0.7923];
    # 0 of n -> [0, z^2 / (n + z^2)]: not the empty "0.00 ± 0.00" a t interval gives.
    assert study.wilson(1, 3) == pytest.approx((0.0615, 0.7923), abs=1e-4)
    assert study.wilson(0, 3) == (0.0, pytest.approx(1.96**2 / (3 + 1.96**2), abs=1e-4))
    assert study.wilson(3, 3)[1] == 1.0 and study.wilson(3, 3)[0] == pytest.approx(1 - 1.96**2 / (3 + 1.96**2), abs=1e-4)
    assert study.bounds([0.0, 1.0, 0.0, math.nan], study.SHARE) == (pytest.approx(1 / 3), *study.wilson(1, 3), 3)
    # A continuous quantity: the t interval clipped to its range; no interval from one value.
    mean, lo, hi, n = study.bounds([0.6, 0.8, 1.0], study.UNIT)
    assert (mean, lo, hi, n) == (pytest.approx(0.8), pytest.approx(0.8 - stats.t.ppf(0.975, 2) * 0.2 / math.sqrt(3)), 1.0, 3)
    assert study.format_bounds(*study.bounds([0.4], study.UNIT)[:3]) == "0.400"
    assert study.format_bounds(0.8, 0.303, 1.0) == "0.800 [0.303, 1.000]"


def test_the_report_pools_seeds_into_cells_with_intervals(tmp_path, make_run):
    root = tmp_path / "sweep"
    finals = {0: 0.6, 1: 0.8, 2: 1.0}
    for seed, final in finals.items():
        make_run(root / f"k1-s{seed}", k=1, seed=seed, val_curve=lambda step, total, f=final: f * step / total)
    # k = 4: learns, then collapses for good at step 15 (validations every 5 steps).
    curve = lambda step, total: {0: 0.1, 5: 0.5, 10: 0.9, 15: 0.2, 20: 0.1}[step]  # noqa: E731
    make_run(root / "k4-s0", k=4, seed=0, val_curve=curve)
    md = write_report([root], tmp_path / "out").markdown.read_text()
    cells = md.split("## Cells (seeds pooled)")[1].split("## ")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in cells.splitlines() if line.startswith("| ") and "---" not in line}
    header = rows.pop("staleness.max_staleness")
    k1, k4 = (dict(zip(header, rows[k], strict=True)) for k in ("1", "4"))
    half = stats.t.ppf(0.975, 2) * 0.2 / math.sqrt(3)  # finals 0.6, 0.8, 1.0: sd 0.2; clipped at 1
    assert k1["runs"] == "3" and k1["final val"] == f"0.800 [{0.8 - half:.3f}, 1.000]"
    assert k1["collapsed (share)"] == "0.00 [0.00, 0.56]"  # 0 of 3: Wilson
    assert k4["runs"] == "1" and k4["final val"] == "0.100" and k4["collapsed (share)"] == "1.00 [0.21, 1.00]"
    # Threshold 0.9: only the seed-2 run of k = 1 reaches it (at its last validation, step 20); k = 4 at step 10.
    reached = "first step ≥ threshold (runs that reached it)"
    assert k1["reached threshold (share)"] == "0.33 [0.06, 0.79]" and k1[reached] == "20.0"  # 1 of 3
    assert k4["reached threshold (share)"] == "1.00 [0.21, 1.00]" and k4[reached] == "10.0"
    summary = (tmp_path / "out" / "summary.csv").read_text().splitlines()
    assert "collapse_step" in summary[0]
    assert any(line.startswith("k4-s0,") and ",15," in line for line in summary[1:])


def test_cells_pool_finished_runs_across_placements_and_count_falls(tmp_path, make_run):
    """Where processes ran (cores, threads) and the weights' digest do not split a cell; a run still going
    is left out of it; a fall towards the floor and back counts as a fall, not a collapse."""
    root = tmp_path / "runs"
    shared = {"rollout": {"cpus_per_worker": 2.0}, "learner": {"torch_threads": 2}}
    split = {"rollout": {"cpus_per_worker": 1.0, "cpu_affinity": [0]},
             "learner": {"torch_threads": 1, "cpu_affinity": [1]}, "model": {"sha256": "ab" * 32}}
    dip = {0: 0.36, 5: 0.2, 10: 0.19, 15: 0.4, 20: 0.42}
    make_run(root / "s0", k=8, seed=0, config=shared, val_curve=lambda step, total: dip[step])
    make_run(root / "s1", k=8, seed=1, config=split, val_curve=lambda step, total: 0.36 + step / 100)
    make_run(root / "s2", k=8, seed=2, config=split, logged_steps=7)  # still going
    make_run(root / "inf", k=None, seed=0, config=split)
    result = write_report([root], tmp_path / "out", collapse_floor=0.17)
    md = result.markdown.read_text()
    cells = md.split("## Cells (seeds pooled)")[1].split("## ")[0]
    assert "1 unfinished left out" in cells
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in cells.splitlines()
            if line.startswith("| ") and "---" not in line]
    assert len(rows) == 3  # header, k = 8 (three runs, two of them finished) and unbounded
    row, unbounded = (dict(zip(rows[0], r, strict=True)) for r in rows[1:])
    assert row["staleness.max_staleness"] == "8" and unbounded["staleness.max_staleness"] == "∞"
    assert row["runs"] == "2" and row["fell (share)"] == "0.50 [0.09, 0.91]" and row["collapsed (share)"] == "0.00 [0.00, 0.66]"
    overview = {line.split("|")[1].strip(): line for line in md.split("## Cells")[0].splitlines() if line.startswith("| s")}
    assert "| 5 (recovered) |" in overview["s0"] and "partial" in overview["s2"]
    # Without the floor the same dip is not a fall: half the peak (0.21) is below it.
    assert "(recovered)" not in write_report([root], tmp_path / "out0").markdown.read_text()


def test_validation_is_placed_at_the_training_time_its_step_ended(tmp_path, make_run):
    from ragen_async.study.report import RunData, val_success_vs_time

    run = RunData.load(make_run(tmp_path / "r", steps=20, k=1))  # steps take 2.1 s each, validation every 5
    minutes, success = val_success_vs_time(run)
    assert minutes == pytest.approx(np.array([0, 5, 10, 15, 20]) * 2.1 / 60)
    assert success == pytest.approx([0.3, 0.55, 0.8, 1.0, 1.0])


def test_the_cells_figure_is_drawn_and_linked(tmp_path, make_run):
    root = tmp_path / "sweep"
    for seed in range(3):
        make_run(root / f"k1-s{seed}", k=1, seed=seed, val_curve=lambda step, total, s=seed: 0.1 * s + step / total / 2)
    make_run(root / "k2-s0", k=2, seed=0)
    result = write_report([root], tmp_path / "out")
    figure = tmp_path / "out" / "cells_val_success.png"
    assert figure in result.plots and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![cells](cells_val_success.png)" in result.markdown.read_text()


def test_the_equal_time_table_reads_each_k_at_the_fastest_cell_s_budget(tmp_path, make_run):
    """k = 0 learns faster per step but runs at half the rate: at the minutes k = 4 needs for its 20 steps,
    k = 0 has done 10 and is behind. Fixed lag and a k without a measured rate stay out of the table."""
    root = tmp_path / "runs"
    four_groups = {"rollout": {"envs": [{"tag": "Bandit", "n_groups": 4}]}}
    for seed in (0, 1):
        make_run(root / f"k0-s{seed}", k=0, seed=seed, config=four_groups, val_curve=lambda st, tot: 0.3 + 0.02 * st)
        make_run(root / f"k4-s{seed}", k=4, seed=seed, config=four_groups, val_curve=lambda st, tot: 0.3 + 0.015 * st)
    make_run(root / "fixed4", k=4, fixed_lag=True, config=four_groups)
    make_run(root / "k8", k=8, config=four_groups)
    md = write_report([root], tmp_path / "out", throughput={0: 1.0, 4: 2.0}).markdown.read_text()
    table = md.split("## At equal time")[1].split("## ")[0]
    assert "at 0.7 min" in table  # k = 4: 20 steps x 4 groups / 2 groups/s = 40 s
    rows = {r[0]: r for r in ([c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()
                              if line.startswith("| ") and "---" not in line)}
    assert set(rows) == {"k", "0", "4"}
    # k, runs, groups/s, minutes for the budget, final val, gain per 100 steps, step reached, val at that time
    assert rows["0"][1:] == ["2", "1.00", "1.3", "0.700 [0.700, 0.700]", "+2.000 [+2.000, +2.000]", "10",
                             "0.500 [0.500, 0.500]"]
    assert rows["4"][1:] == ["2", "2.00", "0.7", "0.600 [0.600, 0.600]", "+1.500 [+1.500, +1.500]", "20",
                             "0.600 [0.600, 0.600]"]
    assert "## At equal time" not in write_report([root], tmp_path / "out2").markdown.read_text()



def test_a_run_degrades_when_it_stays_below_the_synchronous_band_to_its_end(tmp_path, make_run):
    """Degradation is measured against k = 0 at the same step size: the lower end of its runs' 95 % interval
    at each validation. Staying below it to the end (two validations or more) degrades a run; a dip that
    recovers or a last validation alone does not; a run at a step size with no k = 0 runs has no reference."""
    root = tmp_path / "runs"
    for seed, offset in enumerate((0.0, 0.01, 0.02)):  # band: 0.31 + 0.02 step - 0.0248
        make_run(root / f"k0-s{seed}", k=0, seed=seed, val_curve=lambda st, tot, o=offset: 0.3 + o + 0.02 * st)
    sync = lambda st: 0.31 + 0.02 * st  # noqa: E731
    make_run(root / "k4", k=4, val_curve=lambda st, tot: sync(st) if st <= 10 else 0.4)
    make_run(root / "k8", k=8, val_curve=lambda st, tot: 0.1 if st == 10 else sync(st))
    make_run(root / "k2", k=2, val_curve=lambda st, tot: 0.4 if st == 20 else sync(st))
    make_run(root / "lr", k=4, config={"learner": {"actor_lr": 2e-4}}, val_curve=lambda st, tot: 0.3)
    report = write_report([root], tmp_path / "out")
    s = {x.name: x for x in report.summaries}
    assert {n: x.degraded for n, x in s.items()} == {"k0-s0": None, "k0-s1": None, "k0-s2": None, "k4": 15,
                                                     "k8": None, "k2": None, "lr": None}
    # The mean validation success after step 0 (validations at 5, 10, 15, 20: 0.4, 0.5, 0.6, 0.7).
    assert s["k0-s0"].mean_val == pytest.approx(0.55) and s["k4"].mean_val == pytest.approx((0.41 + 0.51 + 0.4 + 0.4) / 4)
    # The early warnings count against the degradation: the fixture's gradient-norm spike at step 10 leads it by 5.
    assert s["k4"].event == 15 and s["k4"].lead["grad_norm"] == 5 and s["k8"].lead["grad_norm"] is None
    overview = {line.split("|")[1].strip(): line for line in report.markdown.read_text().split("## Cells")[0].splitlines()
                if line.startswith("| k") or line.startswith("| lr")}
    assert "| — | 15 |" in overview["k4"]  # fell at —, degraded from 15
    assert ",15," in next(line for line in report.csv.read_text().splitlines() if line.startswith("k4,"))
    assert study.reference_band([(np.array([0, 5]), np.array([0.3, 0.4]))]) == {}  # one run: no interval


def test_the_lag_figure_draws_a_reference_beside_the_runs_and_refuses_a_malformed_one(tmp_path, make_run):
    root = tmp_path / "runs"
    for k in (0, 4):
        for seed in (0, 1):
            make_run(root / f"k{k}-s{seed}", k=k, seed=seed)
    good = tmp_path / "appo.csv"
    good.write_text("# a comment line\nlabel,k,seeds,lag_mean,final_success,final_success_lo,final_success_hi\n"
                    "APPO k = 0,0,3,2.5,0.48,0.43,0.54\nAPPO k = 8,8,1,10.4,0.52,,\n")
    report = write_report([root], tmp_path / "out", references={"APPO": good})
    assert (tmp_path / "out" / "lag_sensitivity.png").stat().st_size > 0
    assert "## Beside the reference" in report.markdown.read_text()
    assert "lag_sensitivity.png" not in {p.name for p in write_report([root], tmp_path / "out0").plots}
    bad = tmp_path / "bad.csv"
    bad.write_text("k,success\n0,0.5\n")
    with pytest.raises(ReportError, match=r"missing \['lag_mean', 'final_success'"):
        write_report([root], tmp_path / "out1", references={"bad": bad})
    with pytest.raises(ReportError, match="cannot read"):
        write_report([root], tmp_path / "out2", references={"gone": tmp_path / "gone.csv"})



def test_each_run_reports_its_realised_staleness_distribution(tmp_path, make_run):
    extra = {step: {"lag/0/tokens": 10.0, "lag/1/tokens": 0.0, "lag/8+/tokens": 30.0 if step > 10 else 0.0}
             for step in range(1, 21)}
    make_run(tmp_path / "r", k=None, extra=extra)
    report = write_report([tmp_path / "r"], tmp_path / "out")
    assert report.summaries[0].lag_shares == {"0": pytest.approx(0.4), "1": 0.0, "8+": pytest.approx(0.6)}
    assert "| trained tokens by age (versions) | 0: 40 %, 8+: 60 % |" in report.markdown.read_text()
    assert "tokens_lag_8+" in report.csv.read_text().splitlines()[0]


def test_differences_from_k0_use_welch_s_interval_and_the_trend_its_slope_interval():
    ci = stats.ttest_ind([1, 2, 3], [2, 4, 6], equal_var=False).confidence_interval()  # scipy's own
    assert study.welch_difference([1, 2, 3, math.nan], [2, 4, 6]) == (-2.0, pytest.approx(ci.low), pytest.approx(ci.high))
    assert study.welch_difference([1.0], [2.0, 3.0])[1:] == (pytest.approx(math.nan, nan_ok=True),) * 2
    assert study.welch_difference([1.0, 1.0], [2.0, 2.0]) == (-1.0, -1.0, -1.0)
    # Slope -0.125 per unit, standard error 0.0296, t(0.975, 2) = 4.303: the interval reaches just above 0.
    slope, low, high, p, n = study.trend([0, 1, 2, 3, math.nan], [1.0, 0.9, 0.85, 0.6, 0.5])
    assert (slope, n) == (pytest.approx(-0.125), 4) and p == pytest.approx(0.0517, abs=1e-4)
    assert low == pytest.approx(-0.125 - 4.3027 * 0.02958, abs=1e-4) and high == pytest.approx(0.0023, abs=1e-4)
    assert math.isnan(study.trend([1, 1, 1], [0.1, 0.2, 0.3])[0])


def test_the_report_compares_each_cell_with_synchronous_training(tmp_path, make_run):
    root = tmp_path / "runs"
    for seed, offset in enumerate((0.0, 0.01, 0.02)):
        make_run(root / f"k0-s{seed}", k=0, seed=seed, val_curve=lambda st, tot, o=offset: 0.3 + o + 0.02 * st)
        make_run(root / f"k4-s{seed}", k=4, seed=seed, val_curve=lambda st, tot, o=offset: 0.25 + o + 0.02 * st)
    md = write_report([root], tmp_path / "out").markdown.read_text()
    section = md.split("## Against synchronous training")[1].split("\n## ")[0]
    row = next(line for line in section.splitlines() if line.startswith("| 4 |"))
    # Every validation 0.05 lower, the seeds 0.01 apart on both sides: mean vals 0.50-0.52 against 0.55-0.57.
    ci = stats.ttest_ind([0.50, 0.51, 0.52], [0.55, 0.56, 0.57], equal_var=False).confidence_interval()
    expected = f"-0.050 [{ci.low:+.3f}, {ci.high:+.3f}]"
    assert row.endswith(f"| {expected} | {expected} | 0.510 | — | — |"), row
    assert "Trend of the mean validation success after step 0 on realised mean staleness (6 runs)" in section


def test_an_adaptive_bound_is_its_own_arm_not_a_seed_of_the_fixed_bound(tmp_path, make_run):
    """Runs with ``staleness.adaptive`` (a bound that moves from k) form their own cell and row, labelled
    adaptive, and stay out of the trend over bounded runs and out of the equal-time table (their k is not
    the bound they ran at)."""
    root = tmp_path / "runs"
    bound = {step: {"staleness/bound": 8.0 if step < 10 else 4.0} for step in range(1, 21)}  # halved at step 10 (older runs logged the bound under this name)
    for seed in range(2):
        make_run(root / f"k0-s{seed}", k=0, seed=seed, extra={step: {"staleness/bound": 0.0} for step in bound})
        make_run(root / f"k8-s{seed}", k=8, seed=seed, extra={step: {"staleness/bound": 8.0} for step in bound})
        make_run(root / f"adaptive-s{seed}", k=8, seed=seed, extra=bound,
                 config={"staleness": {"max_staleness": 8, "fixed_lag": False, "adaptive": True}})
    result = write_report([root], tmp_path / "out", throughput={0: 1.0, 8: 2.0})
    by_name = {s.name: s for s in result.summaries}
    assert (by_name["adaptive-s0"].lag, by_name["k8-s0"].lag) == ("adaptive", "bounded")
    assert by_name["adaptive-s0"].cell_key != by_name["k8-s0"].cell_key
    md = result.markdown.read_text()
    section = md.split("## Against synchronous training")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| 8 |")]
    assert [line.split(" | ")[1] for line in rows] == ["bounded", "adaptive"]
    # The adaptive cell against the fixed bound it starts from (the bounded k = 8 runs); the fixed one has none.
    fixed_k8 = [by_name[f"k8-s{seed}"].mean_val for seed in range(2)]
    adaptive = [by_name[f"adaptive-s{seed}"].mean_val for seed in range(2)]
    expected = study.format_bounds(*study.welch_difference(adaptive, fixed_k8), "+.3f")
    assert expected != "—" and rows[1].endswith(f"| {expected} |") and rows[0].endswith("| — |"), rows
    assert "on realised mean staleness (4 runs)" in section
    equal_time = md.split("## At equal time")[1].split("\n## ")[0]
    assert len([line for line in equal_time.splitlines() if line.startswith("| 8")]) == 1
    assert (tmp_path / "out" / "curves_staleness_bound.png") in result.plots  # the adaptive runs' bound
    others = write_report([root / "k0-s0", root / "k8-s0"], tmp_path / "bounded_only")
    assert not any(p.name == "curves_staleness_bound.png" for p in others.plots)


def test_the_bounded_trend_predicts_a_cell_s_mean_with_a_prediction_interval():
    x, y = [0.0, 0.0, 0.0, 4.0, 4.0, 4.0, 8.0], [0.41, 0.40, 0.42, 0.38, 0.39, 0.40, 0.36]
    mean, low, high = study.predicted_mean(x, y, at=6.0, m=3)
    # The same in matrix form: the fit's covariance s^2 (X'X)^-1 at [1, 6], plus s^2 / 3 for three new runs.
    design = np.column_stack([np.ones(len(x)), x])
    beta, residual, *_ = np.linalg.lstsq(design, np.asarray(y), rcond=None)
    s2 = float(residual[0]) / (len(x) - 2)
    point = np.array([1.0, 6.0])
    half = stats.t.ppf(0.975, len(x) - 2) * math.sqrt(s2 * (1 / 3 + point @ np.linalg.inv(design.T @ design) @ point))
    assert mean == pytest.approx(point @ beta) and (low, high) == pytest.approx((point @ beta - half, point @ beta + half))
    assert all(math.isnan(v) for v in study.predicted_mean([1.0, 1.0, 1.0], [0.1, 0.2, 0.3], 2.0, 3))


def test_cells_outside_the_bounded_runs_are_set_against_the_trend_s_prediction(tmp_path, make_run):
    root = tmp_path / "runs"
    for seed, offset in enumerate((0.0, 0.01, 0.02)):
        make_run(root / f"k0-s{seed}", k=0, seed=seed, val_curve=lambda st, tot, o=offset: 0.3 + o + 0.02 * st)
        make_run(root / f"k4-s{seed}", k=4, seed=seed, val_curve=lambda st, tot, o=offset: 0.25 + o + 0.02 * st)
        make_run(root / f"fixed4-s{seed}", k=4, seed=seed, fixed_lag=True,
                 val_curve=lambda st, tot, o=offset: 0.25 + o + 0.02 * st)
        make_run(root / f"tis4-s{seed}", k=4, seed=seed, off_policy="tis",
                 val_curve=lambda st, tot, o=offset: 0.27 + 2 * o + 0.02 * st)
    md = write_report([root], tmp_path / "out").markdown.read_text()
    section = md.split("## Against synchronous training")[1].split("\n## ")[0]
    bounded = next(line for line in section.splitlines() if line.startswith("| 4 | bounded | none |"))
    fixed = next(line for line in section.splitlines() if line.startswith("| 4 | fixed |"))
    corrected = next(line for line in section.splitlines() if line.startswith("| 4 | bounded | tis |"))
    assert bounded.endswith("| — | — |")  # its own runs made the trend; it is the uncorrected cell
    # Fixed lag at the same mean age (2.0, conftest's staleness/mean = k / 2) as the bounded k = 4 runs.
    summaries = {s.name: s for s in write_report([root], tmp_path / "again").summaries}
    plain = [summaries[f"k{k}-s{seed}"] for k in (0, 4) for seed in range(3)]
    expected = study.predicted_mean([s.staleness_mean for s in plain], [s.mean_val for s in plain], 2.0, 3)
    assert fixed.endswith(f"| {study.format_bounds(*expected, '.3f')} | — |"), fixed
    # The corrected cell against the uncorrected bounded runs at its k (not the fixed-lag ones): mean vals
    # 0.52, 0.54, 0.56 against 0.50, 0.51, 0.52.
    ci = stats.ttest_ind([0.52, 0.54, 0.56], [0.50, 0.51, 0.52], equal_var=False).confidence_interval()
    assert corrected.endswith(f"| +0.030 [{ci.low:+.3f}, {ci.high:+.3f}] |"), corrected


def test_a_config_key_a_run_did_not_record_counts_as_its_default_and_does_not_split_a_cell(tmp_path, make_run):
    """Runs recorded before a field existed lack it; with the field at its default they are seeds of one cell
    with runs that recorded it, and a run that set it otherwise is still a cell of its own."""
    default = RunConfig().staleness.adaptive_signals
    old = make_run(tmp_path / "old", k=4, seed=0)
    new = make_run(tmp_path / "new", k=4, seed=1,
                   config={"staleness": {"max_staleness": 4, "fixed_lag": False, "adaptive_signals": default}})
    other = make_run(tmp_path / "other", k=4, seed=2,
                     config={"staleness": {"max_staleness": 4, "fixed_lag": False, "adaptive_signals": ["stale_ess"]}})
    keys = {s.name: s.cell_key for s in write_report([old, new, other], tmp_path / "out").summaries}
    assert keys["old"] == keys["new"] != keys["other"]


def _cells(shape, ks=(0, 1, 2, 4, 8), noise=(-0.004, 0.0, 0.004)):
    """Three runs per k, realised mean age 0.9 k, success ``shape(k, age)`` plus a fixed spread of seeds."""
    k = [kk for kk in ks for _ in noise]
    age = [0.9 * kk for kk in k]
    y = [shape(kk, a) + e for kk, a, e in zip(k, age, noise * len(ks), strict=True)]
    return k, age, y


def test_the_cost_models_tell_a_step_from_a_line():
    line = {f.model: f for f in study.cost_models(*_cells(lambda k, a: 0.40 - 0.005 * a))}
    step = {f.model: f for f in study.cost_models(*_cells(lambda k, a: 0.40 - 0.02 * (k > 0)))}
    assert line["linear"].aic < line["step"].aic and line["linear"].loco_rmse < line["step"].loco_rmse
    assert step["step"].aic < step["linear"].aic and step["step"].loco_rmse < step["linear"].loco_rmse
    # The linear model is the trend; the step model's constant is the stale runs' mean minus k = 0's.
    k, age, y = _cells(lambda k, a: 0.40 - 0.005 * a)
    assert line["linear"].terms["per version"] == pytest.approx(study.trend(age, y)[:3])
    assert step["step"].terms["k ≥ 1"][0] == pytest.approx(-0.02)
    fit = line["linear"]
    assert fit.aic == pytest.approx(fit.n * math.log(fit.rss / fit.n) + 2 * 3) and fit.loco_cells == 4
    # Leave-one-cell-out, by hand for the step model: a left-out stale cell is predicted by the other stale
    # cells' mean.
    cells = {kk: np.mean([v for kv, v in zip(k, y, strict=True) if kv == kk]) for kk in set(k)}
    errors = [np.mean([cells[o] for o in (1, 2, 4, 8) if o != c]) - cells[c] for c in (1, 2, 4, 8)]
    assert line["step"].loco_rmse == pytest.approx(math.sqrt(np.mean(np.square(errors))))
    # Both terms need three cells; with k = 0 and one stale cell only the two one-term models are fitted.
    assert [f.model for f in study.cost_models(*_cells(lambda k, a: 0.4 - 0.01 * a, ks=(0, 4)))] == ["step", "linear"]
    assert study.cost_models(*_cells(lambda k, a: 0.4, ks=(2, 4))) == []  # no k = 0: no step to measure


def test_the_report_prints_the_headline_s_model_comparison_step_size_factor_and_speed(tmp_path, make_run):
    """Each number an answer quotes is in the report: which model the data prefer and by how much, the step-size
    factor with and without the unbounded cell, and speed inside the runs beside the idle-machine figures."""
    root = tmp_path / "runs"
    def config(lr, k):  # the k >= 1 runs pinned, as the study placed them
        pinned = {"rollout": {"cpu_affinity": [0]}, "learner": {"cpu_affinity": [1]}} if k else {"learner": {}}
        return {**pinned, "learner": {**pinned["learner"], "actor_lr": lr}}

    for lr, steep in ((1e-4, 0.005), (2e-4, 0.010)):
        for seed, offset in enumerate((-0.004, 0.0, 0.004)):
            for k in (0, 2, 4, 8):
                speed = {step: {"throughput/groups_per_s": (2.0 if k == 0 else 2.2) + offset} for step in range(1, 21)}
                make_run(root / f"lr{lr:g}-k{k}-s{seed}", k=k, seed=seed, extra=speed,
                         config=config(lr, k),
                         val_curve=lambda st, tot, k=k, o=offset, s=steep: 0.4 + o - s * 0.5 * k)
    md = write_report([root], tmp_path / "out", throughput={0: 2.0, 2: 2.3, 4: 2.2, 8: 2.4}).markdown.read_text()
    shape = md.split("## The shape of the cost")[1].split("\n## ")[0]
    assert "At actor lr 0.0001 (12 runs): AIC prefers the linear model by" in shape
    assert "| 0.0001 | linear | 12 | per version: -0.0050 [" in shape
    steps = md.split("## Step size")[1].split("\n## ")[0]
    assert "| 0.0002 | all cells | -0.0050 [" in steps and "| 2.0× |" in steps
    speed = md.split("## Speed: inside the runs and on the idle machine")[1].split("\n## ")[0]
    assert "| 0.0001 | 2 | pinned | 3 | 2.20 [" in speed and "| 1.10× | 2.300 | 1.15× |" in speed
    assert ("At actor lr 0.0001, inside the runs: k ≥ 2 (pinned, 9 runs) 2.20 [2.20, 2.20] groups/s against "
            "k = 0's 2.00 [1.99, 2.01] (3 runs): 1.10×") in speed
    assert "on the idle machine (`--throughput`) k ≥ 2: 2.200–2.400 groups/s against 2.000: 1.10–1.20×." in speed
