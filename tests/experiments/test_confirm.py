"""The confirmation's verdicts (``study.report.confirm``): each hypothesis of studies/confirm/PREDICTIONS.md decided
on synthetic runs whose outcome is known, and pending while a cell lacks runs."""

from __future__ import annotations

from ragen_async.study.report import find_runs, summarize
from ragen_async.study.report.confirm import confirm_section, verdicts

SEEDS = (3, 4, 5)
LEVEL = {(1e-4, "k0"): 0.45, (1e-4, "k2"): 0.42, (1e-4, "kinf"): 0.33,
         (2e-4, "k0"): 0.45, (2e-4, "kinf"): 0.22, (2e-4, "controller"): 0.40}
AGE = {"k0": 0.0, "k2": 1.8, "kinf": 10.0, "controller": 6.0}


def _runs(root, make_run, cells=LEVEL, ess_fires_at=(7,)):
    for (lr, cell), level in cells.items():
        for seed in SEEDS:
            k = {"k0": 0, "k2": 2}.get(cell)
            staleness = {"max_staleness": k}
            if cell == "controller":
                staleness.update(adaptive=True, adaptive_engage_k=4)
            noise = 0.01 * (seed - 4)
            extra = {step: {"staleness/mean": AGE[cell], "throughput/groups_per_s": 2.0 + (k != 0) * 0.1 + noise / 10,
                            "warning/stale_ess": float(cell == "kinf" and lr == 1e-4 and step in ess_fires_at)}
                     for step in range(1, 21)}
            make_run(root / f"lr{lr:g}-{cell}-s{seed}", k=k, seed=seed, extra=extra,
                     val_curve=lambda step, total, v=level + noise: 0.36 if step == 0 else v,
                     config={"staleness": staleness, "learner": {"actor_lr": lr}})
    runs, _ = find_runs([root])
    return runs, [summarize(r, collapse_floor=0.176) for r in runs]


def test_each_prediction_is_decided_by_its_rule(tmp_path, make_run):
    runs, summaries = _runs(tmp_path, make_run)
    got = {v.name: v for v in verdicts(runs, summaries)}
    assert [got[h].verdict for h in ("H1", "H2", "H3", "H4", "H5", "H6", "H7", "H8")] == [
        "held", "held", "held", "held", "held", "held", "failed", "held"]
    assert got["H1"].p < 0.05 and "per version" in got["H1"].statistic
    assert got["H2"].statistic.startswith("+0.090")  # 0.42 - 0.33
    assert got["H5"].statistic.startswith("+0.110")  # (0.45 - 0.22) - (0.45 - 0.33)
    assert "(a) 0 of 3 fell" in got["H6"].statistic and "(c) mean M 0.400" in got["H6"].statistic
    assert got["H7"].statistic.startswith("5.00 per 100 steps (3 in 60 steps")  # one firing per 20-step run
    text = "\n".join(confirm_section(runs, summaries))
    assert "| H7 |" in text and "failed" in text


def test_a_cell_without_two_runs_leaves_its_predictions_pending(tmp_path, make_run):
    cells = {key: level for key, level in LEVEL.items() if key[1] != "controller"}
    runs, summaries = _runs(tmp_path, make_run, cells, ess_fires_at=())
    got = {v.name: v.verdict for v in verdicts(runs, summaries)}
    assert got["H6"] == "pending" and got["H7"] == "held" and got["H1"] == "held"
    # The study's seeds (0-2) never count: controller runs of seed 0 leave H6 pending.
    for seed in (0, 1):
        make_run(tmp_path / f"study-controller-s{seed}", k=None, seed=seed,
                 config={"staleness": {"max_staleness": None, "adaptive": True, "adaptive_engage_k": 4},
                         "learner": {"actor_lr": 2e-4}})
    runs, _ = find_runs([tmp_path])
    assert {v.name: v.verdict for v in verdicts(runs, [summarize(r, collapse_floor=0.176) for r in runs])}["H6"] == "pending"


def test_the_controller_fails_its_goal_when_a_run_falls(tmp_path, make_run):
    runs, summaries = _runs(tmp_path, make_run)
    fell = [s for s in summaries if "controller-s3" in s.name]
    assert fell
    from ragen_async.collapse import Collapse

    fell[0].collapse = Collapse(True, 10, 0.40, 5, fell=10)
    h6 = {v.name: v for v in verdicts(runs, summaries)}["H6"]
    assert h6.verdict == "failed" and "(a) 1 of 3 fell" in h6.statistic
    # A part that failed decides the goal before the unbounded cell has run; one that held waits for it.
    alone = [s for s in summaries if "kinf" not in s.name or "lr0.0001" in s.name]
    h6 = {v.name: v for v in verdicts(runs, alone)}["H6"]
    assert h6.verdict == "failed" and "(b) mean age 6.00 against half the unbounded's (pending" in h6.statistic
    fell[0].collapse = Collapse(False, None, 0.40, 5)
    assert {v.name: v for v in verdicts(runs, alone)}["H6"].verdict == "pending"


def test_the_figure_sets_the_confirmation_beside_the_studys_cells(tmp_path, make_run, monkeypatch):
    from ragen_async.study.report import confirm

    cells = {key: level for key, level in LEVEL.items() if key[0] == 2e-4}
    _runs(tmp_path / "confirm", make_run, cells)
    for seed in (0, 1, 2):  # the study's k = 4 cell at lr 2e-4: no confirmation run of it
        make_run(tmp_path / "study" / f"k4-s{seed}", k=4, seed=seed, val_curve=lambda step, total: 0.38,
                 config={"staleness": {"max_staleness": 4}, "learner": {"actor_lr": 2e-4}})
    runs, _ = find_runs([tmp_path])
    summaries = [summarize(r, collapse_floor=0.176) for r in runs]
    saved = {}
    monkeypatch.setattr(confirm, "save_figure", lambda fig, path: saved.setdefault(path.name, fig) and path)
    assert confirm.plot_confirmation(summaries, tmp_path) == tmp_path / "confirmation.png"
    (ax,) = saved["confirmation.png"].axes  # one panel: only lr 2e-4 has confirmation runs
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "4", "∞", "controller"]
    points = {(round(float(x), 2), round(float(y), 3)) for coll in ax.collections for x, y in coll.get_offsets()}
    assert (1 - 0.15, 0.38) in points  # the study's k = 4 runs, left of the tick
    assert (3 + 0.15, 0.40) in points  # the controller's seed 4, right of it
    assert confirm.plot_confirmation([s for s in summaries if s.seed in (0, 1, 2)], tmp_path) is None
