"""The GPU check's end-to-end part (``make test-gpu``): a short asynchronous run of the tiny model with its
engines and learner on CUDA, the weight-sync probe after every sync.

On one GPU the weights go over gloo (an NCCL group cannot hold two ranks on the same device); with two GPUs
or more the NCCL run is added (learner and engine on different devices).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.system.test_ray_runtime import consumed_staleness, ray_cfg, run_ray

pytestmark = [pytest.mark.ray_lane, pytest.mark.gpu, pytest.mark.vllm, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL weight sync needs the learner and the engine on different GPUs"))]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False,
             object_store_memory=500 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}})
    yield
    ray.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_short_async_run_on_gpu_syncs_exactly_and_respects_the_bound(tiny_model_path, tmp_path, backend):
    share = 1.0 if backend == "nccl" else 0.4  # NCCL: one whole GPU each, so they differ
    cfg = ray_cfg(tiny_model_path, tmp_path, "rollout.num_workers=1", "learner.num_ranks=1", "total_steps=6",
                  "staleness.max_staleness=1", f"weight_sync.backend={backend}", "weight_sync.verify_every=1",
                  f"rollout.gpus_per_worker={share}", f"learner.gpus_per_rank={share}",
                  "inference.gpu_memory_utilization=0.2")
    _, steps, provenance = run_ray(cfg)
    assert len(steps) == 6
    stale = consumed_staleness(provenance)
    diffs = [s["weight_sync/probe_max_abs_diff"] for s in steps if "weight_sync/probe_max_abs_diff" in s]
    print(f"{backend}: staleness max {max(stale)}, mean {sum(stale) / len(stale):.2f}; "
          f"probe max |engine - learner| {max(diffs):.2e}; "
          f"sync s {[round(s['weight_sync/time_s'], 3) for s in steps]}")
    assert max(stale) <= 1 and len(diffs) == len(steps)
    assert max(diffs) < 1e-3  # float32 on both sides
