"""Safe defaults at paper scale: a failure between learner steps ends the run
with a checkpoint of the last completed step that ``--resume`` continues; a relative run directory on a
multi-node run is refused; a checkpoint is COMPLETE only with every learner rank's files, hashed; the
learner group has its own timeout; the paper configs checkpoint and document their differences from RAGEN."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path

import pytest

from ragen_async import orchestrator
from ragen_async.agent.chat import ChatFormat
from ragen_async.config import LearnerConfig, RunConfig, load_config
from ragen_async.orchestrator import Trainer, run_trainer
from ragen_async.records import rundir
from ragen_async.records.metrics import MemorySink
from ragen_async.records.rundir import DRIVER_STATE, RunDir, finalize_checkpoint, staging_path, verify_checkpoint
from ragen_async.runtime import LocalRuntime
from tests.system.test_orchestrator_local import bandit_cfg, fake_bandit_engine

ROOT = Path(__file__).resolve().parents[2]
NCCL_DEATH = "rollout actor(s) [1] died; replacing actors on the NCCL path is not supported"
"""What ``RayRuntime._replace`` raises when a rollout actor dies on the NCCL path."""


# ---------------------------------------------------------------- a failure between steps saves the last one
class DyingRuntime(LocalRuntime):
    """The local runtime, whose rollout side dies (as a rollout actor on the NCCL path does) in ``where``
    (``receive``: while collecting the next batch; ``publish``: syncing the weights of a step just trained)
    once ``after`` learner steps are done; ``train``: the learner itself fails in that step."""

    def __init__(self, cfg, engine, where: str, after: int):
        super().__init__(cfg, engine)
        self.where, self.after, self.trained = where, after, 0

    def _maybe_die(self, where: str) -> None:
        if where == self.where and self.trained >= self.after:
            raise RuntimeError(NCCL_DEATH if where != "train" else "learner step failed")

    async def receive(self, timeout_s):
        self._maybe_die("receive")
        return await super().receive(timeout_s)

    async def train(self, shards):
        if self.trained + 1 >= self.after:
            self._maybe_die("train")
        result = await super().train(shards)
        self.trained += 1
        return result

    async def publish(self, version):
        if version > 0:
            self._maybe_die("publish")
        await super().publish(version)


@pytest.mark.parametrize("where", ["receive", "publish"])
def test_a_rollout_death_between_steps_saves_the_last_completed_step_and_resume_continues(
        tiny_model_path, tmp_path, caplog, where):
    """The rollout side dies after learner step 2 (collecting step 3's batch, or syncing step 2's weights):
    the run ends with its own error, after a checkpoint of step 2 (checkpoint_every=0: there was none), named
    in one logged line with the resume command; ``--resume`` trains step 3."""
    chat = ChatFormat.from_pretrained(tiny_model_path)
    cfg = bandit_cfg(tiny_model_path, tmp_path, "validation.every=0", "total_steps=3", "logging.episodes_every=0")
    run_dir = RunDir.create(cfg)
    sink = MemorySink()
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError, match=r"NCCL path is not supported") as info:
        run_trainer(cfg, run_dir, sink, DyingRuntime(cfg, fake_bandit_engine(chat), where, after=2))
    checkpoint = run_dir.latest_checkpoint()
    assert checkpoint is not None and checkpoint.name == "step_000002"
    line = (f"run failed after learner step 2: checkpoint written to {checkpoint}; "
            f"continue with: ragen-async train --resume {run_dir.path}")
    assert [r.getMessage() for r in caplog.records if r.name == "ragen_async.orchestrator"] == [line]
    assert info.value.__notes__ == [line]  # the console's one-line error carries it
    state = json.loads((checkpoint / DRIVER_STATE).read_text())
    assert (state["step"], state["version"]) == (2, 2)
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    assert marker["learner_ranks"] == 1 and "learner_rank0.pt" in marker["required"]
    assert any(name.startswith("learner_state") for name in marker["required"])  # rank 0's optimizers, critic

    resumed = MemorySink()
    run_trainer(cfg, run_dir, resumed, LocalRuntime(cfg, fake_bandit_engine(chat)), run_dir.latest_checkpoint())
    assert [(r["learner/step"], r["policy_version"]) for r in resumed.records if "actor/grad_norm" in r] == [(3, 3)]
    assert run_dir.latest_checkpoint().name == "step_000003"


def test_a_failure_inside_the_learner_step_saves_nothing(tiny_model_path, tmp_path, caplog):
    """A learner step that fails leaves the learner's state unknown (a mini-batch may have stepped): no
    checkpoint is written from it, and the error is the run's own."""
    chat = ChatFormat.from_pretrained(tiny_model_path)
    cfg = bandit_cfg(tiny_model_path, tmp_path, "validation.every=0", "total_steps=3", "logging.episodes_every=0")
    run_dir = RunDir.create(cfg)
    with pytest.raises(RuntimeError, match="learner step failed") as info:
        run_trainer(cfg, run_dir, MemorySink(), DyingRuntime(cfg, fake_bandit_engine(chat), "train", after=2))
    assert run_dir.latest_checkpoint() is None
    assert not getattr(info.value, "__notes__", [])


