"""Training checkpoints: DeepSpeed's engine state plus msds's state, complete or not at all.

    <dir>/step00000120/            DeepSpeed's files for tag step00000120 (model, ZeRO partitions)
    <dir>/step00000120/msds/state.json      step, phase, consumed samples, FLOPs, time (rank 0)
    <dir>/step00000120/msds/rank{r}.pt      rank r's saved large partitions and RNG state
    <dir>/step00000120/msds/COMPLETE        size and sha256 of every file of the checkpoint
    <dir>/latest                            name of the newest complete checkpoint

A checkpoint becomes "latest" only after every rank has written and hashed its files and rank 0
has listed them in COMPLETE. On resume each candidate is verified against COMPLETE, newest first;
a partial or corrupted one is reported and the previous complete one is used.

Every file is read with torch.load(weights_only=True) (`safe_load`), DeepSpeed's included: COMPLETE
catches accidents, not attacks (whoever crafts the files crafts the manifest), so a checkpoint from
elsewhere must not be able to run code when it is loaded.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from msds.errors import MsdsError
from msds.integrity import sha256_file
from msds.model.roles import tensor_parallel_dim
from msds.train import faults

COMPLETE = "COMPLETE"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(engine, ckpt_dir: Path, step: int, state: dict, rank_state: dict, keep: int, extra=None) -> str:
    """Write a checkpoint collectively (every rank calls this) and mark it complete. Each rank
    hashes the files it wrote, all ranks at once; rank 0 gathers their sizes and hashes into
    COMPLETE (hashing only what no rank reported, such as files DeepSpeed writes past its
    checkpoint engine). `extra(tag_dir)`, when given, is called on every rank to write more files
    of the checkpoint and returns the ones this rank wrote (msds.train.relayout.write)."""
    from msds.compat.deepspeed_0_19 import checkpoint_writes_recorded

    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    rank = dist.get_rank()
    if rank == 0:   # rewritten at the same step (e.g. after a resume), a checkpoint is complete only once marked again
        (tag_dir / "msds" / COMPLETE).unlink(missing_ok=True)
    with _space_checked(ckpt_dir, tag_dir):
        with checkpoint_writes_recorded(engine) as written:
            engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
        faults.point("checkpoint-between-files")
        msds_dir = tag_dir / "msds"
        msds_dir.mkdir(parents=True, exist_ok=True)
        torch.save(rank_state, msds_dir / f"rank{rank}.pt")
        written.append(msds_dir / f"rank{rank}.pt")
        if extra is not None:
            written.extend(extra(tag_dir))
        if rank == 0:
            (msds_dir / "state.json").write_text(json.dumps(state, indent=1))
            written.append(msds_dir / "state.json")
    mine = _file_records(tag_dir, written)
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)     # returns on rank 0 once every rank has written and hashed
    faults.point("checkpoint-before-complete")
    if rank == 0:
        manifest = {rel: record for part in parts for rel, record in part.items()}
        unreported = [p for p in tag_dir.rglob("*") if p.is_file() and p.name != COMPLETE
                      and str(p.relative_to(tag_dir)) not in manifest]
        manifest.update(_file_records(tag_dir, unreported))
        files = dict(sorted(manifest.items()))
        with _space_checked(ckpt_dir, tag_dir):
            _atomic_write(msds_dir / COMPLETE, json.dumps({"world_size": dist.get_world_size(), "files": files}))
            _atomic_write(ckpt_dir / "latest", tag)
        _prune(ckpt_dir, keep)
    dist.barrier()
    return tag


# Free space below which a failed write is taken for a full disk: torch.save reports one as an
# opaque RuntimeError ("unexpected pos ..."), not as ENOSPC.
NEARLY_FULL_BYTES = 16 * 2**20


@contextlib.contextmanager
def _space_checked(ckpt_dir: Path, tag_dir: Path):
    """A write of checkpoint `tag_dir` that fails for want of space: the unfinished checkpoint is
    removed (it would never be resumed) and one MsdsError says what is left and what to do."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        free = shutil.disk_usage(ckpt_dir).free
        if getattr(exc, "errno", None) != errno.ENOSPC and free >= NEARLY_FULL_BYTES:
            raise
        shutil.rmtree(tag_dir, ignore_errors=True)
        previous = find_resumable(ckpt_dir, lambda _: None)
        raise MsdsError(f"checkpoint {tag_dir}: no space left on the device of {ckpt_dir} ({free / 2**20:.1f} MiB "
                        f"free); the unfinished checkpoint is removed and "
                        f"{'the newest complete one, ' + previous + ', is intact' if previous else 'none is complete'}"
                        f": free space (or lower checkpoint.keep, or set checkpoint.dir elsewhere) and run the same "
                        f"command again to resume") from None


