"""What the integrity manifest (COMPLETE: size and sha256 of every file) adds to a checkpoint save.

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/checkpoint_integrity.py \
        [--hidden 768 --layers 8 --repeats 3 --dir /tmp/msds-ckpt-bench]

A real DeepSpeed ZeRO-1 engine (fp32, after one step, so the Adam state exists) around an msds GPT
is saved three ways, in turn, `--repeats` times:
- `none`: DeepSpeed's save_checkpoint and msds's per-rank file, no hashing (the floor);
- `per-rank` (msds.train.checkpointing.save): every rank hashes the files it wrote, at the same
  time, and rank 0 writes the manifest;
- `rank 0 alone`: the same files, then rank 0 hashes all of them while the other ranks wait at a
  barrier (what msds did before).
Each time is the collective wall-clock of one save on rank 0, from a barrier before it to the
barrier that ends it; the script prints the median of each and the extra time over `none`.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from msds.config import model_config  # noqa: E402
from msds.distributed import DeepSpeedMPU, init_distributed  # noqa: E402
from msds.integrity import sha256_file  # noqa: E402
from msds.model.transformer import Transformer  # noqa: E402
from msds.train import checkpointing  # noqa: E402


def engine_after_one_step(hidden: int, layers: int):
    cfg = model_config("gpt-small", hidden_size=hidden, num_layers=layers, num_heads=hidden // 64)
    model = Transformer(cfg, seed=0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 1}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           dist_init_required=False, mpu=DeepSpeedMPU)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    engine.backward(engine(ids, labels=ids))
    engine.step()
    return engine, sum(p.numel() for p in model.parameters())


def save_plain(engine, ckpt_dir: Path, rank_state: dict) -> None:
    tag_dir = ckpt_dir / checkpointing.tag_for(1)
    engine.save_checkpoint(str(ckpt_dir), tag=tag_dir.name, save_latest=False)
    (tag_dir / "msds").mkdir(parents=True, exist_ok=True)
    torch.save(rank_state, tag_dir / "msds" / f"rank{dist.get_rank()}.pt")
    dist.barrier()


def save_rank0_hashes(engine, ckpt_dir: Path, rank_state: dict) -> None:
    save_plain(engine, ckpt_dir, rank_state)
    if dist.get_rank() == 0:
        tag_dir = ckpt_dir / checkpointing.tag_for(1)
        manifest = {str(p.relative_to(tag_dir)): sha256_file(p) for p in sorted(tag_dir.rglob("*")) if p.is_file()}
        (tag_dir / "msds" / checkpointing.COMPLETE).write_text(json.dumps(manifest))
    dist.barrier()


def save_per_rank(engine, ckpt_dir: Path, rank_state: dict) -> None:
    checkpointing.save(engine, ckpt_dir, 1, {"step": 1}, rank_state, keep=1)


def timed(save, engine, ckpt_dir: Path, rank_state: dict) -> tuple[float, int]:
    """Seconds of one collective save, and the bytes it wrote (on rank 0; 0 elsewhere)."""
    dist.barrier()
    start = time.perf_counter()
    save(engine, ckpt_dir, rank_state)
    seconds = time.perf_counter() - start
    written = 0
    if dist.get_rank() == 0:
        written = sum(p.stat().st_size for p in ckpt_dir.rglob("*") if p.is_file())
        shutil.rmtree(ckpt_dir)
    dist.barrier()
    return seconds, written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/msds-ckpt-bench")
    args = parser.parse_args(argv)
    init_distributed()
    torch.set_num_threads(1)
    engine, params = engine_after_one_step(args.hidden, args.layers)
    rank_state = {"rng": checkpointing.rng_state()}
    ways = {"none": save_plain, "per-rank": save_per_rank, "rank 0 alone": save_rank0_hashes}
    seconds, written = {name: [] for name in ways}, 0
    for repeat in range(args.repeats):
        for name, save in ways.items():
            took, written = timed(save, engine, Path(args.dir) / f"{name.replace(' ', '-')}-{repeat}", rank_state)
            seconds[name].append(took)
    if dist.get_rank() == 0:
        median = {name: statistics.median(values) for name, values in seconds.items()}
        print(f"{dist.get_world_size()} processes, {params / 1e6:.1f}M parameters (fp32 weights "
              f"{params * 4 / 2**20:.0f} MiB), checkpoint {written / 2**20:.0f} MiB; median of {args.repeats}")
        for name, value in median.items():
            extra = value - median["none"]
            print(f"{name:>13}: {value:6.2f} s  extra for integrity {extra:+6.2f} s ({extra / median['none']:+.0%})  "
                  f"runs {', '.join(f'{v:.2f}' for v in seconds[name])}")
    engine.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