class _Admission:
    async def state(self):
        return {"outstanding": []}


class _Runtime:
    """A stand-in runtime whose learner has ``ranks`` ranks but whose save wrote only what a head node sees
    when rank 1 ran on another node with a relative run directory: rank 0's files."""

    admission = _Admission()

    def __init__(self, ranks: int):
        self.checkpoint_ranks = ranks

    async def save(self, path: Path, step: int) -> None:
        _learner_files(path, ranks=1)


def _learner_files(path: Path, ranks: int) -> None:
    for r in range(ranks):
        (path / f"learner_rank{r}.pt").write_bytes(b"rank %d" % r)
    (path / "learner_state.pt").write_bytes(b"optimizers")
    (path / "actor").mkdir(exist_ok=True)
    (path / "actor" / "config.json").write_text("{}")
    (path / "actor" / "model.safetensors").write_bytes(b"weights")


def test_the_ranks_a_checkpoint_needs_come_from_the_config_not_from_the_files(tmp_path):
    """Trainer.save on a 2-rank learner whose rank 1 file is not where the head looks: refused, not COMPLETE."""
    cfg = load_config(None, [f"run_root={tmp_path}", "runtime=ray", "learner.num_ranks=2", "validation.every=0"])
    run_dir = RunDir.create(cfg)
    trainer = Trainer(cfg, run_dir, MemorySink(), _Runtime(ranks=2))
    with pytest.raises(rundir.IncompleteCheckpoint, match=r"learner_rank1\.pt missing .*learner\.num_ranks=2"):
        asyncio.run(trainer.save(3))
    assert run_dir.latest_checkpoint() is None
    assert not (run_dir.checkpoints / "step_000003").exists()


# ---------------------------------------------------------------- finalize_checkpoint: every rank, hashed
def test_finalize_marks_complete_only_with_every_rank_s_files_and_hashes_them(tmp_path):
    cfg = load_config(None, [f"run_root={tmp_path}", "validation.every=0"])
    run_dir = RunDir.create(cfg)

    partial = staging_path(run_dir, 5)
    _learner_files(partial, ranks=3)
    (partial / "learner_rank1.pt").unlink()  # rank 1 wrote elsewhere (or not at all)
    with pytest.raises(rundir.IncompleteCheckpoint) as info:
        finalize_checkpoint(run_dir, partial, 5, learner_ranks=4)
    message = str(info.value)
    assert "\n" not in message
    assert "learner_rank1.pt, learner_rank3.pt missing" in message and "learner.num_ranks=4" in message
    assert not (partial / "COMPLETE").exists() and not (run_dir.checkpoints / "step_000005").exists()
    assert run_dir.latest_checkpoint() is None

    staging = staging_path(run_dir, 5)
    _learner_files(staging, ranks=4)
    final = finalize_checkpoint(run_dir, staging, 5, learner_ranks=4)
    assert final == run_dir.checkpoints / "step_000005" and verify_checkpoint(final) is None
    marker = json.loads((final / "COMPLETE").read_text())
    manifest = json.loads((final / "MANIFEST.json").read_text())
    assert marker["learner_ranks"] == 4
    assert sorted(marker["required"]) == sorted(
        [f"learner_rank{r}.pt" for r in range(4)] + ["learner_state.pt", "actor/config.json", "actor/model.safetensors"])
    assert all(manifest[name]["sha256"] == sha for name, sha in marker["required"].items())
    assert run_dir.latest_checkpoint() == final

    # On resume the marker is checked against the manifest: a rank file dropped from both is found.
    del manifest["learner_rank2.pt"]
    (final / "learner_rank2.pt").unlink()
    (final / "MANIFEST.json").write_text(json.dumps(manifest))
    assert "learner_rank2.pt" in verify_checkpoint(final)
    assert run_dir.latest_checkpoint() is None


