"""Steps per second on the CPU for one bench shape: the default path against torch's fused AdamW
(`"fused": true` in the DeepSpeed template) and `training.compile` (each transformer block through
torch.compile), each trained from the same seed, alternated over repeats so that a change in the
machine's load falls on every setting alike. Writes a results table (the format of `msds report`).

    .venv/bin/python benchmarks/cpu_speed.py --recipe deep-gpt-3000 --data data/default-bpe-1024 \\
        --steps 600 --repeats 2 --out benchmarks/results/cpu-speed-deep-gpt.json

Steps per second count the steps after the first `--skip` (one-time costs: the first step's
allocations, torch.compile's compilation), from the run's own metrics.jsonl (train_seconds, the
training time without evaluations). Each run is `msds train` in its own process on one thread
(OMP_NUM_THREADS=1, as the bench's --jobs 2 runs train). The final losses say whether a setting
trains the same model: the fused AdamW's arithmetic differs from the default's in the last bits.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

SETTINGS = {
    "default (foreach AdamW, eager)": [],
    "fused AdamW": ["training.ds_config={fused}"],
    "training.compile": ["training.compile=true"],
}
COLUMNS = [
    {"key": "setting", "label": "setting"},
    {"key": "steps_per_s", "label": "steps per second (per repeat)", "format": "list", "digits": 2},
    {"key": "speedup", "label": "against the default (mean)", "digits": 2},
    {"key": "final_loss", "label": "final training loss (per repeat)", "format": "list", "digits": 4},
    {"key": "first_steps_s", "label": "seconds of the skipped first steps (mean)", "digits": 1},
]


def _base_config(recipe: str, data: str, steps: int) -> dict:
    from msds import resources
    from msds.config import load_yaml

    bench = load_yaml(resources.recipe(recipe) or recipe)
    base = bench["base"]
    base["data"]["path"] = data
    base["training"]["steps"] = steps
    base["optimizer"]["warmup_steps"] = steps // 10
    base["logging"] = {"interval": steps, "eval_interval": steps, "eval_batches": 1, "tensorboard": False}
    base["checkpoint"] = {"layout_free": False, "resume": "never"}
    return base


def _fused_template(work: Path) -> Path:
    from msds import resources

    ds = json.loads(resources.ds_template(1).read_text())
    ds["optimizer"]["params"]["fused"] = True
    path = work / "zero1-fused.json"
    path.write_text(json.dumps(ds))
    return path


def _run(config: Path, run_dir: Path, overrides: list[str], skip: int) -> tuple[float, float, float]:
    """(steps per second after `skip`, final training loss, seconds of the first `skip` steps)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "msds.cli", "train", "--config", str(config), f"run_dir={run_dir}",
                    *overrides], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"event": "step"' in line]
    first, last = steps[skip - 1], steps[-1]
    rate = (last["step"] - first["step"]) / (last["train_seconds"] - first["train_seconds"])
    return rate, last["loss"], first["train_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="deep-gpt-3000", help="a bench recipe whose `base` is the shape")
    parser.add_argument("--data", required=True, help="the prepared corpus")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--skip", type=int, default=50, help="steps left out of the rate (one-time costs)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--load", default="", help="what else ran on the machine, for the table's setting")
    parser.add_argument("--date", required=True, help="the day it was measured")
    args = parser.parse_args()
    import deepspeed
    import torch

    results = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = work / "run.yaml"
        config.write_text(yaml.safe_dump(_base_config(args.recipe, args.data, args.steps)))
        fused = _fused_template(work)
        for repeat in range(args.repeats):
            for name, overrides in SETTINGS.items():
                run_dir = work / f"{len(results[name])}-{list(SETTINGS).index(name)}"
                results[name].append(_run(config, run_dir, [o.format(fused=fused) for o in overrides], args.skip))
                print(f"{name}, repeat {repeat + 1}: {results[name][-1][0]:.2f} steps/s, "
                      f"loss {results[name][-1][1]:.4f}", flush=True)
    default = sum(r[0] for r in results[next(iter(SETTINGS))]) / args.repeats
    rows = [{"setting": name, "steps_per_s": [round(r[0], 3) for r in runs],
             "speedup": round(sum(r[0] for r in runs) / args.repeats / default, 3),
             "final_loss": [round(r[1], 5) for r in runs],
             "first_steps_s": round(sum(r[2] for r in runs) / args.repeats, 2)} for name, runs in results.items()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.out.write_text(json.dumps({
        "title": f"Steps per second on one CPU thread, the {args.recipe} shape, {args.steps} steps "
                 f"(the first {args.skip} left out), settings alternated over {args.repeats} repeats",
        "setting": {"machine": f"{platform.machine()} CPU, {os.cpu_count()} cores" + (f"; {args.load}" if args.load
                                                                                      else ""),
                    "versions": f"msds {commit}, torch {torch.__version__}, deepspeed {deepspeed.__version__}",
                    "command": " ".join(["benchmarks/cpu_speed.py", *sys.argv[1:]]), "date": args.date},
        "columns": COLUMNS, "rows": rows, "source": "benchmarks/cpu_speed.py"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
