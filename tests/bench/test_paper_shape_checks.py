"""`make paper-shape`'s learner-path checks (``bench/paper_shape.py``, ``learner_path_checks``): they pass only on
step records of a run that took the paths of the paper's learner a one-shard, one-pass step never takes."""

from __future__ import annotations

from pathlib import Path

from ragen_async.bench.paper_shape import CONFIG, VARIANTS, learner_path_checks
from ragen_async.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _cfg(strategy: str):
    return load_config(REPO / CONFIG, VARIANTS[strategy]["overrides"])


def _record(**over) -> dict:
    rec = {"batch/shard_seqs_max": 5.0, "batch/shard_seqs_min": 4.0, "learner/micro_batches": 1.5,
           "learner/padded_micro_batches": 1.0, "learner/optimizer_steps": 2.0, "batch/num_groups": 3.0,
           "actor/kl_loss": 1e-4, "weight_sync/verified_tensors": 99.0, "weight_sync/verify_s": 2.0}
    return {**rec, **over}


def test_the_shape_config_sends_the_paper_learner_down_every_path():
    cfg = _cfg("ddp")
    assert cfg.learner.strategy == "ddp" and cfg.algo.use_ref and cfg.learner.num_ranks == 2
    assert _cfg("fsdp").learner.strategy == "fsdp" and not _cfg("fsdp").algo.use_ref
    kept = int(cfg.algo.filter_ratio * cfg.rollout.groups_per_step)
    seqs = kept * cfg.rollout.group_size
    assert cfg.algo.filter_mode == "std" and 1 < kept < cfg.rollout.groups_per_step
    assert seqs % cfg.learner.num_ranks == 1  # an odd count on two ranks: the shards cannot be even
    largest = -(-seqs // cfg.learner.num_ranks)  # the larger shard's rows, split between the 2 mini-batches
    assert round(seqs / cfg.learner.mini_batch_size) == 2 and cfg.learner.micro_batch_size < -(-largest // 2)
    assert cfg.weight_sync.verify_every == 1


def test_records_of_such_a_run_pass_every_check():
    results = learner_path_checks([_record(), _record(**{"learner/padded_micro_batches": 0.0})], _cfg("ddp"))
    assert [ok for _, ok, _ in results] == [True] * 6, results


def test_records_of_a_one_shard_one_pass_step_fail_each_check():
    old = _record(**{"batch/shard_seqs_min": 5.0, "learner/micro_batches": 1.0, "learner/padded_micro_batches": 0.0,
                     "learner/optimizer_steps": 1.0, "batch/num_groups": 1.0})
    del old["actor/kl_loss"], old["weight_sync/verified_tensors"]
    results = learner_path_checks([old], _cfg("ddp"))
    assert [ok for _, ok, _ in results] == [False] * 6, results
    assert len(learner_path_checks([old], _cfg("fsdp"))) == 5  # no reference model there
