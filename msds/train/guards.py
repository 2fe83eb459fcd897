"""Guards of a training step: a bad step (a NaN or infinite loss, or a spike above
`training.spike_factor` times the recent mean) is skipped before it reaches the weights, and a
run that stops stepping (a hung rank) is ended with every rank's stack.

The step's loss is all-reduced over every rank together with the stop-signal flag and read to the
host once, before the optimizer update: all ranks see the same value and agree on skipping, and the
loop logs the same value (docs/cluster.md, "Faults and what they cost").

A skipped step runs DeepSpeed's `engine.step()` with the wrapped torch optimizer's own `step` made
a no-op: the gradients are cleared as after any step, ZeRO copies its unchanged fp32 master
partitions back into the model, the learning-rate schedule moves on with the run's steps (the
V-cycle's phases are counted in steps), and neither the weights nor Adam's moments nor its step
count change. A pipeline's engine steps inside `train_batch`: there a bad step is detected, counted
and stops the run after `training.max_bad_steps`, but it has already been applied.
"""
from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

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
        self.stacks_file = run_dir / "stacks" / f"rank-{rank}.txt"
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
