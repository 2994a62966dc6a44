"""A real SLURM on this host for tests: Debian's ``slurm-wlm`` daemons and ``munge``, one ``slurmctld`` and
``n`` ``slurmd -N nodeK`` (each its own port, spool and log), all in a private folder with their own
config (``SLURM_CONF``) and munge socket, so nothing of the system's is touched. The daemons are
stopped by the PIDs this module started.

``ensure_installed`` installs the packages with apt when they are missing (root and Debian's package
mirror needed; the CI machine has both).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


def ensure_installed() -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise RuntimeError("slurm-wlm and munge are not installed and this is not root: "
                           f"apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"slurm-wlm and munge are missing; installing them as root: apt-get install {' '.join(PACKAGES)}",
          file=sys.stderr, flush=True)
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], check=True, env=env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """``with SlurmCluster(folder, nodes=2, cpus=2) as slurm: slurm.run(["sbatch", ...])``."""

    def __init__(self, folder: Path, nodes: int = 2, cpus: int = 2, memory_mb: int = 8000):
        self.dir = Path(folder)
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.cpus, self.memory_mb = cpus, memory_mb
        self.procs: list[subprocess.Popen] = []
        self.host = socket.gethostname()
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ setup
    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            (d / "spool" / n).mkdir(exist_ok=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        ctld_port = _free_port()
        lines = [
            "ClusterName=ragen_test", f"SlurmctldHost={self.host}", f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root", f"AuthInfo=socket={d / 'munge' / 'munge.socket'}",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'spool'}/%n/slurmd.pid",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "ReturnToService=2", "JobRequeue=1", "KillWait=10", "MinJobAge=600",
            "SlurmctldTimeout=30", "SlurmdTimeout=60", "InactiveLimit=0", "Waittime=0",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={_free_port()} "
                         f"CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
                     "State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(line for line in lines if line) + "\n")

    def _start(self, args: list[str], name: str) -> subprocess.Popen:
        log = (self.dir / "log" / f"{name}.out").open("w")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> SlurmCluster:
        ensure_installed()
        self._write_config()
        m = self.dir / "munge"
        self._start(["munged", "-F", "--force", f"--socket={m / 'munge.socket'}", f"--key-file={m / 'munge.key'}",
                     f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                     f"--seed-file={m / 'munged.seed'}"], "munged")
        self._wait(lambda: (m / "munge.socket").exists(), "munged")
        self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, "slurmctld")
        for n in self.nodes:
            self._start(["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}")
        self._wait(self._nodes_idle, "every slurmd to register")
        return self

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return all(states.get(n, "").startswith("idle") for n in self.nodes)

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode} while waiting for {what}: "
                                       f"{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready in {timeout:.0f} s: {self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted((self.dir / "log").iterdir()))

    def run(self, args: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(args, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              check=check, **kw)

    # ------------------------------------------------------------------ jobs
    def job_state(self, job_id: str) -> dict[str, str]:
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state.get('JobState')} after {timeout:.0f} s")
            time.sleep(1)

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
