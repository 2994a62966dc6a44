"""The synchronous reference loop (runtime: local), end to end."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from ragen_async import orchestrator
from ragen_async.agent.chat import ChatFormat
from ragen_async.agent.parsing import format_reply
from ragen_async.config import load_config
from ragen_async.inference.fake_engine import FakeEngine
from ragen_async.orchestrator import run_trainer
from ragen_async.records.metrics import MemorySink
from ragen_async.records.rundir import RunDir, pack_run
from ragen_async.runtime import LocalRuntime

pytestmark = pytest.mark.clusters_lane

REQUIRED = ["learner/step", "policy_version", "rollout/success", "rollout/reward_mean",
            "rollout/in_group_reward_std", "rollout/response_length", "actor/entropy", "actor/grad_norm",
            "actor/pg_clipfrac", "actor/ppo_kl", "critic/vf_loss", "filter/kept_groups", "timing/step_s",
            "throughput/tokens_per_s", "throughput/groups_per_s", "rollout/Bandit/success", "staleness/mean", "weight_sync/time_s"]


def bandit_cfg(model_path, tmp_path, *overrides):
    return load_config("configs/tiny/starpo_s_bandit.yaml", [
        f"model.path={model_path}", f"run_root={tmp_path}", "total_steps=3", "rollout.group_size=4",
        "rollout.envs=[{tag: Bandit, n_groups: 4}]", "validation.every=3",
        "validation.envs=[{tag: Bandit, n_groups: 8}]", "learner.mini_batch_size=4", "logging.console=false",
        *overrides])


def fake_bandit_engine(chat: ChatFormat) -> FakeEngine:
    """Replies well-formed answers naming a random arm (the arm names are read from the prompt)."""
    names = ["Phoenix", "Dragon"]

    def reply(prompt_ids, rng: random.Random):
        return chat.encode(format_reply([rng.choice(names)], think="pick")) + [chat.end_of_turn_id]

    return FakeEngine(reply, logprob=-0.7)


def run_local(cfg, engine=None, run_dir=None, resume=False):
    """The one loop on the local runtime; ``resume`` continues ``run_dir`` from its latest checkpoint."""
    run_dir = run_dir or RunDir.create(cfg)
    sink = MemorySink()
    runtime = LocalRuntime(cfg, engine)
    run_trainer(cfg, run_dir, sink, runtime, run_dir.latest_checkpoint() if resume else None)
    return run_dir, sink.records, runtime


def test_three_steps_with_the_fake_engine(tiny_model_path, tmp_path, capsys):
    cfg = bandit_cfg(tiny_model_path, tmp_path)
    engine = fake_bandit_engine(ChatFormat.from_pretrained(tiny_model_path))
    run_dir, records, trainer = run_local(cfg, engine)
    assert "stopped after step 3: total_steps=3 reached" in capsys.readouterr().out  # which limit ended it
    steps = [r for r in records if "actor/grad_norm" in r]
    assert [r["learner/step"] for r in steps] == [1, 2, 3]
    for key in REQUIRED:
        assert key in steps[-1], key
    assert [r["policy_version"] for r in steps] == [1, 2, 3]
    assert [v for v, _ in engine.loaded] == [1, 2, 3]  # every new version was pushed to the engine
    # the byte-exact weight check at the first sync only (the default), over every tensor published
    assert ["weight_sync/verified_tensors" in r for r in steps] == [True, False, False]
    assert steps[0]["weight_sync/verified_tensors"] == len(engine.loaded[0][1])
    # verl's tokens/s per GPU: every token over the step's wall time, per learner rank (one here)
    assert all(r["throughput/tokens_per_s_per_gpu"] == r["throughput/tokens_per_s"] for r in steps)
    assert all(r["staleness/max"] == 0 for r in steps)  # synchronous: every token is fresh
    val = [r for r in records if "val/Bandit/success" in r]
    assert [r["learner/step"] for r in val] == [0, 3]
    assert (run_dir.checkpoints / "step_000003" / "COMPLETE").exists()
    assert (run_dir.path / "config.yaml").exists()


def test_resume_continues_exactly(tiny_model_path, tmp_path):
    """3 steps straight == 2 steps, stop, resume for the 3rd (same losses, same data)."""
    chat = ChatFormat.from_pretrained(tiny_model_path)
    cfg = bandit_cfg(tiny_model_path, tmp_path, "validation.every=0", "checkpoint_every=2")
    _, straight, _ = run_local(cfg, fake_bandit_engine(chat))

    cfg2 = bandit_cfg(tiny_model_path, tmp_path, "validation.every=0", "checkpoint_every=2", "total_steps=2")
    run_dir, first, _ = run_local(cfg2, fake_bandit_engine(chat))
    cfg3 = bandit_cfg(tiny_model_path, tmp_path, "validation.every=0", "checkpoint_every=2")
    _, resumed, _ = run_local(cfg3, fake_bandit_engine(chat), run_dir=run_dir, resume=True)
    assert [r["learner/step"] for r in resumed] == [3]
    for key in ("actor/pg_loss", "critic/vf_loss", "rollout/reward_mean", "actor/grad_norm"):
        assert resumed[0][key] == pytest.approx(straight[2][key], rel=1e-5, abs=1e-7), key


def test_time_budget_stops_at_a_step_boundary_with_validation_and_checkpoint(tiny_model_path, tmp_path, capsys):
    """A budget far below one step's time: exactly one step, then the final validation and checkpoint."""
    cfg = bandit_cfg(tiny_model_path, tmp_path, "total_steps=50", "validation.every=10",
                     "time_budget_minutes=1e-6")
    engine = fake_bandit_engine(ChatFormat.from_pretrained(tiny_model_path))
    run_dir, records, _ = run_local(cfg, engine)
    assert "stopped after step 1 of total_steps=50: time_budget_minutes=1e-06 spent" in capsys.readouterr().out
    steps = [r for r in records if "actor/grad_norm" in r]
    assert [r["learner/step"] for r in steps] == [1]
    assert steps[0]["timing/budget_spent_s"] > 0
    assert [r["learner/step"] for r in records if "val/Bandit/success" in r] == [0, 1]
    assert [r["val/policy_version"] for r in records if "val/Bandit/success" in r] == [0, 1]  # the version validated
    assert run_dir.latest_checkpoint().name == "step_000001"


