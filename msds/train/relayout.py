"""Resuming on another parallel layout: a checkpoint written at data x tensor x pipeline = a x b x c
continues at a' x b' x c', in the middle of a V-cycle too.

DeepSpeed's files in a checkpoint belong to the layout that wrote them (ZeRO partitions per
data-parallel rank, one module file per tensor-parallel rank, one per pipeline layer), and msds
resumes from them only on that layout (`checkpointing.load`, exact to the bit, every rank's random
generators included). For every other layout a checkpoint also holds a layout-free copy of the
training state (`write`, unless checkpoint.layout_free is false):

    <tag>/msds/layout_free/stage{s}.pt   pipeline stage s's parameters under the flat model's
                                         names, whole (tensor-parallel size 1, no vocabulary
                                         padding), fp32: the live engine's weights and both Adam
                                         moments, and every saved large level of the V-cycle (its
                                         weights, and moments under optimizer_policy `map`);
                                         written by the stage's data- and tensor-parallel rank 0
    <tag>/msds/layout_free/state.json    the layout, Adam's step count, the LR scheduler's state,
                                         DeepSpeed's step counters and the V-cycle's level maps

`resume` builds the phase's engine from this rank's slices of those tensors and installs the
moments and the step count (`build_engine` with tensors and `set_moments`, as a transition does),
restores the LR schedule, re-partitions the saved levels over the new data-parallel ranks, and
re-seeds every random generator from (training.seed, step) (`reseed`: the per-rank streams of
another layout have no counterpart here). The sampler needs nothing: it continues at the global
sample count the checkpoint recorded, as long as the global batch stays the same (`check_resume`).
"""
from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from msds.config import ConfigError
from msds.distributed import seed_generators
from msds.errors import MsdsError
from msds.model.pipeline import named_parameters
from msds.model.roles import VOCABULARY_ROWS, expected_shapes, tensor_parallel_dim
from msds.multilevel.operators import LevelMap
from msds.plan import Phase, RunPlan
from msds.train.checkpointing import COMPLETE, safe_load
from msds.train.engine import (MOMENTS, build_engine, gather_tensor_parallel, optimizer_step_count, set_moments,
                               tensor_reader)
from msds.train.transition import SavedLevel, dp_gather, dp_partition

LAYOUT_FREE = "layout_free"
STATE = "state.json"


def layout_record(plan: RunPlan) -> dict:
    """The layout and batch a checkpoint's state.json records (besides tensor_parallel and
    pipeline_parallel), which a resume is checked against."""
    training = plan.config.training
    return {"data_parallel": plan.layout.data, "micro_batch_size": training.micro_batch_size,
            "grad_accum": training.grad_accum}


# --------------------------------------------------------------------------------------------
# Checking a resume
# --------------------------------------------------------------------------------------------

def check_resume(saved: dict, plan: RunPlan, tag_dir: Path) -> bool:
    """True when `plan` resumes the checkpoint in `tag_dir` (whose state.json is `saved`) on the
    layout that wrote it, False when on another layout. Refuses, with the fields to change, a resume
    that would change the global batch, one on another layout from a checkpoint without a
    layout-free copy, and one whose V-cycle would de-coalesce with another grouping than it
    coalesced with."""
    was = _saved_layout(saved, tag_dir)
    _check_global_batch(saved, was[0], plan, tag_dir)
    if was == (plan.layout.data, plan.layout.tensor, plan.layout.pipeline):
        return True
    state_file = tag_dir / "msds" / LAYOUT_FREE / STATE
    if not state_file.is_file():
        raise MsdsError(f"{tag_dir}: written at data x tensor x pipeline = {_shown(was)} without a layout-free copy "
                        f"(checkpoint.layout_free=false, or an older msds); resume it on that layout: "
                        f"{was[0] * was[1] * was[2]} processes with parallel.tensor={was[1]} "
                        f"parallel.pipeline={was[2]}")
    if saved["train"]["phase"] < len(plan.phases) - 1:   # a transition is still ahead
        _check_level_maps(json.loads(state_file.read_text())["level_maps"], plan, was, tag_dir)
    return False


def _shown(layout: tuple[int, int, int]) -> str:
    return " x ".join(map(str, layout))


