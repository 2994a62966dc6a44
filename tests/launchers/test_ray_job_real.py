"""``launchers/ray_job.sh`` against a real Ray cluster: a head started here from this venv, jobs through
its Jobs API, real (tiny) training on it.

One module-scoped head node serves every test; it runs with its own temp dir and ports, and is torn
down by the processes it started (never ``ray stop``, which would stop every Ray of this user on the
host). Order matters: the resume test continues the run the first test trained.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.clusters_lane, pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "launchers" / "ray_job.sh"
# The project's tiny model (CI builds it before the tests); RAGEN_TEST_MODEL points at another build, as
# for the rest of the suite (tests/conftest.py).
MODEL = Path(os.environ.get("RAGEN_TEST_MODEL") or REPO / "artifacts" / "tiny-model")
BIN = Path(sys.executable).parent
CONFIG = "configs/tiny/starpo_s_bandit.yaml"
# 4 groups of 4 episodes per step (StarPO-S keeps 1), one rollout actor, one learner rank, validation on
# 8 seeds; a checkpoint at the end, so the run can be continued.
TRAIN = [
    "rollout.group_size=4", "rollout.envs=[{tag: Bandit, n_groups: 4}]", "learner.mini_batch_size=4",
    "learner.micro_batch_size=4", "rollout.num_workers=1", "learner.num_ranks=1", "inference.kv_cache_gib=0.1",
    "validation.envs=[{tag: Bandit, n_groups: 8}]", "validation.every=2", "logging.console=false",
]
JOB_TIMEOUT = 240


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def git_commit() -> str | None:
    result = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def stat_of(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first, session fourth); None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cwd_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def cluster_pids(session: int, temp_dir: str) -> list[int]:
    """Every live process of the head we started: its session (ray start made it), and the job drivers,
    which Ray starts in sessions of their own but inside the job's working directory under our temp dir."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        stat = stat_of(pid)
        if stat and stat[0] != "Z" and (stat[3] == str(session) or cwd_of(pid).startswith(temp_dir + "/")):
            pids.append(pid)
    return pids


def stop_cluster(session: int, temp_dir: str) -> None:
    """SIGTERM, then SIGKILL what is left (the GCS and the autoscaler monitor outlast a SIGTERM by far)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in cluster_pids(session, temp_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while cluster_pids(session, temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = cluster_pids(session, temp_dir)
    assert not left, f"processes of the test's Ray head outlived SIGKILL: {left}"


class Cluster:
    def __init__(self, dashboard: str, gcs: str, env: dict[str, str]):
        self.dashboard, self.gcs, self.env = dashboard, gcs, env

    def client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard)

    def launch(self, *args: str, env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT,
               **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(LAUNCHER), *args], cwd=REPO, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, **kw)

    def job_of(self, stderr: str):
        """The job the launcher submitted (it names it on its first line)."""
        line = next(x for x in stderr.splitlines() if x.startswith("submitting "))
        return self.client().get_job_info(line.split()[1])


def start_head(temp_dir: str, env: dict[str, str], attempt: int) -> tuple[int, str | None, list[int]]:
    """`ray start --head` on free ports: its session (to stop what it started), None when it started or else its
    output, and the ports (GCS and dashboard first)."""
    ports = free_ports(9)
    gcs, dashboard, client, node_manager, object_manager, agent_grpc, agent_http, metrics, env_agent = ports
    # Worker ports below the kernel's ephemeral range (Linux: 32768-60999), where free_ports' picks lie: a
    # worker range inside it met one of them once and `ray start` refused to run.
    worker_base = 10000 + ((os.getpid() + attempt) % 200) * 100
    start = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--num-cpus=4", "--object-store-memory=200000000",
         f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}", f"--node-manager-port={node_manager}",
         f"--object-manager-port={object_manager}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--dashboard-agent-listen-port={agent_http}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={env_agent}", f"--min-worker-port={worker_base}",
         f"--max-worker-port={worker_base + 99}", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = start.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        start.kill()
        out = start.communicate()[0] + "\n(`ray start` did not return in 120 s)"
    return start.pid, (None if start.returncode == 0 else out), ports  # start.pid: the session's leader


@pytest.fixture(scope="module")
def cluster():
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"{MODEL} is missing: it is shipped in the repository (`git checkout {MODEL}`)")
    if not (BIN / "ray").is_file():
        pytest.skip(f"no ray CLI next to {sys.executable}")
    pytest.importorskip("ray.dashboard.modules.job.sdk", reason="needs ray[default] (the dashboard's Jobs API)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # this process's JobSubmissionClient
    # As an operator would start it: the venv activated (so the job's `python` is this one), token auth
    # off explicitly, and no W&B mode or key of ours leaking into the jobs.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "WANDB_MODE", "WANDB_API_KEY", "WANDB_RUN_GROUP",
                        "WANDB_TAGS", "WANDB_PROJECT", "WANDB_ENTITY", "RAGEN_RUN_ROOT")}
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", RAY_AUTH_MODE="disabled", WANDB_SILENT="true",
               PYTHON=sys.executable, RAY=str(BIN / "ray"))
    # The ports are free when picked, not reserved: a process of the other lane may bind one before the head
    # does, and `ray start` then fails ("The current node timed out during startup"; seen once in CI). That
    # start is torn down and the head started once more on new ports; a second failure fails the test.
    for attempt in (1, 2):
        temp_dir = tempfile.mkdtemp(prefix="ray_job_test_", dir="/tmp")  # short: Ray's socket paths live under it
        session, out, ports = start_head(temp_dir, env, attempt)
        if out is None:
            break
        try:
            stop_cluster(session, temp_dir)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
        assert attempt == 1, out
        print(f"`ray start --head` failed on ports {ports}; starting it again on new ports:\n{out[-2000:]}")
    gcs, dashboard = ports[:2]
    try:
        c = Cluster(f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}", env)
        deadline = time.monotonic() + 60
        while True:  # the Jobs API answers a moment after `ray start` returns
            listed = subprocess.run([str(BIN / "ray"), "job", "list", "--address", c.dashboard], env=env,
                                    capture_output=True, text=True, timeout=60)
            if listed.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert listed.returncode == 0, f"no Jobs API at {c.dashboard}: {listed.stdout}{listed.stderr}"
        yield c
    finally:
        try:
            stop_cluster(session, temp_dir)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)


def metrics(run_dir: Path) -> tuple[list[int], list[int]]:
    """Learner steps of the training records, and of the validation records, in order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["learner/step"] for r in records if "actor/grad_norm" in r]
    val = [r["learner/step"] for r in records if "val/success" in r]
    return train, val