@pytest.mark.vllm
def test_three_steps_with_vllm_and_weights_reach_the_engine(tiny_model_path, tmp_path):
    """After every update the engine serves the learner's weights: same log-probs for the loop's probe."""
    cfg = bandit_cfg(tiny_model_path, tmp_path, "weight_sync.verify_every=1", "inference.kv_cache_gib=0.1")
    run_dir, records, runtime = run_local(cfg)
    steps = [r for r in records if "actor/grad_norm" in r]
    assert [r["policy_version"] for r in steps] == [1, 2, 3]
    for key in REQUIRED:
        assert key in steps[-1], key
    assert runtime.engine.policy_version == 3
    # float32 on both sides; kernels differ only in reduction order (see tests/inference for the bound).
    assert all(r["weight_sync/probe_max_abs_diff"] < 2e-3 for r in steps)
    # and byte for byte: every tensor the engine's forward reads is what the learner published
    assert all(r["weight_sync/verified_tensors"] > 0 for r in steps)


def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(tiny_model_path, tmp_path, caplog):
    """Checkpoints are staged then renamed, with a manifest; a truncated file in the newest one is found
    on resume, logged, and the run continues from the one before."""
    chat = ChatFormat.from_pretrained(tiny_model_path)
    cfg = bandit_cfg(tiny_model_path, tmp_path, "validation.every=0", "checkpoint_every=1", "total_steps=2")
    run_dir, _, _ = run_local(cfg, fake_bandit_engine(chat))
    assert sorted(p.name for p in run_dir.checkpoints.iterdir()) == ["step_000001", "step_000002"]  # no partials
    state = run_dir.checkpoints / "step_000002" / "learner_rank0.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated, as by a crash or a full disk

    cfg3 = bandit_cfg(tiny_model_path, tmp_path, "validation.every=0", "checkpoint_every=1", "total_steps=3")
    with caplog.at_level("WARNING"):
        _, resumed, _ = run_local(cfg3, fake_bandit_engine(chat), run_dir=run_dir, resume=True)
    assert "step_000002 is damaged (learner_rank0.pt has 100 bytes" in caplog.text
    assert [r["learner/step"] for r in resumed if "actor/grad_norm" in r] == [2, 3]
    assert run_dir.latest_checkpoint().name == "step_000003"


