"""Adaptive staleness: the controller's decisions on scripted warnings, and the bound moving in the
admission gate, the buffer and the training loop together."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from ragen_async.config import ConfigError, load_config
from ragen_async.orchestrator import Trainer
from ragen_async.records.metrics import MemorySink
from ragen_async.records.rundir import RunDir
from ragen_async.runtime import LocalAdmission
from ragen_async.staleness.admission import AdmissionController
from ragen_async.staleness.bound import StalenessBound
from ragen_async.staleness.collapse import EarlyWarning, stale_tokens
from ragen_async.staleness.controllers import AdaptiveBound, KLTargetBound
from tests.fakes import make_group, plain_buffer


def test_the_bound_halves_on_a_warning_and_grows_back_after_quiet_steps():
    bound = AdaptiveBound(start=8, lowest=1, patience=3)
    warnings = [True, False, True, True, False, False, False, False, False, False, False, False, True]
    ks = [bound.update(w) for w in warnings]
    # 8 -> 4 -> (quiet 1) -> 2 -> 1 -> quiet x3 -> 2 -> quiet x3 -> 3 -> quiet x2, then a warning -> 1
    assert ks == [4, 4, 2, 1, 1, 1, 2, 2, 2, 3, 3, 3, 1]
    restored = AdaptiveBound(8, 1, 3)
    restored.restore(bound.state())
    assert (restored.max_staleness, restored.quiet) == (1, 0)
    with pytest.raises(ValueError):
        AdaptiveBound(start=2, lowest=3)


def test_a_lower_bound_closes_admission_until_the_version_catches_up():
    gate = AdmissionController(max_staleness=4, groups_per_step=2)
    assert [gate.try_admit() for _ in range(10)] == list(range(10))  # (4 + 0 + 1) x 2 slots
    gate.set_max_staleness(1)
    assert gate.try_admit() is None and gate.capacity() == 0
    gate.on_consumed(range(4))
    gate.set_published_version(4)  # (1 + 4 + 1) x 2 = 12 may have started: 2 more
    assert [gate.try_admit(), gate.try_admit(), gate.try_admit()] == [10, 11, None]
    with pytest.raises(ValueError):
        gate.set_max_staleness(-1)


def test_the_bound_engages_from_unbounded_and_is_lifted_again_after_quiet_steps():
    bound = AdaptiveBound(start=None, lowest=1, patience=2, engage=4)
    assert bound.max_staleness is None
    warnings = [False, False, True, True, False, False, False, False, False, False, False, True]
    # unbounded until the first warning: -> 4, then halved -> 2; quiet x2 -> 3, x2 -> 4, x2 -> lifted; warning -> 4
    assert [bound.update(w) for w in warnings] == [None, None, 4, 2, 2, 3, 3, 4, 4, None, None, 4]
    restored = AdaptiveBound(None, 1, 2, engage=4)
    restored.restore({"k": None, "quiet": 1})  # an older checkpoint's name for the bound
    assert restored.max_staleness is None and restored.update(True) == 4
    with pytest.raises(ValueError):
        AdaptiveBound(start=None)  # from unbounded it needs the bound to engage
    with pytest.raises(ValueError):
        AdaptiveBound(start=None, lowest=3, engage=2)


def test_an_unbounded_gate_takes_a_bound_and_gives_it_up_again():
    gate = AdmissionController(max_staleness=None, groups_per_step=2)
    assert [gate.try_admit() for _ in range(14)] == list(range(14))  # unbounded: as many as asked for
    gate.set_max_staleness(2)  # (2 + 0 + 1) x 2 = 6 may have started: 14 have, so none until it catches up
    assert gate.try_admit() is None and gate.capacity() == 0
    gate.set_max_staleness(None)
    assert gate.capacity() is None and gate.try_admit() == 14
    buf = plain_buffer(groups_per_step=2, max_staleness=None)
    buf.bound.moved(1, first_index=0)
    buf.add(make_group(0, version=0), learner_version=2, now=0.0)
    assert [(d.index, d.reason) for d in buf.drain_drops()] == [(0, "stale")]
    buf.bound.moved(None, first_index=1)
    buf.add(make_group(1, version=0), learner_version=9, now=0.0)
    assert buf.drain_drops() == []


def test_a_lower_bound_in_the_buffer_drops_what_is_now_too_old():
    buf = plain_buffer(groups_per_step=2, max_staleness=3)
    buf.add(make_group(0, version=0), learner_version=2, now=0.0)  # 2 old: fine under k = 3
    buf.bound.moved(1, first_index=0)
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


def stale_step(kl: float, ess: float, fresh_kl: float = 0.0) -> dict[str, float]:
    """A step's per-lag metrics: 100 fresh tokens and 300 stale ones (200 one version old, 100 eight or more)."""
    return {"lag/0/tokens": 100.0, "lag/0/k3_kl": fresh_kl, "lag/0/is_ess": 1.0,
            "lag/1/tokens": 200.0, "lag/1/k3_kl": kl, "lag/1/is_ess": ess,
            "lag/2/tokens": 0.0, "lag/8+/tokens": 100.0, "lag/8+/k3_kl": kl, "lag/8+/is_ess": ess}


