"""A text that states registered verdicts, held to them: no clause uses a stronger word for a prediction than its
verdict allows (:attr:`~ragen_async.study.report.registered.Outcome.words`).

How a text ties a claim to a prediction: **a clause names the predictions it speaks of by their ids** (``N4``,
``H1``, ``Ga1``, ...; the spec's names), anywhere in it, parentheses included. A clause is a sentence or a part of
one between semicolons, cut only outside parentheses and brackets; code spans (commands, file names) are not read.
Then, clause by clause (:func:`check`):

1. A clause that uses a **verdict word** (:data:`VERDICT_WORDS`: "shown", "beat", "lost", "replicated", "grows",
   "kept", "met", ...) without a negation among the three words before it ("not", "no", "neither", "nor",
   "never") names at least one prediction: a claim stands on a verdict or is not made.
2. A clause that names a prediction whose verdict is not held (failed, pending, interim, not run) uses no verdict
   word un-negated: of a failed test it says "not shown" and gives the estimate with its interval exactly as the
   report prints it (``+0.113 [-0.011, +0.238]``); of a failed goal, "not met". A clause naming a held prediction
   beside a failed one therefore has to be split.

Words that count only as verbs of a claim ("cost" the noun is free, "costs" and "costlier" are not) are listed in
:data:`VERDICT_WORDS`; the shape of a held claim (what exactly was shown) is the text's own business.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ragen_async.study.report.registered import TESTS, Outcome

VERDICT_WORDS = ("shown", "show", "shows", "beat", "beats", "better", "worse", "lost", "lose", "loses", "replicated",
                 "replicate", "replicates", "grows", "grow", "grew", "kept", "keep", "keeps", "costs", "costlier",
                 "steepens", "steeper", "prevented", "prevents", "met", "meets", "confirmed", "held", "holds",
                 "outperformed", "outperforms", "widens", "widened", "recommended")
"""Words that claim an outcome: a clause using one (un-negated) must name a prediction whose verdict allows it."""
NEGATIONS = frozenset({"not", "no", "neither", "nor", "never"})
"""A verdict word with one of these among the three words before it is negated."""

_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
_MARKUP = re.compile(r"!\[[^\]]*\]\([^)]*\)|\]\([^)]*\)|`[^`]*`|\*")
_BLOCK = re.compile(r"\n\s*\n|\n\s*[-*+] |^\s*[-*+] ")


def clauses(text: str) -> list[str]:
    """``text`` (markdown: images, link targets, code spans and emphasis marks dropped) cut into clauses: at each
    paragraph and list item, and inside them at ``;`` and at a full stop followed by white space or the end, outside
    parentheses and brackets."""
    out = []
    for block in _BLOCK.split(_MARKUP.sub(lambda m: "]" if m.group().startswith("](") else "", text)):
        depth, start = 0, 0
        for i, ch in enumerate(block):
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth = max(0, depth - 1)
            elif depth == 0 and (ch == ";" or (ch == "." and (i + 1 == len(block) or block[i + 1].isspace()))):
                out.append(block[start:i + 1])
                start = i + 1
        out.append(block[start:])
    return [" ".join(c.split()) for c in out if c.strip()]


def verdict_words(clause: str) -> list[str]:
    """The verdict words a clause uses un-negated."""
    words = [w.lower() for w in _WORD.findall(clause)]
    return [w for i, w in enumerate(words) if w in VERDICT_WORDS and not NEGATIONS & set(words[max(0, i - 3):i])]


def named(clause: str, outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The predictions a clause names by id."""
    return [o for o in outcomes if re.search(rf"(?<![A-Za-z0-9]){re.escape(o.name)}(?![A-Za-z0-9])", clause)]


def check(text: str, outcomes: Sequence[Outcome]) -> list[str]:
    """Every clause of ``text`` that says more than the verdicts of ``outcomes`` allow (the module's rules), each as
    ``"the clause": what is wrong``; empty when the text holds to them."""
    problems = []
    for clause in clauses(text):
        strong, ids = verdict_words(clause), named(clause, outcomes)
        if strong and not ids:
            problems.append(f'"{clause}": "{strong[0]}" names no prediction')
        for o in ids:
            if o.verdict == "held":
                continue
            if strong:
                problems.append(f'"{clause}": "{strong[0]}" for {o.name}, whose rule allows "{o.words}"')
            said = clause.lower()
            if o.verdict == "failed" and o.kind in TESTS and ("not shown" not in said or o.estimate not in clause):
                problems.append(f'"{clause}": {o.name} failed: say "not shown" and its estimate {o.estimate}')
            elif o.verdict == "failed" and o.kind not in TESTS and "not met" not in said:
                problems.append(f'"{clause}": {o.name} failed: say "not met"')
    return problems


def section(markdown: str, heading: str = "## The answer") -> str:
    """The section of ``markdown`` under ``heading``, to the next heading of its level or above."""
    lines = markdown.splitlines()
    start = lines.index(heading) + 1
    level = heading.split(" ")[0]
    end = next((i for i in range(start, len(lines)) if re.match(rf"#{{1,{len(level)}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])
