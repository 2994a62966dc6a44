"""Mixed precision (``learner/precision.py``): with ``model.dtype: bfloat16`` the learner keeps fp32 masters,
so a step at the paper's lr (1e-6) moves them as the fp32 learner does; engines get bf16 copies;
checkpoints hold the masters and a resumed learner continues from them; under FSDP the reference model
computes in bf16 as the actor does."""

from __future__ import annotations

import torch

from ragen_async.learner.learner import Learner
from ragen_async.learner.precision import cpu_has_bf16
from tests.learner.test_train_step import leave_group, make_cfg, make_shard, spawn_ranks

PAPER_LR = ("learner.actor_lr=1e-6", "learner.critic_lr=1e-5", "learner.mini_batch_size=16")

UPDATE_RTOL = 0.35
"""||update_bf16 - update_fp32|| / ||update_fp32|| after one step at lr 1e-6. Adam's first step is about
lr * sign(g), so the update differs wherever bf16 compute flips the sign of a small gradient entry
(measured on an AVX-512 BF16 CPU: 0.12 with bf16 compute; 0 where the CPU falls back to fp32 compute).
Updates lost to rounding make it about 1.0 (bf16 weights: 0.4 % of entries move)."""


def _update(cfg, shard) -> tuple[Learner, torch.Tensor, torch.Tensor]:
    learner = Learner(cfg)
    before = torch.cat([p.detach().double().flatten() for p in learner.actor.parameters()])
    learner.train_step(shard)
    after = torch.cat([p.detach().double().flatten() for p in learner.actor.parameters()])
    return learner, before, after - before


def test_a_bf16_step_at_lr_1e_6_moves_the_masters_as_the_fp32_step_does(tiny_model_path):
    fp32_cfg = make_cfg(tiny_model_path, *PAPER_LR)
    shard = make_shard(tiny_model_path, fp32_cfg)[0]
    bf16_cfg = make_cfg(tiny_model_path, *PAPER_LR, "model.dtype=bfloat16")
    learner32, before32, update32 = _update(fp32_cfg, shard)
    learner, before16, update16 = _update(bf16_cfg, shard)

    assert {p.dtype for p in learner.actor.parameters()} == {torch.float32}
    assert {p.dtype for p in learner.critic.parameters()} == {torch.float32}
    assert all(s.dtype == torch.float32 for st in learner.actor_opt.state.values() for s in st.values()
               if isinstance(s, torch.Tensor) and s.numel() > 1)
    # The same base in both, and the same entries moved (all with a gradient: embedding rows of tokens the
    # batch lacks have none, and weight decay alone, lr * 0.01 * w, is below an fp32 weight's spacing).
    assert torch.equal(before32, before16)
    moved32, moved16 = (update32 != 0).double().mean().item(), (update16 != 0).double().mean().item()
    assert moved32 > 0.9 and moved16 >= 0.99 * moved32, (moved32, moved16)
    rel = ((update16 - update32).norm() / update32.norm()).item()
    assert rel <= UPDATE_RTOL, rel
    # The engines get bf16 copies; the masters stay fp32.
    assert {t.dtype for _, t in learner.named_weights()} == {torch.bfloat16}
    # What the step computed in (``learner/compute_bits``): bf16 where the CPU has bf16 kernels.
    assert learner.compute_bits == (16.0 if cpu_has_bf16() else 32.0) and learner32.compute_bits == 32.0


def test_a_bf16_checkpoint_holds_the_masters_and_resume_continues_from_them(tiny_model_path, tmp_path):
    cfg = make_cfg(tiny_model_path, *PAPER_LR, "model.dtype=bfloat16")
    shard = make_shard(tiny_model_path, cfg)[0]
    learner = Learner(cfg)
    learner.train_step(shard)
    learner.save_checkpoint(tmp_path / "ckpt")
    resumed = Learner(cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for (name, a), b in zip(learner.actor.named_parameters(), resumed.actor.parameters(), strict=True):
        assert b.dtype == torch.float32 and torch.equal(a, b), name
    for a, b in zip(learner.critic.parameters(), resumed.critic.parameters(), strict=True):
        assert torch.equal(a, b)
    # The next step from the checkpoint is the uninterrupted learner's next step.
    learner.train_step(shard)
    resumed.train_step(shard)
    for a, b in zip(learner.actor.parameters(), resumed.actor.parameters(), strict=True):
        assert torch.equal(a, b)


REF_OVERRIDES = ("learner.strategy=fsdp", "model.dtype=bfloat16", "algo.kl_coef=0.01", "learner.mini_batch_size=16")


def _fsdp_ref_rank(rank, world, init, model_path, shard, out):
    """One FSDP step with a reference model; records the dtype of every linear layer's output, per model."""
    import torch.distributed as dist

    from ragen_async.learner import precision

    torch.set_num_threads(1)
    precision.cpu_has_bf16 = lambda: True  # compute in bf16 on any CPU (without its kernels only slower)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    learner = Learner(make_cfg(model_path, *REF_OVERRIDES), rank=rank, world_size=world)
    seen: dict[str, set] = {"actor": set(), "ref": set()}
    for name, model in (("actor", learner.actor), ("ref", learner.ref)):
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda _m, _args, output, name=name: seen[name].add(output.dtype))
    learner.train_step(shard)
    torch.save({"compute": learner.compute_dtype, "seen": seen}, out / f"rank{rank}.pt")
    leave_group()


def test_under_fsdp_the_reference_model_computes_in_the_actor_s_dtype(tiny_model_path, tmp_path):
    """FSDP's mixed-precision policy gathers the sharded actor in bf16; the reference model is an unsharded
    copy outside it, so it must run under autocast like a DDP replica, not in fp32."""
    cfg = make_cfg(tiny_model_path, *REF_OVERRIDES)
    shards = make_shard(tiny_model_path, cfg, num_ranks=2)
    spawn_ranks(_fsdp_ref_rank, lambda r: (tiny_model_path, shards[r], tmp_path))
    for rank in range(2):
        rec = torch.load(tmp_path / f"rank{rank}.pt")
        assert rec["compute"] == torch.bfloat16
        assert rec["seen"] == {"actor": {torch.bfloat16}, "ref": {torch.bfloat16}}, rec["seen"]