@pytest.fixture(scope="module")
def first_run(cluster, tmp_path_factory):
    """A 2-step run submitted through RAY_ADDRESS (the dashboard URL), W&B offline with a group and tags."""
    run_root = tmp_path_factory.mktemp("ray_job_runs")
    result = cluster.launch("--run-root", str(run_root), "--wandb-group", "jobtest-group-q7", "--wandb-tags",
                            "jobtest-tag-a,jobtest-tag-b", CONFIG, f"model.path={MODEL}", "total_steps=2",
                            "logging.wandb_mode=offline", *TRAIN, env={"RAY_ADDRESS": cluster.dashboard})
    return run_root, result


def test_train_job_succeeds_and_writes_the_run(cluster, first_run):
    run_root, result = first_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"to {cluster.dashboard} (RAY_ADDRESS)" in result.stderr
    assert "SUCCEEDED" in result.stderr
    assert "done in" in result.stdout + result.stderr  # the driver's own last words reached us
    (run_dir,) = run_root.iterdir()
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "step_000002").is_dir()
    train, val = metrics(run_dir)
    assert train == [1, 2] and val == [0, 2]

    info = cluster.job_of(result.stderr)
    assert info.status == "SUCCEEDED"
    assert info.entrypoint.split()[:6] == ["python", "-u", "-m", "ragen_async.cli", "train", CONFIG]
    commit = git_commit()
    assert info.metadata["git_commit"] == (commit or "unknown")
    assert info.metadata["ragen_command"] == "train" and info.metadata["run_root"] == str(run_root)
    env_vars = info.runtime_env["env_vars"]
    assert env_vars["WANDB_RUN_GROUP"] == "jobtest-group-q7" and env_vars["WANDB_TAGS"] == "jobtest-tag-a,jobtest-tag-b"
    # W&B (offline, inside the job) recorded the group, the tags and the commit it was given.
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = wandb_file.read_bytes()
    for expected in ("jobtest-group-q7", "jobtest-tag-a", "jobtest-tag-b", *([commit] if commit else [])):
        assert expected.encode() in data, expected


def test_resume_job_continues_the_run(cluster, first_run):
    run_root, result = first_run
    if result.returncode != 0:
        pytest.fail("the run to continue did not train (see test_train_job_succeeds_and_writes_the_run)")
    (run_dir,) = run_root.iterdir()
    # A finished run is continued by raising its saved total_steps (--resume takes no overrides).
    config = run_dir / "config.yaml"
    text = config.read_text()
    assert "total_steps: 2\n" in text
    config.write_text(text.replace("total_steps: 2\n", "total_steps: 3\n"))
    resumed = cluster.launch("--address", cluster.dashboard, "--job-python", sys.executable, "--entrypoint-num-cpus",
                             "0.5", "train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert list(run_root.iterdir()) == [run_dir]  # the same directory, no new run
    train, val = metrics(run_dir)
    assert train == [1, 2, 3] and val == [0, 2, 3]
    assert (run_dir / "checkpoints" / "step_000003").is_dir()
    info = cluster.job_of(resumed.stderr)
    assert info.entrypoint.split()[-3:] == ["train", "--resume", str(run_dir)]
    assert info.metadata["ragen_command"] == "train --resume"


def test_failed_job_exits_nonzero(cluster, tmp_path):
    """The config validates here, but the CLI in the job rejects it (no model at that path)."""
    result = cluster.launch("--run-root", str(tmp_path), CONFIG, f"model.path={tmp_path / 'no-model'}",
                            "total_steps=1", env={"RAY_ADDRESS": cluster.gcs}, timeout=120)
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-4000:]
    assert "FAILED" in result.stderr and "is not a model directory" in result.stdout
    assert "GCS address" in result.stderr  # host:port: Ray looked the dashboard up through the GCS
    assert cluster.job_of(result.stderr).status == "FAILED"
    assert not any(tmp_path.iterdir())


def test_stopped_job_exits_nonzero(cluster, tmp_path):
    client = cluster.client()
    known = {j.submission_id for j in client.list_jobs()}
    proc = subprocess.Popen([str(LAUNCHER), "--address", cluster.dashboard, "--run-root", str(tmp_path), CONFIG,
                             f"model.path={MODEL}", "total_steps=50", "logging.wandb_mode=disabled", *TRAIN],
                            cwd=REPO, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        job = None
        while job is None and time.monotonic() < deadline and proc.poll() is None:
            job = next((j for j in client.list_jobs() if j.submission_id not in known and j.status == "RUNNING"), None)
            time.sleep(0.5)
        assert job is not None, "the job never ran"
        client.stop_job(job.submission_id)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out[-4000:] + err[-4000:]
    assert f"{job.submission_id} STOPPED" in err
    assert client.get_job_info(job.submission_id).status == "STOPPED"
