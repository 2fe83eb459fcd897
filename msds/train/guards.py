"""Guards of a training step: a bad step (a NaN or infinite loss, or a spike above
`training.spike_factor` times the recent mean) is skipped before it reaches the weights, a run
that stops stepping (a hung rank) is ended with every rank's stack, and so is a start that never
reaches its first step, with one line naming what it waits on.

The step's loss is all-reduced over every rank together with the stop-signal flag and read to the
host once, before the optimizer update: all ranks see the same value and agree on skipping, and the
loop logs the same value (docs/cluster.md, "Faults and what they cost").

A skipped step runs DeepSpeed's `engine.step()` with the wrapped torch optimizer's own `step` made
a no-op: the gradients are cleared as after any step, ZeRO copies its unchanged fp32 master
partitions back into the model, the learning-rate schedule moves on with the run's steps (the
V-cycle's phases are counted in steps), and neither the weights nor Adam's moments nor its step
count change. A pipeline's engine steps inside `train_batch`: there the same decision is made on
its optimizer step, inside (msds.compat.deepspeed_0_19.pipeline_step_decided).
"""
from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from msds import startup
from msds.config import TrainingConfig

# The checkpoint reason of a run stopped by bad steps (metrics.jsonl; slurm/train.sh requeues only
# runs that stopped on a signal or exit_after_steps and exited 0).
BAD_STEPS = "bad steps"


@dataclass
class Verdict:
    loss: float          # the step's loss, averaged over data-parallel replicas
    signalled: bool      # whether any rank received the stop signal
    bad: str | None      # why the step was skipped; None when it was applied


class StepGuard:
    """Decides, before each optimizer update, whether the step is applied; keeps its counts in the
    run's TrainState (`bad_steps`, `bad_steps_in_row`, `recent_losses`), so that a resumed run
    decides as the uninterrupted one would."""

    def __init__(self, training: TrainingConfig, world: int, log):
        self.cfg, self.world, self.log = training, world, log
        self.verdict: Verdict | None = None

    def check(self, loss: torch.Tensor, signalled: bool, state) -> bool:
        """Whether to apply the step whose mean loss on this rank is `loss`: one all-reduce, one
        host read. `state` is the run's TrainState before the step."""
        packed = torch.stack([loss.detach().float().reshape(()), torch.tensor(float(signalled), device=loss.device)])
        dist.all_reduce(packed)
        total, signals = packed.tolist()
        mean = total / self.world
        bad = self._why_bad(mean, state.recent_losses)
        self.verdict = Verdict(mean, signals > 0, bad)
        if bad is None:
            state.bad_steps_in_row = 0
            state.recent_losses = [*state.recent_losses, mean][-self.cfg.spike_window:]
            return True
        state.bad_steps += 1
        state.bad_steps_in_row += 1
        self.log.event("bad_step", {"step": state.step + 1, "loss": mean, "reason": bad,
                                    "in_a_row": state.bad_steps_in_row},
                       f"step {state.step + 1} skipped: {bad} ({state.bad_steps_in_row} in a row)")
        return False

    def _why_bad(self, loss: float, recent: list[float]) -> str | None:
        if not self.cfg.max_bad_steps:
            return None
        if not math.isfinite(loss):
            return f"loss {loss}"
        if self.cfg.spike_factor and len(recent) == self.cfg.spike_window:
            mean = sum(recent) / len(recent)
            if loss > self.cfg.spike_factor * mean:
                return (f"loss {loss:.4f} above training.spike_factor {self.cfg.spike_factor} x the mean "
                        f"{mean:.4f} of the last {len(recent)} steps")
        return None

    def give_up(self, state) -> str | None:
        """The message to stop the run with once `training.max_bad_steps` steps in a row were bad."""
        if not self.cfg.max_bad_steps or state.bad_steps_in_row < self.cfg.max_bad_steps:
            return None
        return (f"training.max_bad_steps: {state.bad_steps_in_row} bad steps in a row up to step {state.step} "
                f"(the last: {self.verdict.bad}); none reached the weights and the run is checkpointed there. "
                f"Lower optimizer.lr or raise optimizer.warmup_steps, or set training.max_bad_steps higher to "
                f"skip more (metrics.jsonl's bad_step records list them)")


@contextlib.contextmanager
def update_skipped(engine):
    """DeepSpeed's engine.step() inside runs everything but the wrapped torch optimizer's step."""
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    basic.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del basic.step


