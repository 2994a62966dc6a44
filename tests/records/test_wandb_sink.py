"""The W&B sink against a real offline run: group, tags, job type, the staleness histogram and the summary."""

from __future__ import annotations

from ragen_async.records.metrics import WandbSink, staleness_histogram


def test_staleness_histogram_from_the_step_counters():
    counts, edges = staleness_histogram({"staleness/token_hist/0": 5, "staleness/token_hist/1": 3,
                                         "staleness/token_hist/2": 0, "staleness/token_hist/overflow": 1,
                                         "staleness/mean": 0.6})
    assert counts.tolist() == [5, 3, 0, 1] and edges.tolist() == [-0.5, 0.5, 1.5, 2.5, 3.5]
    assert staleness_histogram({"staleness/mean": 0.0}) is None


def test_offline_run_has_the_sweep_group_tags_histogram_and_best_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(tmp_path, {"seed": 0}, "offline", "ragen_async_test", None, "k4-s0",
                     group="staleness_sokoban-20261130", tags=["staleness.max_staleness=4", "seed=0"])
    try:
        assert sink.run.group == "staleness_sokoban-20261130" and sink.run.job_type == "train"
        assert list(sink.run.tags) == ["staleness.max_staleness=4", "seed=0"]
        for step, (success, entropy) in enumerate([(0.2, 0.9), (0.7, 0.5), (0.4, 0.6)], 1):
            sink.log({"learner/step": step, "val/success": success, "actor/entropy": entropy,
                      "staleness/token_hist/0": 10 * step, "staleness/token_hist/1": 4})
        assert sink.run.summary["val/success_best"] == 0.7
        assert sink.run.summary["actor/entropy_min"] == 0.5
        hist = sink.run.summary["staleness/token_histogram"]
        assert hist["_type"] == "histogram" and list(hist["values"]) == [30, 4]
        sink.alert("Collapse", "an offline run has no one to notify: nothing is sent, nothing fails")
        sink.log_episodes(3, [{"env_tag": "Bandit", "seed": 7, "group_index": 2, "score": 1.0, "success": True,
                               "staleness": 1, "text": "<think> pick </think> <answer> Dragon </answer>"}])
        table = sink.run.summary["episodes"]
        assert table["_type"] == "table-file" and table["nrows"] == 1 and table["ncols"] == 7
    finally:
        sink.close()
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb")), "no offline run files were written"