def test_a_sharded_actor_needs_every_shard_its_index_names(tmp_path):
    run_dir = RunDir.create(load_config(None, [f"run_root={tmp_path}"]))
    staging = staging_path(run_dir, 1)
    _learner_files(staging, ranks=1)
    (staging / "actor" / "model.safetensors").unlink()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (staging / "actor" / "model.safetensors.index.json").write_text(json.dumps(index))
    (staging / "actor" / "model-00001-of-00002.safetensors").write_bytes(b"1")
    with pytest.raises(rundir.IncompleteCheckpoint, match=r"actor/model-00002-of-00002\.safetensors missing"):
        finalize_checkpoint(run_dir, staging, 1, learner_ranks=1)
    (staging / "actor" / "model-00002-of-00002.safetensors").write_bytes(b"2")
    assert verify_checkpoint(finalize_checkpoint(run_dir, staging, 1, learner_ranks=1)) is None


# ---------------------------------------------------------------- a relative run_root on several nodes
def test_refuse_relative_names_the_fix_in_one_line():
    with pytest.raises(rundir.RelativeRunDir) as info:
        rundir.refuse_relative("runs", "run_root", "SLURM_JOB_NUM_NODES=2")
    assert str(info.value) == ("run_root 'runs' is relative: on a multi-node run (SLURM_JOB_NUM_NODES=2) each node "
                               "has its own working directory; set run_root to a shared absolute path, e.g. "
                               "run_root=/shared/runs")
    with pytest.raises(rundir.RelativeRunDir, match=r"--resume 'runs/x' is relative: .*shared absolute path"):
        rundir.refuse_relative(Path("runs/x"), "--resume", "the Ray cluster has 3 alive nodes")
    rundir.refuse_relative("/shared/runs", "run_root", "SLURM_JOB_NUM_NODES=2")  # absolute: fine
    rundir.refuse_relative("runs", "run_root", None)  # one node: fine


def test_multi_node_is_slurm_s_node_count_or_the_ray_cluster_s(monkeypatch):
    import ray

    from ragen_async.runtime import ray_runtime

    for var in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert ray_runtime.multi_node() is None
    monkeypatch.setenv("SLURM_NNODES", "1")
    assert ray_runtime.multi_node() is None
    monkeypatch.setenv("SLURM_NNODES", "4")
    assert ray_runtime.multi_node() == "SLURM_NNODES=4"
    monkeypatch.delenv("SLURM_NNODES")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    assert ray_runtime.multi_node() is None
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    assert ray_runtime.multi_node() == "the Ray cluster has 2 alive nodes"


