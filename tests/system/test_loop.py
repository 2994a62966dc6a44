"""The one training loop (``orchestrator.Trainer``) on a simulated runtime: many producers, random
finishing order, slow groups that go stale, a learner whose steps take random time.

Checks the driver's receive path exactly where the double-counted drop lived: every drop, at add time
or at consume time, returns exactly one admission slot; the AReaL bound ``groups_started <= limit``
holds at every admission; the recorded staleness never exceeds k; every admitted index is accounted
for (consumed once, dropped once, or still outstanding).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ragen_async.config import load_config
from ragen_async.orchestrator import Trainer
from ragen_async.records.metrics import MemorySink
from ragen_async.records.provenance import read_provenance
from ragen_async.records.rundir import RunDir
from tests.fakes import TickRuntime


def sim_cfg(tmp_path, k, steps=40, B=4, consume="arrival"):
    """Arrival order by default: the drop tests here are about the groups it overtakes and drops."""
    return load_config(None, [f"run_root={tmp_path}", "runtime=ray", f"total_steps={steps}", "validation.every=0",
                              f"staleness.max_staleness={'null' if k is None else k}", "algo.filter_mode=none",
                              f"rollout.envs=[{{tag: Bandit, n_groups: {B}}}]", "rollout.group_size=2",
                              "learner.num_ranks=1", "logging.console=false", f"staleness.consume={consume}"])


@pytest.mark.parametrize("k", [0, 1, 2, None])
def test_every_drop_returns_exactly_one_slot_and_the_bound_holds(tmp_path, k):
    cfg = sim_cfg(tmp_path, k)
    runtime = TickRuntime(k, groups_per_step=4, producers=12, seed=k or 0)
    run_dir = RunDir.create(cfg)
    trainer = Trainer(cfg, run_dir, MemorySink(), runtime)
    sites = []
    drain = trainer.buffer.drain_drops

    def recording_drain():
        drops = drain()
        sites.extend(d.where for d in drops)
        return drops

    trainer.buffer.drain_drops = recording_drain
    # Inject consume-time drops (in-order consumption under AReaL's rule makes natural ones rare): every
    # seventh index is refused when the batch is taken, as a group that turned stale in the buffer would be.
    violation = trainer.buffer._violation
    trainer.buffer._violation = lambda index, oldest, v, consuming: (
        "stale" if consuming and index % 7 == 3 else violation(index, oldest, v, consuming))
    asyncio.run(trainer.run())
    trainer.close()

    ctrl = runtime.admission.controller
    assert ctrl.groups_consumed == 40 * 4
    assert ctrl.groups_dropped == trainer.buffer.dropped_total == len(sites)  # one slot per drop
    assert ctrl.groups_consumed + ctrl.groups_dropped + len(ctrl.outstanding) == ctrl.groups_admitted
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    staleness = [p["learner_version"] - g["min_version"] for p in provenance for g in p["groups"]]
    consumed = [g["group_id"] for p in provenance for g in p["groups"]]
    assert len(consumed) == len(set(consumed)) == 40 * 4  # nothing trained on twice
    assert trainer.duplicates > 0  # ... although copies arrived
    assert "consume" in sites
    if k is None:
        assert "add" not in sites and max(staleness) > 2
        return
    assert max(staleness) <= k
    assert ctrl.refusals > 0  # admission was binding
    if k > 0:
        assert max(staleness) == k  # the bound was reached, not only respected
        assert "add" in sites  # slow groups arrived already too stale


def test_audit_accounts_for_every_index_and_catches_a_duplicate(tmp_path):
    """`ragen-async audit`: every admitted index consumed once, dropped once (why), or outstanding at the
    last checkpoint; a group trained on twice, or one that vanished, makes it exit 1."""
    import json

    from typer.testing import CliRunner

    from ragen_async.cli import app

    cfg = sim_cfg(tmp_path, 1, steps=20)
    runtime = TickRuntime(1, groups_per_step=4, producers=12, seed=3)
    run_dir = RunDir.create(cfg)
    trainer = Trainer(cfg, run_dir, MemorySink(), runtime)
    asyncio.run(trainer.run())
    trainer.close()
    ctrl = runtime.admission.controller

    result = CliRunner().invoke(app, ["audit", str(run_dir.path)])
    assert result.exit_code == 0, result.output
    totals = json.loads(result.output.strip().splitlines()[-1])
    assert totals["consumed"] == 80 and totals["dropped"] == ctrl.groups_dropped > 0
    assert totals["admitted"] == ctrl.groups_admitted == 80 + totals["dropped"] + totals["outstanding"]
    assert set(totals["drop_reasons"]) == {"stale@add"}

    path = run_dir.path / "provenance.jsonl"
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    twice = records[0]["groups"][0]
    records[-1]["groups"].append(twice)  # a group trained on twice
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(app, ["audit", str(run_dir.path)])
    assert result.exit_code == 1 and f"duplicates [{twice['index']}]" in result.output

    records[-1]["groups"].pop()
    records[1]["groups"].pop()  # a consumed group whose record is lost: an unexplained gap
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(app, ["audit", str(run_dir.path)])
    assert result.exit_code == 1 and "unexplained" in result.output


@pytest.mark.parametrize("every", [0, 5])
def test_fixed_lag_plays_the_next_batch_while_this_one_trains_at_exactly_the_lag(tmp_path, every):
    """Under fixed lag the next batch's weights (v + 1 - k) are already in the learner's ring, so the engines take
    them and admission opens before the step trains: groups of the next version start while the learner trains
    (before a step that validates they wait: validation lends the engines the current weights). Every consumed
    group is exactly min(k, v) versions old and none is dropped."""
    k, steps = 2, 20
    cfg = load_config(None, [f"run_root={tmp_path}", "runtime=ray", f"total_steps={steps}",
                             f"validation.every={every}", f"staleness.max_staleness={k}", "staleness.fixed_lag=true",
                             "algo.filter_mode=none", "rollout.envs=[{tag: Bandit, n_groups: 4}]",
                             "rollout.group_size=2", "learner.num_ranks=1", "logging.console=false"])
    runtime = TickRuntime(0, groups_per_step=4, producers=12, seed=3)  # the gate admits one version at a time
    started_while_training = []
    train = runtime.train

    async def counting_train(shards):
        before = runtime.admission.controller.groups_admitted
        result = await train(shards)
        started_while_training.append(runtime.admission.controller.groups_admitted - before)
        return result

    runtime.train = counting_train
    run_dir = RunDir.create(cfg)
    trainer = Trainer(cfg, run_dir, MemorySink(), runtime)
    asyncio.run(trainer.run())
    trainer.close()

    validating = {s for s in range(1, steps + 1) if every and s % every == 0}  # steps validated after
    assert [n > 0 for n in started_while_training] == [s not in validating for s in range(1, steps + 1)]
    assert trainer.buffer.dropped_total == 0
    provenance = read_provenance(run_dir.path / "provenance.jsonl")
    assert [p["learner_version"] - g["min_version"] for p in provenance for g in p["groups"]] == [
        min(k, p["learner_version"]) for p in provenance for _ in p["groups"]]


def test_a_weight_check_that_fails_at_an_early_publish_leaves_admission_at_the_last_completed_step(tmp_path):
    """Under fixed lag the next version's weights go out before the step trains; if the check at that sync fails,
    admission has not opened the next version, so the state saved on the failure is the last completed step's
    and the run resumes from it (a resume publishes that step's version, which admission must not be past)."""
    cfg = load_config(None, [f"run_root={tmp_path}", "runtime=ray", "total_steps=10", "validation.every=0",
                             "staleness.max_staleness=2", "staleness.fixed_lag=true", "weight_sync.verify_every=1", "weight_sync.probe=false",
                             "algo.filter_mode=none", "rollout.envs=[{tag: Bandit, n_groups: 4}]",
                             "rollout.group_size=2", "learner.num_ranks=1", "logging.console=false"])
    runtime = TickRuntime(0, groups_per_step=4, producers=12, seed=5)
    trainer = Trainer(cfg, RunDir.create(cfg), MemorySink(), runtime)
    checks = []

    async def verify_weights(version):
        checks.append(version)
        if len(checks) == 5:  # the sync before step 5 trains
            raise RuntimeError("planted: an engine serves other bytes")
        return {}

    trainer.verify_weights = verify_weights
    with pytest.raises(RuntimeError, match="planted"):
        asyncio.run(trainer.run())
    trainer.close()
    assert trainer.completed == trainer.version == 4
    assert runtime.admission.controller.state()["published_version"] == 4  # not 5: the next version never opened
    state = json.loads((trainer.run_dir.checkpoints / "step_000004" / "driver_state.json").read_text())
    assert state["version"] == state["admission"]["published_version"] == 4
