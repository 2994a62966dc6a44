"""Fixtures of the study's tests: a model directory that passes the model check, and sweep specs on the tiny
Bandit config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY_BANDIT = REPO / "configs" / "tiny" / "starpo_s_bandit.yaml"


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
