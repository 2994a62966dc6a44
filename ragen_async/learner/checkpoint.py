"""A learner's checkpoint: what :meth:`Learner.save_checkpoint` writes and :meth:`Learner.load_checkpoint` reads.

Every tensor is kept in the learner's master precision (fp32). Models and optimizers are saved as full,
unsharded state dicts keyed by parameter name, so a checkpoint loads under any strategy (one process, DDP,
FSDP) and rank count: ``actor/`` (Hugging Face layout with the tokenizer: a model directory), ``learner_state/``
(rank 0: one file per part, so rank 0 holds one full part at a time) and each rank's ``learner_rank{r}.pt``
(version, RNG states, the caller's ``extra``). Earlier layouts (all parts in ``learner_state.pt``, or in every
rank's file) still load.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from ragen_async.config import RunConfig


class Learner(Protocol):
    """What a checkpoint reads and writes of a learner (``learner.Learner``; named here by what it has, so that
    this module does not import the one that imports it)."""

    cfg: RunConfig
    rank: int
    distributed: bool
    sharded: bool
    policy_version: int
    skipped_steps: int
    actor: nn.Module
    actor_head: nn.Module
    actor_opt: torch.optim.Optimizer
    critic: nn.Module | None
    critic_opt: torch.optim.Optimizer | None
    ref: nn.Module | None

    def _reshard(self) -> None: ...

    def _all_gather(self, value: Any) -> list[Any]: ...

log = logging.getLogger(__name__)

SHARED_STATE = "learner_state"
"""The checkpoint folder (written by rank 0) with the optimizer, critic and reference states, one file per
part (``actor_opt.pt``, ``critic.pt``, ``critic_opt.pt``, ``ref.pt``; an absent part has no file), so rank 0
holds one full part at a time: at Qwen2.5-0.5B's size an optimizer's full state is 4 GB."""
OLD_SHARED_STATE = "learner_state.pt"
"""The same parts in one file, as earlier checkpoints hold them."""
SHARED_PARTS = ("actor_opt", "critic", "critic_opt", "ref")

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Full (unsharded) state dicts, gathered to rank 0's CPU; the other ranks get empty ones."""