def _saved_layout(saved: dict, tag_dir: Path) -> tuple[int, int, int]:
    """(data, tensor, pipeline) of the run that wrote the checkpoint. Checkpoints from before
    layout changes were possible do not record the data-parallel size: it is what their world size
    leaves."""
    tensor, pipeline = saved.get("tensor_parallel", 1), saved.get("pipeline_parallel", 1)
    data = saved.get("data_parallel")
    if data is None:
        world = json.loads((tag_dir / "msds" / COMPLETE).read_text())["world_size"]
        data = world // (tensor * pipeline)
    return data, tensor, pipeline


def _check_global_batch(saved: dict, data: int, plan: RunPlan, tag_dir: Path) -> None:
    if "micro_batch_size" not in saved:
        return   # older checkpoints: they resume only on their own layout and config
    micro, accum = saved["micro_batch_size"], saved["grad_accum"]
    was, now = data * micro * accum, plan.samples_per_step
    if was == now:
        return
    training, dp = plan.config.training, plan.layout.data
    if was % (dp * training.micro_batch_size) == 0:
        fix = f"set training.grad_accum={was // (dp * training.micro_batch_size)}"
    elif was % dp == 0:
        fix = f"choose training.micro_batch_size and training.grad_accum whose product is {was // dp}"
    else:
        fix = f"launch a number of processes whose data-parallel size divides {was}"
    raise ConfigError(f"training.grad_accum: {tag_dir} was written with a global batch of {was} samples per step "
                      f"(data parallel {data} x training.micro_batch_size {micro} x training.grad_accum {accum}); "
                      f"this run's would be {now} (data parallel {dp} x {training.micro_batch_size} x "
                      f"{training.grad_accum}), which would change the run; {fix}")


def _check_level_maps(saved_maps: list[dict], plan: RunPlan, was: tuple[int, int, int], tag_dir: Path) -> None:
    """The plan's level maps must group every axis as the checkpoint's run did: its saved levels are
    to be de-coalesced with the grouping they were coalesced with, and the rest of the run is to be
    the same run. Heads and FFN are grouped inside multilevel.shards (default: the tensor-parallel
    size) chunks, layers inside the pipeline stages, so changing either can change the grouping."""
    if len(saved_maps) != len(plan.level_maps):
        raise ConfigError(f"multilevel.levels: {tag_dir} was written by a V-cycle of {len(saved_maps) + 1} levels, "
                          f"this config has {len(plan.level_maps) + 1}; resume with the levels it was written with")
    for index, (data, now) in enumerate(zip(saved_maps, plan.level_maps)):
        then = LevelMap.from_dict(data, f"{tag_dir}: level map {index + 1}")
        for axis in sorted(set(then.groupings) | set(now.groupings)):
            old, new = then.groupings.get(axis), now.groupings.get(axis)
            if old is not None and new is not None and torch.equal(old.members(), new.members()):
                continue
            if old is None or new is None or (old.factor, old.layout) != (new.factor, new.layout):
                raise ConfigError(f"multilevel.levels[{index}].{axis}: differs from the level {tag_dir} was written "
                                  f"with; resume with the levels it was written with")
            if axis == "layers":
                raise ConfigError(f"parallel.pipeline: {tag_dir} grouped the layers of level {index + 1} inside each "
                                  f"of its {was[2]} pipeline stages, which {plan.layout.pipeline} stages group "
                                  f"differently ({old.layout} layout); resume with parallel.pipeline={was[2]}")
            raise ConfigError(f"multilevel.shards: {tag_dir} grouped the {axis} of level {index + 1} inside each of "
                              f"{old.shards} shards (written at parallel.tensor={was[1]}), this run would group them "
                              f"inside {new.shards}; set multilevel.shards={old.shards} (a multiple of "
                              f"parallel.tensor) so that de-coalescing undoes the coalescing")


# --------------------------------------------------------------------------------------------
# Writing the layout-free copy
# --------------------------------------------------------------------------------------------

