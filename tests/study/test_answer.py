"""README's answer held to the registered verdicts (``study.report.answer``): the verdicts recomputed from the
committed runs of studies/confirm and studies/newlevels by the registered evaluator, and no clause of README's
"The answer" using a stronger word for a prediction than its verdict allows; and the check itself, on sentences
whose fault is known."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ragen_async.study.report import read_runs
from ragen_async.study.report.answer import check, clauses, section, verdict_words
from ragen_async.study.report.registered import Outcome, decide, load_spec

REPO = Path(__file__).resolve().parents[2]
STUDIES = REPO / "studies"


@pytest.fixture(scope="module")
def outcomes() -> list[Outcome]:
    """Every registered verdict the answer states: the confirmation's (H, F, C) on its runs, the new levels' (N) and
    the KL-target controller's (Ga-Gd, K) on theirs, each decided by its spec's rule."""
    confirm_runs, confirm_summaries, _ = read_runs([STUDIES / "confirm"])
    new_runs, new_summaries, _ = read_runs([STUDIES / "newlevels"])
    got = decide(load_spec(STUDIES / "confirm" / "predictions.yaml"), confirm_summaries, confirm_runs)
    for spec in ("predictions.yaml", "controller.yaml"):
        got += decide(load_spec(STUDIES / "newlevels" / spec), new_summaries, new_runs)
    return got


def test_readme_s_answer_says_no_more_than_the_verdicts(outcomes):
    by = {o.name: o for o in outcomes}
    # The verdicts as the studies' READMEs give them, so that a change in the data or the evaluator shows here first.
    assert {n: by[n].verdict for n in ("H1", "H2", "H3", "H4", "H5", "H6", "C1", "C2")} == {
        "H1": "held", "H2": "failed", "H3": "failed", "H4": "held", "H5": "held", "H6": "failed", "C1": "held",
        "C2": "held"}
    assert [by[f"N{i}"].verdict for i in range(1, 9)] == ["failed"] * 6 + ["held"] * 2
    assert {n: by[n].verdict for n in ("Ga1", "Ga2", "Ga3", "Ga", "Gb", "Gc", "Gd1", "Gd2", "Gd3", "K1", "K2")} == {
        "Ga1": "failed", "Ga2": "failed", "Ga3": "failed", "Ga": "failed", "Gb": "failed", "Gc": "failed",
        "Gd1": "held", "Gd2": "held", "Gd3": "held", "K1": "failed", "K2": "held"}
    text = section((REPO / "README.md").read_text())
    assert check(text, outcomes) == []
    # The answer speaks of every new-level prediction and of the controller's goal (PREDICTIONS.md: "What each
    # outcome means for the answer"), each by its id.
    said = " ".join(clauses(text))
    assert all(f"N{i}" in said for i in range(1, 9)) and "Ga" in said and "H6" in said


def _outcome(name: str, verdict: str, kind: str = "welch", estimate: str = "+0.113 [-0.011, +0.238]") -> Outcome:
    return Outcome(name, "", f"a - b: {estimate}", 0.03, 0.16, verdict, kind, estimate)


SET = [_outcome("N4", "failed"), _outcome("N8", "held", estimate="+0.028 [+0.006, +0.049]"),
       _outcome("Ga1", "failed", "no_falls", ""), _outcome("N9", "pending")]


@pytest.mark.parametrize("sentence, fault", [
    # Sentences of README's answer before this check (a219c7e..5d54fcc), each saying more than its verdict.
    ("At twice the step size synchronous training beat the unbounded pipeline by +0.113 [-0.011, +0.238] (N4).",
     '"beat" for N4'),
    ("On SmallCountdown the cost grows with age (shown); on Sokoban the unbounded runs lost +0.113 [-0.011, "
     "+0.238] (N4).", '"grows" names no prediction'),
    ("a bound of 4 kept +0.113 [-0.011, +0.238] of what no bound lost (N4).", '"kept" for N4'),
    ("Staleness costs success: shown on Sokoban (N4, Holm p = 0.161).", '"costs" for N4'),
    # A failed test named without its hedge, or without its estimate and interval.
    ("Synchronous over unbounded +0.113 (N4).", 'N4 failed: say "not shown"'),
    ("Synchronous over unbounded is not shown (N4).", "its estimate +0.113 [-0.011, +0.238]"),
    # A held and a failed prediction in one clause with the held one's word.
    ("The cost grows past k = 4 (N8) and at the larger step (N4: not shown, +0.113 [-0.011, +0.238]).",
     '"grows" for N4'),
    ("The controller kept every run up (Ga1).", '"kept" for Ga1'),
    ("The controller's goal: 1 of 3 fell (Ga1).", 'Ga1 failed: say "not met"'),
    ("It is shown (N9).", '"shown" for N9, whose rule allows "not decided"'),
])
def test_a_clause_that_says_more_than_its_verdict_is_named(sentence, fault):
    problems = check(sentence, SET)
    assert any(fault in p for p in problems), problems


@pytest.mark.parametrize("sentence", [
    "The cost grows past k = 4 on SmallCountdown (N8: +0.028 [+0.006, +0.049])"
    "; at the larger step not shown (N4: +0.113 [-0.011, +0.238], Holm p = 0.161).",
    "Not shown on the new levels, as an estimate: +0.113 [-0.011, +0.238] (N4).",
    "The controller's goal: not met, 1 of 3 runs fell (Ga1).",
    "Neither controller met its goal; no bound is shown to be the choice.",
    "The command `ragen-async report --registered` prints `shown` or `not shown` for each.",
])
def test_a_clause_that_holds_to_its_verdict_passes(sentence):
    assert check(sentence, SET) == []


def test_clauses_are_cut_outside_brackets_and_negation_looks_three_words_back():
    assert clauses("A (b; c. d) e; f [g; h]. I 0.5 j.") == ["A (b; c. d) e;", "f [g; h].", "I 0.5 j."]
    assert verdict_words("it did not replicate, and nothing was shown") == ["shown"]
    assert verdict_words("neither was it shown nor kept") == []


def test_each_verdict_is_given_the_words_its_rule_allows():
    assert _outcome("N8", "held").words == "shown"
    assert _outcome("N4", "failed").words == "not shown: estimate +0.113 [-0.011, +0.238]"
    assert Outcome("Ga3", "", "Age 3.46 against 4.53", math.nan, math.nan, "failed", "age_at_least").words == (
        "not met: Age 3.46 against 4.53")
    assert _outcome("Gd1", "held", "drops_at_most").words == "met"
    assert _outcome("N3", "failed (interim)").words == _outcome("N5", "pending").words == "not decided"
    assert section("# t\n## The answer\nx\n### sub\ny\n## Next\nz") == "x\n### sub\ny"
