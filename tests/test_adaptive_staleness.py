"""Adaptive staleness: the controller's decisions on scripted warnings, and the bound moving in the
admission gate, the buffer and the training loop together."""

from __future__ import annotations

import asyncio

import pytest

from ragen_async.collapse import EarlyWarning
from ragen_async.config import ConfigError, load_config
from ragen_async.metrics import MemorySink
from ragen_async.orchestrator import Trainer
from ragen_async.rundir import RunDir
from ragen_async.runtime import LocalAdmission
from ragen_async.staleness import AdaptiveBound, AdmissionController
from tests.test_buffer import make_group, plain_buffer


def test_the_bound_halves_on_a_warning_and_grows_back_after_quiet_steps():
    bound = AdaptiveBound(k_max=8, k_min=1, patience=3)
    warnings = [True, False, True, True, False, False, False, False, False, False, False, False, True]
    ks = [bound.update(w) for w in warnings]
    # 8 -> 4 -> (quiet 1) -> 2 -> 1 -> quiet x3 -> 2 -> quiet x3 -> 3 -> quiet x2, then a warning -> 1
    assert ks == [4, 4, 2, 1, 1, 1, 2, 2, 2, 3, 3, 3, 1]
    restored = AdaptiveBound(8, 1, 3)
    restored.restore(bound.state())
    assert (restored.k, restored.quiet) == (1, 0)
    with pytest.raises(ValueError):
        AdaptiveBound(k_max=2, k_min=3)


def test_a_lower_bound_closes_admission_until_the_version_catches_up():
    gate = AdmissionController(max_staleness=4, groups_per_step=2)
    assert [gate.try_admit() for _ in range(10)] == list(range(10))  # (4 + 0 + 1) x 2 slots
    gate.set_max_staleness(1)
    assert gate.try_admit() is None and gate.capacity() == 0
    gate.on_consumed(range(4))
    gate.set_published_version(4)  # (1 + 4 + 1) x 2 = 12 may have started: 2 more
    assert [gate.try_admit(), gate.try_admit(), gate.try_admit()] == [10, 11, None]
    with pytest.raises(ValueError):
        AdmissionController(None, 2).set_max_staleness(1)  # an unbounded gate has nothing to move
    with pytest.raises(ValueError):
        gate.set_max_staleness(-1)


def test_a_lower_bound_in_the_buffer_drops_what_is_now_too_old():
    buf = plain_buffer(groups_per_step=2, max_staleness=3)
    buf.add(make_group(0, version=0), learner_version=2, now=0.0)  # 2 old: fine under k = 3
    buf.set_max_staleness(1)
    buf.add(make_group(1, version=0), learner_version=2, now=0.0)  # 2 old: too old under k = 1
    drops = buf.drain_drops()
    assert [(d.index, d.reason) for d in drops] == [(1, "stale")]
    assert not buf.ready(2)  # group 0 is re-checked at consumption under the new bound, and dropped
    assert [(d.index, d.reason) for d in buf.drain_drops()] == [(0, "stale")]


def test_warnings_fire_online_and_survive_a_checkpoint():
    warning = EarlyWarning(window=2)
    assert warning.update({"actor/grad_norm": 1.0, "rollout/in_group_reward_std": 1.0}) == set()
    assert warning.update({"actor/grad_norm": 1.0, "rollout/in_group_reward_std": 1.0}) == set()
    copy = EarlyWarning(window=2)
    copy.restore(warning.state())
    for w in (warning, copy):
        assert w.update({"actor/grad_norm": 9.0, "rollout/in_group_reward_std": 0.0}) == {"grad_norm"}
        assert w.update({"actor/grad_norm": 1.0, "rollout/in_group_reward_std": 0.0}) == {"reward_std"}


class RecordingAdmission(LocalAdmission):
    def __init__(self, k: int):
        super().__init__(k, 4)
        self.moves: list[int] = []

    async def set_max_staleness(self, k: int) -> None:
        self.moves.append(k)
        await super().set_max_staleness(k)


class StubRuntime:
    def __init__(self, k: int):
        self.admission = RecordingAdmission(k)


def test_the_loop_moves_the_bound_in_the_buffer_and_at_admission(tmp_path):
    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [
        f"run_root={tmp_path}", "runtime=ray", "staleness.max_staleness=4", "staleness.adaptive=true",
        "staleness.adaptive_patience=2", "staleness.adaptive_min_k=1", "logging.console=false"])
    runtime = StubRuntime(4)
    trainer = Trainer(cfg, RunDir.create(cfg), MemorySink(), runtime)
    records = [{"actor/grad_norm": 1.0} for _ in range(5)] + [{"actor/grad_norm": 10.0}, {"actor/grad_norm": 10.0}]
    records += [{"actor/grad_norm": 1.0} for _ in range(4)]
    bounds = []
    for r in records:
        asyncio.run(trainer.adapt(r))
        bounds.append(trainer.buffer.max_staleness)
    # 5 quiet steps at k_max; spike: 4 -> 2; the median (1) still low: 2 -> 1; then 2 quiet steps each -> 2 -> 3
    assert bounds == [4, 4, 4, 4, 4, 2, 1, 1, 2, 2, 3]
    assert runtime.admission.moves == [2, 1, 2, 3] and runtime.admission.controller.max_staleness == 3
    assert [r["warning/grad_norm"] for r in records] == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("overrides, message", [
    (["staleness.max_staleness=0"], "needs staleness.max_staleness >= 1"),
    (["staleness.max_staleness=2", "staleness.fixed_lag=true"], "no fixed_lag"),
    (["staleness.max_staleness=2", "staleness.adaptive_min_k=3"], "adaptive_min_k (3) is above"),
])
def test_adaptive_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/tiny/starpo_s_bandit.yaml", ["runtime=ray", "staleness.adaptive=true", *overrides])
