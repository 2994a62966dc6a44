"""Helpers for the experiment tests: synthetic run directories and a fake ``train``.

Nothing here trains a model: a run directory is a ``config.yaml`` and a ``metrics.jsonl`` written
by hand with the keys the orchestrator logs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY_BANDIT = REPO / "configs" / "tiny" / "starpo_s_bandit.yaml"


def training_record(step: int, total: int, k: int, **extra: Any) -> dict[str, Any]:
    """A learner-step record whose numbers drift the way a run's do: reward up, std and entropy down."""
    x = step / max(total, 1)
    return {
        "learner/step": step, "policy_version": step,
        "rollout/success": 0.2 + 0.7 * x, "rollout/reward_mean": -0.5 + 1.4 * x,
        "rollout/in_group_reward_std": 0.5 - 0.4 * x, "actor/entropy": 1.0 - 0.5 * x,
        "actor/grad_norm": 0.5 + (2.0 if step == total // 2 else 0.1 * x),
        "rollout/valid_action_rate": 0.9 + 0.1 * x,
        "staleness/mean": k * 0.5, "staleness/max": float(k), "mismatch/k3_kl": 1e-4 * (1 + k),
        "timing/step_s": 2.0 + k * 0.1, **extra,
    }


def write_run(path: Path, *, steps: int = 20, k: int | None = 0, fixed_lag: bool = False,
              off_policy: str = "none", seed: int = 0, val_every: int = 5, envs: tuple[str, ...] = ("Bandit",),
              val_curve=lambda step, total: min(1.0, 0.3 + step / max(total, 1)),
              partial_last_line: bool = False, extra: dict[int, dict[str, Any]] | None = None,
              config: dict[str, Any] | None = None, logged_steps: int | None = None) -> Path:
    """A run directory as the orchestrator leaves it (config.yaml, metrics.jsonl, checkpoints/); ``config``
    adds top-level config sections, ``logged_steps`` stops the log early (a run still going)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "checkpoints").mkdir(exist_ok=True)
    config = {"name": path.name, "seed": seed, "total_steps": steps,
              "staleness": {"max_staleness": k, "fixed_lag": fixed_lag}, "algo": {"off_policy": off_policy},
              **(config or {})}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    lines = []

    def val(step: int) -> None:
        scores = {f"val/{e}/success": val_curve(step, steps) for e in envs}
        lines.append({"learner/step": step, "policy_version": step,
                      "val/success": sum(scores.values()) / len(scores), **scores})

    if val_every:
        val(0)
    for step in range(1, (steps if logged_steps is None else logged_steps) + 1):
        lines.append(training_record(step, steps, k or 0, **(extra or {}).get(step, {})))
        if val_every and (step % val_every == 0 or step == steps):
            val(step)
    text = "".join(json.dumps(r) + "\n" for r in lines)
    if partial_last_line:
        text += json.dumps(training_record(steps + 1, steps, k or 0))[:40]
    (path / "metrics.jsonl").write_text(text)
    return path


class FakeTrain:
    """Stands in for ``orchestrator.train``: makes a run directory, logs a few steps, returns."""

    def __init__(self, fail: set[str] = frozenset(), interrupt: set[str] = frozenset(), steps: int = 4):
        self.fail, self.interrupt, self.steps = set(fail), set(interrupt), steps
        self.calls: list[tuple[str, str]] = []  # (run name, "new" | "resume")
        self.pools: list = []  # the engine pool each call got (``orchestrator.train``'s ``pool``)

    def __call__(self, cfg=None, *, resume: Path | None = None, pool=None):
        from ragen_async.config import dump_config, load_config

        self.pools.append(pool)
        if resume is not None:
            run_dir = Path(resume)
            cfg = load_config(run_dir / "config.yaml")
        else:
            run_dir = Path(cfg.run_root) / f"{cfg.name}-fake"
            run_dir.mkdir(parents=True)
            (run_dir / "config.yaml").write_text(dump_config(cfg))
        short = run_dir.parent.name  # the sweep gives each run its own run_root: SWEEP_DIR/runs/<run name>
        self.calls.append((short, "resume" if resume is not None else "new"))
        with (run_dir / "metrics.jsonl").open("a") as f:
            for step in range(1, self.steps + 1):
                k = cfg.staleness.max_staleness or 0
                f.write(json.dumps(training_record(step, self.steps, k)) + "\n")
        if short in self.interrupt:
            self.interrupt.discard(short)  # interrupted once; a resume then finishes it
            raise KeyboardInterrupt
        if short in self.fail:
            raise RuntimeError(f"engine died in {short}\nsecond line of detail")
        success = 0.5 + 0.1 * (cfg.staleness.max_staleness or 0)
        last = {"learner/step": self.steps, "val/success": success, "val/Bandit/success": success,
                "val/reward_mean": math.nan}
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({k: v for k, v in last.items() if k != "val/reward_mean"}) + "\n")
        return run_dir, last


@pytest.fixture
def fake_model(tmp_path: Path) -> Path:
    """A directory that passes the "is this a model" check (it has a config.json)."""
    path = tmp_path / "fake-model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def bandit_spec(tmp_path: Path):
    """Write a sweep spec on the tiny Bandit config and return its path."""

    def make(grid: dict[str, list[Any]], **fields: Any) -> Path:
        # Staleness grids need the asynchronous runtime (the local loop is synchronous by definition).
        if any(k.startswith("staleness.") for k in grid) and "runtime" not in fields.get("overrides", {}):
            fields = {**fields, "overrides": {**fields.get("overrides", {}), "runtime": "ray"}}
        spec = {"name": "t", "base": str(TINY_BANDIT), "grid": grid, **fields}
        path = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    return make


@pytest.fixture
def make_run():
    """``make_run(path, steps=..., k=..., ...)``: see :func:`write_run`."""
    return write_run


@pytest.fixture
def fake_train():
    """``fake_train(fail={...}, interrupt={...})``: see :class:`FakeTrain`."""
    return FakeTrain
