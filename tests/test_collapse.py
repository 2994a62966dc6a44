"""The collapse rule online: the watch fires once per fall, the trainer logs and raises the alert."""

import asyncio
import math

from ragen_async.collapse import CollapseWatch
from ragen_async.config import load_config
from ragen_async.metrics import MemorySink
from ragen_async.orchestrator import Trainer
from ragen_async.rundir import RunDir


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