def write(engine, plan: RunPlan, saved: list[SavedLevel], tag_dir: Path) -> list[Path]:
    """Write the layout-free copy of the training state into `tag_dir` (every rank calls this: the
    tensors are gathered collectively); returns the files this rank wrote. One parameter at a time
    is gathered over the data- and tensor-parallel ranks; only each stage's writer keeps the whole
    tensors, in host memory, until it writes its stage's file."""
    writer = parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
    vocab = plan.config.model.vocab_size

    def keep(out: dict, name: str, shard: torch.Tensor) -> None:
        whole = gather_tensor_parallel({name: shard})[name]
        if writer:
            out[name] = (whole[:vocab] if name in VOCABULARY_ROWS else whole).cpu()

    names, read = tensor_reader(engine, moments=True)
    weights, moments = {}, {key: {} for key in MOMENTS}
    for name in names:
        keep(weights, name, read("param", name))
        for key in MOMENTS:
            keep(moments[key], name, read(key, name))
    levels = [_whole_level(level, engine.device, keep) for level in saved]
    directory, written = tag_dir / "msds" / LAYOUT_FREE, []
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
        written.append(directory / f"stage{parallel_state.get_pipeline_model_parallel_rank()}.pt")
        torch.save({"weights": weights, "moments": moments, "saved": levels}, written[-1])
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        layout = plan.layout
        state = {"layout": {"data": layout.data, "tensor": layout.tensor, "pipeline": layout.pipeline},
                 "optimizer_step": optimizer_step_count(engine), "lr_scheduler": engine.lr_scheduler.state_dict(),
                 "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                 "level_maps": [level_map.to_dict() for level_map in plan.level_maps]}
        written.append(directory / STATE)
        written[-1].write_text(json.dumps(state, indent=1))
    return written


def _whole_level(level: SavedLevel, device, keep) -> dict:
    """A saved level's tensors gathered from every data-parallel rank's partition (and, by `keep`,
    every tensor-parallel rank's shard)."""
    def whole(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape in level.shapes.items():
            keep(out, name, dp_gather(parts[name].to(device), shape))
        return out

    moments = None if level.moments is None else {key: whole(level.moments[key]) for key in MOMENTS}
    return {"level": level.level, "weights": whole(level.weights), "moments": moments, "val_loss": level.val_loss}


# --------------------------------------------------------------------------------------------
# Resuming from it
# --------------------------------------------------------------------------------------------

def resume(plan: RunPlan, phase: Phase, tag_dir: Path, step: int):
    """The engine of `phase` and this rank's saved levels, from the layout-free copy in `tag_dir`,
    on this plan's layout; every random generator re-seeded for `step` (`reseed`)."""
    directory = tag_dir / "msds" / LAYOUT_FREE
    state = json.loads((directory / STATE).read_text())
    live, saved = _read_stage_files(directory, state["layout"]["pipeline"], plan, phase.level)
    engine = build_engine(plan, phase, local_shards(live["weights"], plan).items())
    held = {name for name, _ in named_parameters(engine.module)}
    if held != set(live["weights"]):
        raise RuntimeError(f"this pipeline stage holds {sorted(held ^ set(live['weights']))} other than "
                           f"msds.train.relayout._on_stage says: the two must follow the same partition")
    set_moments(engine, lambda key: local_shards(live["moments"][key], plan).items(), state["optimizer_step"])
    _restore_schedule(engine, state)
    levels = [_saved_level(entry, plan) for entry in saved]
    reseed(plan.config.training.seed, step)
    return engine, levels


def _read_stage_files(directory: Path, stages: int, plan: RunPlan, level: int) -> tuple[dict, list[dict]]:
    """The tensors this rank's pipeline stage needs, whole: the live model's (at `level`) and every
    saved level's. The stage files are read one at a time, so at most one of them is in memory
    besides what this stage keeps."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    wanted = stage_names(plan, level, stage)
    live, saved = _empty(True), None
    for index in range(stages):
        content = safe_load(directory / f"stage{index}.pt")
        _merge(live, content, wanted)
        if saved is None:
            saved = [{"level": entry["level"], "val_loss": entry["val_loss"], **_empty(entry["moments"] is not None)}
                     for entry in content["saved"]]
        for entry, found in zip(saved, content["saved"]):
            _merge(entry, found, stage_names(plan, entry["level"], stage))
        del content
    missing = sorted(wanted - set(live["weights"]))
    if missing:
        raise MsdsError(f"{directory}: holds no {missing[0]} ({len(missing)} missing) for the level-{level} model")
    return live, saved


def _empty(moments: bool) -> dict:
    return {"weights": {}, "moments": {key: {} for key in MOMENTS} if moments else None}


def _merge(into: dict, found: dict, wanted: set[str]) -> None:
    """Add the `wanted` tensors of one stage file's entry `found` to `into`."""
    into["weights"].update(_pick(found["weights"], wanted))
    if into["moments"] is not None:
        for key in MOMENTS:
            into["moments"][key].update(_pick(found["moments"][key], wanted))


def _pick(tensors: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if name in wanted}


def stage_names(plan: RunPlan, level: int, stage: int) -> set[str]:
    cfg = plan.model(level)
    return {name for name in expected_shapes(cfg) if _on_stage(name, cfg.num_layers, stage, plan.layout.pipeline)}


def _on_stage(name: str, num_layers: int, stage: int, stages: int) -> bool:
    """Whether pipeline stage `stage` of `stages` holds parameter `name` (msds.model.pipeline: equal
    blocks per stage, the embeddings on the first, the head on the last, the tied word embeddings on
    both)."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) // (num_layers // stages) == stage
    if name.startswith("embeddings.word."):
        return stage in (0, stages - 1)
    return stage == (0 if name.startswith("embeddings.") else stages - 1)


def local_shards(tensors: dict[str, torch.Tensor], plan: RunPlan) -> dict[str, torch.Tensor]:
    """This rank's tensor-parallel slices of whole tensors (`local_shard`)."""
    return {name: local_shard(name, t, tuple(t.shape), plan) for name, t in tensors.items()}


def local_shard(name: str, whole, shape: tuple[int, ...], plan: RunPlan) -> torch.Tensor:
    """This rank's tensor-parallel slice of parameter `name`, out of `whole`: its whole tensor (TP=1,
    no vocabulary padding) of `shape`, or anything indexed like one (a safetensors slice, which then
    reads only this rank's slice). The vocabulary is padded with zero rows to this plan's size (the
    padding rows of a run are zero: no gradient, no decay, no moments)."""
    dim = tensor_parallel_dim(name)
    if dim is None:
        return whole[:]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    chunk = (plan.padded_vocab_size if name in VOCABULARY_ROWS else shape[dim]) // tp
    start, stop = min(rank * chunk, shape[dim]), min((rank + 1) * chunk, shape[dim])
    piece = whole[(slice(None),) * dim + (slice(start, stop),)].clone()
    if stop - start == chunk:
        return piece
    return torch.cat([piece, piece.new_zeros(chunk - (stop - start), *piece.shape[1:])])   # vocabulary rows


def _restore_schedule(engine, state: dict) -> None:
    """The LR scheduler where the checkpoint left it, the optimizer's learning rates with it (the
    scheduler writes them only when it steps), and DeepSpeed's step counters."""
    scheduler = engine.lr_scheduler
    scheduler.load_state_dict(state["lr_scheduler"])
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    engine.global_steps, engine.global_samples = state["global_steps"], state["global_samples"]


def _saved_level(entry: dict, plan: RunPlan) -> SavedLevel:
    """This rank's share of a saved level on this layout: its tensor-parallel slices, partitioned
    over the data-parallel ranks as a transition partitions them."""
    def partitions(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: dp_partition(t).cpu() for name, t in tensors.items()}

    weights = local_shards(entry["weights"], plan)
    moments = None if entry["moments"] is None else \
        {key: partitions(local_shards(entry["moments"][key], plan)) for key in MOMENTS}
    return SavedLevel(level=entry["level"], shapes={name: tuple(t.shape) for name, t in weights.items()},
                      weights=partitions(weights), moments=moments, val_loss=entry["val_loss"])


def reseed(seed: int, step: int) -> None:
    """Seed every generator of this process (Python's, NumPy's, torch's and megatron-core's tracker
    streams) from (training.seed, step), the same on every rank, as a fresh run seeds them from
    training.seed (the tracker still gives each tensor-parallel rank its own stream). A run resumed
    on another layout thus draws its dropout masks and random-LTD token choices reproducibly, but
    not the draws of the run it continues."""
    derived = zlib.crc32(f"{seed}/resumed at step {step}".encode())
    random.seed(derived)
    np.random.seed(derived)
    seed_generators(derived)