def test_sigterm_stops_after_the_current_step_with_a_checkpoint_and_resume_completes(tiny_model_path, tmp_path):
    """SLURM's time-limit warning or a preemption notice (SIGTERM; SIGUSR1 alike): the step in progress
    finishes, a checkpoint is written although ``checkpoint_every`` is 0, ``Interrupted`` names the resume
    command, the previous signal handler is back, and ``--resume`` runs the remaining steps."""
    import os
    import signal
    import threading
    import time

    cfg = bandit_cfg(tiny_model_path, tmp_path, "total_steps=8", "validation.every=0", "checkpoint_every=0",
                     "logging.wandb_mode=disabled")
    chat = ChatFormat.from_pretrained(tiny_model_path)
    path = tmp_path / "run"

    def steps_logged() -> list[int]:
        metrics = path / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return [json.loads(line)["learner/step"] for line in lines if "actor/grad_norm" in line]

    def terminate_after_step_two():
        while len(steps_logged()) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=terminate_after_step_two, daemon=True).start()
    with pytest.raises(orchestrator.Interrupted, match=f"SIGTERM after step .*--resume {path}") as stopped:
        orchestrator.train(cfg, runtime=LocalRuntime(cfg, fake_bandit_engine(chat)), run_dir_path=path)
    assert signal.getsignal(signal.SIGTERM) is before
    step = stopped.value.step
    assert 2 <= step < 8 and steps_logged() == list(range(1, step + 1))
    assert RunDir(path).latest_checkpoint().name == f"step_{step:06d}"

    assert {p.name for p in pack_run(path)} == {"metrics.jsonl.gz", "provenance.jsonl.gz"}  # packed while stopped
    orchestrator.train(None, resume=path, runtime=LocalRuntime(cfg, fake_bandit_engine(chat)))
    assert steps_logged() == list(range(1, 9)) and not list(path.glob("*.gz"))  # unpacked, then appended to
    # each start names the machine it ran on (a run's realised staleness depends on it)
    machines = RunDir(path).read_state()["machines"]
    assert [m["from_step"] for m in machines] == [0, step]
    assert all(m["cpu"] and m["cpus"] >= 1 and isinstance(m["cpu_flags"], list) for m in machines)