def test_a_ray_run_with_a_relative_run_root_on_slurm_nodes_is_refused_before_anything_is_written(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    cfg = load_config(None, ["runtime=ray", "run_root=runs"])
    with pytest.raises(rundir.RelativeRunDir, match=r"^run_root 'runs' is relative: on a multi-node run "
                                             r"\(SLURM_JOB_NUM_NODES=2\).*run_root=/shared/runs$"):
        orchestrator.train(cfg)
    with pytest.raises(rundir.RelativeRunDir, match=r"^--run-dir 'r1' is relative"):
        orchestrator.train(cfg, run_dir_path=Path("r1"))
    assert list(tmp_path.iterdir()) == []


def test_the_ray_runtime_refuses_a_relative_run_dir_once_it_sees_several_nodes(monkeypatch):
    """Under ``ray job submit`` the driver learns the cluster's size only when it connects (RAY_ADDRESS):
    the runtime refuses there, before any actor starts."""
    from ragen_async.runtime import ray_runtime
    from ragen_async.runtime.ray_runtime import RayRuntime

    monkeypatch.setattr(RayRuntime, "_init_ray", lambda self: None)
    monkeypatch.setattr(RayRuntime, "_build", lambda self: pytest.fail("actors started"))
    monkeypatch.setattr(ray_runtime, "multi_node", lambda: "the Ray cluster has 2 alive nodes")
    cfg = load_config(None, ["runtime=ray"])
    with pytest.raises(rundir.RelativeRunDir, match=r"^run_root 'runs' is relative: on a multi-node run \(the Ray cluster"):
        RayRuntime(cfg, run_dir_given=("runs", "run_root"))


# ---------------------------------------------------------------- an absolute but node-local run_root on several nodes
def test_refuse_unshared_names_the_path_the_blind_nodes_and_the_fix(tmp_path):
    """Each node is asked whether it reads the marker the driver wrote, while it is there; the marker is gone
    afterwards, whatever the answer."""
    asked = []

    def one_blind_node(marker, token):
        asked.append(marker.read_text() == token and marker.parent == tmp_path)
        return ["10.0.0.2"]

    with pytest.raises(rundir.UnsharedRunDir) as info:
        rundir.refuse_unshared(str(tmp_path), "run_root", one_blind_node)
    assert str(info.value) == (f"run_root {str(tmp_path)!r} is not shared by every node: a file written there on "
                               "this node is not seen from node(s) 10.0.0.2, where the learner ranks' checkpoint "
                               "files would go to a folder of their own; set run_root to a folder on a shared file "
                               "system, e.g. run_root=/shared/runs")
    assert asked == [True] and list(tmp_path.iterdir()) == []
    rundir.refuse_unshared(tmp_path, "--resume", lambda marker, token: [])  # every node sees it: fine
    assert list(tmp_path.iterdir()) == []


def test_the_ray_runtime_refuses_a_node_local_run_dir_before_any_actor_starts(tmp_path, monkeypatch):
    """An absolute path that is a folder of its own on each node (``/tmp/runs``) passes the relative check; the
    runtime asks every node whether it sees a file written there, before any actor starts."""
    from ragen_async.runtime import ray_runtime
    from ragen_async.runtime.ray_runtime import RayRuntime

    monkeypatch.setattr(RayRuntime, "_init_ray", lambda self: None)
    monkeypatch.setattr(RayRuntime, "_build", lambda self: pytest.fail("actors started"))
    monkeypatch.setattr(ray_runtime, "multi_node", lambda: "SLURM_JOB_NUM_NODES=2")
    monkeypatch.setattr(ray_runtime, "blind_nodes", lambda marker, token: ["10.0.0.2"])
    cfg = load_config(None, ["runtime=ray", f"run_root={tmp_path}"])
    with pytest.raises(rundir.UnsharedRunDir, match=rf"^run_root '{tmp_path}' is not shared by every node: .*10\.0\.0\.2"):
        RayRuntime(cfg, run_dir_given=(str(tmp_path), "run_root"))


def test_learner_ranks_get_absolute_checkpoint_paths(tmp_path, monkeypatch):
    """A rank's working directory need not be the driver's: the paths it is sent are absolute."""
    from ragen_async.runtime.ray_runtime import RayRuntime

    sent = []

    class Call:
        def remote(self, *args):
            sent.append(args[0])

            async def done():
                return 0
            return done()

    class Learner:
        save_checkpoint = load_checkpoint = Call()

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "r" / "ckpt").mkdir(parents=True)
    rt = RayRuntime.__new__(RayRuntime)  # no cluster: only the learner calls
    rt.learners, rt.restarts, rt.abandoned = [Learner(), Learner()], 0, 0
    asyncio.run(rt.save(Path("runs/r/ckpt"), 1))
    asyncio.run(rt.load(Path("runs/r/ckpt")))
    assert sent == [str(tmp_path / "runs/r/ckpt")] * 4


