"""Byte-exact weight verification: every engine computes with exactly the tensors the learner published.

A sync can go wrong in ways that leave an engine serving, at the version it reports, weights other than the
published ones: a tensor skipped by the load, a fused layer rebuilt from one part, a tied output head whose
kernel kept an old copy of the embedding, a repack that did not rerun. At bf16 and a small step size the
log-prob probe (:mod:`ragen_async.weight_sync.probe`) cannot see that: one step moves few bf16 values by one
unit in the last place, less than the kernels' rounding differences. This check compares bytes instead.

Each engine reports a *served fingerprint* (:data:`ServedEntry` rows): for every tensor its forward reads, the
checkpoint tensor it stands for, the module that reads it, and a digest of the exact values it computes with
(the vLLM worker recovers a linear layer's weight through the layer's own kernel: see
``inference/vllm_worker_ext.py``). The learner digests what it published for that version in each reported
dtype (:func:`published_digests`), and :func:`check_served` compares the two, stopping the run with
:class:`WeightSyncMismatch` naming the engine, the tensor and the version at the first difference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import blake3
import torch

from ragen_async.weight_sync.base import WeightSyncError
from ragen_async.weight_sync.wire import dtype_from_name, dtype_name

ServedEntry = tuple[str, str, str, list[int], str]
"""``(checkpoint name, served by, dtype, shape, digest)``: one tensor an engine's forward reads. ``served
by`` names the engine's module (a tied output head reads the embedding: ``model.embed_tokens.weight`` served
by ``lm_head``); plain data, so it travels through vLLM's RPC and Ray unchanged."""

Digests = dict[tuple[str, str], tuple[list[int], str]]
"""``(checkpoint name, dtype) -> (shape, digest)`` of what the learner published."""


class WeightSyncMismatch(WeightSyncError):
    """An engine computes with other values than the learner published for the version it reports."""


def checks_due(syncs: int, *, verify_first: bool, verify_every: int, probe: bool) -> tuple[bool, bool]:
    """``(byte-exact check, log-prob probe)``: which checks run after the ``syncs``-th sync of a run (1 = the
    first), for ``weight_sync.verify_first``, ``verify_every`` and ``probe``. The check runs at the first sync
    when either ``verify_first`` or ``verify_every`` asks for it, and at every ``verify_every``-th; the probe
    only at every ``verify_every``-th (with ``probe``)."""
    nth = bool(verify_every) and syncs % verify_every == 0
    first = syncs == 1 and (verify_first or bool(verify_every))
    return first or nth, nth and probe


def tensor_digest(t: torch.Tensor) -> str:
    """A digest (BLAKE3, hex) of ``t``'s values: its bytes in row-major order (shape and dtype travel beside it)."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    h = blake3.blake3()
    if data.numel():
        h.update(memoryview(data.view(torch.uint8).numpy()))
    return h.hexdigest()


def served_entry(name: str, served_by: str, t: torch.Tensor) -> ServedEntry:
    """The :data:`ServedEntry` of tensor ``t``, read by ``served_by`` as checkpoint tensor ``name``."""
    return (name, served_by, dtype_name(t.dtype), list(t.shape), tensor_digest(t))


def needed_digests(served: Iterable[Sequence[ServedEntry]]) -> list[tuple[str, str]]:
    """The ``(checkpoint name, dtype)`` pairs the learner must digest to check every engine's report."""
    return sorted({(e[0], e[2]) for entries in served for e in entries})


def published_digests(named: Iterable[tuple[str, torch.Tensor]], needed: Iterable[tuple[str, str]]) -> Digests:
    """The learner's side: for each ``(name, dtype)`` in ``needed`` the digest of the published tensor
    ``name`` cast to ``dtype`` (an engine may keep a bias in float32 for its kernel, which is exact for
    bf16 values; a lossy cast would show as a mismatch, as it should), and ``(name, "") -> (shape, "")``
    for every published tensor, so a tensor no engine serves is noticed too."""
    dtypes: dict[str, list[str]] = {}
    for name, dtype in needed:
        dtypes.setdefault(name, []).append(dtype)
    out: Digests = {}
    for name, t in named:  # one tensor at a time: ``named`` may stream gathered buckets
        out[(name, "")] = (list(t.shape), "")
        for dtype in dtypes.get(name, []):
            cast = t if dtype_name(t.dtype) == dtype else t.to(dtype_from_name(dtype))
            out[(name, dtype)] = (list(cast.shape), tensor_digest(cast))
    return out


def served_differences(expected: Mapping[tuple[str, str], tuple[list[int], str]], served: Sequence[ServedEntry]
                       ) -> list[str]:
    """Every way one engine's report differs from what was published, one line each (empty: identical)."""
    problems = []
    seen = set()
    for name, by, dtype, shape, digest in served:
        seen.add(name)
        where = f"{name}" + ("" if by == name.removesuffix(".weight").removesuffix(".bias") else f" (as read by {by})")
        if (name, "") not in expected:
            problems.append(f"{where}: the engine computes with it, the learner published no such tensor")
            continue
        want_shape, want = expected.get((name, dtype), expected[(name, "")])
        if list(shape) != list(want_shape):
            problems.append(f"{where}: shape {list(shape)} served, {list(want_shape)} published")
        elif digest != want:
            problems.append(f"{where}: its {dtype} values differ from the published ones")
    problems += [f"{name}: published, but the engine's forward reads no such tensor"
                 for name, dtype in sorted(expected) if not dtype and name not in seen]
    return problems


def check_served(expected: Mapping[tuple[str, str], tuple[list[int], str]],
                 served: Sequence[tuple[int, Sequence[ServedEntry]]], *, version: int) -> int:
    """Compare every engine's served fingerprint (``(the version it reports, entries)`` per engine) with the
    digests of ``version``; returns the number of tensors checked per engine, or raises
    :class:`WeightSyncMismatch` naming each differing engine, its first differing tensors and the version."""
    bad = []
    for i, (engine_version, entries) in enumerate(served):
        if int(engine_version) != int(version):
            bad.append(f"engine {i} reports version {engine_version}")
            continue
        problems = served_differences(expected, entries)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            bad.append(f"engine {i}: {len(problems)} tensor(s) differ: " + "; ".join(problems[:3]) + more)
    if bad:
        raise WeightSyncMismatch(
            f"byte-exact weight check after publishing version {version}: " + " | ".join(bad) + ". The engine "
            "serves other weights than the learner published for this version (a load skipped, a tied head "
            "left behind, a kernel not repacked), so its samples' versions would be wrong; stopping the run")
    return max((len(entries) for _, entries in served), default=0)
