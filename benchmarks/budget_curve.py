"""Issue 58's budget curve: one table row per budget point and V-cycle try, from the `msds bench`
outputs of recipes/bench/budget-curve-<arch>-<steps>.yaml, written as a benchmarks/results JSON table
(the report format of `msds report`: per-seed lists, the setting, the source).

Tokens per parameter count the parameters outside the word, position and token-type embeddings
(the convention of scaling-law work), with the tokens of the baseline's steps.

    for B in 40 120 400 1200; do
        msds bench --config recipes/bench/budget-curve-gpt-$B.yaml --out bench_out/budget-gpt-$B --jobs 2
    done
    .venv/bin/python benchmarks/budget_curve.py --arch gpt --out benchmarks/results/budget-curve-gpt.json \\
        bench_out/budget-gpt-{40,120,400,1200}
    .venv/bin/python benchmarks/budget_curve.py --plot --out docs/img/budget-curve.png \
        benchmarks/results/budget-curve-gpt.json benchmarks/results/budget-curve-bert.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
from pathlib import Path

import yaml

EMBEDDINGS = ("embeddings.word.weight", "embeddings.position.weight", "embeddings.token_type.weight")
COLUMNS = [
    {"key": "tokens_per_param", "label": "tokens per non-embedding parameter", "digits": 2},
    {"key": "steps", "label": "baseline steps", "digits": 0},
    {"key": "variant", "label": "V-cycle try"},
    {"key": "reference", "label": "reference: schedule, peak LR, warmup"},
    {"key": "interior", "label": "reference interior?"},
    {"key": "flops_saving", "label": "FLOPs saved (mean / worst)", "format": "mean_worst", "digits": 1,
     "suffix": "%", "worst": "min"},
    {"key": "wallclock_saving", "label": "wall-clock saved (mean / worst)", "format": "mean_worst", "digits": 1,
     "suffix": "%", "worst": "min"},
    {"key": "missed", "label": "missed the target in seeds"},
    {"key": "multiplier", "label": "compute multiplier k per seed"},
]


def non_embedding_parameters(config: dict) -> int:
    from msds.config import run_config_from_dict
    from msds.model.roles import expected_shapes

    model = run_config_from_dict(config).model
    return sum(math.prod(shape) for name, shape in expected_shapes(model).items() if name not in EMBEDDINGS)


def _schedule(optimizer: dict) -> str:
    floor = "zero" if optimizer["min_lr_ratio"] == 0 else f"{optimizer['min_lr_ratio']:.0%}"
    if optimizer["schedule"] == "wsd":
        return f"WSD to {floor} (last {optimizer['decay_fraction']:.0%})"
    return f"{optimizer['schedule']} to {floor}"


def _interior(check: dict) -> str:
    if check["interior"]:
        return "yes"
    edges = [f"{dim} edge" for dim, d in check["dimensions"].items() if not d["interior"]]
    return "NO (" + ", ".join(edges) + ")"


def _percent(values: list) -> list | None:
    return None if any(v is None for v in values) else [round(100 * v, 2) for v in values]


def rows(bench_dir: Path) -> list[dict]:
    results = json.loads((bench_dir / "results.json").read_text())
    seeds = list(results["per_seed"])
    seed_dir = bench_dir / f"seed{seeds[0]}"
    reference = results["reference"]
    config = yaml.safe_load((seed_dir / reference / "config.yaml").read_text())
    optimizer = config["optimizer"]
    steps = config["training"]["steps"]
    tokens = steps * config["training"]["micro_batch_size"] * config["training"]["grad_accum"] * config["data"]["seq_len"]
    out = []
    for name, variant in results["variants"].items():
        if name in results["baseline_sweep"]:
            continue
        k = results.get("multiplier", {}).get("variants", {}).get(name)
        finals = variant["final_val_loss"]["per_seed"]
        targets = [results["per_seed"][s]["target_val_loss"] for s in seeds]
        # Without the longer runs, k is known only where the variant ends above the 1x reference.
        known = ", ".join("< 1" if f >= t else "n/a" for f, t in zip(finals, targets))
        out.append({"tokens_per_param": round(tokens / non_embedding_parameters(config), 3), "steps": steps,
                    "variant": name,
                    "reference": f"{_schedule(optimizer)}, {optimizer['lr']:g}, {optimizer['warmup_steps']}",
                    "interior": _interior(results["sweep_check"]),
                    "flops_saving": _percent(variant["flops_saving"]["per_seed"]),
                    "wallclock_saving": _percent(variant["wallclock_saving"]["per_seed"]),
                    "missed": ", ".join(variant["missed_in_seeds"]) or "none",
                    "multiplier": known if k is None else ", ".join(k["per_seed"]),
                    "seeds": seeds, "final_val_loss": finals, "target_val_loss": targets})
    return out


def plot(tables: list[dict], path: Path) -> None:
    """FLOPs saving and compute multiplier k of each V-cycle try against tokens per parameter, one
    panel each: the mean over seeds, where every seed has a number (reached the target; k inside
    the measured range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for table in tables:
        arch = table["title"].split(",")[1].split("(")[0].strip()
        for variant in dict.fromkeys(r["variant"] for r in table["rows"]):
            rows = [r for r in table["rows"] if r["variant"] == variant]
            x = [r["tokens_per_param"] for r in rows]
            reached = [r for r in rows if r["flops_saving"]]
            left.plot([r["tokens_per_param"] for r in reached],
                      [sum(r["flops_saving"]) / len(r["flops_saving"]) for r in reached], marker="o",
                      label=f"{arch} {variant}")
            ks = [[float(v) for v in r["multiplier"].split(", ")] if r["multiplier"] and "<" not in r["multiplier"]
                  and ">" not in r["multiplier"] else None for r in rows]
            right.plot([xi for xi, k in zip(x, ks) if k], [sum(k) / len(k) for k in ks if k], marker="o",
                       label=f"{arch} {variant}")
    for ax, label in ((left, "FLOPs saved to the reference's final loss (%, mean)"),
                      (right, "compute multiplier k (mean)")):
        ax.set_xscale("log")
        ax.set_xlabel("tokens per non-embedding parameter")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    right.axhline(1, color="black", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["gpt", "bert"], help="the architecture of the bench directories")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--command", default="", help="the command line that produced the bench outputs")
    parser.add_argument("--plot", action="store_true", help="instead: draw the curve of the results tables (JSON) given "
                                                 "in place of bench directories into --out, a PNG")
    parser.add_argument("bench_dirs", nargs="*", type=Path)
    args = parser.parse_args()
    if args.plot:
        plot([json.loads(p.read_text()) for p in args.bench_dirs], args.out)
        return
    if args.arch is None:
        parser.error("--arch: give the architecture of the bench directories (gpt or bert)")
    import deepspeed
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    table = {"title": f"Issue 58's budget curve, {args.arch.upper()} (2 x 64, 1,024 tokens per step): the V-cycle "
                      f"against the best of a schedule x learning-rate sweep at each budget",
             "setting": {"machine": f"{platform.machine()} CPU, {os.cpu_count()} cores shared with "
                                    f"other work (wall-clock savings are noisy)",
                         "versions": f"msds {commit}, torch {torch.__version__}, deepspeed {deepspeed.__version__}",
                         "command": args.command, "date": "2026-12-06"},
             "columns": COLUMNS,
             "rows": [row for d in args.bench_dirs for row in rows(d)],
             "source": ", ".join(str(d / "results.json") for d in args.bench_dirs)}
    args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
