"""Resume rewinds the run's logs to the checkpoint, and W&B never receives a step twice."""

from __future__ import annotations

import json

from ragen_async.records.metrics import WandbSink
from ragen_async.records.provenance import rewind_jsonl


def test_rewind_drops_records_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"learner/step": s, "x": s} for s in (0, 1, 2, 3, 4, 5)] + [{"learner/step": 4, "val/success": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert rewind_jsonl(path, 3, key="learner/step") == 5  # what the interrupted run had logged
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["learner/step"] for r in kept] == [0, 1, 2, 3]
    assert rewind_jsonl(tmp_path / "missing.jsonl", 3, key="step") == -1


def test_wandb_sink_skips_steps_it_already_has():
    class FakeRun:
        def __init__(self):
            self.logged = []

        def log(self, record):
            self.logged.append(record["learner/step"])

    sink = WandbSink.__new__(WandbSink)  # no wandb.init: only the skipping rule is under test
    sink.run, sink.skip_until_step = FakeRun(), 5
    for step in (4, 5, 6, 7):
        sink.log({"learner/step": step, "x": 1.0})
    assert sink.run.logged == [6, 7]
