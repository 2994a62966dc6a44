"""The collapse rule online: the watch fires once per fall, the trainer logs and raises the alert."""

import asyncio
import math
import time

from ragen_async.config import load_config
from ragen_async.orchestrator import Trainer
from ragen_async.records.metrics import MemorySink
from ragen_async.records.rundir import RunDir
from ragen_async.staleness.collapse import CollapseWatch


def test_the_watch_fires_once_per_fall_and_rearms_after_a_recovery():
    watch = CollapseWatch()
    fired = [watch.update(v) for v in (0.1, 0.8, 0.5, 0.3, 0.2, 0.1, math.nan, 0.6, 0.35, 0.3, 0.0)]
    # 0.3 and 0.2 are the first two validations below 0.4 (half of 0.8): fires at 0.2; stays quiet while
    # it lasts; 0.6 recovers and re-arms; 0.35 and 0.3 fall again.
    assert fired == [False, False, False, False, True, False, False, False, False, True, False]


def test_a_run_that_never_learned_raises_no_alert():
    watch = CollapseWatch()
    assert not any(watch.update(0.0) for _ in range(10))


class ScriptedValidation:
    def __init__(self, values):
        self.values = list(values)

    async def validate(self):
        return {"val/success": self.values.pop(0)}


def test_the_trainer_logs_the_alert_and_tells_the_sink(tmp_path):
    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [f"run_root={tmp_path}", "logging.console=false"])
    sink = MemorySink()
    trainer = Trainer(cfg, RunDir.create(cfg), sink, ScriptedValidation([0.2, 0.9, 0.3, 0.2, 0.1]))
    for step in range(0, 50, 10):
        asyncio.run(trainer.validate(step))
    assert [r["alert/collapse"] for r in sink.records] == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert len(sink.alerts) == 1 and sink.alerts[0][0] == "Collapse"
    assert "step 30" in sink.alerts[0][1] and "0.900" in sink.alerts[0][1]


def test_a_resumed_watch_remembers_the_peak_and_the_validations_below_it():
    watch = CollapseWatch()
    for v in (0.2, 0.9, 0.3):
        watch.update(v)
    resumed = CollapseWatch()
    resumed.restore(watch.state())
    assert resumed.update(0.2)  # the second validation below half of 0.9, counting the one before the resume
    fresh = CollapseWatch()
    fresh.restore(CollapseWatch().state())  # no validation yet: the peak stays unset
    assert fresh.peak == -math.inf and not fresh.update(0.0)


class FakeAdmission:
    async def state(self):
        return {"next_index": 0, "outstanding": [], "refusals": 0}

    async def restore(self, state):
        self.restored = state


class CheckpointingRuntime(ScriptedValidation):
    """Validation from a script; checkpoints that hold only the driver's state."""

    def __init__(self, values):
        super().__init__(values)
        self.admission = FakeAdmission()

    async def save(self, path, step):
        path.mkdir(parents=True, exist_ok=True)

    async def load(self, path):
        return 0


def test_a_resumed_trainer_continues_the_budget_the_collapse_watch_and_the_duplicate_count(tmp_path):
    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", [f"run_root={tmp_path}", "logging.console=false",
                                                               "time_budget_minutes=30"])
    run_dir = RunDir.create(cfg)
    trainer = Trainer(cfg, run_dir, MemorySink(), CheckpointingRuntime([0.2, 0.9, 0.3]))
    for step in (0, 10, 20):
        asyncio.run(trainer.validate(step))
    trainer.budget.start()
    time.sleep(0.01)
    trainer.budget.pause()
    trainer.duplicates = 2
    checkpoint = asyncio.run(trainer.save(20))

    sink = MemorySink()
    resumed = Trainer(cfg, run_dir, sink, CheckpointingRuntime([0.2]))
    asyncio.run(resumed.resume(checkpoint))
    assert resumed.budget.spent_s == trainer.budget.spent_s >= 0.01
    assert resumed.duplicates == 2
    asyncio.run(resumed.validate(30))  # the second validation below half of 0.9: the alert fires
    assert sink.records[-1]["alert/collapse"] == 1.0 and "0.900" in sink.alerts[0][1]
