"""Peak host memory of a rank during a V-cycle transition: a 24-layer GPT on 2 processes under
ZeRO 3, each process's RSS sampled from outside (psutil, every 10 ms).

    nice -n 10 .venv/bin/python benchmarks/transition_memory.py [--layers 24 --hidden 384] [--json out.json]

The script launches itself as 2 gloo workers (torchrun). Each worker plans a 3-phase V-cycle of the
test GPT recipe at this size (level 2 = hidden, heads, FFN and layers / 2; ZeRO 3, fp32, Adam's
moments mapped), trains one step, and runs the down and then the up transition through
msds.train.transition.run_transition (what `msds train` calls), each followed by one training step
of the new level. Around each transition it writes marks with wall-clock times: `settle` (after a
garbage collection; then it sleeps 1 s), `start`, `end` (with the transition's metrics record),
`trained` (after the step that follows). Before `end` it hands freed memory back to the system
(glibc's malloc_trim), so that the level after is what the new engine holds, whatever the version of
msds under test does.

Per rank and transition, from the samples: `level` = median RSS over the second before `start`
(the process as training left it: what a job has to provide anyway), `peak` = max RSS between
`start` and `end`, `after` = median RSS over the second after `end` (the new engine before its
first step), `training after` = median RSS over the second after `trained` (the new level while it
trains: its gradients and activations too). The down transition keeps this rank's share of the large
model's weights and moments for the way up by design (1/dp of them): its transient memory is
peak - level - that share. The up transition ends with the larger model training, which needs more
memory than the smaller one did: its transient memory is what the transition needs beyond training
on either side, peak - max(level, training after) (negative: the transition's peak stays below the
larger model's training). The goal (issue 18): transient <= 25% of the full model's weights and
moments (fp32: 12 bytes per parameter). The last column is the peak the transition's metrics record
itself (`ranks`: Linux's RSS high-water mark, reset at its start).

Sampling every 10 ms can miss a peak shorter than that (the transitions here take seconds).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL = 0.25
SAMPLE_S = 0.01


def recipe_overrides(args, corpus: str, run_dir: str) -> list[str]:
    return [f"data.path={corpus}", f"run_dir={run_dir}", "logging.tensorboard=false", "training.zero_stage=3",
            f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.num_heads={args.hidden // 64}", f"model.ffn_size={4 * args.hidden}",
            "multilevel.levels=[{hidden: 2, heads: 2, ffn: 2, layers: 2}]", "multilevel.phase_steps=[1,1,1]",
            "logging.eval_batches=1"]


# -- worker (one per rank, under torchrun) ---------------------------------------------------------

def worker(args) -> None:
    warnings.filterwarnings("ignore")
    import torch

    from msds.config import load_run_config
    from msds.data import eval_batches, train_batches
    from msds.distributed import data_parallel_group, init_distributed, launched_world_size
    from msds.plan import build_plan
    from msds.train.engine import build_engine, train_step
    from msds.train.transition import run_transition

    torch.set_num_threads(1)
    cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml",
                          recipe_overrides(args, args.corpus, f"{args.marks}/run"))
    plan = build_plan(cfg, launched_world_size())
    init_distributed(seed=cfg.training.seed)
    rank = torch.distributed.get_rank()
    marks = open(Path(args.marks) / f"rank{rank}.jsonl", "w", buffering=1)

    def mark(what: str, **extra) -> None:
        marks.write(json.dumps({"mark": what, "time": time.time(), **extra}) + "\n")

    eval_set = eval_batches(cfg.data.path, cfg.logging.eval_split, cfg.model.arch, cfg.data.seq_len,
                            cfg.training.micro_batch_size, 1, seed=cfg.data.seed)
    batches = train_batches(cfg.data.path, cfg.model.arch, cfg.data.seq_len, cfg.training.micro_batch_size,
                            cfg.data.seed, torch.distributed.get_rank(data_parallel_group()), plan.layout.data)
    torch.manual_seed(cfg.training.seed)
    engine = build_engine(plan, plan.phases[0], None)
    saved = []
    train_step(engine, batches, 1, None)
    for index in (0, 1):
        gc.collect()
        mark("settle")
        time.sleep(1.0)
        mark("start", direction="down" if index == 0 else "up")
        engine, record = run_transition(engine, plan, plan.phases[index], plan.phases[index + 1], saved,
                                        eval_set, index + 1)
        release_freed_memory()
        mark("end", record=record)
        time.sleep(1.0)
        train_step(engine, batches, 1, None)
        mark("trained")
        time.sleep(1.0)
    torch.distributed.barrier()


def release_freed_memory() -> None:
    """Hand what glibc's allocator keeps of freed memory back to the system, so that the level read
    after a transition is what the process needs. (msds's transitions do this themselves; an older
    version under test, through PYTHONPATH, may not, and its level after would then read as its
    peak.)"""
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


# -- parent: launch, sample, report -------------------------------------------------------------

def model_state_bytes(args, corpus: str) -> tuple[int, int]:
    """(parameters, bytes of fp32 weights + both Adam moments) of the level-1 model."""
    from msds.config import load_run_config
    from msds.model.roles import expected_shapes

    cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml", recipe_overrides(args, corpus, "unused"))
    numel = sum(math.prod(s) for s in expected_shapes(cfg.model).values())
    return numel, 12 * numel


def sample(launcher: subprocess.Popen) -> list[tuple[float, int, int]]:
    """(time, rank, RSS bytes) of every worker of `launcher`'s process tree until it exits."""
    import psutil

    root, ranks, samples = psutil.Process(launcher.pid), {}, []
    while launcher.poll() is None:
        now = time.time()
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for child in children:
            try:
                if child.pid not in ranks:
                    if "--worker" not in child.cmdline():
                        continue
                    ranks[child.pid] = int(child.environ()["RANK"])
                samples.append((now, ranks[child.pid], child.memory_info().rss))
            except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
                continue
        time.sleep(max(0.0, SAMPLE_S - (time.time() - now)))
    return samples