# ---------------------------------------------------------------- the learner group's own timeout
def test_the_learner_group_times_out_after_learner_group_timeout_s(monkeypatch):
    """Not weight_sync.timeout_s (120 s): rank 0 may read a 16 GB checkpoint while the others wait."""
    import torch.distributed as dist

    from ragen_async.learner import actor

    calls, stores = [], []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kw: stores.append((args, kw)) or "client store")
    cfg = load_config(None, ["learner.group_timeout_s=2400", "weight_sync.timeout_s=120"])
    actor.join_learner_group(cfg, "gloo", "10.0.0.1", 29500, 1, 4)
    [(backend, kw)] = calls
    assert backend == "gloo" and kw["timeout"] == dt.timedelta(seconds=2400)
    assert (kw["store"], kw["rank"], kw["world_size"]) == ("client store", 1, 4)
    assert stores == [(("10.0.0.1", 29500, 4, False), {"timeout": dt.timedelta(seconds=2400)})]
    assert LearnerConfig().group_timeout_s >= 1800  # the default covers loading a paper-scale checkpoint


def test_the_learner_actor_joins_its_group_with_that_timeout(monkeypatch):
    """``LearnerActor.setup`` (the Ray shell, run here without Ray) passes the group timeout on."""
    import torch.distributed as dist

    from ragen_async.learner import actor

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(kw["timeout"]))

    class Stop(Exception):
        pass

    def no_learner(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(actor, "Learner", no_learner)
    shell = actor.LearnerActor.__ray_metadata__.modified_class
    self = shell.__new__(shell)
    self.cfg = load_config(None, ["learner.group_timeout_s=900", "learner.backend=gloo"])
    self.rank, self.world_size, self._store = 0, 2, "rank 0's store"
    with pytest.raises(Stop):
        shell.setup(self, "127.0.0.1", 29500)
    assert calls == [dt.timedelta(seconds=900)]


def test_rank_0_holds_the_learner_groups_port_from_the_moment_it_picks_it(monkeypatch):
    """The rendezvous is a TCP store rank 0 opens on a kernel-picked port and keeps: no other process can
    take the port before the group forms (a port only found free, as before, could be taken in between, and
    the other ranks then waited on a stranger's socket until the group's timeout)."""
    import socket

    import ray

    from ragen_async.learner import actor

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    shell = actor.LearnerActor.__ray_metadata__.modified_class
    self = shell.__new__(shell)
    self.cfg, self.world_size = load_config(None, ["learner.group_timeout_s=30"]), 2
    address, port = shell.rendezvous(self)
    assert address == "127.0.0.1" and port > 0
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind(("127.0.0.1", port))
    del self._store


# ---------------------------------------------------------------- the paper configs
PAPER = sorted([*(ROOT / "configs/paper").glob("starpo*.yaml"), *(ROOT / "configs/paper").glob("grpo*.yaml")])
"""The paper's runs (not helpers such as make paper-shape's small-batch config)."""


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_paper_configs_checkpoint_and_aggregate_as_ragen_ran(path):
    cfg: RunConfig = load_config(path)
    assert 0 < cfg.checkpoint_every <= 25 and cfg.total_steps % cfg.checkpoint_every == 0
    assert cfg.algo.loss_agg_mode == "seq-mean-token-mean"
    assert cfg.learner.group_timeout_s >= 1800


def test_the_checkpoint_interval_states_its_cost_and_the_readme_its_differences():
    base = (ROOT / "configs/paper/base.yaml").read_text()
    assert "checkpoint_every: 20" in base and "16 GB" in base and "1 GB/s" in base
    readme = (ROOT / "configs/paper/README.md").read_text()
    for topic in ("Loss aggregation", "length instruction", "KL in the PPO runs", "Validation across engines",
                  "Checkpoints", "verify_every", "fp32 master weights", "RAGEN-AI/RAGEN at `5eb79b8`"):
        assert topic in readme, topic
