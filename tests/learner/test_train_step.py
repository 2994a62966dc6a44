"""The learner on the tiny model: a step, its bookkeeping, checkpoint round trip, data parallelism."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from ragen_async import algo
from ragen_async.agent.chat import ChatFormat
from ragen_async.agent.episode import AgentLimits, ScriptedPolicy, play_group
from ragen_async.config import load_config
from ragen_async.envs.registry import make_env_from_tag
from ragen_async.learner.learner import Learner
from ragen_async.staleness.buffer import TrajectoryBuffer
from ragen_async.staleness.ids import format_group_id
from ragen_async.weight_sync.wire import adjacent_bytes


def make_cfg(model_path, *overrides):
    return load_config(None, [f"model.path={model_path}", "rollout.group_size=4", "learner.mini_batch_size=8",
                              "learner.micro_batch_size=3", "learner.actor_lr=1e-3", "learner.critic_lr=1e-3",
                              "rollout.envs=[{tag: SimpleSokoban, n_groups: 4}]", *overrides])


def make_shard(model_path, cfg, num_ranks=1):
    """A real batch: random-policy Sokoban groups through the real agent and buffer code."""
    chat = ChatFormat.from_pretrained(model_path)
    policy = ScriptedPolicy(chat, "random", actions_per_turn=2, seed=0)
    limits = AgentLimits(max_turns=3, max_actions_per_turn=2, max_tokens_per_turn=64, context_budget_tokens=2048)

    async def groups():
        return await asyncio.gather(*[
            play_group(policy, chat, lambda: make_env_from_tag("SimpleSokoban"), "SimpleSokoban", 100 + i, 4, limits,
                       group_id=format_group_id(i), index=i) for i in range(4)])

    buffer = TrajectoryBuffer(4, max_staleness=0, filter_mode="none", filter_ratio=1.0, num_ranks=num_ranks)
    for g in asyncio.run(groups()):
        buffer.add(g, 0, 0.0)
    shards = buffer.next_batch(0, 0, 0.0).shards
    return shards


def _traced(target, trace: str, *args) -> None:
    """A rank's body, with a dump of every thread's stack to ``trace`` should it run past the test's limit."""
    import faulthandler

    with open(trace, "w") as f:
        faulthandler.dump_traceback_later(SPAWN_LIMIT_S - 30, file=f)
        target(*args)
        faulthandler.cancel_dump_traceback_later()


SPAWN_LIMIT_S = 300
"""How long a spawned rank may take; a rank still running then fails the test with its stacks."""