def _file_records(tag_dir: Path, paths) -> dict[str, dict]:
    """Size and sha256 of each file, by its path relative to the checkpoint's directory."""
    records = {}
    for path in map(Path, paths):
        rel = str(path.resolve().relative_to(tag_dir.resolve()))
        records[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return records


def _prune(ckpt_dir: Path, keep: int) -> None:
    complete = sorted(p.parent.parent for p in ckpt_dir.glob(f"step*/msds/{COMPLETE}"))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def verify(tag_dir: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    marker = tag_dir / "msds" / COMPLETE
    if not marker.is_file():
        return "not marked complete (a save was interrupted)"
    try:
        manifest = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return f"{marker} is corrupt"
    for rel, expected in manifest["files"].items():
        path = tag_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != expected["bytes"] or sha256_file(path) != expected["sha256"]:
            return f"{rel} is truncated or altered"
    return None


def find_resumable(ckpt_dir: Path, report) -> str | None:
    """The newest complete, intact checkpoint's tag, reporting each one skipped on the way. Whether
    this run's layout can resume it is msds.train.relayout.check_resume's question."""
    if not ckpt_dir.is_dir():
        return None
    for tag_dir in sorted(ckpt_dir.glob("step*"), reverse=True):
        problem = verify(tag_dir)
        if problem is None:
            return tag_dir.name
        report(f"checkpoint {tag_dir} skipped: {problem}; trying the previous one")
    return None


def _allowed_types() -> list[type]:
    """The classes a checkpoint may hold besides tensors and plain containers: DeepSpeed's records
    (msds.compat.deepspeed_0_19.checkpoint_types) and msds's Phase, a record of numbers. Older
    checkpoints hold Phase in their LR scheduler state (LambdaLR saved the attributes of the plan's
    curve objects until msds gave it a plain function); allowing it keeps them resumable."""
    from msds.compat.deepspeed_0_19 import checkpoint_types
    from msds.plan.schedule import Phase

    return [Phase, *checkpoint_types()]


def safe_load(path, map_location="cpu"):
    """torch.load(path) with weights_only=True and only `_allowed_types()` allowed besides tensors
    and plain containers, so that loading runs no code of the file; an MsdsError naming the file and
    what it refused when the file asks for anything else."""
    try:
        with torch.serialization.safe_globals(_allowed_types()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise MsdsError(f"{path}: {_refusal(str(exc))}: not a tensor checkpoint msds or DeepSpeed writes; do not "
                        f"load checkpoints from untrusted sources with torch.load(weights_only=False)") from None


def _refusal(message: str) -> str:
    """What torch's weights-only unpickler refused, from its error message."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", message)
    if found:
        return f"refuses to unpickle {found.group(1)}"
    found = re.search(r"WeightsUnpickler error: ([^\n]+)", message)
    return f"refuses to unpickle it ({found.group(1) if found else message.strip().splitlines()[0]})"


def load(engine, ckpt_dir: Path, tag: str) -> tuple[dict, dict]:
    """Restore the engine from checkpoint `tag`, every file read by `safe_load`; returns (state,
    this rank's state)."""
    from msds.compat.deepspeed_0_19 import checkpoint_reads_through

    with checkpoint_reads_through(engine, safe_load):
        load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    if load_path is None:
        raise MsdsError(f"{ckpt_dir / tag}: DeepSpeed could not load this checkpoint")
    msds_dir = ckpt_dir / tag / "msds"
    state = json.loads((msds_dir / "state.json").read_text())
    rank_state = safe_load(msds_dir / f"rank{dist.get_rank()}.pt")
    return state, rank_state


def rng_state() -> dict:
    """Every random generator this process draws from: Python's `random`, NumPy's global one,
    torch's CPU generator, torch's CUDA generator of every visible device (when CUDA is available)
    and megatron-core's model-parallel tracker streams (per tensor-parallel rank). Only tensors,
    numbers, strings, lists, tuples and dicts: `safe_load` reads it back."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": [kind, keys.tolist(), position, has_gauss, cached_gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "megatron": {name: state.clone() for name, state in get_cuda_rng_tracker().get_states().items()}}


def restore_rng_state(state) -> None:
    """Put every generator back where `rng_state()` found it. A checkpoint written before msds kept
    them all holds the CPU generator's state alone: only that one is restored then."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    if torch.is_tensor(state):
        torch.set_rng_state(state)
        return
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states({name: s.clone() for name, s in state["megatron"].items()})


def read_state(ckpt_dir: Path, tag: str) -> dict:
    return json.loads((ckpt_dir / tag / "msds" / "state.json").read_text())


def convert_to_model(ckpt_dir: Path, tag: str | None, out_dir: Path) -> Path:
    """An msds model checkpoint (TP=1 shapes) from a training checkpoint written with ZeRO 0-2 at
    any tensor- and pipeline-parallel size: DeepSpeed's per-tensor-parallel-rank module files (per
    pipeline layer, for pipelines) are concatenated along the axes megatron-core splits, and the
    vocabulary's padding rows are dropped. (ZeRO-3 keeps no module weights in those files: such
    runs are exported by the trainer itself, to <run_dir>/model.)"""
    from msds.model.files import save_model, without_vocab_padding
    from msds.config import ModelConfig, from_dict

    ckpt_dir = Path(ckpt_dir)
    tag = tag or (ckpt_dir / "latest").read_text().strip()
    problem = verify(ckpt_dir / tag)
    if problem:
        raise MsdsError(f"{ckpt_dir / tag}: {problem}")
    state = read_state(ckpt_dir, tag)
    cfg = from_dict(ModelConfig, state["model"], "model").validate()
    read = _pipeline_module if state.get("pipeline_parallel", 1) > 1 else _flat_module
    shards = [read(ckpt_dir / tag, cfg, rank) for rank in range(state["tensor_parallel"])]
    tensors = {name: torch.cat([s[name] for s in shards], dim=tensor_parallel_dim(name))
               if tensor_parallel_dim(name) is not None else shards[0][name] for name in shards[0]}
    return save_model(out_dir, cfg, without_vocab_padding(cfg, tensors))


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in state.items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _flat_module(tag_dir: Path, cfg, tp_rank: int) -> dict[str, torch.Tensor]:
    path = tag_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"
    module = safe_load(path)["module"]
    if not module or any(t.numel() == 0 for t in module.values() if torch.is_tensor(t)):
        raise MsdsError(f"{path}: holds no full module weights (a ZeRO-3 checkpoint); use the model the "
                        f"run exported to <run_dir>/model")
    return _tensors(module)


def _pipeline_module(tag_dir: Path, cfg, tp_rank: int) -> dict[str, torch.Tensor]:
    """One tensor-parallel rank's weights from a pipeline's per-layer files, under flat names."""
    from msds.model.pipeline import unit_prefixes

    out = {}
    for index, prefix in enumerate(unit_prefixes(cfg)):
        if prefix is None:
            continue                      # the tied repeat: its weight is layer 0's
        path = tag_dir / f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt"
        if not path.is_file():
            raise MsdsError(f"{path}: missing; the checkpoint does not hold every pipeline layer")
        layer = _tensors(safe_load(path))
        out.update({prefix + name: tensor for name, tensor in layer.items()})
    return out


def _run_convert(args) -> int:
    out = convert_to_model(Path(args.ckpt_dir), args.tag, Path(args.out))
    print(f"wrote msds model checkpoint {out} (tensor-parallel size 1)")
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=convert_to_model.__doc__)
    parser.add_argument("ckpt_dir", help="a run's checkpoint directory (<run_dir>/checkpoints)")
    parser.add_argument("out", help="msds model checkpoint to create")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the latest complete one)")
    parser.set_defaults(run=_run_convert)
