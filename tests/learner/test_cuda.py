"""A learner step on CUDA (the GPU check, ``make test-gpu``): GAE with the critic, and GRPO. The same step
on the CPU is the reference, so a device mix-up and a wrong number both fail here."""

from __future__ import annotations

import math

import pytest
import torch

from ragen_async.learner.learner import Learner
from tests.learner.test_train_step import make_cfg, make_shard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("overrides", [[], ["algo.adv_estimator=grpo"]], ids=["gae", "grpo"])
def test_a_learner_step_on_cuda_matches_the_cpu_step(tiny_model_path, overrides):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = make_cfg(tiny_model_path, *overrides)
    shard = make_shard(tiny_model_path, cfg)[0]
    cpu, gpu = Learner(cfg, device="cpu"), Learner(cfg, device="cuda")
    assert next(gpu.actor.parameters()).is_cuda
    m_cpu, m_gpu = cpu.train_step(shard).metrics, gpu.train_step(shard).metrics
    assert gpu.policy_version == 1
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "mismatch/k3_kl"):
        assert math.isfinite(m_gpu[key]) and m_gpu[key] == pytest.approx(m_cpu[key], rel=1e-3, abs=1e-4), key
    worst = max((a - b.cpu()).abs().max().item()
                for (_, a), (_, b) in zip(cpu.named_weights(), gpu.named_weights(), strict=True))
    print(f"largest weight difference CUDA vs CPU after one step: {worst:.2e}")
    assert worst < 1e-4
