"""The learner keeps every tensor on its device: a whole step (and the probe) run on torch's ``meta``
device under an op-level audit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ragen_async.learner.learner import Learner
from tests.learner.test_train_step import make_cfg, make_shard

aten = torch.ops.aten

# Ops that move data between devices on purpose: the host -> device copies of collation and of the
# host-planned indices. Any other op touching a CPU tensor of one element or more is a mistake.
_TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten.lift_fresh.default, aten.lift_fresh_copy.default}


class DeviceAudit(TorchDispatchMode):
    """Records every aten op (forward, backward, optimizer, collectives' inputs) that takes or makes a
    tensor off ``device``, except explicit transfers. 0-dim CPU tensors are let through, as CUDA does
    (a CPU scalar tensor mixes with device tensors; AdamW's step counter is one)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self.offenders: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if func not in _TRANSFERS:
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor) and t.device.type != self.device and t.dim() > 0:
                    self.offenders.append(f"{func}: {t.device} tensor of shape {tuple(t.shape)}")
        return out


class MetaLearner(Learner):
    """A Learner whose device reads (``_fetch``, the only one) return zeros: a meta tensor has no data.
    It checks that what would be read back is on the learner's device."""

    def _fetch(self, values: torch.Tensor) -> list[float]:
        assert values.device == self.device, values.device
        return [0.0] * values.numel()


def _run_on_meta(model_path, monkeypatch, *overrides):
    cfg = make_cfg(model_path, "learner.logits_chunk_tokens=16", *overrides)
    shard = make_shard(model_path, cfg)[0]
    learner = MetaLearner(cfg, device="meta")
    assert next(learner.actor.parameters()).device.type == "meta"
    # Pretend to be one rank of several so the collectives run: NCCL only reduces device tensors.
    reduced = []

    def all_reduce(t, *args, **kwargs):
        assert t.device == learner.device, f"all_reduce of a {t.device} tensor"
        reduced.append(t.shape)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    learner.distributed = True
    audit = DeviceAudit("meta")
    with audit:
        result = learner.train_step(shard)
        probe = learner.probe_logprobs(shard.trajectories[0].token_ids.tolist()[:40])
    assert audit.ops > 1000 and reduced  # the step really ran through the mode and the collectives
    assert not audit.offenders, "\n".join(sorted(set(audit.offenders)))
    assert len(probe) == 40
    return learner, result


def test_a_gae_step_with_critic_and_reference_keeps_every_tensor_on_the_device(tiny_model_path, monkeypatch):
    """The model and the batch live on torch's ``meta`` device (shapes, no data), which refuses to mix
    with CPU tensors as CUDA does; a dispatch mode records every op that still touches a CPU tensor
    (meta, unlike CUDA, lets gather and indexing take CPU indices, the audit does not). So a CPU tensor
    created by mistake anywhere in the step (collation, recompute, GAE and whitening, losses, backward,
    optimizer, metrics, all-reduce) fails this test. Meta has no values, so the learner's one
    device-to-host read (``_fetch``) returns zeros here; everything before it runs for real."""
    learner, result = _run_on_meta(tiny_model_path, monkeypatch, "algo.kl_coef=0.01")
    assert learner.critic is not None and learner.ref is not None
    # (lag_sums ran on the device too; with meta's zeros every lag bucket is empty, so none is logged)
    assert {"actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "critic/vf_explained_var"} <= set(result.metrics)
    assert result.metrics["learner/optimizer_steps"] == 2  # two mini-batches: the recompute pass ran too


def test_a_grpo_step_keeps_every_tensor_on_the_device(tiny_model_path, monkeypatch):
    """As above for GRPO (no critic: group-normalised scores broadcast over the reply tokens)."""
    learner, result = _run_on_meta(tiny_model_path, monkeypatch, "algo.adv_estimator=grpo")
    assert learner.critic is None and "actor/pg_loss" in result.metrics