def test_the_staleness_signals_read_the_stale_tokens_only():
    assert stale_tokens(stale_step(0.01, 0.9, fresh_kl=5.0)) == pytest.approx(
        {"stale/tokens": 300.0, "stale/k3_kl": 0.01, "stale/is_ess": 0.9})
    mixed = {**stale_step(0.0, 1.0), "lag/1/k3_kl": 0.03, "lag/1/is_ess": 0.4}  # weighted 2:1 against 8+
    assert stale_tokens(mixed) == pytest.approx({"stale/tokens": 300.0, "stale/k3_kl": 0.02, "stale/is_ess": 0.6})
    assert stale_tokens({"lag/0/tokens": 50.0, "lag/0/k3_kl": 1.0, "lag/1/tokens": 0.0}) == {}  # nothing stale
    warning = EarlyWarning(window=2)
    fired = [warning.update(stale_step(kl, ess, fresh_kl=9.0)) for kl, ess in
             ((0.01, 0.9), (0.01, 0.9), (0.05, 0.9), (0.01, 0.3), (0.01, 0.9))]
    # a KL 5x the median of the previous two stale steps; an effective sample size below half the tokens
    assert fired == [set(), set(), {"stale_kl"}, {"stale_ess"}, set()]
    synchronous = EarlyWarning(window=2)
    assert all(synchronous.update({"lag/0/tokens": 9.0, "lag/0/k3_kl": kl}) == set() for kl in (0.0, 0.0, 1.0))


class RecordingAdmission(LocalAdmission):
    def __init__(self, k: int | None):
        super().__init__(k, 4)
        self.moves: list[int | None] = []

    async def set_max_staleness(self, k: int | None) -> int:
        self.moves.append(k)
        return await super().set_max_staleness(k)


class StubRuntime:
    def __init__(self, k: int | None):
        self.admission = RecordingAdmission(k)


def test_the_loop_moves_the_bound_in_the_buffer_and_at_admission(tmp_path):
    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [
        f"run_root={tmp_path}", "runtime=ray", "staleness.max_staleness=4", "staleness.adaptive=true",
        "staleness.adaptive_patience=2", "staleness.adaptive_min_staleness=1", "logging.console=false"])
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


def test_the_bound_reacts_only_to_the_signals_it_is_given(tmp_path):
    """``staleness.adaptive_signals``: a stale-token ESS warning halves the bound when named, and is only
    logged when not (the default: RAGEN's three signals)."""
    moved = {}
    for signals in (["grad_norm"], ["grad_norm", "stale_ess"]):
        cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [
            f"run_root={tmp_path / str(len(signals))}", "runtime=ray", "staleness.max_staleness=4",
            "staleness.adaptive=true", f"staleness.adaptive_signals={signals}", "logging.console=false"])
        trainer = Trainer(cfg, RunDir.create(cfg), MemorySink(), StubRuntime(4))
        records = [stale_step(0.01, 0.9), stale_step(0.01, 0.2), stale_step(0.01, 0.9)]
        for r in records:
            asyncio.run(trainer.adapt(r))
        assert [r["warning/stale_ess"] for r in records] == [0, 1, 0]
        assert records[1]["stale/is_ess"] == pytest.approx(0.2)  # logged with the step
        moved[len(signals)] = trainer.buffer.max_staleness
    assert moved == {1: 4, 2: 2}
    with pytest.raises(ConfigError, match="adaptive_signals"):
        load_config("configs/tiny/starpo_s_bandit.yaml", ["staleness.adaptive_signals=[kl]"])


def test_the_loop_engages_a_bound_from_unbounded_on_the_stale_ess_and_lifts_it(tmp_path):
    """The staleness controller: unbounded until the stale tokens' ESS falls below half, then the engage
    bound in the buffer and at admission, halved by the next warning, lifted after quiet steps."""
    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [
        f"run_root={tmp_path}", "runtime=ray", "staleness.max_staleness=null", "staleness.adaptive=true",
        "staleness.adaptive_engage_staleness=2", "staleness.adaptive_patience=2", "staleness.adaptive_min_staleness=1",
        "staleness.adaptive_signals=[stale_ess]", "logging.console=false"])
    runtime = StubRuntime(None)
    trainer = Trainer(cfg, RunDir.create(cfg), MemorySink(), runtime)
    assert trainer.buffer.max_staleness is None
    bounds = []
    for ess in (0.9, 0.9, 0.3, 0.3, 0.9, 0.9, 0.9, 0.9):
        asyncio.run(trainer.adapt(stale_step(0.01, ess)))
        bounds.append(trainer.buffer.max_staleness)
    assert bounds == [None, None, 2, 1, 1, 2, 2, None]
    assert runtime.admission.moves == [2, 1, 2, None] and runtime.admission.controller.max_staleness is None


