"""Level transitions: the one place where a run changes levels. The loop calls `run_transition`
and logs what it returns.

Down (coalesce): gather the engine's full fp32 weights (and Adam moments under the `map` policy),
every tensor of the model at once on every rank, keep this rank's partition of them in host memory
for the interpolation on the way back up, coalesce, and build the smaller model and a fresh engine
around it.

Up (de-coalesce + interpolate): read the small model's full weights, de-coalesce them, interpolate
each rank's partition with the saved large partition, all-gather the result, and build the larger
model and its engine.

The old engine is destroyed before the new one is built. Weights are never written into a live
engine: DeepSpeed's fp32 master copies would overwrite such edits at the next step.
"""
from __future__ import annotations

import gc
import math
import resource
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from msds.multilevel.operators import LevelMap, coalesce, decoalesce, interpolate
from msds.plan import Phase, RunPlan
from msds.train.engine import MOMENTS, build_engine, destroy_engine, evaluate, full_moments, full_weights, \
    optimizer_step_count, set_moments


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


def _partition(tensor: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's contiguous chunk of the flattened tensor (chunks padded equal)."""
    world, rank = dist.get_world_size(_dp_group()), dist.get_rank(_dp_group())
    flat = tensor.reshape(-1)
    size = -(-flat.numel() // world)
    return flat[rank * size:(rank + 1) * size].clone()


def _gather(part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's `_partition` of it (on `part`'s device: NCCL needs GPU
    tensors, gloo takes CPU ones)."""
    world = dist.get_world_size(_dp_group())
    numel = math.prod(shape)
    size = -(-numel // world)
    padded = torch.zeros(size, dtype=part.dtype, device=part.device)
    padded[:part.numel()] = part
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=_dp_group())
    return torch.cat(pieces)[:numel].reshape(shape)


def _partitions(tensors: dict[str, torch.Tensor], host: bool = False) -> dict[str, torch.Tensor]:
    return {name: _partition(t).cpu() if host else _partition(t) for name, t in tensors.items()}


def resident_memory_mb() -> float:
    """Current resident set size of this process (Linux), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_transition(engine, plan: RunPlan, current: Phase, following: Phase, saved: list[SavedLevel],
                   eval_set: list[dict], step: int):
    """Leave `current` for `following` at global step `step`: evaluate, coalesce (pushing the large
    level's share onto `saved`) or de-coalesce and interpolate (popping it), evaluate again.
    Returns the next phase's engine and the `transition` record for the metrics (with its seconds
    and FLOPs, which the caller adds to the run's counters)."""
    map_moments = plan.config.multilevel.optimizer_policy == "map"
    loss_before = evaluate(engine, eval_set)
    rss_before = resident_memory_mb()
    start = time.perf_counter()
    if following.level > current.level:
        engine, kept = _coalesce(engine, plan, current, following, map_moments, loss_before)
        saved.append(kept)
        extra = {}
    else:
        kept = saved.pop()
        engine = _decoalesce(engine, plan, following, kept, map_moments)
        extra = {"loss_before_coalescing": kept.val_loss, "alpha": plan.config.multilevel.alpha}
    seconds = time.perf_counter() - start
    return engine, {"step": step, "direction": "down" if following.level > current.level else "up",
                    "from_level": current.level, "to_level": following.level, "seconds": seconds,
                    "flops": plan.transition_flops(current.level, following.level),
                    "loss_before": loss_before, "loss_after": evaluate(engine, eval_set),
                    "rss_mb_before": rss_before, "rss_mb_after": resident_memory_mb(), **extra}


def _coalesce(engine, plan: RunPlan, current: Phase, following: Phase, map_moments: bool,
              val_loss: float):
    """Level `current.level` -> `following.level` (one coarser). Returns the new engine and this
    rank's share of the large level, kept for the way back up."""
    level_map = plan.level_maps[current.level - 1]
    weights = full_weights(engine)
    moments = full_moments(engine) if map_moments else None
    step = optimizer_step_count(engine)
    # Kept in host memory until the way back up: each rank only its 1/dp share.
    saved = SavedLevel(level=current.level, shapes={n: tuple(t.shape) for n, t in weights.items()},
                       weights=_partitions(weights, host=True), val_loss=val_loss,
                       moments={k: _partitions(v, host=True) for k, v in moments.items()} if moments else None)
    local_map = _local(level_map)
    small = coalesce(weights, local_map)
    small_moments = {k: coalesce(moments[k], local_map, kind=k) for k in MOMENTS} if moments else None
    del weights, moments
    destroy_engine(engine)
    del engine
    gc.collect()
    new_engine = build_engine(plan, following, small)
    if small_moments is not None:
        set_moments(new_engine, small_moments, step)
    return new_engine, saved


def _decoalesce(engine, plan: RunPlan, following: Phase, saved: SavedLevel, map_moments: bool):
    """Level `saved.level + 1` -> `saved.level`, interpolating with the saved large state."""
    level_map = plan.level_maps[saved.level - 1]
    alpha = plan.config.multilevel.alpha
    small = full_weights(engine)
    small_moments = full_moments(engine) if map_moments else None
    step = optimizer_step_count(engine)
    destroy_engine(engine)
    del engine
    gc.collect()

    def upsample(tensors: dict[str, torch.Tensor], saved_parts: dict[str, torch.Tensor], kind: str):
        large = decoalesce(tensors, _local(level_map), kind=kind)
        device = next(iter(large.values())).device
        mixed = interpolate(_partitions(large), {n: t.to(device) for n, t in saved_parts.items()}, alpha)
        return {name: _gather(mixed[name], saved.shapes[name]) for name in saved.shapes}

    weights = upsample(small, saved.weights, "param")
    moments = None
    if small_moments is not None:
        if saved.moments is None:
            raise RuntimeError("map policy: the saved level has no moments to interpolate with")
        moments = {k: upsample(small_moments[k], saved.moments[k], k) for k in MOMENTS}
    del small, small_moments
    new_engine = build_engine(plan, following, weights)
    if moments is not None:
        set_moments(new_engine, moments, step)
    return new_engine
