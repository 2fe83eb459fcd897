"""Random kill campaigns (issue 66): one training command launched again and again, each launch
SIGKILLed at a seeded random moment until the campaign's kills are spent, then launched once more
to the end. A kill hits one worker or every worker: some in start-up (a random time before the
first step: imports, DeepSpeed's JIT op load, the rendezvous, the engine build, the resume), the
rest a random fraction of a second after a random step (a step, a transition, a checkpoint write,
the end of training). The launcher (torchrun) ends the other workers; the next launch resumes from
the newest complete checkpoint. tests/test_faults.py runs a short campaign and
benchmarks/kill_campaign.py a long one (BENCHMARKS.md, "Faults").

What each kill cost: the steps it lost (the newest step logged when it struck minus the step the
run resumed from) and the time to resume (from the kill to the first step of a later launch).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# How long a launcher may take to end its other workers after a kill.
KILL_BOUND_S = 60.0
POLL_S = 0.02


@dataclass
class Kill:
    launch: int                      # which launch it ended (0 = the first)
    ranks: list[int]                 # the workers killed
    moment: str                      # "start-up" (before the launch's first step) or "step"
    seconds: float                   # after the launch started
    steps_done: int | None = None    # the newest step the launch logged (None: it logged none)
    resumed_from: int | None = None  # the step the run went on from (0: from the start)
    resume_s: float | None = None    # from the kill to the first step of a later launch (to its end
                                     # when the run was done: killed after its last checkpoint)
    struck_at: float = field(default=0.0, repr=False)   # time.monotonic() of the kill

    @property
    def steps_lost(self) -> int | None:
        """Steps to train again: 0 for a launch that trained none (what an earlier kill lost is its)."""
        if self.steps_done is None:
            return 0
        return None if self.resumed_from is None else self.steps_done - self.resumed_from


class MetricsTail:
    """The records appended to a run's metrics.jsonl since this object was made (whole lines only)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        return [json.loads(line) for line in whole.decode().splitlines() if line.strip()]


class Launch:
    """One launch of `command`, its output in `log`; what it logged so far."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path, metrics: Path):
        self.started = time.monotonic()
        self.tail = MetricsTail(metrics)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.resumed_from: int | None = None
        self.last_step: int | None = None
        self.first_step_at: float | None = None

    def poll(self) -> bool:
        """Reads what was logged; whether the launcher still runs."""
        for record in self.tail.new():
            if record["event"] in ("start", "resume"):
                self.resumed_from = record["step"]
            elif record["event"] == "step":
                self.last_step = record["step"]
                self.first_step_at = self.first_step_at or time.monotonic()
        return self.proc.poll() is None

    def workers(self) -> dict[int, int]:
        """rank -> pid of the launcher's worker processes (its children with RANK set)."""
        ranks = {}
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            for pid in _read(children).split():
                rank = next((v for k, _, v in (e.partition("=") for e in _read(f"/proc/{pid}/environ").split("\0"))
                             if k == "RANK"), None)
                if rank is not None:
                    ranks[int(rank)] = int(pid)
        return ranks

    def kill(self) -> None:
        """SIGKILL the launcher and its workers (torchrun starts each in a session of its own)."""
        for pid in [*self.workers().values(), self.proc.pid]:
            _kill(pid)
        self.proc.wait()

    def end(self, timeout: float) -> int:
        """The launcher's exit status once it exits (within `timeout`, or this raises)."""
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the launcher did not exit within {timeout:g} s") from None
        self.poll()
        return status


def _read(path) -> str:
    try:
        return Path(path).read_text()
    except OSError:   # the process is gone
        return ""


