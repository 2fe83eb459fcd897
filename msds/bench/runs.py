"""What a finished bench run holds, as typed records: its evaluations, its transitions, and the
load it was timed under (its summary.json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from msds.train.metrics import read_metrics

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class CurvePoint:
    """A point of a run's validation-loss curve: step, cumulative FLOPs, training seconds, loss."""
    step: int
    flops: float
    train_seconds: float
    val_loss: float


@dataclass(frozen=True)
class EvalPoint(CurvePoint):
    """One evaluation of a run, and the level it evaluated (1: the full-size model)."""
    level: int = 1

    def point(self) -> CurvePoint:
        return CurvePoint(self.step, self.flops, self.train_seconds, self.val_loss)


@dataclass(frozen=True)
class Transition:
    """One level change of a run, from its metrics record."""
    step: int
    direction: str
    from_level: int
    to_level: int
    seconds: float
    loss_before: float
    loss_after: float


@dataclass(frozen=True)
class Load:
    """The load a run was timed under: cores, its threads, the runs the bench trained at once, and
    the machine's mean 1-minute load average."""
    cores: int
    threads: int
    runs_at_once: int
    load_average: float


@dataclass(frozen=True)
class Run:
    """A finished run's evaluations, transitions and load (None for a run of a version that did not
    record it)."""
    evals: list[EvalPoint]
    transitions: list[Transition]
    load: Optional[Load]


def read_evals(run_dir: Path) -> list[EvalPoint]:
    return [EvalPoint(r["step"], r["flops"], r["train_seconds"], r["val_loss"], r.get("level", 1))
            for r in read_metrics(run_dir, "eval")]


def read_run(run_dir: Path) -> Run:
    transitions = [Transition(**{k: t[k] for k in Transition.__dataclass_fields__})
                   for t in read_metrics(run_dir, "transition")]
    return Run(read_evals(run_dir), transitions, recorded_load(run_dir))


def recorded_load(run_dir: Path) -> Optional[Load]:
    """The load a finished run was timed under, from its summary.json (None for a run of a version
    that did not record it)."""
    summary = run_dir / SUMMARY_FILE
    load = json.loads(summary.read_text()).get("load") if summary.is_file() else None
    return None if load is None else Load(**load)


def same_load(a: Optional[Load], b: Optional[Load]) -> Optional[bool]:
    """Whether two runs' wall-clocks compare: the same cores, threads and runs trained at once, and
    mean load averages within 25% of each other (of 1, on a machine near idle). None when neither
    run has a record (both from a version that kept none); False when only one has."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        return False
    if (a.cores, a.threads, a.runs_at_once) != (b.cores, b.threads, b.runs_at_once):
        return False
    return abs(a.load_average - b.load_average) <= 0.25 * max(a.load_average, b.load_average, 1.0)
