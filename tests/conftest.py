"""Shared pytest setup: markers, the two-worker split of `make test`, the tiny models."""

from __future__ import annotations

import os

import pytest

# `make test` runs the suite in two parts. First, on two pytest-xdist workers (`-n 2`), everything but the
# `alone` modules: the modules of each lane below run one after another on one worker, in file order, as in a
# serial run (they start Ray clusters, vLLM engines, SLURM daemons or training processes, or depend on their
# module's order); the two lanes run beside each other, one on each worker, and the other tests (pure
# functions, learner ranks, envs, the agent) go to whichever worker is free. The lanes are split so that
# nothing in one can disturb the other: "ray" starts local Ray sessions (ray.init, /tmp/ray), "clusters"
# starts Ray clusters of its own on chosen ports and temp dirs (Ray jobs, SLURM) and engines without Ray.
# Then, with nothing beside them, the `alone` modules: they give processes and threads a few seconds at most
# (weight-group joins, transport and admission timeouts; a gloo join timed out at 3 s beside the engines once).
LANES = {
    "ray": frozenset({"test_ray_runtime.py", "test_driver_kill.py", "test_rllib_ref.py", "test_soak.py",
                      "test_gpu_run.py"}),
    "clusters": frozenset({"test_slurm_real.py", "test_ray_job_real.py", "test_vllm_engine.py",
                           "test_orchestrator_local.py", "test_device_check.py", "test_experiments_scripts.py",
                           "test_exact_verify.py", "test_simcluster.py"}),
}
ALONE_MODULES = frozenset({
    "test_gloo.py", "test_gloo_faults.py", "test_gloo_vllm.py", "test_nccl.py", "test_nccl_faults.py",
    "test_transport_zmq.py", "test_transport_inproc.py", "test_transport_replay.py", "test_admission_gate.py",
})


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _lane(nodeid: str) -> str | None:
    return next((name for name, modules in LANES.items() if _module(nodeid) in modules), None)


def pytest_collection_modifyitems(config, items):
    placed = ALONE_MODULES.union(*LANES.values())
    strays = sorted({item.path.name for item in items if item.get_closest_marker("vllm") and item.path.name not in placed})
    if strays:
        raise pytest.UsageError(f"tests marked vllm in {strays}: add the module to a lane (or ALONE_MODULES) in "
                                "tests/conftest.py")
    for item in items:
        if item.path.name in ALONE_MODULES:
            item.add_marker("alone")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist: the lanes are handed out first
        items.sort(key=lambda item: _lane(item.nodeid) is None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """One work unit per lane (pytest-xdist's `loadgroup` marks no longer reach its scheduler under pytest
    9.2), every other test a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _lane(nodeid) or nodeid

    return LaneScheduling(config, log)


def save_random_qwen2(path, *, tied: bool, seed: int) -> str:
    """Save a random Qwen2ForCausalLM to ``path``: hidden 64, 2 heads of 32 (vLLM's CPU attention needs head size
    >= 32), 1 KV head, 2 layers, intermediate 128, vocab 512, float32, the head ``tied`` to the embedding or not."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                         dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    # The default init (std 0.02) gives near-uniform next-token distributions; widen it so the
    # log-probs of sampled tokens vary and agreement tests are meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def random_tiny_qwen2(tmp_path_factory) -> str:
    """Path of a random Qwen2 (:func:`save_random_qwen2`), untied embeddings."""
    return save_random_qwen2(tmp_path_factory.mktemp("random_tiny_qwen2"), tied=False, seed=1234)


@pytest.fixture(scope="session")
def random_tied_qwen2(tmp_path_factory) -> str:
    """Path of a random Qwen2 (:func:`save_random_qwen2`) whose head is tied to the embedding, as Qwen2.5-0.5B's."""
    return save_random_qwen2(tmp_path_factory.mktemp("random_tied_qwen2"), tied=True, seed=99)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The project's tiny model (``make test`` builds it first; built here if missing).
    ``RAGEN_TEST_MODEL`` points the tests at another build (e.g. a quick one while iterating)."""
    import os
    from pathlib import Path

    if os.environ.get("RAGEN_TEST_MODEL"):
        return os.environ["RAGEN_TEST_MODEL"]

    from ragen_async.tinymodel.build import DEFAULT_OUT_DIR, ensure_tiny_model

    root = Path(__file__).resolve().parents[1]
    path = root / DEFAULT_OUT_DIR
    ensure_tiny_model(path)
    return str(path)
