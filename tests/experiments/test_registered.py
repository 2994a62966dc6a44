"""Registered predictions as data (``study.report.registered``): a spec decided on synthetic runs whose outcome is
known, by its rule (Holm within a family, or the raw p), pending and interim while cells lack runs, bad specs
refused with what is wrong; and the committed spec of studies/newlevels reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ragen_async.study.report import find_runs, summarize, write_report
from ragen_async.study.report.registered import SpecError, decide, load_spec

REPO = Path(__file__).resolve().parents[2]
SEEDS = (6, 7, 8)
AGE = {"k0": 0.0, "k2": 1.8, "k4": 3.5, "kinf": 10.0}
SPEC = {"name": "test", "seeds": list(SEEDS), "alpha": 0.05, "decide_on": "holm", "families": [
    {"name": "Sokoban", "task": "SimpleSokoban", "floor": 0.18, "predictions": [
        {"name": "N1", "claim": "slope", "slope": ["1e-4/k0", "1e-4/k2", "1e-4/kinf"]},
        {"name": "N2", "claim": "small", "welch": ["1e-4/k0", "1e-4/k2"]},
        {"name": "N3", "claim": "large", "welch": ["1e-4/k2", "1e-4/kinf"]},
        {"name": "N5", "claim": "gap", "gap_of_gaps": [["2e-4/k0", "2e-4/kinf"], ["1e-4/k0", "1e-4/kinf"]]}]}]}


def _runs(root, make_run, levels, seeds=SEEDS, spread=0.01):
    for (lr, cell), level in levels.items():
        for seed in seeds:
            k = {"k0": 0, "k2": 2, "k4": 4}.get(cell)
            noise = spread * (seed - 7)
            make_run(root / f"lr{lr:g}-{cell}-s{seed}", k=k, seed=seed, envs=("SimpleSokoban",),
                     extra={step: {"staleness/mean": AGE[cell]} for step in range(1, 21)},
                     val_curve=lambda step, total, v=level + noise: 0.36 if step == 0 else v,
                     config={"staleness": {"max_staleness": k}, "learner": {"actor_lr": lr}})
    runs, _ = find_runs([root])
    return runs, [summarize(r) for r in runs]


def _spec(tmp_path, data=SPEC, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_spec(path)


LEVELS = {(1e-4, "k0"): 0.45, (1e-4, "k2"): 0.449, (1e-4, "kinf"): 0.33, (2e-4, "k0"): 0.45, (2e-4, "kinf"): 0.22}


def test_each_prediction_is_decided_by_the_spec_s_rule_holm_within_the_family(tmp_path, make_run):
    _, summaries = _runs(tmp_path / "runs", make_run, LEVELS)
    got = {o.name: o for o in decide(_spec(tmp_path), summaries)}
    assert got["N2"].statistic.startswith("1e-4/k0 - 1e-4/k2: +0.001")
    assert got["N3"].statistic.startswith("1e-4/k2 - 1e-4/kinf: +0.119")
    assert got["N5"].statistic.startswith("(2e-4/k0 - 2e-4/kinf) - (1e-4/k0 - 1e-4/kinf): +0.110")
    assert "per version" in got["N1"].statistic and got["N1"].p < 0.05
    assert [got[n].verdict for n in ("N1", "N2", "N3", "N5")] == ["held", "failed", "held", "held"]
    # Holm: the smallest p times 4, the next times 3, ...; the adjusted p is never below the raw one
    assert all(o.p_holm >= o.p for o in got.values())
    # A p between alpha / m and alpha holds on the raw rule and fails on Holm's.
    borderline = {(1e-4, "k0"): 0.45, (1e-4, "k2"): 0.435, (1e-4, "kinf"): 0.43, (2e-4, "k0"): 0.45,
                  (2e-4, "kinf"): 0.44}
    _, summaries = _runs(tmp_path / "border", make_run, borderline, spread=0.006)
    holm = {o.name: o for o in decide(_spec(tmp_path), summaries)}
    raw = {o.name: o for o in decide(_spec(tmp_path, {**SPEC, "decide_on": "raw"}, "raw.yaml"), summaries)}
    flipped = [n for n in holm if holm[n].p < 0.05 <= holm[n].p_holm]
    assert flipped and all(raw[n].verdict == "held" and holm[n].verdict == "failed" for n in flipped)


def test_a_cell_without_two_runs_is_pending_and_one_without_three_interim(tmp_path, make_run):
    levels = {key: v for key, v in LEVELS.items() if key[0] == 1e-4}
    _, summaries = _runs(tmp_path / "runs", make_run, levels)
    got = {o.name: o.verdict for o in decide(_spec(tmp_path), summaries)}
    assert got["N5"] == "pending" and got["N3"] == "held (interim)"  # Holm over 3 of 4 for now
    _, two = _runs(tmp_path / "two", make_run, LEVELS, seeds=(6, 7))
    assert all(o.verdict.endswith("(interim)") for o in decide(_spec(tmp_path), two))
    _, other_seeds = _runs(tmp_path / "other", make_run, LEVELS, seeds=(3, 4, 5))
    assert all(o.verdict == "pending" for o in decide(_spec(tmp_path), other_seeds))


@pytest.mark.parametrize("change, message", [
    ({"decide_on": "bonferroni"}, "decide_on is holm or raw"),
    ({"families": [{"task": "SimpleSokoban", "predictions": [{"name": "N1", "welch": ["1e-4/k0"]}]}]},
     "welch takes [greater, than]"),
    ({"families": [{"task": "SimpleSokoban", "predictions": [{"name": "N1", "welch": ["1e-4/k0", "fast/k2"]}]}]},
     "'fast' is not a learning rate"),
    ({"families": [{"task": "SimpleSokoban", "predictions": [{"name": "N1", "welch": ["1e-4/k0", "1e-4/two"]}]}]},
     "the bound is k0, k<n> or kinf"),
    ({"families": [{"task": "SimpleSokoban", "predictions": [
        {"name": "N1", "slope": ["1e-4/k0", "1e-4/k2"]}, {"name": "N1", "slope": ["1e-4/k0", "1e-4/k2"]}]}]},
     "unique name"),
])
def test_a_bad_spec_is_refused_with_what_is_wrong(tmp_path, change, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _spec(tmp_path, {**SPEC, **change})


def test_the_new_level_spec_reads_and_the_report_prints_its_section(tmp_path, make_run):
    spec = load_spec(REPO / "studies" / "newlevels" / "predictions.yaml")
    assert spec.seeds == SEEDS and spec.decide_on == "holm"
    assert [p.name for f in spec.families for p in f.predictions] == [f"N{i}" for i in range(1, 9)]
    _runs(tmp_path / "runs", make_run, LEVELS)
    report = write_report([tmp_path / "runs"], tmp_path / "out", registered=REPO / "studies/newlevels/predictions.yaml")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Registered predictions: New levels" in text and "| N3 |" in text and "pending" in text
    assert report.summaries