@pytest.mark.parametrize("overrides, message", [
    (["staleness.max_staleness=0"], "needs staleness.max_staleness >= 1"),
    (["staleness.max_staleness=null"], "needs staleness.adaptive_engage_staleness"),
    (["staleness.max_staleness=4", "staleness.adaptive_engage_staleness=2"], "applies only with"),
    (["staleness.max_staleness=null", "staleness.adaptive_engage_staleness=2", "staleness.adaptive_min_staleness=3"],
     "adaptive_min_staleness (3) is above"),
    (["staleness.max_staleness=2", "staleness.fixed_lag=true"], "no fixed_lag"),
    (["staleness.max_staleness=2", "staleness.adaptive_min_staleness=3"], "adaptive_min_staleness (3) is above"),
    (["staleness.max_staleness=null", "staleness.adaptive_engage_staleness=2", "staleness.kl_target=0.001"],
     "kl_target moves the adaptive bound"),
    (["staleness.max_staleness=4", "staleness.adaptive_max_staleness=8"], "adaptive_max_staleness applies only with"),
    (["staleness.max_staleness=4", "staleness.kl_target=0.001", "staleness.adaptive_max_staleness=2"],
     "adaptive_max_staleness (2) is below"),
])
def test_adaptive_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/tiny/starpo_s_bandit.yaml", ["runtime=ray", "staleness.adaptive=true", *overrides])


def test_the_kl_target_bound_cuts_in_proportion_holds_while_it_drains_and_rises_back():
    bound = KLTargetBound(target=1e-3, start=8, lowest=1, highest=10, patience=2, span=1)  # span 1: no averaging
    # 4x over the target: the age that gives it is about sqrt(4) = 2x too old, so 8 -> 4; then held, however high
    # the KL stays, while the groups admitted under 8 drain (consumed bound 8) and for the span after
    assert bound.update(4e-3, 8) == 4 and "over the target" in bound.reason
    assert [bound.update(4e-3, 8) for _ in range(8)] == [4] * 8 and bound.reason == ""
    assert bound.update(1.1e-3, 4) == 3  # measured under the new bound, and still over: at least one lower
    assert [bound.update(None, 3) for _ in range(6)] == [3, 3, 3, 3, 3, 3]  # nothing stale: nothing decided
    # under half the target for `patience` steps in a row: one up (between half and the target: no change)
    assert [bound.update(x, 3) for x in (4e-4, 7e-4, 4e-4, 4e-4, 4e-4, 4e-4)] == [3, 3, 3, 4, 4, 5]
    assert "under half the target" in bound.reason
    for _ in range(30):
        bound.update(1e-5)
    assert bound.max_staleness == 10  # never above `highest`
    restored = KLTargetBound(1e-3, 8, 1, 10, 2, span=1)
    restored.restore(bound.state())
    assert restored.state() == bound.state() and restored.update(0.5) == bound.update(0.5) == 1  # never below 1
    with pytest.raises(ValueError):
        KLTargetBound(target=1e-3, start=4, highest=2)


def in_order_pipeline(controller: KLTargetBound, steps: int, kl_per_age2: float, start: int) -> list[int]:
    """The bound after each step of an in-order run whose generation outpaces the learner (the gate binds), in the
    loop's order: a step consumes the oldest batch in flight, its new version opens admission under the bound in
    force (a batch admitted after step s is consumed at step s + bound + 1, at age bound), then the controller reads
    the step's stale KL, ``kl_per_age2`` x age squared; after a tightening nothing is admitted until the batches in
    flight drain under it."""
    pipeline = [(start, a) for a in range(-start - 1, 0)]  # (bound admitted under, step admitted after)
    bound, bounds = start, []
    for step in range(steps):
        admitted_under, admitted_at = pipeline.pop(0)
        age = step - admitted_at - 1
        while len(pipeline) < bound + 1:
            pipeline.append((bound, step))
        bound = controller.update(kl_per_age2 * age**2 if age > 0 else None, admitted_under)
        bounds.append(bound)
    return bounds


def test_after_a_cut_the_kl_target_bound_waits_for_the_old_groups_to_drain_and_settles():
    """At bound 4 the stale KL is 1.25x the target, at 3 between half the target and the target: the bound is cut
    once, to 3, and stays there. It measures the cut only after the groups admitted under 4 are consumed (at age
    4, for 5 steps): a hold of the cut's size plus the average's span re-cut to 2 on the old groups' KL and then
    swung between bounds."""
    controller = KLTargetBound(target=2e-3, start=4, lowest=1, highest=16, patience=5, span=5)
    bounds = in_order_pipeline(controller, 200, 2.5e-3 / 16, start=4)
    cut = bounds.index(3)
    assert bounds[:cut] == [4] * cut and bounds[cut:] == [3] * (200 - cut), bounds


