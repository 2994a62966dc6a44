"""Countdown: combine the given numbers with + - * / into an equation that hits the target (RAGEN's Countdown).

RAGEN reads its tasks from the ``Countdown-Tasks-3to4`` parquet; we draw them from the seed instead, in
the same shape: 3 or 4 numbers in 1..99 and a target of at most 100. The target is the value of a random
expression over all the numbers (positive integer intermediates, exact division only), so every task has
a solution; tasks whose target falls out of range are redrawn from the same generator.

The single action is the equation as free text. Reward (RAGEN's rule): 1.0 if its integers are exactly
the given numbers (as a multiset) and it evaluates to the target within 1e-5; 0.1 if the numbers match
but the value does not (division by zero included); 0.0 otherwise, including text that does not parse.
Equations are parsed with ``ast`` and only integer literals, + - * /, parentheses and unary minus are
accepted; nothing is ever passed to ``eval``.
"""

from __future__ import annotations

import ast
import operator
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ragen_async.envs.base import TextEnv, build_config

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1
_TOLERANCE = 1e-5
_MAX_EQUATION_CHARS = 300  # bounds parser recursion on adversarial input; real answers are ~20 chars

_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.USub, ast.Constant, *_BINARY_OPS)


def parse_equation(text: str) -> ast.Expression | None:
    """The syntax tree of ``text`` if it is pure integer arithmetic (+ - * /, parentheses, unary minus)."""
    if len(text) > _MAX_EQUATION_CHARS:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            return None
        # Only int literals: no floats or strings, and no bools (which subclass int).
        if isinstance(node, ast.Constant) and type(node.value) is not int:
            return None
    return tree


def _evaluate(node: ast.expr) -> Fraction:
    """Exact value of a tree accepted by ``parse_equation`` (raises ``ZeroDivisionError``)."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand)
    assert isinstance(node, ast.BinOp)
    return _BINARY_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


def safe_eval(text: str) -> Fraction | None:
    """Exact value of an arithmetic equation, or ``None`` if it is not one or divides by zero."""
    tree = parse_equation(text)
    if tree is None:
        return None
    try:
        return _evaluate(tree.body)
    except ZeroDivisionError:
        return None


def score_equation(equation: str, numbers: list[int], target: int) -> float:
    """RAGEN's Countdown reward for one answer (see the module docstring)."""
    tree = parse_equation(equation)
    if tree is None:
        return 0.0
    literals = sorted(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant))
    if literals != sorted(numbers):
        return 0.0
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return FORMAT_REWARD
    return CORRECT_REWARD if abs(value - target) < _TOLERANCE else FORMAT_REWARD


def solve(numbers: list[int], target: int) -> str | None:
    """An equation using every number once that equals ``target``, by exhaustive search, or ``None``.

    Repeatedly replaces two values by their sum, difference, product or quotient (exact fractions, so
    intermediate results may be negative or fractional): at most 3888 leaves for four numbers.
    """

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            value, text = items[0]
            return text if value == target else None
        for i, (a, text_a) in enumerate(items):
            for j, (b, text_b) in enumerate(items):
                if i == j:
                    continue
                rest = [item for k, item in enumerate(items) if k not in (i, j)]
                candidates = [(a - b, "-")] + ([(a / b, "/")] if b != 0 else [])
                if i < j:  # commutative ops once per pair
                    candidates += [(a + b, "+"), (a * b, "*")]
                for value, op in candidates:
                    found = search([*rest, (value, f"({text_a} {op} {text_b})")])
                    if found is not None:
                        return found
        return None

    found = search([(Fraction(n), str(n)) for n in numbers])
    # Every combination is parenthesized; the outermost pair is redundant.
    return found[1:-1] if found is not None and len(numbers) > 1 else found


def _random_target(rng: np.random.Generator, numbers: list[int]) -> int:
    """Value of a random expression over all ``numbers`` with positive integer intermediates."""
    values = list(numbers)
    while len(values) > 1:
        i, j = (int(k) for k in rng.choice(len(values), size=2, replace=False))
        a, b = values[i], values[j]
        options = [a + b, a * b] + ([a - b] if a > b else []) + ([a // b] if a % b == 0 else [])
        values = [v for k, v in enumerate(values) if k not in (i, j)] + [options[int(rng.integers(len(options)))]]
    return values[0]


@dataclass(frozen=True)
class CountdownConfig:
    min_count: int = 3
    """Fewest numbers in a task."""
    max_count: int = 4
    """Most numbers in a task."""
    max_number: int = 99
    """Numbers are drawn uniformly from 1..max_number."""
    max_target: int = 100
    """Targets are redrawn until they lie in 1..max_target."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_count <= self.max_count:
            raise ValueError(f"need 2 <= min_count <= max_count, got {self.min_count}, {self.max_count}")
        if self.max_number < 1 or self.max_target < 1:
            raise ValueError("max_number and max_target must be positive")


class CountdownEnv(TextEnv):
    """One free-text answer: an equation over the numbers that equals the target."""

    instructions = (
        "Build an arithmetic equation that equals the target number. Use each of the given numbers exactly "
        "once, combined with +, -, * and / and parentheses as needed; no other numbers are allowed. "
        "Answer with the equation only, without '=' or the target, for example: (7 - 3) * 5"
    )
    max_actions_per_episode = 1

    def __init__(self, *, render_mode: str | None = None, **config: Any) -> None:
        super().__init__(render_mode=render_mode)
        self.config = build_config(CountdownConfig, config)
        self.numbers: list[int] = []
        self.target = 0
        self._reward: float | None = None
        self._solution: str | None = None

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:  # type: ignore[override]
        (rng,) = self._reset_rngs(seed, 1)
        cfg = self.config
        count = int(rng.integers(cfg.min_count, cfg.max_count + 1))  # drawn once: larger tasks fail the range more
        while True:
            self.numbers = [int(n) for n in rng.integers(1, cfg.max_number + 1, size=count)]
            self.target = _random_target(rng, self.numbers)
            if 1 <= self.target <= cfg.max_target:
                break
        self._reward = None
        self._solution = None
        self._terminated = False
        return self.render(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        self._check_steppable()
        self._reward = score_equation(action, self.numbers, self.target)
        self._terminated = True
        info = {"success": self.success, "action_is_effective": self._reward > 0.0}
        return self.render(), self._reward, True, False, info

    def render(self) -> str:  # type: ignore[override]
        return f"Target: {self.target}, nums: {self.numbers}"

    @property
    def success(self) -> bool:
        return self._reward == CORRECT_REWARD

    def oracle_actions(self, max_actions: int) -> list[str]:
        if self._terminated or max_actions < 1:
            return []
        if self._solution is None:
            self._solution = solve(self.numbers, self.target)
            assert self._solution is not None, "targets are built from an expression over the numbers"
        return [self._solution]

    def random_action(self, rng: random.Random) -> str:
        """The numbers in random order joined by random operators, e.g. ``"12 / 3 - 40 * 7"``."""
        numbers = rng.sample(self.numbers, len(self.numbers))
        equation = str(numbers[0])
        for number in numbers[1:]:
            equation += f" {rng.choice('+-*/')} {number}"
        return equation