def leave_group() -> None:
    """A spawned rank's last line, once its results are saved: leave the group and exit at once, without running
    destructors. A rank once hung (about 1 suite run in 10) after its work and ``destroy_process_group`` were done,
    in the C++ teardown of its learner's gloo state while its peer exited (its stack: no Python frame of the rank's
    body, a native thread); the teardown races with the peer closing its sockets, which these tests do not check."""
    import faulthandler
    import os
    import sys

    import torch.distributed as dist

    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(target, make_args, world: int = 2) -> None:
    """Run ``target(rank, world, init, *make_args(rank))`` in ``world`` spawned processes (one gloo group,
    ``init`` its ``init_method``) and require each to exit cleanly. The group meets through a file, not a
    port: a port picked free here can be taken by another process before rank 0 binds it, and a rank that
    then reaches something else's socket waits out the group's timeout. A target ends with :func:`leave_group`."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="ranks-")
    init = f"file://{tmp}/rendezvous"
    traces = [f"{tmp}/rank{r}.trace" for r in range(world)]
    procs = [ctx.Process(target=_traced, args=(target, traces[r], r, world, init, *make_args(r))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SPAWN_LIMIT_S
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    stacks = "".join(f"--- rank {r}:\n{open(traces[r]).read()}" for r in stuck)
    assert not stuck, f"rank(s) {stuck} still running after {SPAWN_LIMIT_S} s:\n{stacks}"
    assert [p.exitcode for p in procs] == [0] * world


def test_train_step_advances_version_and_reports_metrics(tiny_model_path):
    cfg = make_cfg(tiny_model_path)
    learner = Learner(cfg)
    before = [p.detach().clone() for p in learner.actor.parameters()]
    result = learner.train_step(make_shard(tiny_model_path, cfg)[0])
    metrics = result.metrics
    # 16 trajectories, mini-batch 8 -> two optimizer steps, but one learner step -> version 1 (the
    # version unit is the learner step: admission and fixed-lag count in it)
    assert metrics["learner/optimizer_steps"] == 2
    assert metrics["learner/compute_bits"] == 32.0  # float32: what the actor's matmuls produced
    assert metrics["learner/micro_batches"] >= 1 and metrics["learner/padded_micro_batches"] == 0  # one rank
    assert learner.policy_version == result.version == 1
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl",
                "critic/vf_loss", "mismatch/k3_kl"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.actor.parameters(), strict=True))


def test_grpo_needs_no_critic(tiny_model_path):
    cfg = make_cfg(tiny_model_path, "algo.adv_estimator=grpo")
    learner = Learner(cfg)
    assert learner.critic is None
    metrics = learner.train_step(make_shard(tiny_model_path, cfg)[0]).metrics
    assert "critic/vf_loss" not in metrics and math.isfinite(metrics["actor/pg_loss"])


def test_the_critic_has_no_dropout_in_train_mode(random_tiny_qwen2):
    """The value head's dropout (Transformers' default 0.1 for a token classifier) is off in the model as built,
    so a forward in train mode gives the same values twice."""
    from ragen_async.learner.learner import load_critic

    critic = load_critic(random_tiny_qwen2).train()
    assert [m.p for m in critic.modules() if isinstance(m, torch.nn.Dropout)] == [0.0]
    ids = torch.arange(1, 30)[None]
    with torch.no_grad():
        torch.testing.assert_close(critic(input_ids=ids).logits, critic(input_ids=ids).logits, rtol=0, atol=0)


def test_seq_mean_token_mean_does_not_count_a_row_without_trained_tokens(tiny_model_path):
    """``seq-mean-token-mean`` is a mean over sequences of each one's token mean: a row whose loss mask is all
    zero adds nothing to the sum and is no sequence of the mean, so a batch with such a row steps as without it."""
    import dataclasses

    import numpy as np

    from ragen_async.protocol import NO_VERSION

    cfg = make_cfg(tiny_model_path, "algo.loss_agg_mode=seq-mean-token-mean", "learner.mini_batch_size=64",
                   "algo.adv_estimator=grpo")  # the actor's loss is enough (no critic: half the time)
    shard = make_shard(tiny_model_path, cfg)[0]
    first = shard.trajectories[0]
    empty = dataclasses.replace(first, traj_id=f"{first.traj_id}-untrained", loss_mask=np.zeros_like(first.loss_mask),
                                behaviour_logprobs=np.zeros_like(first.behaviour_logprobs),
                                token_versions=np.full_like(first.token_versions, NO_VERSION))
    with_empty = dataclasses.replace(shard, trajectories=(*shard.trajectories, empty),
                                     scores=np.append(shard.scores, np.float32(0)),
                                     normalized_scores=np.append(shard.normalized_scores, np.float32(0)))
    expected = Learner(cfg).train_step(shard).metrics
    got = Learner(cfg).train_step(with_empty).metrics
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-8), key


def test_non_finite_gradient_skips_the_step(tiny_model_path):
    cfg = make_cfg(tiny_model_path, "algo.adv_estimator=grpo")
    learner = Learner(cfg)
    shard = make_shard(tiny_model_path, cfg)[0]
    with torch.no_grad():
        next(learner.actor.parameters()).mul_(float("nan"))
    poisoned = [p.detach().clone() for p in learner.actor.parameters()]
    learner.train_step(shard)
    assert learner.skipped_steps == 2
    for a, b in zip(poisoned, learner.actor.parameters(), strict=True):
        assert torch.equal(a.nan_to_num(), b.detach().nan_to_num())  # no optimizer step happened


@pytest.mark.slow
def test_checkpoint_resume_reproduces_the_next_step(tiny_model_path, tmp_path):
    cfg = make_cfg(tiny_model_path)
    shard = make_shard(tiny_model_path, cfg)[0]
    a = Learner(cfg)
    a.train_step(shard)
    a.save_checkpoint(tmp_path / "ckpt", extra={"step": 1})
    expected = a.train_step(shard).metrics

    torch.manual_seed(1234)  # resume must not depend on the fresh process's RNG state
    b = Learner(cfg)
    assert b.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
    assert b.policy_version == 1
    got = b.train_step(shard).metrics
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "actor/entropy"):
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-7), key
    for pa, pb in zip(a.actor.parameters(), b.actor.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)
    # The published weights lie in one flat buffer (sent without packing), after steps and a load too.
    for learner in (a, b):
        assert adjacent_bytes([t for _, t in learner.named_weights()], torch.float32) is not None
    # The saved actor is a complete model directory: evaluating a checkpoint needs nothing else.
    ChatFormat.from_pretrained(tmp_path / "ckpt" / "actor")


# One mini-batch; small logits chunks so DDP also sees the chunked, recomputed vocabulary head.
DDP_OVERRIDES = ("learner.mini_batch_size=16", "learner.logits_chunk_tokens=32")


def _ddp_rank(rank, world, init, model_path, shard, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    learner = Learner(make_cfg(model_path, *DDP_OVERRIDES), rank=rank, world_size=world)
    torch.save(learner.train_step(shard).metrics, out / f"rank{rank}.pt")
    leave_group()


@pytest.mark.slow
def test_two_ranks_give_the_single_process_gradient(tiny_model_path, tmp_path):
    """Global token counts + all-reduced whitening: 2-rank DDP computes the single-process gradient.

    Compared through the all-reduced gradient norm and the per-rank loss shares (which must sum to the
    single-process loss). Parameters are not compared: Adam's first step is ~lr*sign(g), so float
    rounding in near-zero gradient entries would flip signs without meaning anything.
    """
    from ragen_async.learner.learner import merge_rank_metrics

    cfg = make_cfg(tiny_model_path, *DDP_OVERRIDES)
    single = Learner(cfg).train_step(make_shard(tiny_model_path, cfg, num_ranks=1)[0]).metrics
    shards = make_shard(tiny_model_path, cfg, num_ranks=2)
    assert {len(s.trajectories) for s in shards} != {0}
    spawn_ranks(_ddp_rank, lambda r: (tiny_model_path, shards[r], tmp_path))
    merged = merge_rank_metrics([torch.load(tmp_path / f"rank{r}.pt") for r in range(2)])
    for key in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "critic/vf_loss", "actor/entropy"):
        assert merged[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key
    assert merged["learner/num_tokens"] == single["learner/num_tokens"]  # the batch's, not a rank's mean


def test_merged_metrics_count_the_tokens_of_every_rank():
    """``learner/num_tokens`` is what ``throughput/learner_tokens_per_s`` divides: the batch's trained tokens
    (summed over ranks), not their mean over ranks; norms and means stay averaged."""
    from ragen_async.learner.learner import merge_rank_metrics

    merged = merge_rank_metrics([{"learner/num_tokens": 300.0, "actor/grad_norm": 2.0},
                                 {"learner/num_tokens": 100.0, "actor/grad_norm": 2.0}])
    assert merged == {"learner/num_tokens": 400.0, "actor/grad_norm": 2.0}


def _checkpoint_rank(rank, world, init, model_path, shard, ckpt, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cfg = make_cfg(model_path, "learner.mini_batch_size=16")
    learner = Learner(cfg, rank=rank, world_size=world)
    learner.train_step(shard)
    written_alone = None
    if rank == 1:  # rank 1 saves first, alone: it writes its own state and nothing shared
        learner.save_checkpoint(ckpt, extra={"step": 1})
        written_alone = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    dist.barrier()
    if rank == 0:
        learner.save_checkpoint(ckpt, extra={"step": 1})
    dist.barrier()
    resumed = Learner(cfg, rank=rank, world_size=world)
    extra = resumed.load_checkpoint(ckpt)
    same = all(torch.equal(a, b) for a, b in zip(learner.actor.parameters(), resumed.actor.parameters(), strict=True))
    same_critic = all(torch.equal(a, b) for a, b in
                      zip(learner.critic.parameters(), resumed.critic.parameters(), strict=True))
    torch.save({"written_alone": written_alone, "extra": extra, "version": resumed.policy_version,
                "same_actor": same, "same_critic": same_critic}, out / f"ckpt_rank{rank}.pt")
    leave_group()


@pytest.mark.slow
def test_two_ranks_checkpoint_without_racing_on_the_shared_actor_files(tiny_model_path, tmp_path):
    """Each rank writes its own ``learner_rank{r}.pt``; only rank 0 writes the actor (weights and
    tokenizer), which every rank shares. Rank 1 saves first, alone, so any shared file it wrote would
    show; then both ranks resume from the checkpoint."""
    cfg = make_cfg(tiny_model_path, "learner.mini_batch_size=16")
    shards = make_shard(tiny_model_path, cfg, num_ranks=2)
    ckpt = tmp_path / "ckpt"
    spawn_ranks(_checkpoint_rank, lambda r: (tiny_model_path, shards[r], ckpt, tmp_path))
    results = [torch.load(tmp_path / f"ckpt_rank{r}.pt") for r in range(2)]
    assert results[1]["written_alone"] == ["learner_rank1.pt"]
    files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
    assert {"learner_rank0.pt", "learner_rank1.pt", "actor/config.json", "actor/model.safetensors"} <= files
    for r in results:
        assert r["extra"] == {"step": 1} and r["version"] == 1 and r["same_actor"] and r["same_critic"]


def test_pack_rows_caps_rows_and_padded_tokens():
    from ragen_async.learner.batch import pack_rows

    lengths = [300, 900, 120, 700, 880, 650, 90, 310]
    groups = pack_rows(lengths, max_rows=3, max_tokens=2000)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) <= 3
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 2000
        assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)
    # padded tokens: far fewer than one micro-batch of rows in their order would pad to
    assert sum(len(g) * max(lengths[i] for i in g) for g in groups) < 3 * (900 + 880 + 310)
    plain = pack_rows(lengths, max_rows=3)  # rows only: contiguous, in order, even sizes
    assert [i for g in plain for i in g] == list(range(8)) and sorted(map(len, plain)) == [2, 3, 3]


def test_logits_only_at_trained_tokens_match_the_full_forward(tiny_model_path):
    """TokenLogits computes the vocabulary head only where the loss mask is 1; the log-probs and
    entropies there equal those of a full forward with an attention mask (right padding)."""
    from ragen_async import algo
    from ragen_async.learner.batch import collate_shard

    cfg = make_cfg(tiny_model_path)
    learner = Learner(cfg)
    batch = collate_shard(make_shard(tiny_model_path, cfg)[0], learner.pad_id).select(slice(0, 6)).trimmed()
    with torch.no_grad():
        logprobs, entropy = learner._policy_forward(learner.actor_head, batch, with_entropy=True)
        logits = learner.actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        logits = logits[:, :-1] / learner.temperature
        full_lp = algo.logprobs_from_logits(logits, batch.input_ids[:, 1:])
        full_ent = algo.entropy_from_logits(logits)
    mask = batch.loss_mask[:, 1:] > 0
    assert mask.sum() > 20 and (batch.loss_mask[:, 1:] == 0).sum() > mask.sum()  # most tokens are not trained
    assert torch.allclose(logprobs[:, 1:][mask], full_lp[mask], atol=1e-4)
    assert torch.allclose(entropy[:, 1:][mask], full_ent[mask], atol=1e-4)
    assert (logprobs[:, 1:][~mask] == 0).all()


@pytest.mark.slow
def test_single_on_policy_update_skips_the_actor_recompute_without_changing_the_old_logprobs(tiny_model_path):
    """One update on the whole shard reads its old log-probs from its own forward: the behaviour vs
    learner mismatch it reports equals the one from a separate no-grad pass, and the update is the
    same as with that pass (PPO ratio exactly 1, same new weights)."""
    import copy

    from ragen_async.learner.batch import collate_shard

    cfg = make_cfg(tiny_model_path, "learner.mini_batch_size=16")  # one mini-batch: the single pass
    shard = make_shard(tiny_model_path, cfg)[0]
    learner = Learner(cfg)
    reference = copy.deepcopy(learner)
    batch = collate_shard(shard, learner.pad_id)
    old = reference._recompute(batch)["old_logprobs"]
    expected = algo.masked_mean(algo.kl_estimate(batch.behaviour_logprobs, old, "k3"), batch.loss_mask)

    calls = []
    original = learner._recompute
    learner._recompute = lambda b, logprobs=True, values=True: calls.append((logprobs, values)) or original(b, logprobs,
                                                                                                          values)
    metrics = learner.train_step(shard).metrics
    assert calls == [(False, False)]  # the actor's no-grad pass was skipped (and the critic's)
    assert metrics["mismatch/k3_kl"] == pytest.approx(float(expected), abs=1e-7)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)


def test_the_probe_under_older_weights_is_that_version_s_not_the_current_one(tiny_model_path):
    """Fixed lag publishes an older version: the probe must score the probe sequence with those weights
    (what the engines hold), in a copy of the actor, leaving the learner's own untouched."""
    cfg = make_cfg(tiny_model_path, "learner.actor_lr=1e-2")
    learner = Learner(cfg)
    ids = make_shard(tiny_model_path, cfg)[0].trajectories[0].token_ids.tolist()[:40]
    before = {name: w.clone() for name, w in learner.named_weights()}
    at_v0 = learner.probe_logprobs(ids)
    learner.train_step(make_shard(tiny_model_path, cfg)[0])
    at_v1 = learner.probe_logprobs(ids)
    assert max(abs(a - b) for a, b in zip(at_v0, at_v1, strict=True)) > 1e-3  # the step moved the policy
    assert learner.probe_logprobs(ids, weights=before) == pytest.approx(at_v0, abs=1e-6)
    assert learner.probe_logprobs(ids) == at_v1  # the learner's own weights are untouched
    with pytest.raises(ValueError, match="do not fit"):
        learner.probe_logprobs(ids, weights={"no.such.weight": torch.zeros(1)})
