"""Run directories: where a run's config, metrics, checkpoints and state live.

``runs/<name>-<time>/`` holds ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``checkpoints/step_NNNNNN/`` and ``run_state.json`` (e.g. the W&B run id, so a resumed run continues
the same W&B run).

Checkpoints are written atomically: into ``checkpoints/.step_NNNNNN.partial/``, then a ``MANIFEST.json``
(size and SHA-256 of every file) and the ``COMPLETE`` marker, then one rename to ``step_NNNNNN/``. A
crash mid-write leaves only a partial directory, never a half-written checkpoint under its final name.
On resume :meth:`RunDir.latest_checkpoint` verifies the manifest of the newest checkpoint and falls back
to the previous one, with a warning, if a file is missing, truncated or corrupted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen_async.config import RunConfig, dump_config

log = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"
DRIVER_STATE = "driver_state.json"
"""The driver's part of a checkpoint: its step, the admission state, the budget spent."""


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
    def episodes_path(self) -> Path:
        return self.path / "episodes.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @classmethod
    def create(cls, cfg: RunConfig, path: Path | None = None) -> RunDir:
        """A new run directory: ``path`` (which must not exist yet), or ``RUN_ROOT/NAME-TIMESTAMP``."""
        if path is not None:
            if Path(path).exists():
                raise FileExistsError(f"run directory {path} already exists; continue it with --resume {path}")
            path = Path(path)
        else:
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
        """The newest complete checkpoint whose files match its manifest (older ones are tried in turn)."""
        for marker in sorted(self.checkpoints.glob("step_*/COMPLETE"), reverse=True):
            problem = verify_checkpoint(marker.parent)
            if problem is None:
                return marker.parent
            log.warning("checkpoint %s is damaged (%s); falling back to the previous one", marker.parent, problem)
        return None

    def read_state(self) -> dict[str, Any]:
        p = self.path / "run_state.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def write_state(self, **state: Any) -> None:
        (self.path / "run_state.json").write_text(json.dumps(state))


def staging_path(run_dir: RunDir, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before :func:`finalize_checkpoint` (emptied first)."""
    path = run_dir.checkpoints / f".step_{step:06d}.partial"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def finalize_checkpoint(run_dir: RunDir, staging: Path, step: int) -> Path:
    """Write the manifest and the ``COMPLETE`` marker into ``staging``, then rename it to its final name."""
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(staging)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (staging / "COMPLETE").touch()
    final = run_dir.checkpoints / f"step_{step:06d}"
    if final.exists():  # the same step saved again (a resumed run): replace it
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    return final


def verify_checkpoint(path: Path) -> str | None:
    """``None`` if every file in the checkpoint's manifest is there with its size and hash; else why not."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        return f"unreadable manifest: {e}"
    for name, entry in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, expected {entry['bytes']}"
        if _sha256(f) != entry["sha256"]:
            return f"{name} does not match its SHA-256"
    return None
