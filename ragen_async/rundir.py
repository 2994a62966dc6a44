"""Run directories: where a run's config, metrics, checkpoints and state live.

``runs/<name>-<time>/`` holds ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``checkpoints/step_NNNNNN/`` (complete only once its ``COMPLETE`` marker exists) and
``run_state.json`` (e.g. the W&B run id, so a resumed run continues the same W&B run).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen_async.config import RunConfig, dump_config


@dataclass
class RunDir:
    path: Path

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @classmethod
    def create(cls, cfg: RunConfig) -> RunDir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.name)
        path = Path(cfg.run_root) / f"{safe}-{stamp}"
        suffix = 1
        while path.exists():
            path = Path(cfg.run_root) / f"{safe}-{stamp}-{suffix}"
            suffix += 1
        path.mkdir(parents=True)
        (path / "checkpoints").mkdir()
        (path / "config.yaml").write_text(dump_config(cfg))
        return cls(path)

    def latest_checkpoint(self) -> Path | None:
        done = sorted(self.checkpoints.glob("step_*/COMPLETE"))
        return done[-1].parent if done else None

    def read_state(self) -> dict[str, Any]:
        p = self.path / "run_state.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def write_state(self, **state: Any) -> None:
        (self.path / "run_state.json").write_text(json.dumps(state))


def checkpoint_path(run_dir: RunDir, step: int) -> Path:
    path = run_dir.checkpoints / f"step_{step:06d}"
    if path.exists():
        shutil.rmtree(path)
    return path


def save_checkpoint_marker(path: Path) -> None:
    """Written last: a checkpoint directory without it is partial and ignored on resume."""
    (path / "COMPLETE").touch()


