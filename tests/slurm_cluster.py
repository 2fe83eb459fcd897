"""A real one-node Slurm cluster on localhost for tests: Debian's munge, slurmctld and slurmd.

`SlurmCluster.start()` installs the packages when they are missing (apt-get, needs root and package
access), writes a minimal slurm.conf into a private directory, starts munged, slurmctld and slurmd
and waits until the node is idle; `stop()` ends the daemons it started. Everything Slurm writes
(state, spool, logs) stays in that directory; the client commands find the cluster through the
SLURM_CONF environment variable, which the cluster sets for this process (and so for its jobs).

When Slurm cannot be installed or started, `start()` raises `SlurmUnavailable` with the reason,
which the tests turn into a skip.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
DAEMONS = ["/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd"]
MUNGE_SOCKET_DIR = Path("/run/munge")

# The job states after which a job never runs again (squeue forgets jobs soon after; scontrol
# keeps them for MinJobAge, 300 s by default).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not root, no package access, a daemon does not start)."""


def _run(cmd: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def install_slurm() -> None:
    """apt-get install the daemons and clients unless they are there (~15 s with package access)."""
    if all(Path(d).exists() for d in DAEMONS) and shutil.which("sbatch"):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        try:
            result = _run(cmd, timeout=600, env=env)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` did not finish in 600 s") from None
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed (no package access?): {' | '.join(tail)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = int(f.readline().split()[1])
    return int(total_kb / 1024 * 0.9)


class SlurmCluster:
    """One controller and one compute node (this machine, `hostname`) with all its CPUs."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.conf = self.workdir / "slurm.conf"
        self.node = socket.gethostname()
        self.cpus = os.cpu_count() or 1
        self.started: list[Path] = []   # pid files of the daemons this object started
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- set-up ---------------------------------------------------------------------------

    def write_conf(self) -> None:
        d = self.workdir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        # Ports picked free rather than Slurm's 6817/6818, so that a second test session on the
        # same machine cannot talk to (or fail to bind next to) this cluster.
        self.conf.write_text(f"""\
ClusterName=msds-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
# Requeued jobs may start again after this many seconds (default 120): short for tests.
AuthInfo=cred_expire=10
# Look at pending jobs every 2 s (default 60 s), so a requeued job starts once it may.
SchedulerParameters=sched_interval=2,bf_interval=2
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_memory_mb()} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def start_munge(self) -> None:
        """munged with the key the package generated; an already running munged is reused."""
        if _run(["munge", "-n"]).returncode == 0:
            return
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
        result = _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
        if result.returncode != 0:
            raise SlurmUnavailable(f"munged does not start: {result.stderr.strip()}")
        self.started.append(MUNGE_SOCKET_DIR / "munged.pid")

    def start(self, timeout: float = 60) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise SlurmUnavailable("starting slurmd needs root")
        install_slurm()
        self.write_conf()
        self.start_munge()
        for daemon, pid_file in (("/usr/sbin/slurmctld", "slurmctld.pid"), ("/usr/sbin/slurmd", "slurmd.pid")):
            result = _run([daemon, "-f", str(self.conf)], env=self.env)
            if result.returncode != 0:
                self.stop()
                raise SlurmUnavailable(f"{daemon} does not start: {result.stderr.strip()} "
                                       f"(log: {self.workdir / 'log'})")
            self.started.append(self.workdir / pid_file)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = _run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env).stdout.strip()
            if state == "idle":
                os.environ["SLURM_CONF"] = str(self.conf)
                return self
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"node {self.node} not idle after {timeout} s (sinfo: {state!r}; "
                               f"log: {self.workdir / 'log'})")

    def stop(self) -> None:
        """End the daemons this object started (by their pid files), newest first."""
        for pid_file in reversed(self.started):
            try:
                os.kill(int(pid_file.read_text().split()[0]), 15)
            except (OSError, ValueError, IndexError):
                pass
        self.started.clear()
        if os.environ.get("SLURM_CONF") == str(self.conf):
            del os.environ["SLURM_CONF"]

    # -- jobs -----------------------------------------------------------------------------

    def sbatch(self, args: list[str], env: dict | None = None, cwd: Path | None = None) -> int:
        """Submit; returns the job id."""
        result = _run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RestartCnt, ExitCode, ...)."""
        out = _run(["scontrol", "-o", "show", "job", str(job_id)], env=self.env).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def signal_batch_shell(self, job_id: int, signal: str) -> None:
        """Send `signal` to the job's batch shell alone, as `--signal=B:<signal>@T` does at T."""
        result = _run(["scancel", "--batch", f"--signal={signal}", str(job_id)], env=self.env)
        if result.returncode != 0:
            raise RuntimeError(f"scancel --batch --signal={signal} {job_id} failed: {result.stderr.strip()}")

    def wait_for_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """Poll until the job reaches a final state; returns its last `scontrol show job` fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(1)
        _run(["scancel", str(job_id)], env=self.env)
        raise TimeoutError(f"job {job_id} not finished after {timeout} s: {self.job(job_id)}")
