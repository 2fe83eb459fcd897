"""A real Slurm cluster on localhost for tests: Debian's munge, slurmctld and slurmd.

`SlurmCluster.start()` installs the packages when they are missing (apt-get, needs root and package
access), writes a minimal slurm.conf into a private directory, starts munged, slurmctld and slurmd
and waits until the nodes are idle; `stop()` ends the daemons it started.

One node by default: this machine, under its own name. `SlurmCluster(dir, nodes=N)` makes N nodes
of this one machine, node1..nodeN, each its own slurmd (`slurmd -N nodeK`, Slurm's multiple-slurmd
mode; Debian builds it in) on its own port with its share of the CPUs and memory; all N have
NodeAddr=127.0.0.1, which is where `slurm/train.sh` finds the first node's rendezvous. Everything Slurm writes
(state, spool, logs) stays in that directory; the client commands find the cluster through the
SLURM_CONF environment variable, which the cluster sets for this process (and so for its jobs).

When Slurm cannot be installed or started, `start()` raises `SlurmUnavailable` with the reason,
which `running_cluster` (the tests' fixtures) turns into a skip.
"""
from __future__ import annotations

import os
import shutil
import signal
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


def running_cluster(workdir: Path, nodes: int = 1):
    """A pytest fixture's body (`yield from running_cluster(...)`): a started cluster, stopped
    afterwards; its tests are skipped, with the reason, where Slurm cannot run."""
    import pytest

    cluster = SlurmCluster(workdir, nodes)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm cluster of {nodes} node(s): {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = int(f.readline().split()[1])
    return int(total_kb / 1024 * 0.9)


class SlurmCluster:
    """One controller and `nodes` compute nodes on this machine: one node is the machine itself
    (`hostname`, all its CPUs); several are node1..nodeN, each with its own slurmd and an equal
    share of the CPUs (at least one each) and of the memory."""

    def __init__(self, workdir: Path, nodes: int = 1):
        self.workdir = Path(workdir)
        self.conf = self.workdir / "slurm.conf"
        self.host = socket.gethostname()
        self.nodes = [self.host] if nodes == 1 else [f"node{i}" for i in range(1, nodes + 1)]
        self.node = self.nodes[0]
        self.cpus = max(1, (os.cpu_count() or 1) // nodes)   # per node
        self.memory_mb = _memory_mb() // nodes                # per node
        self.started: list[Path] = []   # pid files of the daemons this object started
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- set-up ---------------------------------------------------------------------------

    def slurmd_pid_file(self, node: str) -> Path:
        return self.workdir / (f"slurmd-{node}.pid" if len(self.nodes) > 1 else "slurmd.pid")

    def _node_lines(self) -> str:
        if len(self.nodes) == 1:
            return (f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} "
                    f"State=UNKNOWN\n")
        # Several slurmd on one host: each its own name, port, spool directory, pid and log file
        # (%n is the node name); NodeHostname is the machine every one of them runs on.
        return "".join(f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={_free_port()} "
                       f"CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN\n" for node in self.nodes)

    def write_conf(self) -> None:
        d = self.workdir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        several = len(self.nodes) > 1
        per_node = "-%n" if several else ""
        spool = f"{d}/spool/%n" if several else f"{d}/spool"
        for node in self.nodes if several else ():
            (d / "spool" / node).mkdir(exist_ok=True)
        # Ports picked free rather than Slurm's 6817/6818, so that a second test session on the
        # same machine cannot talk to (or fail to bind next to) this cluster.
        self.conf.write_text(f"""\
ClusterName=msds-test
SlurmctldHost={self.host}(127.0.0.1)
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
SlurmdSpoolDir={spool}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd{per_node}.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd{per_node}.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{self._node_lines()}PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
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
        daemons = [(["/usr/sbin/slurmctld"], self.workdir / "slurmctld.pid")]
        daemons += [(["/usr/sbin/slurmd", *(["-N", node] if len(self.nodes) > 1 else [])], self.slurmd_pid_file(node))
                    for node in self.nodes]
        for command, pid_file in daemons:
            result = _run([*command, "-f", str(self.conf)], env=self.env)
            if result.returncode != 0:
                self.stop()
                raise SlurmUnavailable(f"`{' '.join(command)}` does not start: {result.stderr.strip()} "
                                       f"(log: {self.workdir / 'log'})")
            self.started.append(pid_file)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = _run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env).stdout.split()
            if states == ["idle"] * len(self.nodes):
                os.environ["SLURM_CONF"] = str(self.conf)
                return self
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"nodes {','.join(self.nodes)} not idle after {timeout} s (sinfo: {states}; "
                               f"log: {self.workdir / 'log'})")

    def stop(self) -> None:
        """Cancel the jobs still there (a failed test's), then end the daemons this object started
        (by their pid files), newest first: no job's processes outlive the cluster."""
        if self.started and _run(["scancel", f"--user={os.getuid()}"], env=self.env).returncode == 0:
            deadline = time.monotonic() + 30
            while _run(["squeue", "-h"], env=self.env).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
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

    def node_states(self) -> list[str]:
        """`sinfo`'s state of each node, in the order of `nodes` (idle, allocated, down*, ...)."""
        out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return [states.get(node, "") for node in self.nodes]

    def hostnames(self, node_list: str) -> list[str]:
        """A node list (node[1-2]) as names."""
        return _run(["scontrol", "show", "hostnames", node_list], env=self.env).stdout.split()

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

    # -- faults ---------------------------------------------------------------------------

    def job_processes(self, job_id: int, node: str) -> list[int]:
        """The processes of job `job_id` on `node` (of this machine's several): its tasks and their
        children, which inherit the tasks' SLURM_JOB_ID and SLURMD_NODENAME, and the slurmstepd
        that runs them."""
        tasks = []
        marks = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode()}
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and marks <= set((proc / "environ").read_bytes().split(b"\0")):
                    tasks.append(int(proc.name))
            except OSError:
                continue
        stepds = set()
        for pid in tasks:
            try:
                ppid = int((Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[1])
                if (Path("/proc") / str(ppid) / "comm").read_text().strip() == "slurmstepd":
                    stepds.add(ppid)
            except (OSError, ValueError, IndexError):
                continue
        return [*stepds, *tasks]

    def lose_node(self, node: str, job_id: int) -> None:
        """`node` stops answering for good, with job `job_id` running on it: its slurmd and the job's
        processes there freeze (SIGSTOP: the other nodes' ranks wait in their collectives instead
        of failing first), the node is set DOWN, as slurmctld sets a node that stopped answering
        for SlurmdTimeout (Slurm then ends the job and requeues it, if it may be requeued), and the
        frozen processes are killed (SIGKILL), as a powered-off node's are."""
        slurmd = int(self.slurmd_pid_file(node).read_text().split()[0])
        frozen = [slurmd, *self.job_processes(job_id, node)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        result = _run(["scontrol", "update", f"nodename={node}", "state=down", "reason=lost (test)"], env=self.env)
        if result.returncode != 0:
            raise RuntimeError(f"scontrol update nodename={node} state=down failed: {result.stderr.strip()}")
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
