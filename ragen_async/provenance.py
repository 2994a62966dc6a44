"""Provenance of the data each learner step consumed: which groups, from which worker, made by which
policy versions. One JSON line per step in ``provenance.jsonl`` of the run directory.

Staleness claims are checked against this file rather than against the config: a test (or a
researcher) can recompute every token's staleness from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ragen_async.protocol import BatchShard, TrajectoryGroup


def provenance_record(step: int, learner_version: int, groups: Sequence[TrajectoryGroup],
                      shards: Sequence[BatchShard]) -> dict:
    kept = {t.traj_id for s in shards for t in s.trajectories}
    out = []
    for g in groups:
        versions = [t.token_versions[t.loss_mask.astype(bool)] for t in g.trajectories]
        sampled = np.concatenate(versions) if versions else np.zeros(0, dtype=np.int32)
        out.append({
            "group_id": g.group_id, "env_tag": g.env_tag, "seed": g.seed, "worker": g.worker_id,
            "kept": any(t.traj_id in kept for t in g.trajectories),
            "min_version": int(sampled.min()) if sampled.size else None,
            "max_version": int(sampled.max()) if sampled.size else None,
            "scores": [round(float(x), 6) for x in g.scores],
        })
    return {"step": step, "learner_version": learner_version, "groups": out}


class ProvenanceLog:
    def __init__(self, path: Path | None):
        self._f = Path(path).open("a", buffering=1) if path is not None else None

    def write(self, step: int, learner_version: int, groups: Sequence[TrajectoryGroup],
              shards: Sequence[BatchShard]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(provenance_record(step, learner_version, groups, shards)) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def read_provenance(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def rewind_jsonl(path: Path, step: int, key: str) -> int:
    """Drop the records of ``path`` whose ``key`` exceeds ``step`` (a resume from the checkpoint of
    ``step`` runs them again); returns the largest ``key`` the file held before (-1 if none)."""
    path = Path(path)
    if not path.exists():
        return -1
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seen = max((int(r[key]) for r in records if key in r), default=-1)
    kept = [r for r in records if int(r.get(key, -1)) <= step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return seen
