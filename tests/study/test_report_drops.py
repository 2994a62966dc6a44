"""The report's drops: the share of generated groups each cell dropped, the generation that cost beside the
speed, and the dropped groups against the consumed ones: by level (where other runs consumed the same level,
which works on provenance written before drop records carried episode statistics) and by their own episode
statistics. Synthetic run directories: config.yaml, metrics.jsonl and provenance.jsonl written by hand."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from ragen_async.config import EnvGroupSpec
from ragen_async.rollout.worker import assign_group
from ragen_async.study.report import RunData, write_report
from ragen_async.study.report.drops import level_of

B, STEPS, SEED = 4, 20, 10_000
ROLLOUT = {"rollout": {"seed": SEED, "envs": [{"tag": "Bandit", "n_groups": B}]}}


def hard(index: int) -> bool:
    return index % 5 == 0


def level_score(index: int) -> float:
    """A level's score wherever it is played: the hard levels (every fifth) fail."""
    return 0.0 if hard(index) else 10.0 + index % 3


def write_provenance(path, *, drop_hard: bool, new_format: bool = False,
                     staleness: int = 3) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """provenance.jsonl of a run that consumes B groups a step, in index order; with ``drop_hard`` every hard
    level is dropped (as a slow group would be) at the step being collected. Old format: drops hold index,
    reason, where, staleness; consumed groups index, seed, scores. New format: both with the episode statistics
    (dropped: 5 turns, 100 tokens, failed, 20 s in play; consumed: 2 turns, 40 tokens, solved, 5 s).
    Returns step -> the indices consumed at it, and step -> those dropped."""
    records, consumed, drops, index = [], {}, {}, 0
    for step in range(1, STEPS + 1):
        groups, dropped = [], []
        while len(groups) < B:
            score = level_score(index)
            if drop_hard and hard(index):
                d = {"index": index, "reason": "stale", "where": "add", "staleness": staleness}
                if new_format:
                    d.update(bound=staleness - 1, past_bound=1, waited_s=3.0, seed=SEED + index, turns=5.0, tokens=100,
                             success=0.0, in_flight_s=20.0, scores=[score, score])
                dropped.append(d)
            else:
                g = {"index": index, "group_id": f"g{index:08d}", "seed": SEED + index, "scores": [score, score]}
                if new_format:
                    g.update(turns=2.0, tokens=40, success=1.0, in_flight_s=5.0)
                groups.append(g)
            index += 1
        consumed[step], drops[step] = [g["index"] for g in groups], [d["index"] for d in dropped]
        records.append({"step": step, "learner_version": step - 1, "groups": groups, "dropped": dropped})
    (path / "provenance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return consumed, drops


def drops_table(markdown: str) -> list[dict[str, str]]:
    section = markdown.split("## Drops (seeds pooled)")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| ")]
    return [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]


@pytest.fixture
def study(tmp_path, make_run):
    """k = 0 (3 seeds, consume every level), k = 2 (3 seeds, committed-format drops of the hard levels),
    k = 4 (two seeds with drop records that carry episode statistics, one without), and k = 1 without
    provenance (the counts in metrics.jsonl only)."""
    root = tmp_path / "runs"
    for seed in range(3):
        write_provenance(make_run(root / f"k0-s{seed}", steps=STEPS, k=0, seed=seed, config=ROLLOUT), drop_hard=False)
        k2 = write_provenance(make_run(root / f"k2-s{seed}", steps=STEPS, k=2, seed=seed, config=ROLLOUT),
                              drop_hard=True)
        write_provenance(make_run(root / f"k4-s{seed}", steps=STEPS, k=4, seed=seed, config=ROLLOUT),
                         drop_hard=True, new_format=seed < 2, staleness=5)
    every_other = {s: {"rollout/groups": float(B), "staleness/dropped_groups": float(s % 2 == 0)}
                   for s in range(1, STEPS + 1)}
    make_run(root / "k1-s0", steps=STEPS, k=1, config=ROLLOUT, extra=every_other)
    return root, k2  # every k = 2 run consumed and dropped the same indices


def test_each_cell_shows_its_drops_their_cost_and_the_levels_it_dropped(study, tmp_path):
    root, (consumed, drops) = study
    result = write_report([root], tmp_path / "out")
    rows = {r["staleness.max_staleness"]: r for r in drops_table(result.markdown.read_text())}

    dropped = sum(len(d) for d in drops.values())
    generated = STEPS * B + dropped
    k2 = rows["2"]
    assert (k2["runs"], k2["groups dropped"]) == ("3", str(3 * dropped))
    assert k2["dropped (share of generated groups)"] == f"{dropped / generated:.3f} [{dropped / generated:.3f}, " \
                                                       f"{dropped / generated:.3f}]"
    assert k2["versions past the bound"].startswith("1.00")  # staleness 3 against k = 2
    seconds = STEPS * (2.0 + 2 * 0.1)  # the synthetic step time at k = 2
    assert k2["generated groups/s"].startswith(f"{generated / seconds:.2f}")
    assert k2["consumed groups/s"].startswith(f"{STEPS * B / seconds:.2f}")
    # The level comparison: each hard level failed where k = 0 consumed it (score 0), the levels consumed at the
    # same step scored 10-12 there; levels beyond k = 0's last index have no score elsewhere.
    seen = STEPS * B  # the k = 0 runs consumed levels 0 .. seen - 1
    gaps = [0.0 - np.mean([level_score(i) for i in consumed[step] if i < seen]) for step in consumed
            if any(i < seen for i in drops[step]) and any(i < seen for i in consumed[step])]
    delta = k2["Δ level score"]
    assert delta.startswith(f"{np.mean(gaps):+.3f} [") and delta.endswith(f"({3 * len(gaps)} steps)")
    assert k2["level score elsewhere (dropped / consumed)"].startswith("0.00 / ")
    assert k2["turns"] == k2["tokens per group"] == k2["success"] == "—"  # not recorded in that format
    assert k2["generated tokens dropped (share)"] == "—"

    k0 = rows["0"]
    assert k0["groups dropped"] == "0" and k0["dropped (share of generated groups)"].startswith("0.000")
    assert k0["Δ level score"] == "—"
    # k = 4: two runs' records carry episode statistics, the third's do not: its cell has no token share.
    k4 = rows["4"]
    assert (k4["turns"], k4["tokens per group"], k4["success"]) == ("5.00 / 2.00", "100 / 40", "0.000 / 1.000")
    assert k4["generated tokens dropped (share)"] == "—" and k4["versions past the bound"].startswith("1.00")
    with (tmp_path / "out" / "summary.csv").open() as f:
        by_run = {r["run"]: r for r in csv.DictReader(f)}
    share = dropped * 100 / (dropped * 100 + STEPS * B * 40)
    assert float(by_run["k4-s0"]["dropped_token_share"]) == pytest.approx(share)
    assert float(by_run["k4-s0"]["dropped_time_share"]) == pytest.approx(dropped * 20 / (dropped * 20 + STEPS * B * 5))
    assert float(by_run["k4-s0"]["drop_waited_s"]) == pytest.approx(3.0)
    assert math.isnan(float(by_run["k4-s2"]["dropped_token_share"]))  # not recorded
    # Without provenance the counts in metrics.jsonl give the share.
    assert float(by_run["k1-s0"]["drop_share"]) == pytest.approx((STEPS // 2) / (STEPS * B + STEPS // 2))
    assert float(by_run["k0-s0"]["drop_share"]) == 0.0
    # The console gets one line per cell that dropped anything.
    assert len(result.drops) == 3 and any(line.startswith("drops: Bandit k = 2 (bounded)") and
                                          f"{dropped / generated:.1%} of generated groups dropped" in line
                                          for line in result.drops)


def test_a_level_follows_from_the_index_as_the_rollout_worker_assigns_it(tmp_path):
    envs = [{"tag": "SimpleSokoban", "n_groups": 3, "overrides": {"dim": 6}}, {"tag": "Bandit", "n_groups": 2}]
    run = RunData(name="r", path=tmp_path, config={"rollout": {"seed": 77, "envs": envs}})
    level = level_of(run)
    specs = [EnvGroupSpec.model_validate(e) for e in envs]
    for index in range(40):
        a = assign_group(index, specs, 77)
        assert level(index) == f"{a.env.tag}|{json.dumps(a.env.overrides, sort_keys=True)}|{a.seed}"