def test_a_sigterm_while_the_runtime_starts_stops_the_run_after_its_first_step(tiny_model_path, tmp_path,
                                                                            monkeypatch):
    """A stop signal that arrives while the runtime is being built (engines starting; in a sweep, every run
    after the first) is not lost: the run stops after its first step with a checkpoint. (Before, the handler
    was installed only after the runtime, and such a SIGTERM was ignored or ended the process.)"""
    import os
    import signal

    cfg = bandit_cfg(tiny_model_path, tmp_path, "total_steps=8", "validation.every=0", "checkpoint_every=0",
                     "logging.wandb_mode=disabled")
    chat = ChatFormat.from_pretrained(tiny_model_path)

    def make_runtime_and_get_a_sigterm(cfg, *_args):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the main thread, before the runtime exists
        return LocalRuntime(cfg, fake_bandit_engine(chat))

    monkeypatch.setattr(orchestrator, "make_runtime", make_runtime_and_get_a_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(orchestrator.Interrupted, match="SIGTERM after step 1") as stopped:
        orchestrator.train(cfg, run_dir_path=tmp_path / "run")
    assert stopped.value.step == 1 and signal.getsignal(signal.SIGTERM) is before
    assert RunDir(tmp_path / "run").latest_checkpoint().name == "step_000001"


def test_starting_ray_keeps_the_runs_sigterm_handler_and_sizes_the_session_for_the_pool(tiny_model_path, tmp_path,
                                                                                       monkeypatch):
    """ray.init() installs a SIGTERM handler that exits the process at once (ray/_private/worker.py:
    ``sys.exit(signum)``); a Ray runtime started after the run's stop handler puts the run's back, so a
    SIGTERM during the engines' start-up still means: stop after the current step, with a checkpoint. The
    session it starts advertises the CPUs its pool asks for (a sweep's largest run), if more than its own."""
    import signal

    import ray

    from ragen_async.runtime.engine_pool import EnginePool
    from ragen_async.runtime.ray_runtime import RayRuntime

    started = {}

    def ray_init_as_ray_does(**kwargs):
        started.update(kwargs)
        signal.signal(signal.SIGTERM, lambda signum, _frame: exit(signum))

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # (the start-up would set it in this process)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", ray_init_as_ray_does)
    runtime = RayRuntime.__new__(RayRuntime)  # only the Ray start-up, no actors
    runtime.cfg = bandit_cfg(tiny_model_path, tmp_path, "runtime=ray")
    runtime.log_dir = tmp_path
    runtime.pool = EnginePool()
    runtime.pool.session_cpus = 5.0  # a sweep's largest run (this one needs 2)
    stop = orchestrator.StopRequest()
    previous = stop.install()
    try:
        runtime._init_ray()
        assert signal.getsignal(signal.SIGTERM) is stop and runtime._started_ray
        assert started["num_cpus"] == 5
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_a_stop_on_a_validation_step_validates_that_step_when_the_run_resumes(tiny_model_path, tmp_path):
    """A stop signal saves the step and stops before the validation due after it; the resumed run validates that
    step first, so every validation point of the run is there once (a study's M averages them)."""
    import os
    import signal
    import threading
    import time

    cfg = bandit_cfg(tiny_model_path, tmp_path, "total_steps=5", "validation.every=1", "checkpoint_every=0",
                     "logging.wandb_mode=disabled")
    chat = ChatFormat.from_pretrained(tiny_model_path)
    path = tmp_path / "run"

    def records() -> list[dict]:
        metrics = path / "metrics.jsonl"
        return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

    def terminate_after_step_one():
        while not any("actor/grad_norm" in r for r in records()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_after_step_one, daemon=True).start()
    with pytest.raises(orchestrator.Interrupted) as stopped:
        orchestrator.train(cfg, runtime=LocalRuntime(cfg, fake_bandit_engine(chat)), run_dir_path=path)
    step = stopped.value.step
    assert [r["learner/step"] for r in records() if "val/success" in r] == list(range(step))  # not yet `step`
    orchestrator.train(None, resume=path, runtime=LocalRuntime(cfg, fake_bandit_engine(chat)))
    assert [r["learner/step"] for r in records() if "val/success" in r] == list(range(6))


def test_resuming_a_run_without_a_checkpoint_trains_it_from_the_start(tiny_model_path, tmp_path, capsys):
    """A run dir whose weights were not kept (a study's sweep carried to another clone): its records are
    dropped and it trains again from step 1, with no duplicate steps in metrics or provenance."""
    chat = ChatFormat.from_pretrained(tiny_model_path)
    cfg = bandit_cfg(tiny_model_path, tmp_path, "total_steps=2", "validation.every=2")
    path = tmp_path / "run"
    orchestrator.train(cfg, runtime=LocalRuntime(cfg, fake_bandit_engine(chat)), run_dir_path=path)
    shutil.rmtree(path / "checkpoints")
    orchestrator.train(None, resume=path, runtime=LocalRuntime(cfg, fake_bandit_engine(chat)))
    assert f"{path} has no checkpoint: training it from the start" in capsys.readouterr().out
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert [r["learner/step"] for r in records if "actor/grad_norm" in r] == [1, 2]
    assert [r["learner/step"] for r in records if "val/Bandit/success" in r] == [0, 2]
    provenance = [json.loads(line) for line in (path / "provenance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in provenance] == [1, 2]


def test_sampled_episodes_are_written_as_text_every_n_steps(tiny_model_path, tmp_path):
    from ragen_async.orchestrator import make_sink

    cfg = bandit_cfg(tiny_model_path, tmp_path, "logging.episodes_every=2", "logging.episodes_per_log=3")
    run_dir = RunDir.create(cfg)
    sink = make_sink(cfg, run_dir)
    try:
        run_trainer(cfg, run_dir, sink, LocalRuntime(cfg, fake_bandit_engine(ChatFormat.from_pretrained(tiny_model_path))))
    finally:
        sink.close()
    rows = [json.loads(line) for line in run_dir.episodes_path.read_text().splitlines()]
    assert [r["learner/step"] for r in rows] == [2, 2, 2]  # steps 1..3, every 2nd: step 2 only
    assert [r["group_index"] for r in rows] == sorted(r["group_index"] for r in rows)
    for r in rows:
        assert r["env_tag"] == "Bandit" and r["staleness"] == 0 and isinstance(r["success"], bool)
        assert "<think> pick </think>" in r["text"] and ("Phoenix" in r["text"] or "Dragon" in r["text"])
