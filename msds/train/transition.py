"""Level transitions: the one place where a run changes levels. The loop calls `run_transition`
and logs what it returns.

A transition streams the model: it never holds the whole of the old or the new model's weights or
moments on a rank, only one group of tensors at a time in full (what the operators need together)
and this rank's partitions (1/dp of each flattened tensor) of the rest.

Down (coalesce): for each coalescing group (msds.multilevel.operators.coalesce_groups: a tensor, or
the same tensor of the layers a depth group merges) read the group's full fp32 weights (and Adam
moments under the `map` policy) from the engine, keep this rank's partition of them in host memory
for the interpolation on the way back up, coalesce them and keep this rank's partition of the small
tensors. Then destroy the engine and build the smaller model's engine, all-gathering one small
tensor at a time.

Up (de-coalesce + interpolate): keep this rank's partition of every small tensor read from the
engine, destroy it, and build the larger model's engine from one small tensor at a time: all-gather
it and the saved large tensors it de-coalesces into, de-coalesce and interpolate them in one pass
(the fused kernel for CUDA tensors, PyTorch on the CPU: operators.decoalesce_interpolate), hand them
to the engine, which keeps this rank's part. The saved partitions are released as they are used. A
grow-only run (RunPlan.grow_only) saved nothing: its way up takes the de-coalesced model as it is.

Under ZeRO 3 the new model is built partitioned (msds.train.engine.build_engine), so the extra
memory of a transition is about one group's full tensors on top of the partitions; under ZeRO 0-2
every rank holds the whole module anyway (DeepSpeed's design), and the transition adds no more than
the group to it. Host memory a transition releases (the saved partitions as they are consumed, the
old engine) is handed back to the system as it goes (release_freed_memory): the new
engine's flat buffers could not reuse it otherwise, and the rank would hold both. Weights are never
written into a live engine: DeepSpeed's fp32 master copies would overwrite such edits at the next
step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import math
import resource
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from msds.multilevel.operators import (LevelMap, coalesce, coalesce_groups, decoalesce, decoalesce_interpolate,
                                      decoalesced_names)
from msds.plan import Phase, RunPlan
from msds.train import faults
from msds.train.engine import MOMENTS, build_engine, destroy_engine, evaluate, optimizer_step_count, set_moments, \
    tensor_reader


# How much of the saved partitions an up transition on the CPU releases before it hands the memory
# back to the system.
RELEASE_EVERY_BYTES = 8 * 2**20


@dataclass
class SavedLevel:
    """This rank's share of a large model's state, kept from coalescing until de-coalescing."""

    level: int
    shapes: dict[str, tuple[int, ...]]
    weights: dict[str, torch.Tensor]
    moments: Optional[dict[str, dict[str, torch.Tensor]]] = None
    val_loss: Optional[float] = None

    def state_dict(self) -> dict:
        return {"level": self.level, "shapes": self.shapes, "weights": self.weights,
                "moments": self.moments, "val_loss": self.val_loss}


def _dp_group():
    return parallel_state.get_data_parallel_group()


def _local(level_map: LevelMap) -> LevelMap:
    """The level as this tensor-parallel rank sees its shards (heads and FFN grouped inside the
    shard), so the operators run on local tensors with no tensor-parallel communication."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return level_map
    return level_map.shard_local(tp, parallel_state.get_tensor_model_parallel_rank())


