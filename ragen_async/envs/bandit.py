"""Two-armed bandit with symbolic arm names (RAGEN's Bandit).

The model pulls one of two arms once. The low-risk arm pays a fixed ``lo_arm_score``; the high-risk arm
pays ``hi_arm_score`` with probability ``hi_arm_prob`` and nothing otherwise. Nothing in the prompt says
which is which: the model has to infer the risk profile from the names alone ("Phoenix" vs "Dragon"),
so the task probes whether RL can align a model's priors about words with rewards.

Each reset flips a coin (from the seed) to assign the two names to action ids 1 and 2, so position in
the prompt carries no signal. Success means choosing the arm with the higher expected payout, whatever
the draw; with the defaults (0.1 vs 0.25) that is the high-risk arm, as in RAGEN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragen_async.envs.base import TextEnv, build_config


@dataclass(frozen=True)
class BanditConfig:
    lo_arm_name: str = "Phoenix"
    """Name of the low-risk arm (fixed payout)."""
    hi_arm_name: str = "Dragon"
    """Name of the high-risk arm (rare large payout)."""
    lo_arm_score: float = 0.1
    """Deterministic payout of the low-risk arm (RAGEN's code uses 0.1, its paper 0.15)."""
    hi_arm_score: float = 1.0
    """Payout of the high-risk arm when it pays."""
    hi_arm_prob: float = 0.25
    """Probability that the high-risk arm pays."""

    def __post_init__(self) -> None:
        if self.lo_arm_name.strip().casefold() == self.hi_arm_name.strip().casefold():
            raise ValueError(f"the arms need distinct names, got {self.lo_arm_name!r} twice")
        if not 0.0 <= self.hi_arm_prob <= 1.0:
            raise ValueError(f"hi_arm_prob must lie in [0, 1], got {self.hi_arm_prob}")

    @property
    def best_arm_name(self) -> str:
        """The arm with the higher expected payout (the high-risk arm on a tie, as RAGEN scores it)."""
        hi_expectation = self.hi_arm_prob * self.hi_arm_score
        return self.hi_arm_name if hi_expectation >= self.lo_arm_score else self.lo_arm_name


class BanditEnv(TextEnv):
    """One pull of one of two named arms; ``action_lookup`` is reassigned at every reset."""

    max_actions_per_episode = 1

    def __init__(self, *, render_mode: str | None = None, **config: Any) -> None:
        super().__init__(render_mode=render_mode)
        self.config = build_config(BanditConfig, config)
        self.action_lookup = {1: self.config.lo_arm_name, 2: self.config.hi_arm_name}
        self._pull: tuple[str, float] | None = None
        """(arm name, payout) once the arm is pulled."""

    @property
    def instructions(self) -> str:  # type: ignore[override]
        first, second = self.action_lookup.values()
        return (
            f"You are in front of two slot machines, {first} and {second}, and you may pull exactly one. "
            "Each machine pays out points following its own pattern, and its name is your only clue to that "
            "pattern. Think about what each name symbolizes and what it suggests about how that machine "
            "pays, then pick the one you expect to pay more on average. "
            f"Answer with one machine name only: {first} or {second}."
        )

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:  # type: ignore[override]
        names_rng, self._payout_rng = self._reset_rngs(seed, 2)
        lo, hi = self.config.lo_arm_name, self.config.hi_arm_name
        self.action_lookup = {1: lo, 2: hi} if names_rng.integers(2) == 0 else {1: hi, 2: lo}
        self._pull = None
        self._terminated = False
        return self.render(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        self._check_steppable()
        arm = self.action_lookup[self.action_id(action)]
        if arm == self.config.hi_arm_name:
            pays = self._payout_rng.random() < self.config.hi_arm_prob
            reward = self.config.hi_arm_score if pays else 0.0
        else:
            reward = self.config.lo_arm_score
        self._pull = (arm, float(reward))
        self._terminated = True
        return self.render(), float(reward), True, False, {"success": self.success, "action_is_effective": True}

    def render(self) -> str:  # type: ignore[override]
        if self._pull is None:
            first, second = self.action_lookup.values()
            return f"Machines: {first}, {second}. Pull one."
        arm, reward = self._pull
        return f"{arm}: {reward} points"

    @property
    def success(self) -> bool:
        return self._pull is not None and self._pull[0] == self.config.best_arm_name

    def oracle_actions(self, max_actions: int) -> list[str]:
        return [self.config.best_arm_name] if self._pull is None and max_actions > 0 else []