def campaign(command: list[str], envs: list[dict[str, str]], run_dir: Path, total_steps: int, kills: int,
             startup_kills: int, seed: int, logs: Path, first_step_s: float = 10.0,
             launch_timeout_s: float = 900.0) -> list[Kill]:
    """Launches of `command` (environments taken from `envs` in turn), each killed, until `kills`
    kills struck, then one to the end; fewer kills when a launch finishes the run before its kill.
    `startup_kills` of the kills (which ones: seeded) strike in start-up, at a uniform random time
    before `first_step_s` (then the shortest time to a first step seen); the others after a uniform
    random step of the launch plus a uniform random fraction of a second. Raises when a launch fails
    other than by its kill, ends before the end of the run without one, or runs past
    `launch_timeout_s` (a start that waits forever)."""
    rng = random.Random(seed)
    in_startup = set(rng.sample(range(kills), startup_kills))
    metrics = run_dir / "metrics.jsonl"
    done, pending = [], []
    for index in range(kills + 1):
        launch = Launch(command, envs[index % len(envs)], logs / f"launch-{index}.log", metrics)
        try:
            kill = None if index == kills else _strike(launch, index, index in in_startup, rng, total_steps,
                                                       first_step_s, launch_timeout_s)
            status = launch.end(KILL_BOUND_S if kill else launch_timeout_s)
        finally:
            launch.kill()
        if launch.first_step_at is None and launch.resumed_from == total_steps:
            launch.first_step_at = time.monotonic()   # the run was done (a kill after its last checkpoint)
        pending = _settle(pending, launch)
        if launch.first_step_at is not None:
            first_step_s = min(first_step_s, launch.first_step_at - launch.started)
        if kill is None:
            if status != 0 or total_steps not in (launch.last_step, launch.resumed_from):
                raise RuntimeError(f"launch {index} ended with exit status {status} at step {launch.last_step} "
                                   f"of {total_steps} without a kill; see {logs}")
            return done
        kill.steps_done = launch.last_step
        pending.append(kill)
        done.append(kill)
    return done


def _settle(pending: list[Kill], launch: Launch) -> list[Kill]:
    """Fills in, for the kills before `launch`, where the run went on from and when; the kills it
    cannot settle yet (it ended before resuming, or before a first step)."""
    left = []
    for kill in pending:
        if kill.resumed_from is None and launch.resumed_from is not None:
            kill.resumed_from = launch.resumed_from
        if kill.resume_s is None and launch.first_step_at is not None:
            kill.resume_s = launch.first_step_at - kill.struck_at
        if kill.resumed_from is None or kill.resume_s is None:
            left.append(kill)
    return left


def _strike(launch: Launch, index: int, startup: bool, rng: random.Random, total_steps: int,
            first_step_s: float, timeout_s: float) -> Kill | None:
    """Kills workers of `launch` at the moment drawn for it; the Kill, or None when the launch
    ended first."""
    ranks = rng.choice([[0], [1], [0, 1]])
    delay = rng.uniform(0, first_step_s) if startup else None
    fraction, target = rng.random(), None
    while launch.poll():
        if time.monotonic() - launch.started > timeout_s:
            raise RuntimeError(f"launch {index} did not reach its kill within {timeout_s:g} s")
        if target is None and not startup and launch.resumed_from is not None:
            # a run killed after its last checkpoint resumes at its end: it only ends again
            target = rng.randint(launch.resumed_from + 1, total_steps) if launch.resumed_from < total_steps \
                else total_steps + 1
        due = (time.monotonic() - launch.started >= delay) if startup else \
            (target is not None and (launch.last_step or 0) >= target)
        workers = launch.workers()
        if due and all(rank in workers for rank in ranks):
            time.sleep(0 if startup else fraction)
            struck = [rank for rank in ranks if _kill(workers[rank])]
            if not struck:
                return None
            return Kill(index, struck, "start-up" if launch.last_step is None else "step",
                        time.monotonic() - launch.started, struck_at=time.monotonic())
        time.sleep(POLL_S)
    return None


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def summary(kills: list[Kill]) -> dict:
    """The campaign in numbers (BENCHMARKS.md, "Faults")."""
    lost = [k.steps_lost for k in kills if k.steps_lost is not None]
    resume = sorted(k.resume_s for k in kills if k.resume_s is not None)
    return {"kills": len(kills), "in_start_up": sum(k.moment == "start-up" for k in kills),
            "both_workers": sum(len(k.ranks) > 1 for k in kills),
            "steps_lost_mean": sum(lost) / len(lost), "steps_lost_max": max(lost),
            "resume_s_median": resume[len(resume) // 2], "resume_s_max": resume[-1]}


def records(kills: list[Kill]) -> list[dict]:
    return [{**{k: v for k, v in asdict(kill).items() if k != "struck_at"}, "steps_lost": kill.steps_lost}
            for kill in kills]
