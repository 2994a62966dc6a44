"""Mixed precision (``learner/precision.py``): with ``model.dtype: bfloat16`` the learner keeps fp32 masters,
so a step at the paper's lr (1e-6) moves them as the fp32 learner does; engines get bf16 copies;
checkpoints hold the masters and a resumed learner continues from them."""

from __future__ import annotations

import torch

from ragen_async.learner.learner import Learner
from tests.learner.test_learner import make_cfg, make_shard

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
    _, before32, update32 = _update(fp32_cfg, shard)
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