def analyse(samples, marks: dict[int, list[dict]], kept_share: float, full_state: int) -> list[dict]:
    rows = []
    for rank, events in sorted(marks.items()):
        mine = [(t, rss) for t, r, rss in samples if r == rank]
        starts = [e for e in events if e["mark"] == "start"]
        ends = [e for e in events if e["mark"] == "end"]
        for start, end in zip(starts, ends):
            level = statistics.median(rss for t, rss in mine if start["time"] - 1.0 <= t < start["time"])
            after = statistics.median(rss for t, rss in mine if end["time"] < t <= end["time"] + 1.0)
            trained = next(e for e in events if e["mark"] == "trained" and e["time"] > end["time"])
            training = statistics.median(rss for t, rss in mine if trained["time"] < t <= trained["time"] + 1.0)
            peak = max(rss for t, rss in mine if start["time"] <= t <= end["time"])
            down = start["direction"] == "down"
            kept = kept_share if down else 0.0
            # Up: the larger engine replaces the smaller one, and trains with more memory after.
            transient = peak - level - kept if down else peak - max(level, training)
            record = end["record"]
            rows.append({"rank": rank, "direction": start["direction"], "level_mb": level / 2**20,
                         "after_mb": after / 2**20, "training_after_mb": training / 2**20, "peak_mb": peak / 2**20,
                         "extra_mb": (peak - level) / 2**20, "kept_share_mb": kept / 2**20,
                         "transient_mb": transient / 2**20, "transient_of_full_state": transient / full_state,
                         "window_s": end["time"] - start["time"], "transition_s": record["seconds"],
                         "record": record})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=384, help="a multiple of 128 (heads of 64, halved)")
    parser.add_argument("--corpus", default=str(Path.home() / ".cache" / "msds" / "test-data" / "default-bpe-1024"),
                        help="a prepared corpus with a 1024-token vocabulary (prepared here when missing)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--marks", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not (Path(args.corpus) / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "msds.cli", "data", "prepare", "--tokenizer", "bpe-1024",
                        "--out", args.corpus], check=True)
    numel, full_state = model_state_bytes(args, args.corpus)
    dp = 2
    kept_share = full_state / dp
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as work:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(dp), __file__, "--worker",
                   "--marks", work, "--corpus", args.corpus, "--layers", str(args.layers), "--hidden", str(args.hidden)]
        launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        samples = sample(launcher)
        output = launcher.stdout.read()
        if launcher.wait() != 0:
            print(output[-5000:])
            return 1
        marks = {rank: [json.loads(line) for line in (Path(work) / f"rank{rank}.jsonl").read_text().splitlines()]
                 for rank in range(dp)}
    rows = analyse(samples, marks, kept_share, full_state)
    print(f"GPT {args.layers} layers x {args.hidden}: {numel / 1e6:.1f} M parameters, weights + moments "
          f"{full_state / 2**20:.0f} MiB; ZeRO 3, {dp} processes; kept large share per rank "
          f"{kept_share / 2**20:.0f} MiB; {len(samples)} RSS samples")
    print("| rank | transition | level before (MiB) | peak (MiB) | level after (MiB) | training after (MiB) "
          "| peak - before (MiB) | kept share (MiB) | transient (MiB) | transient / full state | transition (s) "
          "| in-process peak - before (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        own = next(x for x in r["record"]["ranks"] if x["rank"] == r["rank"])["rss_peak_extra_mb"] \
            if "ranks" in r["record"] else None
        print(f"| {r['rank']} | {r['direction']} | {r['level_mb']:.0f} | {r['peak_mb']:.0f} | {r['after_mb']:.0f} | "
              f"{r['training_after_mb']:.0f} | "
              f"{r['extra_mb']:.0f} | {r['kept_share_mb']:.0f} | {r['transient_mb']:.0f} | "
              f"{r['transient_of_full_state']:.1%} | {r['transition_s']:.1f} | "
              f"{'-' if own is None else f'{own:.0f}'} |")
    worst = max(r["transient_of_full_state"] for r in rows)
    print(f"goal: transient <= {GOAL:.0%} of the full model's weights and moments: "
          f"{'met' if worst <= GOAL else 'NOT met'} (worst {worst:.1%})")
    if args.json:
        args.json.write_text(json.dumps({"parameters": numel, "full_state_bytes": full_state,
                                         "kept_share_bytes": kept_share, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