def dp_partition(tensor: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's contiguous chunk of the flattened tensor (chunks padded equal)."""
    world, rank = dist.get_world_size(_dp_group()), dist.get_rank(_dp_group())
    flat = tensor.reshape(-1)
    size = -(-flat.numel() // world)
    return flat[rank * size:(rank + 1) * size].clone()


def dp_gather(part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's `dp_partition` of it (on `part`'s device: NCCL needs GPU
    tensors, gloo takes CPU ones)."""
    world = dist.get_world_size(_dp_group())
    numel = math.prod(shape)
    size = -(-numel // world)
    padded = torch.zeros(size, dtype=part.dtype, device=part.device)
    padded[:part.numel()] = part
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=_dp_group())
    return torch.cat(pieces)[:numel].reshape(shape)


class _Shares:
    """This rank's partitions of a model's tensors by kind ("param", "exp_avg", "exp_avg_sq") and
    name, with their full shapes: what a transition keeps of a model between reading one engine and
    building the next."""

    def __init__(self):
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.parts: dict[str, dict[str, torch.Tensor]] = {}

    def keep(self, kind: str, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.shapes[name] = tuple(tensor.shape)
            self.parts.setdefault(kind, {})[name] = dp_partition(tensor)

    def full(self, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of `kind` in the order kept, each all-gathered when asked for; its
        partition is released then."""
        parts = self.parts.pop(kind, {})
        for name in list(parts):
            yield name, dp_gather(parts.pop(name), self.shapes[name])


def _kinds(map_moments: bool) -> tuple[str, ...]:
    return ("param", *MOMENTS) if map_moments else ("param",)


def _build(plan: RunPlan, following: Phase, source: Callable[[str], Iterable[tuple[str, torch.Tensor]]],
           map_moments: bool, step: int):
    """The next phase's engine from `source(kind)`, the new model's full tensors one at a time."""
    engine = build_engine(plan, following, source("param"))
    release_freed_memory()   # the consumed partitions, and ZeRO-3's per-parameter ones it flattened
    if map_moments:
        set_moments(engine, source, step)
    return engine


def release_freed_memory() -> None:
    """Hand the free pages glibc's allocator keeps of released host tensors back to the system
    (malloc_trim; nothing under another C library). A transition calls it wherever it has released
    much: glibc serves allocations of 32 MiB or more (DeepSpeed's flat buffers) from fresh mappings,
    and smaller ones from holes only where they fit, so without it such holes stay resident beside
    the new engine. (Device memory needs no such call: torch's CUDA allocator reuses or frees its
    cached blocks itself when an allocation would not fit.)"""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None; looked up once (find_library runs external tools)."""
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


def resident_memory_mb() -> float:
    """Current resident set size of this process (Linux), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rss_high_water_mb() -> float:
    """This process's peak resident set size since the last reset (Linux's VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _start_peak_window() -> dict:
    """Reset the peak-memory counters (Linux's RSS high-water mark, through clear_refs; torch's on a
    GPU) and return the levels they start from. `rss` is None where the kernel refuses the reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss = resident_memory_mb()
    except OSError:
        rss = None
    levels = {"rss": rss}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        levels["device"] = torch.cuda.memory_allocated() / 2**20
    return levels


def _peaks_above(levels: dict) -> dict:
    """Peak memory since `_start_peak_window` above the levels it returned, in MiB."""
    # Never below 0: the kernel's RSS counters lag by a few pages per thread, and a peak is at least
    # the level it started from.
    peaks = {"rss_peak_extra_mb": None if levels["rss"] is None else max(0.0, _rss_high_water_mb() - levels["rss"])}
    if "device" in levels:
        peaks["device_peak_extra_mb"] = torch.cuda.max_memory_allocated() / 2**20 - levels["device"]
    return peaks


def run_transition(engine, plan: RunPlan, current: Phase, following: Phase, saved: list[SavedLevel],
                   eval_set: list[dict], step: int):
    """Leave `current` for `following` at global step `step`: evaluate, coalesce (pushing the large
    level's share onto `saved`) or de-coalesce and interpolate (popping it; a grow-only run does not
    interpolate), evaluate again.
    Returns the next phase's engine and the `transition` record for the metrics: its seconds and
    FLOPs (which the caller adds to the run's counters), losses, and memory: this rank's RSS before
    and after, and under `ranks` every rank's seconds and peak memory above its level before the
    transition (host RSS; device memory on a GPU), evaluations excluded."""
    map_moments = plan.config.multilevel.optimizer_policy == "map"
    loss_before = evaluate(engine, eval_set).loss
    rss_before = resident_memory_mb()
    levels = _start_peak_window()
    start = time.perf_counter()
    if following.level > current.level:
        engine, kept = _coalesce(engine, plan, current, following, map_moments, loss_before)
        saved.append(kept)
        extra = {}
    else:
        kept = None if plan.grow_only else saved.pop()
        engine = _decoalesce(engine, plan, following, kept, map_moments)
        extra = {} if kept is None else {"loss_before_coalescing": kept.val_loss, "alpha": plan.config.multilevel.alpha}
    seconds = time.perf_counter() - start
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rank": dist.get_rank(), "seconds": seconds, **_peaks_above(levels)})
    return engine, {"step": step, "direction": "down" if following.level > current.level else "up",
                    "from_level": current.level, "to_level": following.level, "seconds": seconds,
                    "flops": plan.transition_flops(current.level, following.level),
                    "loss_before": loss_before, "loss_after": evaluate(engine, eval_set).loss,
                    "rss_mb_before": rss_before, "rss_mb_after": resident_memory_mb(), "ranks": ranks, **extra}


def _coalesce(engine, plan: RunPlan, current: Phase, following: Phase, map_moments: bool,
              val_loss: float):
    """Level `current.level` -> `following.level` (one coarser), a coalescing group at a time.
    Returns the new engine and this rank's share of the large level, kept for the way back up."""
    local_map = _local(plan.level_maps[current.level - 1])
    backend = plan.config.multilevel.transition_backend
    names, read = tensor_reader(engine, map_moments)
    # Kept in host memory until the way back up: each rank only its 1/dp share.
    saved = SavedLevel(level=current.level, shapes={}, weights={}, val_loss=val_loss,
                       moments={key: {} for key in MOMENTS} if map_moments else None)
    small = _Shares()
    for group in coalesce_groups(names, local_map):
        for kind in _kinds(map_moments):
            large = {name: read(kind, name) for name in group}
            saved.shapes.update((name, tuple(t.shape)) for name, t in large.items())
            kept = saved.weights if kind == "param" else saved.moments[kind]
            kept.update((name, dp_partition(t).cpu()) for name, t in large.items())
            small.keep(kind, coalesce(large, local_map, kind=kind, backend=backend))
            del large
    step = optimizer_step_count(engine)
    destroy_engine(engine)
    del engine
    gc.collect()
    faults.point("inside-down-transition")
    return _build(plan, following, small.full, map_moments, step), saved


def _decoalesce(engine, plan: RunPlan, following: Phase, saved: Optional[SavedLevel], map_moments: bool):
    """Level `following.level + 1` -> `following.level`, interpolating with the saved large state
    (None: the de-coalesced tensors are the large model's), a small tensor at a time."""
    if saved is not None and map_moments and saved.moments is None:
        raise RuntimeError("map policy: the saved level has no moments to interpolate with")
    local_map = _local(plan.level_maps[following.level - 1])
    alpha, backend = plan.config.multilevel.alpha, plan.config.multilevel.transition_backend
    names, read = tensor_reader(engine, map_moments)
    small = _Shares()
    for name in names:
        for kind in _kinds(map_moments):
            small.keep(kind, {name: read(kind, name)})
    step = optimizer_step_count(engine)
    destroy_engine(engine)
    del engine
    gc.collect()
    faults.point("inside-up-transition")

    def large(kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The large model's full tensors of `kind`, one small tensor's de-coalesced copies at a time."""
        released = 0
        for name, tensor in small.full(kind):
            if saved is None:
                yield from decoalesce({name: tensor}, local_map, kind=kind, backend=backend).items()
                continue
            parts = saved.weights if kind == "param" else saved.moments[kind]
            kept = {}
            for large_name in decoalesced_names(name, local_map):
                part = parts.pop(large_name)
                released += part.numel() * part.element_size()
                kept[large_name] = dp_gather(part.to(tensor.device), saved.shapes[large_name])
            del part   # the last partition too is released before the new tensors are handed on
            yield from decoalesce_interpolate({name: tensor}, kept, local_map, alpha, kind=kind,
                                              backend=backend).items()
            # On the CPU, where host memory is the training memory: the released partitions are
            # 1/dp the size of the full tensors gathered next, so their holes would stay unused beside
            # the new engine; hand them back as they add up (on a GPU the few calls around suffice).
            if tensor.device.type == "cpu" and released >= RELEASE_EVERY_BYTES:
                release_freed_memory()
                released = 0
        release_freed_memory()

    return _build(plan, following, large, map_moments, step)