def save(learner: Learner, path: Path, extra: dict | None = None, write_weights: bool = True) -> None:
    """Write ``learner_rank{rank}.pt`` (version, RNG, ``extra``) and, on rank 0, ``learner_state/``
    (optimizers, critic, reference model) and, with ``write_weights``, the actor in Hugging Face
    layout with its tokenizer. Models and optimizers are saved as full, unsharded state dicts keyed
    by parameter name, so a checkpoint loads under any strategy and rank count. Shared files are
    written by rank 0 alone (no rank races on them). Under FSDP this is a collective (every rank
    takes part in the gathers); otherwise the ranks need not call it together. The caller waits
    for every rank's save before finalising the checkpoint."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    learner._reshard()
    gathers = learner.sharded or learner.rank == 0  # ranks that take part in building the shared files
    if write_weights and gathers:
        weights = get_model_state_dict(learner.actor_head, options=_FULL)
        if learner.rank == 0:
            from transformers import AutoTokenizer

            # A gathered state dict holds tied weights (lm_head = embeddings) as separate copies;
            # write each once, as save_pretrained does for the live (shared) tensors.
            tied = _aliases(learner.actor)
            weights = {k: v for k, v in _strip(weights, "lm.").items() if k not in tied}
            learner.actor.save_pretrained(path / "actor", state_dict=weights)
            # With its tokenizer, a checkpoint's actor is a model directory (model.path=.../actor).
            AutoTokenizer.from_pretrained(learner.cfg.model.path).save_pretrained(path / "actor")
    if gathers:
        parts = {
            "actor_opt": lambda: _full_optim(learner.actor_head, learner.actor_opt),
            "critic": lambda: get_model_state_dict(learner.critic, options=_FULL) if learner.critic is not None else None,
            "critic_opt": lambda: _full_optim(learner.critic, learner.critic_opt) if learner.critic is not None else None,
            "ref": lambda: get_model_state_dict(learner.ref, options=_FULL) if learner.ref is not None else None,
        }
        if learner.rank == 0:
            (path / SHARED_STATE).mkdir(exist_ok=True)
        for name, gather in parts.items():  # one full part in memory at a time
            part = gather()
            if learner.rank == 0 and part is not None:
                torch.save(part, path / SHARED_STATE / f"{name}.pt")
            del part
    state = {
        "policy_version": learner.policy_version,
        "skipped_steps": learner.skipped_steps,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "extra": extra or {},
    }
    torch.save(state, path / f"learner_rank{learner.rank}.pt")

def _full_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict | None:
    # An optimizer that never stepped has no state; get_optimizer_state_dict would initialise it
    # with a zero step (counted by Adam's bias correction), so save nothing instead.
    return get_optimizer_state_dict(model, opt, options=_FULL) if opt.state else None

def load(learner: Learner, path: Path) -> dict:
    """Restore a checkpoint written by :func:`save` under any strategy and rank count
    (a rank without its own ``learner_rank{r}.pt`` takes rank 0's), or an older one with the
    optimizers and critic in every rank's file. With several ranks this is a collective: rank 0
    reads the shared files and broadcasts them (sharding them under FSDP)."""
    path = Path(path)
    learner._reshard()
    # Read, then agree: a rank that failed to read must not leave the others waiting in a collective.
    weights: dict[str, torch.Tensor] = {}
    present: dict[str, bool] = {}
    try:
        own = path / f"learner_rank{learner.rank}.pt"
        if not own.exists():
            log.warning("%s not in checkpoint %s (written by fewer ranks): using rank 0's", own.name, path)
            own = path / "learner_rank0.pt"
        state = torch.load(own, weights_only=False)
        if learner.rank == 0:  # rank 0 reads the shared files and broadcasts them, one part at a time
            weights = _read_actor(learner, path)
            present = _shared_parts(learner, path)
        error = None
    except Exception as e:
        error = e
    # Which parts the checkpoint holds (rank 0 knows): every rank must run the same collectives.
    reports = learner._all_gather((None if error is None else f"rank {learner.rank}: {error!r}", present))
    if error is not None:
        raise error
    if failed := [e for e, _ in reports if e is not None]:
        raise RuntimeError(f"cannot load checkpoint {path}: {'; '.join(failed)}")
    present = reports[0][1]
    if learner.critic is not None and not present["critic"]:
        raise RuntimeError(f"checkpoint {path} has no critic, but algo.adv_estimator needs one")
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=learner.distributed, strict=False)
    set_model_state_dict(learner.actor_head, weights, options=opts)
    del weights
    strict = dataclasses.replace(opts, strict=True)

    def part(name: str) -> dict:
        return _read_part(learner, path, name) if learner.rank == 0 else {}

    if present["actor_opt"]:
        set_optimizer_state_dict(learner.actor_head, learner.actor_opt, part("actor_opt"), options=opts)
    else:  # saved before the first step
        learner.actor_opt.state.clear()
    if learner.critic is not None:
        set_model_state_dict(learner.critic, part("critic"), options=strict)
        if present["critic_opt"]:
            set_optimizer_state_dict(learner.critic, learner.critic_opt, part("critic_opt"), options=opts)
        else:
            learner.critic_opt.state.clear()
    if learner.ref is not None and present["ref"]:
        set_model_state_dict(learner.ref, part("ref"), options=strict)
    learner.policy_version = state["policy_version"]
    learner.skipped_steps = state["skipped_steps"]
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state["extra"]

def _shared_parts(learner: Learner, path: Path) -> dict[str, bool]:
    """Rank 0: which of :data:`SHARED_PARTS` the checkpoint holds."""
    if (path / SHARED_STATE).is_dir():
        return {name: (path / SHARED_STATE / f"{name}.pt").is_file() for name in SHARED_PARTS}
    return {name: value is not None for name, value in _read_old_shared(learner, path).items()}

def _read_part(learner: Learner, path: Path, name: str) -> dict:
    """Rank 0: one part of the shared state, as a full state dict keyed by parameter name."""
    if (path / SHARED_STATE).is_dir():
        return torch.load(path / SHARED_STATE / f"{name}.pt", weights_only=False)
    return _read_old_shared(learner, path)[name]

def _read_old_shared(learner: Learner, path: Path) -> dict:
    """Rank 0: the shared state of an earlier checkpoint (small models only): all parts in
    ``learner_state.pt``, or, older still, in each rank's file with the optimizer states keyed by
    parameter index (the order of ``parameters()``, the same under every strategy)."""
    if (path / OLD_SHARED_STATE).exists():
        return torch.load(path / OLD_SHARED_STATE, weights_only=False)
    old = torch.load(path / "learner_rank0.pt", weights_only=False)
    actor_names = [f"lm.{n}" for n, _ in learner.actor.named_parameters()]
    critic_names = [n for n, _ in learner.critic.named_parameters()] if learner.critic is not None else []
    return {"actor_opt": _by_name(old["actor_opt"], actor_names),
            "critic": old.get("critic"),
            "critic_opt": _by_name(old.get("critic_opt"), critic_names),
            "ref": old.get("ref")}

def _read_actor(learner: Learner, path: Path) -> dict[str, torch.Tensor]:
    """Rank 0: the checkpoint's actor weights, keyed as in ``actor_head``, checked against the model
    (a tied ``lm_head`` is not saved)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted((path / "actor").glob("*.safetensors")):
        weights.update({f"lm.{k}": v for k, v in load_file(str(f)).items()})
    expected = set(learner.actor_head.state_dict())
    missing = sorted(k for k in expected - weights.keys() if "lm_head" not in k)
    unexpected = sorted(weights.keys() - expected)
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing={missing} unexpected={unexpected}")
    return weights


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _aliases(model: nn.Module) -> set[str]:
    """State-dict keys whose tensor is an earlier key's (tied weights)."""
    seen: set[int] = set()
    aliases = set()
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in seen:
            aliases.add(k)
        seen.add(id(v))
    return aliases


def _by_name(osd: dict | None, names: list[str]) -> dict | None:
    """An optimizer state dict keyed by parameter index -> keyed by name (get_optimizer_state_dict's
    full layout); ``None`` when there is no state (an optimizer that never stepped)."""
    if not osd or not osd["state"]:
        return None
    return {"state": {names[i]: s for i, s in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
