"""The confirmation's verdicts: each hypothesis of studies/confirm/PREDICTIONS.md, as its data file
(studies/confirm/predictions.yaml) gives it to the registered evaluator, decided on synthetic runs whose outcome is
known, and pending while a cell lacks runs; and the study script's analyses beside them
(studies/confirm/analysis.py: falls beside H4, the controller beside its cells, the cost's shape, the figure)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ragen_async.study.report import cohorts, find_runs, summarize
from ragen_async.study.report.registered import decide, load_spec
from ragen_async.study.stats import holm

CONFIRM = Path(__file__).resolve().parents[2] / "studies" / "confirm"
SPEC = load_spec(CONFIRM / "predictions.yaml")
_module = importlib.util.spec_from_file_location("confirm_analysis", CONFIRM / "analysis.py")
analysis = importlib.util.module_from_spec(_module)
_module.loader.exec_module(analysis)


def verdicts(runs, summaries):
    return decide(SPEC, summaries, runs)


def confirm_section(runs, summaries):
    return analysis.section(runs, summaries)

SEEDS = (3, 4, 5)
LEVEL = {(1e-4, "k0"): 0.45, (1e-4, "k2"): 0.42, (1e-4, "kinf"): 0.33,
         (2e-4, "k0"): 0.45, (2e-4, "kinf"): 0.22, (2e-4, "controller"): 0.40}
AGE = {"k0": 0.0, "k2": 1.8, "k4": 3.5, "kinf": 10.0, "controller": 6.0}


def _runs(root, make_run, cells=LEVEL, ess_fires_at=(7,), task="SimpleSokoban", falls=()):
    """Runs of ``cells`` on ``task``, seeds 3-5; the runs named in ``falls`` (cell, seed) drop to 0.1 from step 10."""
    for (lr, cell), level in cells.items():
        for seed in SEEDS:
            k = {"k0": 0, "k2": 2, "k4": 4}.get(cell)
            staleness = {"max_staleness": k}
            if cell == "controller":
                staleness.update(adaptive=True, adaptive_engage_staleness=4)
            noise = 0.01 * (seed - 4)
            extra = {step: {"staleness/mean": AGE[cell], "throughput/groups_per_s": 2.0 + (k != 0) * 0.1 + noise / 10,
                            "warning/stale_ess": float(cell == "kinf" and lr == 1e-4 and step in ess_fires_at)}
                     for step in range(1, 21)}
            drop = (cell, seed) in falls
            make_run(root / f"{task}-lr{lr:g}-{cell}-s{seed}", k=k, seed=seed, extra=extra, envs=(task,),
                     val_curve=lambda step, total, v=level + noise, d=drop: 0.36 if step == 0 else 0.1 if d and step >= 10 else v,
                     config={"staleness": staleness, "learner": {"actor_lr": lr}})
    runs, _ = find_runs([root])
    return runs, [summarize(r, collapse_floor=0.176) for r in runs]


def test_each_prediction_is_decided_by_its_rule(tmp_path, make_run):
    runs, summaries = _runs(tmp_path, make_run)
    got = {v.name: v for v in verdicts(runs, summaries)}
    assert [got[h].verdict for h in ("H1", "H2", "H3", "H4", "H5", "H6", "H7", "H8")] == [
        "held", "held", "held", "held", "held", "held", "failed", "held"]
    assert got["H1"].p < 0.05 and "per version" in got["H1"].statistic
    assert got["H2"].statistic.startswith("1e-4/k2 - 1e-4/kinf: +0.090")  # 0.42 - 0.33
    assert got["H5"].statistic.startswith("(2e-4/k0 - 2e-4/kinf) - (1e-4/k0 - 1e-4/kinf): +0.110")
    assert got["H6a"].statistic == "2e-4/adaptive: 0 of 3 fell"
    assert got["H6c"].statistic == "M 2e-4/adaptive 0.400 against 0.3753"
    assert got["H7"].statistic.startswith("5.00 per 100 steps (3 in 60 steps")  # one firing per 20-step run
    text = "\n".join(confirm_section(runs, summaries))
    assert "| H7 |" in text and "failed" in text


def test_a_cell_without_two_runs_leaves_its_predictions_pending_and_one_without_three_interim(tmp_path, make_run):
    cells = {key: level for key, level in LEVEL.items() if key[1] != "controller"}
    runs, summaries = _runs(tmp_path, make_run, cells, ess_fires_at=())
    got = {v.name: v.verdict for v in verdicts(runs, summaries)}
    assert got["H6"] == "pending" and got["H7"] == "held" and got["H1"] == "held"
    # Two of a cell's three seeds decide its predictions only for now: marked interim until the third has run.
    runs, summaries = _runs(tmp_path / "two", make_run, cells, ess_fires_at=())
    two = [s for s in summaries if not s.name.endswith("lr0.0001-k2-s5")]
    got = {v.name: v.verdict for v in verdicts(runs, two)}
    assert got["H2"] == got["H3"] == got["H1"] == "held (interim)" and got["H4"] == "held"
    # The study's seeds (0-2) never count: controller runs of seed 0 leave H6 pending.
    for seed in (0, 1):
        make_run(tmp_path / f"study-controller-s{seed}", k=None, seed=seed,
                 config={"staleness": {"max_staleness": None, "adaptive": True, "adaptive_engage_staleness": 4},
                         "learner": {"actor_lr": 2e-4}})
    runs, _ = find_runs([tmp_path])
    assert {v.name: v.verdict for v in verdicts(runs, [summarize(r, collapse_floor=0.176) for r in runs])}["H6"] == "pending"


def test_the_controller_fails_its_goal_when_a_run_falls(tmp_path, make_run):
    runs, summaries = _runs(tmp_path, make_run, falls=[("controller", 3)])
    got = {v.name: v for v in verdicts(runs, summaries)}
    assert got["H6"].verdict == "failed" and got["H6a"].statistic == "2e-4/adaptive: 1 of 3 fell"
    assert any("controller-s3 (SimpleSokoban, controller): fell at step 10" in line for line in confirm_section(runs, summaries))
    # A part that failed decides the goal before the unbounded cell has run; one that held waits for it.
    alone = [s for s in summaries if "kinf" not in s.name or "lr0.0001" in s.name]
    got = {v.name: v for v in verdicts(runs, alone)}
    assert got["H6"].verdict == "failed" and got["H6b"].verdict == "pending"
    runs, summaries = _runs(tmp_path / "again", make_run)
    alone = [s for s in summaries if "kinf" not in s.name or "lr0.0001" in s.name]
    assert {v.name: v for v in verdicts(runs, alone)}["H6"].verdict == "pending"


def test_falls_use_the_predictions_floor_not_the_reports(tmp_path, make_run):
    # A drop from 0.40 to 0.25 is below half-way from 0.176 to 0.40 (0.288, Sokoban's floor) but above half of 0.40 (floor 0).
    runs, _ = _runs(tmp_path, make_run, {(2e-4, "controller"): 0.40})
    for run in runs:
        run.val = [{**v, "val/success": 0.25} if v["learner/step"] >= 10 else v for v in run.val]
    summaries = [summarize(r, collapse_floor=0.0) for r in runs]  # the report's floor: no fall
    assert all(s.collapse.fell is None for s in summaries)
    assert {v.name: v for v in verdicts(runs, summaries)}["H6a"].statistic == "2e-4/adaptive: 3 of 3 fell"


FL = {(1e-4, "k0"): 0.33, (1e-4, "k4"): 0.30, (1e-4, "kinf"): 0.25, (1e-4, "controller"): 0.31}


@pytest.mark.parametrize("task, x", [("FrozenLake", "F"), ("SmallCountdown", "C")])
def test_a_second_task_is_decided_apart_and_its_gate_comes_first(tmp_path, make_run, task, x):
    # Sokoban runs only: the second tasks' predictions pending. Their runs never enter H1-H8 nor each other's.
    runs, summaries = _runs(tmp_path / "sokoban", make_run)
    got = {v.name: v for v in verdicts(runs, summaries)}
    assert [got[f"{x}{i}"].verdict for i in range(5)] == ["pending"] * 5 and got[f"{x}3a"].verdict == "pending"
    runs, summaries = _runs(tmp_path / "second", make_run, FL, task=task, ess_fires_at=())
    got = {v.name: v for v in verdicts(runs, summaries)}
    assert all(got[h].verdict == "pending" for h in ("H1", "H2", "H6", "H8"))
    other = "C" if x == "F" else "F"
    assert [got[f"{other}{i}"].verdict for i in range(5)] == ["pending"] * 5
    # Gain: the last two validations (0.33 +- noise) over step 0 (0.36): below the gate, which fails.
    assert got[f"{x}0"].verdict == "failed" and got[f"{x}0"].statistic.startswith("mean gain -0.030")
    assert [got[f"{x}{i}"].verdict for i in range(1, 5)] == ["not run"] * 4
    # Above the gate, the rest are decided on the task's cells.
    lifted = {key: level + 0.2 for key, level in FL.items()}
    runs, summaries = _runs(tmp_path / "second2", make_run, lifted, task=task, ess_fires_at=())
    got = {v.name: v for v in verdicts(runs, summaries)}
    assert got[f"{x}0"].verdict == "held" and got[f"{x}0"].statistic.startswith("mean gain +0.170")
    assert [got[f"{x}{i}"].verdict for i in range(1, 5)] == ["held", "held", "held", "held"]
    assert got[f"{x}3c"].statistic == "M 1e-4/adaptive 0.510 against 1e-4/k4 0.500"


def test_the_figure_sets_the_confirmation_beside_the_studys_cells_and_the_new_levels(tmp_path, make_run, monkeypatch):
    confirm = analysis
    cells = {key: level for key, level in LEVEL.items() if key[0] == 2e-4}
    _runs(tmp_path / "confirm", make_run, cells)
    for seed in (0, 1, 2):  # the study's k = 4 cell at lr 2e-4: no confirmation run of it
        make_run(tmp_path / "study" / f"k4-s{seed}", k=4, seed=seed, val_curve=lambda step, total: 0.38,
                 envs=("SimpleSokoban",),
                 config={"staleness": {"max_staleness": 4}, "learner": {"actor_lr": 2e-4}})
    make_run(tmp_path / "newlevels" / "k4-s6", k=4, seed=6, val_curve=lambda step, total: 0.33,
             envs=("SimpleSokoban",), config={"staleness": {"max_staleness": 4}, "learner": {"actor_lr": 2e-4}})
    runs, _ = find_runs([tmp_path])
    summaries = [summarize(r, collapse_floor=0.176) for r in runs]
    saved = {}
    monkeypatch.setattr(cohorts, "save_figure", lambda fig, path: saved.setdefault(path.name, fig) and path)
    assert confirm.plot_confirmation(runs, summaries, tmp_path) == tmp_path / "confirmation.png"
    (ax,) = saved["confirmation.png"].axes  # one panel: only Sokoban at lr 2e-4 has confirmation runs
    assert ax.get_title() == "SimpleSokoban, actor lr 2e-4"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "4", "∞", "controller"]
    points = {(round(float(x), 2), round(float(y), 3)) for coll in ax.collections for x, y in coll.get_offsets()}
    assert (1 - 0.15, 0.38) in points  # the study's k = 4 runs, left of the tick
    assert (3.0, 0.40) in points  # the confirmation's controller, seed 4, on it
    assert (1 + 0.15, 0.33) in points  # the new levels' k = 4 run, right of it
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "study, seeds 0-2", "confirmation, seeds 3-5", "new levels, seeds 6-8", "the run fell"]
    assert confirm.plot_confirmation(runs, [s for s in summaries if s.seed in (0, 1, 2)], tmp_path) is None


def test_the_controller_is_set_beside_the_unbounded_and_synchronous_cells(tmp_path, make_run):
    runs, summaries = _runs(tmp_path, make_run)
    text = "\n".join(confirm_section(runs, summaries))
    assert "M(controller) 0.400 - M(unbounded) 0.220 = +0.180 [" in text
    assert "M(controller) 0.400 - M(synchronous (k = 0)) 0.450 = -0.050 [" in text


def test_holm_adjusts_by_the_step_down_rule():
    # By hand: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 -> 0.02, 0.03, 0.06, 0.04, then kept non-decreasing
    # (0.04 -> 0.06) and capped at 1; NaN (a prediction without a p) neither adjusted nor counted in m.
    got = holm([0.01, 0.04, float("nan"), 0.03, 0.005])
    assert got[2] != got[2]
    assert [round(p, 10) for i, p in enumerate(got) if i != 2] == [0.03, 0.06, 0.06, 0.02]
    assert holm([0.6, 0.9]) == [1.0, 1.0]
    assert holm([]) == []


def test_holm_p_is_shown_beside_within_each_tasks_family_and_leaves_the_verdicts(tmp_path, make_run):
    runs, summaries = _runs(tmp_path / "sokoban", make_run)
    lifted = {key: level + 0.2 for key, level in FL.items()}
    more, more_summaries = _runs(tmp_path / "countdown", make_run, lifted, task="SmallCountdown", ess_fires_at=())
    got = verdicts(runs + more, summaries + more_summaries)
    by = {v.name: v for v in got}
    # The family of a task: its predictions with a p (H1-H5; C1, C2), adjusted together, never across tasks.
    family = ["H1", "H2", "H3", "H4", "H5"]
    assert [by[h].p_holm for h in family] == holm([by[h].p for h in family])
    assert [by[h].p_holm for h in ("C1", "C2")] == holm([by["C1"].p, by["C2"].p])
    assert all(by[h].p_holm != by[h].p_holm for h in ("H6", "H7", "H8", "C0", "C3", "C4", "F1"))
    assert [by[h].verdict for h in ("C1", "C2")] == ["held", "held"]
    assert by["H2"].p_holm >= by["H2"].p
    # The verdicts stay the registered rule's (unadjusted p < 0.05).
    assert [by[h].verdict for h in family] == ["held"] * 5
    text = "\n".join(confirm_section(runs + more, summaries + more_summaries))
    assert "| p | Holm p | verdict |" in text
    h2 = next(line for line in text.splitlines() if line.startswith("| H2 |"))
    assert f"| {by['H2'].p:.3f} | {by['H2'].p_holm:.3f} | held |" in h2
    assert "Holm's adjustment" in text and "shown beside" in text


def test_the_cost_is_shaped_by_segments_and_by_aic_beside_the_verdicts(tmp_path, make_run):
    cost_shape = analysis.cost_shape
    runs, summaries = _runs(tmp_path, make_run)
    lines = "\n".join(cost_shape(summaries))
    # Per version of age between the cells' means: (0.42 - 0.45) / 1.8 and (0.33 - 0.42) / (10 - 1.8).
    assert "SimpleSokoban at actor lr 1e-4 (9 runs): per version of mean age -0.0167 from k = 0 to k = 2" in lines
    assert "-0.0110 from k = 2 to unbounded" in lines
    assert "AIC" in lines and "log(1 + age)" in lines and "step's lack of fit" in lines
    # Two cells at lr 2e-4 (k = 0, unbounded): no shape to tell apart, no line for it.
    assert "actor lr 2e-4" not in lines
    assert "The shape of the cost" in "\n".join(confirm_section(runs, summaries))


def test_the_single_digit_variant_is_named_smallcountdown():
    (family,) = [f for f in SPEC.families if f.predictions[0].name == "C0"]
    assert family.name == family.task == "SmallCountdown" and analysis.SECOND_TASKS["SmallCountdown"][1] == "SmallCountdown"


def test_the_falls_beside_h4_are_counted_and_tested(tmp_path, make_run):
    # The unbounded cell at lr 2e-4 above the fall line (0.176 + (0.36 - 0.176) / 2 = 0.268) but for two runs.
    runs, summaries = _runs(tmp_path, make_run, {**LEVEL, (2e-4, "kinf"): 0.30}, falls=[("kinf", 3), ("kinf", 4)])
    text = "\n".join(confirm_section(runs, summaries))
    # 2 of 3 against 0 of 3: of the C(6, 3) = 20 ways to place 3 runs among 6 with 2 falls, C(2, 2) C(4, 1) = 4 put
    # both falls in the unbounded cell (none puts more): one-sided p = 4 / 20 = 0.200.
    assert ("Beside H4 (reported, not decided): falls at lr 2e-4, unbounded 2 of 3, synchronous (k = 0) 0 of 3; "
            "Fisher's exact test, one-sided (more falls unbounded): p = 0.200.") in text


def test_the_second_tasks_controller_is_set_beside_its_unbounded_and_k4_cells(tmp_path, make_run):
    lifted = {key: level + 0.2 for key, level in FL.items()}
    runs, summaries = _runs(tmp_path, make_run, lifted, task="SmallCountdown", ess_fires_at=())
    text = "\n".join(confirm_section(runs, summaries))
    assert "Beside C3 (reported, not decided): M(controller) 0.510 - M(unbounded) 0.450 = +0.060 [" in text
    assert "M(controller) 0.510 - M(k = 4) 0.500 = +0.010 [" in text
    assert "Beside F3" not in text
