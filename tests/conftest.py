"""Shared pytest setup: markers, the two-worker split of `make test`, the tiny models.

The layout's one rule: a test is ``tests/<folder>/test_<topic>.py``, the folder mirroring the subpackage of
ragen_async it tests (plus staleness/ for the staleness bound and all it governs, system/ for whole training runs,
config/ for config.py and configs/, launchers/ for launchers/ and slurm/), the topic not repeating the folder's
name, and every basename unique across tests/ (pytest imports test files by basename); tests/ itself holds only
``test_<module>.py`` for a root module of the package and the tests of the package's or this suite's own rules."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

# `make test` runs the suite in two parts. First, on two pytest-xdist workers (`-n 2`), everything but the
# `alone` modules: the modules of each lane (the marker a module sets: ray_lane, clusters_lane) run one after
# another on one worker, in file order, as in a
# serial run (they start Ray clusters, vLLM engines, SLURM daemons or training processes, or depend on their
# module's order); the two lanes run beside each other, one on each worker, and the other tests (pure
# functions, learner ranks, envs, the agent) go to whichever worker is free. The lanes are split so that
# nothing in one can disturb the other: "ray" starts local Ray sessions (ray.init, /tmp/ray), "clusters"
# starts Ray clusters of its own on chosen ports and temp dirs (Ray jobs, SLURM) and engines without Ray.
# Then, with nothing beside them, the `alone` modules: they give processes and threads a few seconds at most
# (weight-group joins, transport and admission timeouts; a gloo join timed out at 3 s beside the engines once).
LANES = ("ray_lane", "clusters_lane")
"""The lanes, by the marker a module sets (``pytestmark``); the ``alone`` marker puts a module in the last part."""


ALONE_PART = "alone and not soak"
"""The marker expression of `make test`'s last part (the Makefile's target ``test``)."""


def _lane(item) -> str | None:
    return next((name for name in LANES if item.get_closest_marker(name)), None)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """In `make test`'s last part, a test module that never names the ``alone`` marker is not imported: none of
    its tests could be selected, and importing every module of the suite (torch, transformers, vLLM, Ray, TRL)
    took about 15 CPU-seconds of the part's own time against 7 for the ``alone`` modules alone."""
    if (config.getoption("markexpr", "") == ALONE_PART and collection_path.is_file()
            and collection_path.name.startswith("test_") and collection_path.suffix == ".py"
            and "pytest.mark.alone" not in collection_path.read_text()):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    strays = sorted({item.path.name for item in items if item.get_closest_marker("vllm")
                     and _lane(item) is None and not item.get_closest_marker("alone")})
    if strays:
        raise pytest.UsageError(f"tests marked vllm in {strays}: mark the module ray_lane, clusters_lane or alone "
                                "(tests/conftest.py)")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist: the lanes are handed out first
        items.sort(key=lambda item: _lane(item) is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A test in no lane that leaves a Ray session of its own running in the test process (after its fixtures are
    torn down) would run beside the ray lane's sessions: refused, so a new Ray test cannot be left off the lane by
    mistake (the clusters lane starts its own clusters apart, and the ``alone`` tests run with nothing beside)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and _lane(item) is None and not item.get_closest_marker("alone") and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{item.nodeid} started a Ray session but its module is in no lane: mark it ray_lane "
                    "(tests/conftest.py)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """One work unit per lane (pytest-xdist's `loadgroup` marks no longer reach its scheduler under pytest
    9.2), every other test a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _module_lane(root / nodeid.split("::", 1)[0]) or nodeid

    return LaneScheduling(config, log)


@functools.cache
def _module_lane(path: Path) -> str | None:
    """The lane a module's marker names, read from its source: xdist's scheduler sees node ids, not markers."""
    text = path.read_text() if path.is_file() else ""
    return next((name for name in LANES if f"pytest.mark.{name}" in text), None)


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
    """The project's tiny model, shipped in the repository (``artifacts/tiny-model``; ``make model`` checks it,
    tests/tinymodel/test_shipped.py that it is what the current code builds). ``RAGEN_TEST_MODEL`` points the
    tests at another build (e.g. a quick one while iterating)."""
    import os
    from pathlib import Path

    if os.environ.get("RAGEN_TEST_MODEL"):
        return os.environ["RAGEN_TEST_MODEL"]

    from ragen_async.tinymodel.build import DEFAULT_OUT_DIR, is_complete_build

    root = Path(__file__).resolve().parents[1]
    path = root / DEFAULT_OUT_DIR
    if not is_complete_build(path):
        pytest.fail(f"{path} holds no complete tiny-model build: it is in the repository (`git checkout "
                    f"{DEFAULT_OUT_DIR}` restores it; `make model-build` rebuilds it)")
    return str(path)


@pytest.fixture
def make_run():
    """``make_run(path, steps=..., k=..., ...)``: a run directory written by hand (``tests.fakes.write_run``)."""
    from tests.fakes import write_run

    return write_run


@pytest.fixture
def fake_train():
    """``fake_train(fail={...}, interrupt={...})``: see ``tests.fakes.FakeTrain``."""
    from tests.fakes import FakeTrain

    return FakeTrain
