"""What a run checks of its model directory before it starts: that it is one, and, where the config pins
them (``model.sha256``), that its weights are the pinned ones.

A study that spans days and machines compares runs only if they all started from the same weights; a
rebuild on another machine, or a model directory replaced in between, would change the start silently.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHTS_GLOB = "*.safetensors"


def weights_sha256(path: str | Path) -> str:
    """SHA-256 over the directory's safetensors files, in name order (what ``build_info.json`` records)."""
    digest = hashlib.sha256()
    for weights in sorted(Path(path).glob(WEIGHTS_GLOB)):
        with weights.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def model_problem(path: str, sha256: str | None = None) -> str | None:
    """Why a run cannot start from ``path`` (one line), or ``None``: no model directory there, or weights
    whose digest is not the pinned ``sha256``."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return f"model.path={path!r} does not exist or is not a model directory (no config.json)"
    if sha256 is not None:
        got = weights_sha256(p)
        if got != sha256.lower():
            return (f"model.path={path!r} holds weights with sha256 {got[:16]}..., but model.sha256 pins "
                    f"{sha256[:16]}...: not the model this config was written for")
    return None
