"""Run directories: where a run's config, metrics, checkpoints and state live.

``runs/<name>-<time>/`` holds ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``checkpoints/step_NNNNNN/`` and ``run_state.json`` (e.g. the W&B run id, so a resumed run continues
the same W&B run).

A finished run's ``metrics.jsonl`` and ``provenance.jsonl`` may be packed (gzip, ``metrics.jsonl.gz``; ``ragen-async
pack``, :func:`pack_run`) to keep a study's runs small enough to commit; every reader takes either form
(:func:`record_file`, :func:`read_record`), and a resume unpacks them first (:func:`unpack_run`).

Checkpoints are written atomically: into ``checkpoints/.step_NNNNNN.partial/``, then a ``MANIFEST.json``
(size and SHA-256 of every file) and the ``COMPLETE`` marker, then one rename to ``step_NNNNNN/``. A
crash mid-write leaves only a partial directory, never a half-written checkpoint under its final name.
A checkpoint is marked COMPLETE only when every learner rank's files are there: ``learner_rank{r}.pt``
for each of the config's ``learner.num_ranks`` ranks (never counted from the files this node sees: on a
cluster a rank on another node may have written elsewhere), and rank 0's shared state (``learner_state/``,
or ``learner_state.pt`` in older checkpoints) and ``actor/`` weights; ``COMPLETE`` lists them with their
SHA-256. On resume :meth:`RunDir.latest_checkpoint` verifies the manifest (and that list) of the newest
checkpoint and falls back to the previous one, with a warning, if a file is missing, truncated or corrupted.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen_async.config import RunConfig, dump_config

log = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
"""The marker of a finished checkpoint: JSON naming the learner ranks and the files they must have written."""
DRIVER_STATE = "driver_state.json"
"""The driver's part of a checkpoint: its step, the admission state, the budget spent."""
RECORDS = ("metrics.jsonl", "provenance.jsonl")
"""The run's records that :func:`pack_run` compresses."""
PACKED = ".gz"
"""The suffix of a packed record (``metrics.jsonl.gz``)."""


def record_file(path: Path) -> Path | None:
    """``path`` (``RUN_DIR/metrics.jsonl``), or its packed form when only that exists; ``None`` without either."""
    packed = path.with_name(path.name + PACKED)
    return path if path.is_file() else packed if packed.is_file() else None


def read_record(path: Path) -> str:
    """The text of a record, ``path`` or its packed form (:func:`record_file`); ``FileNotFoundError`` without either."""
    found = record_file(path)
    if found is None:
        raise FileNotFoundError(f"{path} (nor {path.name}{PACKED})")
    if found.suffix == PACKED:
        return gzip.decompress(found.read_bytes()).decode(errors="replace")
    return found.read_text(errors="replace")


def pack_run(path: Path) -> list[Path]:
    """Compress a run directory's plain records (:data:`RECORDS`) to ``<name>.gz`` and remove the plain files;
    returns the packed files. The same content always packs to the same bytes (no name or time in the header),
    and each file is read back and compared before its plain form goes. A run must not be writing meanwhile."""
    packed = []
    for name in RECORDS:
        plain = Path(path) / name
        if not plain.is_file():
            continue
        data = plain.read_bytes()
        buffer = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
            f.write(data)
        target = plain.with_name(name + PACKED)
        target.write_bytes(buffer.getvalue())
        if gzip.decompress(target.read_bytes()) != data:
            target.unlink()
            raise OSError(f"{target}: does not read back as {plain}; the plain file is kept")
        plain.unlink()
        packed.append(target)
    return packed


def unpack_run(path: Path) -> list[Path]:
    """Undo :func:`pack_run` where only the packed form exists (a resumed run appends to the plain file)."""
    restored = []
    for name in RECORDS:
        plain = Path(path) / name
        packed = plain.with_name(name + PACKED)
        if packed.is_file() and not plain.exists():
            plain.write_bytes(gzip.decompress(packed.read_bytes()))
            packed.unlink()
            restored.append(plain)
    return restored


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


class RelativeRunDir(ValueError):
    """A relative run directory on a multi-node run."""


def refuse_relative(path: str | Path, option: str, multi_node: str | None) -> None:
    """Refuse a relative run directory on a multi-node run (``multi_node``: why it is one, or ``None``): each
    node resolves the path against its own working directory (under Ray's Jobs API each node unpacks its own
    copy of the job's), so a learner rank on another node would write its checkpoint files there, out of
    the head's sight. ``option`` names where the path came from: ``run_root``, ``--run-dir`` or ``--resume``."""
    if multi_node is None or Path(path).is_absolute():
        return
    fix = {"run_root": "set run_root to a shared absolute path, e.g. run_root=/shared/runs",
           "--run-dir": "give --run-dir as a shared absolute path, e.g. --run-dir /shared/runs/NAME",
           "--resume": "give --resume the run directory's shared absolute path"}[option]
    raise RelativeRunDir(f"{option} {str(path)!r} is relative: on a multi-node run ({multi_node}) each node has "
                         f"its own working directory; {fix}")