def stacks_file(run_dir: Path, rank: int) -> Path:
    """The file a rank's watchdogs (hang and start-up) append its thread stacks to."""
    return run_dir / "stacks" / f"rank-{rank}.txt"


class HangWatchdog:
    """Ends the process when no step completes within `training.hang_timeout_s`: faulthandler's
    own thread (it runs even while the main thread waits inside a collective or a C call) writes
    the stack of every thread of this rank to the rank's own file, then exits with status 1; the
    launcher then ends the other ranks and the job fails, and Slurm can requeue it. The timeout
    covers anything between two steps too: evaluations, transitions and checkpoint writes.

    One file per rank (`stacks_file`), not stderr: every rank's watchdog fires at about the same
    time, and faulthandler writes a line in several pieces, so dumps sharing one stream interleave
    mid-line. The file is appended to: each launch writes a header (`HEADER`, the rank, host and
    process) and cuts it off again when its run returns or raises, so the file keeps the stacks of
    every launch that hung, each after its header (slurm/train.sh looks for them), and the bare
    header of a launch that was killed. A run that never hung leaves no file."""

    HEADER = "# msds hang watchdog:"

    def __init__(self, timeout_s: float, run_dir: Path, rank: int):
        self.timeout_s = timeout_s
        self.stacks_file = stacks_file(run_dir, rank)
        self.rank = rank
        self._file = None
        self._start = 0

    def arm(self) -> None:
        """(Re)start the countdown: on entry and after every step."""
        if self._file is not None:
            faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self._file)

    def __enter__(self) -> "HangWatchdog":
        if self.timeout_s:
            self.stacks_file.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.stacks_file, "a")
            self._start = self._file.tell()
            self._file.write(f"{self.HEADER} rank {self.rank}, host {socket.gethostname()}, pid {os.getpid()}, "
                             f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; its stacks follow if no step "
                             f"completed within {self.timeout_s:g} s\n")
            self._file.flush()
            self.arm()
        return self

    def __exit__(self, *exc) -> None:
        if self._file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._file.truncate(self._start)
        self._file.close()
        self._file = None
        if self._start == 0:
            self.stacks_file.unlink(missing_ok=True)
            with contextlib.suppress(OSError):   # another rank's file is still there
                self.stacks_file.parent.rmdir()


class StartupWatchdog:
    """Ends the process when its first training step has not completed `training.startup_timeout_s`
    seconds after its start (`msds train`: when the command began, its imports included): appends a
    header, the one line it prints and the stack of every thread to the rank's stacks file (the HangWatchdog's), prints that line, naming what the
    process waits on (msds.startup: a lock file and its age, the rendezvous address, a collective),
    and exits with EXIT_STATUS. slurm/train.sh does not requeue such a job: the requeued job would
    wait on the same thing. A timer thread, not faulthandler's (the HangWatchdog's): it needs
    Python to say what is waited on; every wait msds names (a sleep on a lock file, a rendezvous,
    a gloo collective) releases the interpreter's lock."""

    HEADER = "# msds start-up watchdog:"
    EXIT_STATUS = 4

    def __init__(self, timeout_s: float, run_dir: Path, rank: int, started: float):
        self.timeout_s, self.rank, self.started = timeout_s, rank, started
        self.stacks_file = stacks_file(run_dir, rank)
        self._timer = None
        if timeout_s > 0:   # a negative one is refused by the run plan, which comes next
            self._timer = threading.Timer(max(0.0, started + timeout_s - time.time()), self._expire)
            self._timer.daemon = True
            self._timer.start()

    def stop(self) -> None:
        """The first step completed (or the run ended without one): no timeout any more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        line = (f"msds train: error: rank {self.rank} has not completed its first step {time.time() - self.started:.0f} s "
                f"after its start (training.startup_timeout_s {self.timeout_s:g}); it waits on {startup.current()}; "
                f"the stacks of its threads are in {self.stacks_file}")
        self.stacks_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.stacks_file, "a") as file:
            file.write(f"{self.HEADER} rank {self.rank}, host {socket.gethostname()}, pid {os.getpid()}\n{line}\n")
            file.flush()
            faulthandler.dump_traceback(file, all_threads=True)
        print(line, file=sys.stderr, flush=True)
        os._exit(self.EXIT_STATUS)
