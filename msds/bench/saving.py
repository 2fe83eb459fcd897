"""The saving: each variant's cost (FLOPs, wall-clock) to reach the reference's final validation
loss, per seed, then its mean and worst over the seeds; the reference is the baseline sweep's best
member."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from msds.bench.runs import CurvePoint, EvalPoint, Load, Run, Transition, read_evals, read_run, same_load
from msds.bench.variants import BASELINE


def crossing_index(evals: list[EvalPoint], target: float) -> Optional[int]:
    """The index in `evals` of the first full-size evaluation (level 1) whose val_loss is at or
    below `target`, or None. Evaluations of a smaller level do not count: the run delivers the
    full-size model, and a small model can reach a loss the full-size one has not."""
    return next((i for i, point in enumerate(evals) if point.level == 1 and point.val_loss <= target), None)


def first_crossing(evals: list[EvalPoint], target: float, key: str) -> float | None:
    """The `key` value (flops or train_seconds) at which the full-size model's val_loss first reaches
    `target` (`crossing_index`), interpolated linearly from the evaluation just before it. No
    interpolation spans a transition: a full-size evaluation that reaches the target right after one
    counts at its own cost."""
    index = crossing_index(evals, target)
    if index is None:
        return None
    point = evals[index]
    previous = evals[index - 1] if index > 0 and evals[index - 1].level == 1 else None
    if previous is None:
        return getattr(point, key)
    span = previous.val_loss - point.val_loss
    fraction = (previous.val_loss - target) / span if span > 0 else 1.0
    return getattr(previous, key) + fraction * (getattr(point, key) - getattr(previous, key))


def value_at(evals: list[EvalPoint], key: str, x: float) -> float | None:
    """val_loss at `key` = x, interpolated linearly between evaluations (None outside the curve)."""
    for a, b in zip(evals, evals[1:]):
        xa, xb = getattr(a, key), getattr(b, key)
        if xa <= x <= xb:
            fraction = (x - xa) / (xb - xa) if xb > xa else 1.0
            return a.val_loss + fraction * (b.val_loss - a.val_loss)
    return None


@dataclass
class VariantRun:
    """One variant in one seed, against the reference's final validation loss and cost there."""
    final_val_loss: float
    total_flops: float
    total_seconds: float
    reached_target: bool
    flops_to_target: Optional[float]
    seconds_to_target: Optional[float]
    flops_saving: Optional[float]
    wallclock_saving: Optional[float]
    load: Optional[Load]
    timed_like_reference: Optional[bool]
    # What the reference had reached with this variant's whole compute: the comparison at equal
    # cost when the variant does not reach the target.
    baseline_val_loss_at_same_flops: Optional[float]
    transition_seconds: float
    transitions: list[Transition] = field(default_factory=list)
    evals: list[CurvePoint] = field(default_factory=list)


@dataclass
class SeedResult:
    """One seed: the reference, its final validation loss (the target) and every variant's run."""
    reference: str
    target_val_loss: float
    variants: dict[str, VariantRun]


def _saving(cost: Optional[float], reference_cost: float) -> Optional[float]:
    return None if cost is None else 1 - cost / reference_cost


def _variant_run(run: Run, reference: Run) -> VariantRun:
    target, last, evals = reference.evals[-1].val_loss, run.evals[-1], run.evals
    flops_at, seconds_at = first_crossing(evals, target, "flops"), first_crossing(evals, target, "train_seconds")
    return VariantRun(
        final_val_loss=last.val_loss, total_flops=last.flops, total_seconds=last.train_seconds,
        reached_target=flops_at is not None, flops_to_target=flops_at, seconds_to_target=seconds_at,
        flops_saving=_saving(flops_at, reference.evals[-1].flops),
        wallclock_saving=_saving(seconds_at, reference.evals[-1].train_seconds),
        load=run.load, timed_like_reference=same_load(run.load, reference.load),
        baseline_val_loss_at_same_flops=value_at(reference.evals, "flops", last.flops),
        transition_seconds=sum(t.seconds for t in run.transitions),
        transitions=run.transitions, evals=[e.point() for e in evals])


def summarize(seed_dir: Path, names: list[str], reference: str = BASELINE) -> SeedResult:
    """One seed: every variant against the reference baseline's final validation loss and cost."""
    runs = {name: read_run(seed_dir / name) for name in names}
    variants = {name: _variant_run(runs[name], runs[reference]) for name in names}
    return SeedResult(reference, runs[reference].evals[-1].val_loss, variants)


def best_baseline(seed_dirs: list[Path], members: list[str]) -> tuple[str, dict[str, float]]:
    """The sweep member with the lowest mean final validation loss over the seeds, and every
    member's mean."""
    means = {name: statistics.fmean(read_evals(d / name)[-1].val_loss for d in seed_dirs) for name in members}
    return min(means, key=means.get), means


@dataclass
class Spread:
    """A value over the seeds: its mean and worst (None when a seed has none) and each seed's."""
    mean: Optional[float]
    worst: Optional[float]
    per_seed: list[Optional[float]]

    @classmethod
    def of(cls, values: list[Optional[float]], worst: Callable) -> "Spread":
        known = [v for v in values if v is not None]
        complete = len(known) == len(values)
        return cls(statistics.fmean(known) if complete else None, worst(known) if complete else None, values)


@dataclass
class LossSpread(Spread):
    """A loss over the seeds, with its best seed too."""
    best: float = 0.0


@dataclass
class VariantSummary:
    """A variant over the seeds: its final loss and savings, the seeds where it missed the target
    and those where its wall-clock was not timed under its reference's load."""
    final_val_loss: LossSpread
    flops_saving: Spread
    wallclock_saving: Spread
    missed_in_seeds: list[str]
    not_timed_like_reference_in_seeds: list[str]


def _summary(runs: dict[str, VariantRun]) -> VariantSummary:
    losses = [r.final_val_loss for r in runs.values()]
    loss = Spread.of(losses, max)
    return VariantSummary(
        final_val_loss=LossSpread(loss.mean, loss.worst, loss.per_seed, min(losses)),
        flops_saving=Spread.of([r.flops_saving for r in runs.values()], min),
        wallclock_saving=Spread.of([r.wallclock_saving for r in runs.values()], min),
        missed_in_seeds=[s for s, r in runs.items() if not r.reached_target],
        not_timed_like_reference_in_seeds=[s for s, r in runs.items() if r.timed_like_reference is False])


def aggregate(per_seed: dict[str, SeedResult], names: list[str]) -> dict[str, VariantSummary]:
    """Mean and worst over seeds of each variant's final loss and savings."""
    return {name: _summary({s: result.variants[name] for s, result in per_seed.items()}) for name in names}


@dataclass
class BenchResults:
    """A bench's results.json: the reference and the sweep's means, every variant over the seeds and
    in each seed, the downstream evaluation (msds/eval/bench.py's record; None without an eval:
    section) and the headline."""
    config: str
    reference: str
    baseline_sweep: dict[str, float]
    variants: dict[str, VariantSummary]
    per_seed: dict[str, SeedResult]
    eval: Optional[dict] = None
    headline: str = ""
    sweep_check: Optional[dict] = None      # msds/bench/sweep.py `interior`: is the reference an interior optimum
    multiplier: Optional[dict] = None       # msds/bench/multiplier.py, with reference_budgets

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not (k in ("eval", "sweep_check", "multiplier") and v is None)}