class UnsharedRunDir(ValueError):
    """A run directory that some node of a multi-node run does not share (a node-local path)."""


def refuse_unshared(path: str | Path, option: str, blind_nodes: Callable[[Path, str], list[str]]) -> None:
    """Refuse a run directory that is not the same folder on every node, before anything trains: write a marker
    file holding a random token into it and ask ``blind_nodes(marker, token)`` which nodes do not read that token
    there. An absolute but node-local path (``/tmp``, ``/dev/shm``, a local disk) exists on every node, each its
    own: the learner ranks on other nodes would write their checkpoint files out of the driver's sight, and the
    first checkpoint would fail with nothing saved. ``option`` names where the path came from, as for
    :func:`refuse_relative`."""
    folder = Path(path).absolute()
    token = secrets.token_hex(16)
    marker = folder / f".shared-check-{token}"
    marker.write_text(token)
    try:
        blind = blind_nodes(marker, token)
    finally:
        marker.unlink(missing_ok=True)
    if blind:
        fix = {"run_root": "set run_root to a folder on a shared file system, e.g. run_root=/shared/runs",
               "--run-dir": "give --run-dir on a shared file system, e.g. --run-dir /shared/runs/NAME",
               "--resume": "resume from the run directory on a shared file system"}[option]
        raise UnsharedRunDir(f"{option} {str(path)!r} is not shared by every node: a file written there on this "
                             f"node is not seen from node(s) {', '.join(blind)}, where the learner ranks' checkpoint "
                             f"files would go to a folder of their own; {fix}")


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


class IncompleteCheckpoint(RuntimeError):
    """A checkpoint lacks a file a learner rank must have written; it is not marked COMPLETE."""


def learner_files(staging: Path, num_ranks: int) -> list[str]:
    """The files ``num_ranks`` learner ranks must have written into a checkpoint: ``learner_rank{r}.pt`` for
    each rank; rank 0's shared state: every part in its ``learner_state/`` folder (a part the learner does
    not have, as an optimizer before its first step, has no file) or else ``learner_state.pt`` (the older
    single file); and rank 0's actor: ``actor/config.json`` and its safetensors weights (``model.safetensors``,
    or every shard ``model.safetensors.index.json`` names)."""
    names = [f"learner_rank{r}.pt" for r in range(num_ranks)]
    shared = staging / "learner_state"
    if shared.is_dir():
        names += sorted(f"learner_state/{p.relative_to(shared)}" for p in shared.rglob("*") if p.is_file())
    else:
        names.append("learner_state.pt")
    names.append("actor/config.json")
    index = staging / "actor" / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        names += ["actor/model.safetensors.index.json"] + [f"actor/{s}" for s in shards]
    else:
        names.append("actor/model.safetensors")
    return names


def finalize_checkpoint(run_dir: RunDir, staging: Path, step: int, learner_ranks: int = 0) -> Path:
    """Write the manifest and the ``COMPLETE`` marker into ``staging``, then rename it to its final name.
    ``learner_ranks`` (the config's ``learner.num_ranks``; 0 for a runtime without a learner, as the
    simulated cluster's) learner ranks must each have written their files (:func:`learner_files`): if
    one is missing, :class:`IncompleteCheckpoint` is raised and ``staging`` stays unmarked."""
    required = learner_files(staging, learner_ranks) if learner_ranks else []
    if missing := [name for name in required if not (staging / name).is_file()]:
        raise IncompleteCheckpoint(
            f"checkpoint of step {step} is incomplete, not marked COMPLETE: {', '.join(missing)} missing from "
            f"{staging} (learner.num_ranks={learner_ranks}: every rank writes learner_rank{{r}}.pt, rank 0 also "
            f"learner_state and actor/; on a multi-node run the run directory must be on storage every node "
            f"shares)")
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(staging)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (staging / COMPLETE).write_text(json.dumps({"step": step, "learner_ranks": learner_ranks,
                                                "required": {name: manifest[name]["sha256"] for name in required}},
                                               indent=1))
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
    marker = path / COMPLETE
    try:  # (an empty marker, as older checkpoints have: no required files listed; checked by its manifest alone)
        complete = json.loads(marker.read_text()) if marker.is_file() and marker.stat().st_size else {}
    except json.JSONDecodeError as e:
        return f"unreadable {COMPLETE} marker: {e}"
    for name, sha in complete.get("required", {}).items():
        if manifest.get(name, {}).get("sha256") != sha:
            return f"{name} (learner files of {complete.get('learner_ranks')} rank(s)) is not in the manifest as marked"
    for name, entry in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, expected {entry['bytes']}"
        if _sha256(f) != entry["sha256"]:
            return f"{name} does not match its SHA-256"
    return None