def test_the_kl_average_smooths_a_single_spike():
    bound = KLTargetBound(target=1e-3, start=4, span=5)
    assert [bound.update(x) for x in (5e-4, 5e-4, 3e-3)] == [4, 4, 4]  # one step 3x over: the average is not
    assert bound.kl == pytest.approx(math.exp((math.log(3e-3) + 2 * math.log(5e-4)) / 3))
    assert bound.update(3e-3) == 3  # two are


def test_kl_rise_fires_on_a_rise_against_the_runs_own_level_and_survives_a_checkpoint():
    rng = np.random.default_rng(0)
    level = [float(math.exp(rng.normal(math.log(1e-3), 0.3))) for _ in range(40)]
    warning, fired = EarlyWarning(), []
    for kl in level + [2e-2] * 3:
        fired.append("kl_rise" in warning.update({"stale/k3_kl": kl}))
    assert not any(fired[:15])  # the warm-up: nothing to compare with yet
    assert fired[-3:] == [True, True, True] and sum(fired[:40]) <= 3
    copy = EarlyWarning()
    copy.restore(json.loads(json.dumps(warning.state())))
    step = {"stale/k3_kl": 1e-3}
    assert copy.update(dict(step)) == warning.update(dict(step))
    fresh = EarlyWarning()  # a checkpoint written before kl_rise existed
    fresh.restore({k: v for k, v in warning.state().items() if not k.startswith("kl_")})
    assert fresh.kl_average is None and not fresh.kl_history


def test_the_loop_holds_the_stale_kl_under_its_target_and_logs_why_the_bound_moved(tmp_path, caplog, capsys):
    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [
        f"run_root={tmp_path}", "runtime=ray", "staleness.max_staleness=4", "staleness.adaptive=true",
        "staleness.kl_target=0.001", "staleness.adaptive_max_staleness=6", "staleness.adaptive_patience=2",
        "staleness.adaptive_min_staleness=1", "logging.console=false"])
    runtime = StubRuntime(4)
    trainer = Trainer(cfg, RunDir.create(cfg), MemorySink(), runtime)
    assert isinstance(trainer.bound.controller, KLTargetBound)
    records = [stale_step(kl, 0.9) for kl in (1e-4, 1e-4, 1e-4, 1e-4, 1e-4, 5e-2, 5e-2, 5e-2)]
    with caplog.at_level("INFO", logger="ragen_async.orchestrator"):
        for r in records:
            asyncio.run(trainer.adapt(r))
    # two quiet steps each: 4 -> 5 -> 6 (the top); then the average climbs over the target and the bound is cut
    assert runtime.admission.moves[:2] == [5, 6] and runtime.admission.moves[2] < 6
    assert [r["staleness/bound_change"] for r in records][:5] == [0, 1, 0, 1, 0]
    assert all(r["staleness/controller_kl"] > 0 for r in records)
    assert "over the target" in caplog.text and "under half the target" in caplog.text
    printed = capsys.readouterr().out  # and on the run's console
    assert "adaptive staleness: bound 4 -> 5 after step None: stale KL under half the target for 2 steps" in printed
    assert trainer.buffer.max_staleness == runtime.admission.controller.max_staleness == runtime.admission.moves[-1]


def test_a_kl_target_runs_token_age_histogram_reaches_the_highest_bound_it_may_set(tmp_path):
    """The histogram's bins (``staleness/token_hist/*``) run to ``adaptive_max_staleness``, not to the bound the
    run starts from: a group 10 versions old under a bound raised to 16 is counted at 10, not as overflow."""
    from ragen_async.orchestrator import make_buffer
    from tests.fakes import make_group

    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [
        f"run_root={tmp_path}", "runtime=ray", "staleness.max_staleness=4", "staleness.adaptive=true",
        "staleness.kl_target=0.001", "staleness.adaptive_max_staleness=16", "algo.filter_mode=none",
        "rollout.envs=[{tag: Bandit, n_groups: 1}]", "learner.num_ranks=1"])
    bound = StalenessBound.from_config(cfg.staleness)
    buffer = make_buffer(cfg, bound)
    bound.moved(16, first_index=0)
    buffer.add(make_group(0, version=0), learner_version=10, now=0.0)
    metrics = buffer.next_batch(10, 0, 1.0).metrics
    assert metrics["staleness/token_hist/10"] == 1.0 and metrics["staleness/token_hist/overflow"] == 0.0
