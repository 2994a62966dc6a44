"""FSDP2 on 2 gloo ranks with uneven shards: the buffer balances shards by tokens, so ranks get different
row counts and pack different numbers of micro-batches. Every forward and backward of a sharded model is a
collective, so each rank must run as many as the rank with the most (``Learner._padded``), or the group
waits until its timeout. Each decoder layer is its own FSDP unit."""

from __future__ import annotations

import dataclasses
import datetime

import torch

from ragen_async.learner.learner import Learner
from tests.learner.test_fsdp import STEP_ATOL, STEP_OUTLIERS
from tests.learner.test_train_step import leave_group, make_cfg, make_shard, spawn_ranks

OVERRIDES = ("learner.mini_batch_size=16", "learner.micro_batch_size=2", "learner.strategy=fsdp")
SPLIT = 12
"""Rank 0 gets 12 of the 16 trajectories (6 micro-batches), rank 1 four (2 micro-batches)."""
GROUP_TIMEOUT_S = 60
"""A rank left waiting in a collective fails after this long instead of hanging the test."""


def _split(shard, lo: int, hi: int, rank: int):
    take = slice(lo, hi)
    return dataclasses.replace(shard, trajectories=shard.trajectories[take], scores=shard.scores[take],
                               normalized_scores=shard.normalized_scores[take], rank=rank, world_size=2)


def _rank(rank, world, init, model_path, shard, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    learner = Learner(make_cfg(model_path, *OVERRIDES), rank=rank, world_size=world)
    units = sum(isinstance(m, FSDPModule) for m in learner.actor_head.modules())
    metrics = learner.train_step(shard).metrics
    weights = {n: t.clone() for n, t in learner.full_weights()}
    torch.save({"units": units, "layers": learner.actor.config.num_hidden_layers, "metrics": metrics,
                "weights": weights}, out / f"rank{rank}.pt")
    leave_group()


def test_fsdp_with_uneven_shards_steps_as_one_process_does(tiny_model_path, tmp_path):
    cfg = make_cfg(tiny_model_path, *OVERRIDES)
    whole = make_shard(tiny_model_path, cfg)[0]
    assert len(whole.trajectories) == 16
    shards = [_split(whole, 0, SPLIT, 0), _split(whole, SPLIT, 16, 1)]
    single = Learner(cfg)
    single.train_step(whole)
    expected = dict(single.named_weights())

    spawn_ranks(_rank, lambda r: (tiny_model_path, shards[r], tmp_path))
    rank0 = torch.load(tmp_path / "rank0.pt")
    assert rank0["units"] == rank0["layers"] + 1  # one per decoder layer, and the root
    diffs = torch.cat([(rank0["weights"][n] - t).abs().flatten() for n, t in expected.items()])
    outliers, bound = STEP_OUTLIERS
    assert int((diffs > STEP_ATOL).sum()) <= outliers and diffs.max().item() <= bound, diffs.max().item()
