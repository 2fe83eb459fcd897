"""Fault injection for the fault tests (tests/test_faults.py): real faults at named places, off
unless the environment variable MSDS_FAULT names one.

    MSDS_FAULT=<place>[:<rank>][:<nth>][,<place>...]

`rank` (default: every rank) is the global rank that faults; `nth` (default 1) the call of the
place in this process that faults, or `<n>+` for that call and every later one. The places and
what happens there (docs/cluster.md, "Faults and what they cost"):

    inside-down-transition       SIGKILL after the large engine is destroyed, before the small one exists
    inside-up-transition         SIGKILL after the small engine is destroyed, before the large one exists
    checkpoint-between-files     SIGKILL after DeepSpeed's files of a checkpoint, before msds's
    checkpoint-before-complete   SIGKILL after every file of a checkpoint, before its COMPLETE marker
    hang-before-step             sleep forever before a training step (a rank that hangs, not dies)
    nan-loss                     the micro-batch's loss (and so its gradients) becomes NaN (under a
                                 pipeline: on its last stage)
    spike-loss                   the micro-batch's loss (and so its gradients) is multiplied by 1000

The kill is SIGKILL to this process, exactly what the OOM killer or a lost node does: no handler,
no flush, no cleanup runs.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from dataclasses import dataclass

import torch

ENV = "MSDS_FAULT"
KILLS = ("inside-down-transition", "inside-up-transition", "checkpoint-between-files", "checkpoint-before-complete")
POISONS = {"nan-loss": float("nan"), "spike-loss": 1000.0}
PLACES = (*KILLS, "hang-before-step", *POISONS)

_calls: dict[str, int] = {}


@dataclass(frozen=True)
class Fault:
    place: str
    rank: int | None
    nth: int
    onwards: bool

    def due(self, call: int) -> bool:
        rank_matches = self.rank is None or self.rank == int(os.environ.get("RANK", 0))
        return rank_matches and (call >= self.nth if self.onwards else call == self.nth)


@functools.cache
def _parse(spec: str) -> tuple[Fault, ...]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        place, *rest = item.split(":")
        if place not in PLACES or len(rest) > 2:
            raise ValueError(f"{ENV}={spec!r}: {item!r} is not <place>[:<rank>][:<nth>]; places: {', '.join(PLACES)}")
        rank = int(rest[0]) if rest and rest[0] else None
        nth = rest[1] if len(rest) > 1 else "1"
        faults.append(Fault(place, rank, int(nth.rstrip("+")), nth.endswith("+")))
    return tuple(faults)


def _due(place: str) -> bool:
    """Counts this call of `place`; whether a fault of MSDS_FAULT is due at it."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    _calls[place] = _calls.get(place, 0) + 1
    return any(f.place == place and f.due(_calls[place]) for f in _parse(spec))


def point(place: str) -> None:
    """A kill or hang place: SIGKILL this process, or sleep forever, when MSDS_FAULT says so."""
    if not _due(place):
        return
    print(f"rank {os.environ.get('RANK', 0)}: {ENV}: {place}", flush=True)
    if place in KILLS:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(3600)


def poisoned(loss: torch.Tensor) -> torch.Tensor:
    """The micro-batch's loss, poisoned (NaN, or 1000 times larger) when MSDS_FAULT says so."""
    for place, factor in POISONS.items():
        if _due(place):
            loss = loss * factor
    return loss


@contextlib.contextmanager
def poisoned_pipeline_loss(module):
    """Within it (a training step), a pipeline module's loss function, which DeepSpeed's pipeline
    engine calls on the last stage once per micro-batch, returns `poisoned` losses."""
    loss_fn = module.loss_fn
    module.loss_fn = lambda outputs, labels: poisoned(loss_fn(outputs, labels))
    try:
        yield
    finally:
        module.loss_fn = loss_fn
