"""Issue 58's budget curve: one table row per budget point and variant, from the `msds bench`
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
    .venv/bin/python benchmarks/budget_curve.py --trend --out benchmarks/results/budget-curve-trend.json \
        benchmarks/results/budget-curve-gpt.json benchmarks/results/budget-curve-bert.json

Rows include the controls of a bench (a variant that is not a V-cycle, e.g. the small model trained
alone on the same FLOPs) beside the V-cycle tries.
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

from msds.plan.regime import CONTROL

# Only for benches run one run at a time on an idle machine (--wallclock).
WALLCLOCK = {"key": "wallclock_saving", "label": "wall-clock saved (mean / worst)", "format": "mean_worst",
             "digits": 1, "suffix": "%", "worst": "min"}
COLUMNS = [
    {"key": "tokens_per_param", "label": "tokens per non-embedding parameter", "digits": 2},
    {"key": "steps", "label": "baseline steps", "digits": 0},
    {"key": "variant", "label": "variant"},
    {"key": "reference", "label": "reference: schedule, peak LR, warmup"},
    {"key": "interior", "label": "reference interior?"},
    {"key": "flops_saving", "label": "FLOPs saved (mean / worst)", "format": "mean_worst", "digits": 1,
     "suffix": "%", "worst": "min"},
    {"key": "missed", "label": "missed the target in seeds"},
    WALLCLOCK,
    {"key": "loss_gap", "label": "final loss minus the reference's (mean / worst)", "format": "mean_worst",
     "digits": 3, "worst": "max"},
    {"key": "multiplier", "label": "compute multiplier k per seed"},
    {"key": "quality", "label": "downstream, against the reference"},
]


def _quality(results: dict, name: str) -> str:
    """The bench's equal-quality verdict for a variant (msds/eval/bench.py: the paired standard error
    over seeds), with where it was scored; "-" without an eval: section."""
    record = (results.get("eval") or {}).get("variants", {}).get(name)
    if record is None:
        return "-"
    where = " (at the target)" if results["eval"].get("at") == "target" else " (final models)"
    return ("equal" if record["equal_quality"] else "worse on " + ", ".join(record["worse_than_reference"])) + where


def _model(config: dict):
    from msds.config import run_config_from_dict

    return run_config_from_dict(config).model


def non_embedding_parameters(config: dict) -> int:
    from msds.plan.regime import non_embedding_parameters as count

    return count(_model(config))


def _schedule(optimizer: dict) -> str:
    floor = "zero" if optimizer["min_lr_ratio"] == 0 else f"{optimizer['min_lr_ratio']:.0%}"
    if optimizer["schedule"] == "wsd":
        return f"WSD to {floor} (last {optimizer['decay_fraction']:.0%})"
    return f"{optimizer['schedule']} to {floor}"


def _interior(check: dict) -> str:
    if check["interior"] is None:   # a bench without a sweep: its baseline was chosen elsewhere
        return "not swept here"
    if check["interior"]:
        return "yes"
    edges = [f"{dim} edge" for dim, d in check["dimensions"].items() if not d["interior"]]
    return "NO (" + ", ".join(edges) + ")"


def _percent(values: list) -> list | None:
    return None if any(v is None for v in values) else [round(100 * v, 2) for v in values]


def _best_control(results: dict) -> str | None:
    """The `small-alone*` variant with the lowest mean final validation loss (the tuned control)."""
    controls = [n for n in results["variants"] if n.startswith(CONTROL)]
    return min(controls, key=lambda n: results["variants"][n]["final_val_loss"]["mean"], default=None)


def rows(bench_dir: Path, only: list[str] | None = None) -> list[dict]:
    """One row per variant outside the baseline sweep (or in `only`); of several `small-alone*`
    variants (the control at several rates) only the best."""
    results = json.loads((bench_dir / "results.json").read_text())
    control = _best_control(results)
    seeds = list(results["per_seed"])
    seed_dir = bench_dir / f"seed{seeds[0]}"
    reference = results["reference"]
    config = yaml.safe_load((seed_dir / reference / "config.yaml").read_text())
    optimizer = config["optimizer"]
    steps = config["training"]["steps"]
    tokens = steps * config["training"]["micro_batch_size"] * config["training"]["grad_accum"] * config["data"]["seq_len"]
    out = []
    for name, variant in results["variants"].items():
        if name.startswith(CONTROL) and name != control:
            continue
        if name in results["baseline_sweep"] or (only and name not in only and not name.startswith(CONTROL)):
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
                    "loss_gap": [round(f - t, 4) for f, t in zip(finals, targets)],
                    "multiplier": known if k is None else ", ".join(k["per_seed"]),
                    "quality": _quality(results, name),
                    "seeds": seeds, "final_val_loss": finals, "target_val_loss": targets})
    return out


# Where users train, in tokens per non-embedding parameter (the budgets the trend is read at):
# compute-optimal (about 20); GPT-2 small (124 M, about 85 M outside the embeddings) on 10 B tokens,
# as in public reproductions; BERT-Large (about 300 M outside the embeddings) on about 130 B tokens.
USER_BUDGETS = {"compute-optimal": 20, "GPT-2 small": 118, "BERT-Large": 430}
TREND_COLUMNS = [
    {"key": "arch", "label": "architecture"},
    {"key": "variant", "label": "variant"},
    {"key": "budgets", "label": "tokens per parameter fitted", "format": "list", "digits": 1},
    {"key": "k_means", "label": "k (mean) at those budgets", "format": "list", "digits": 2},
    {"key": "slope", "label": "slope of log k per decade of budget", "digits": 2},
    {"key": "k_one_at", "label": "k = 1 at tokens per parameter", "digits": 1},
    *({"key": f"k_at_{t}", "label": f"k at {t} ({name})", "digits": 2} for name, t in USER_BUDGETS.items()),
]


def _mean_k(row: dict) -> float | None:
    values = row["multiplier"].split(", ")
    if any(v.startswith(("<", ">")) or v == "n/a" for v in values):
        return None
    return sum(float(v) for v in values) / len(values)


def _below_one(row: dict) -> bool:
    """Every seed ended above the reference (k below 1, no number)."""
    return all(v.strip() == "< 1" for v in row["multiplier"].split(","))


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares log10 k = a + b log10(tokens per parameter), a power law that keeps k positive:
    (a, b)."""
    xs = [math.log10(t) for t, _ in points]
    ys = [math.log10(k) for _, k in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def fitted_k(a: float, b: float, tokens_per_param: float) -> float:
    return 10 ** (a + b * math.log10(tokens_per_param))


def trend_rows(tables: list[dict]) -> list[dict]:
    """Per architecture and variant with a numeric mean k at three or more budgets: the fitted power
    law of k against the budget, where it crosses 1 and what it implies at USER_BUDGETS. An
    extrapolation from one small shape: it says which way the saving goes, not its size there. A
    longer budget measured with k below 1 in every seed overrules the fit from there on."""
    out = []
    for table in tables:
        arch = table["title"].split(",")[1].split("(")[0].strip()
        for variant in dict.fromkeys(r["variant"] for r in table["rows"]):
            points = [(r["tokens_per_param"], _mean_k(r)) for r in table["rows"] if r["variant"] == variant]
            points = [(t, k) for t, k in points if k is not None]
            if len(points) < 3:
                continue
            a, b = fit(points)
            row = {"arch": arch, "variant": variant, "budgets": [t for t, _ in points],
                   "k_means": [round(k, 3) for _, k in points], "slope": round(b, 3),
                   "k_one_at": round(10 ** (-a / b), 1) if b < 0 else None}
            row.update({f"k_at_{t}": round(fitted_k(a, b, t), 3) for t in USER_BUDGETS.values()})
            bound = measured_below_one(table["rows"], variant, points[-1][0], (a, b))
            if bound:
                row["k_one_at"] = f"below {bound:.0f} (measured)"
                row.update({f"k_at_{t}": f"< 1 (measured at {bound:.0f})" for t in USER_BUDGETS.values() if t >= bound})
            out.append(row)
    return out


def measured_below_one(rows: list[dict], variant: str, after: float, law: tuple[float, float]) -> float | None:
    """The first budget past `after` where `variant` ended above the reference in every seed (k
    below 1, a measurement) while the fitted `law` still says k >= 1 there: the fit is overruled
    from that budget on. None without one."""
    for r in rows:
        if r["variant"] == variant and r["tokens_per_param"] > after and _below_one(r):
            return r["tokens_per_param"] if fitted_k(*law, r["tokens_per_param"]) >= 1 else None
    return None


def plot(tables: list[dict], path: Path) -> None:
    """FLOPs saving and compute multiplier k of each V-cycle try against tokens per parameter, one
    panel each: the mean over seeds, where every seed has a number (reached the target; k inside
    the measured range); a downward triangle at k = 1 where every seed ended above the reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for table in tables:
        model = table["setting"].get("model")
        arch = table["title"].split(",")[1].split("(")[0].strip() + (
            f" {model['layers']}x{model['hidden']}" if model else "")
        for variant in dict.fromkeys(r["variant"] for r in table["rows"]):
            rows = [r for r in table["rows"] if r["variant"] == variant]
            x = [r["tokens_per_param"] for r in rows]
            reached = [r for r in rows if r["flops_saving"]]
            left.plot([r["tokens_per_param"] for r in reached],
                      [sum(r["flops_saving"]) / len(r["flops_saving"]) for r in reached], marker="o",
                      label=f"{arch} {variant}")
            points = [(r["tokens_per_param"], _mean_k(r)) for r in rows]
            points = [(t, k) for t, k in points if k is not None]
            line, = right.plot([t for t, _ in points], [k for _, k in points], marker="o", label=f"{arch} {variant}")
            below = [r["tokens_per_param"] for r in rows if _below_one(r)]
            right.plot(below, [1] * len(below), marker="v", linestyle="none", color=line.get_color())   # k < 1 there
            if len(points) >= 3:
                a, b = fit(points)
                span = [min(x), measured_below_one(rows, variant, points[-1][0], (a, b)) or max(USER_BUDGETS.values())]
                span = [10 ** (math.log10(span[0]) + i * (math.log10(span[1]) - math.log10(span[0])) / 20)
                        for i in range(21)]
                right.plot(span, [fitted_k(a, b, t) for t in span], linestyle="--", linewidth=0.8,
                           color=line.get_color())
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


def _shape(bench_dir: Path):
    """The full-size model and the tokens per step of a bench's reference."""
    results = json.loads((bench_dir / "results.json").read_text())
    config = yaml.safe_load((bench_dir / f"seed{next(iter(results['per_seed']))}" / results["reference"]
                             / "config.yaml").read_text())
    t = config["training"]
    return _model(config), t["micro_batch_size"] * t["grad_accum"] * config["data"]["seq_len"]


CROSSOVER_COLUMNS = [
    {"key": "tokens_per_param", "label": "tokens per non-embedding parameter (full model)", "digits": 1},
    {"key": "steps", "label": "full-model steps", "digits": 0},
    {"key": "epochs", "label": "epochs of the corpus: full / half-depth", "format": "list", "digits": 2},
    {"key": "full", "label": "full model: best peak rate, final loss (mean), interior?"},
    {"key": "small", "label": "half-depth model alone, same FLOPs: best peak rate, final loss (mean), interior?"},
    {"key": "gap", "label": "full minus half-depth, per seed", "format": "list", "digits": 3},
    {"key": "better", "label": "the better use of the FLOPs"},
]


def _rate_loss(rates: dict[str, float], means: dict[str, float], best: str) -> str:
    """'peak rate, loss, interior?' of the best of members with the given rates: interior when a
    lower and a higher rate were both run and ended worse."""
    lower = [means[n] for n in rates if rates[n] < rates[best]]
    higher = [means[n] for n in rates if rates[n] > rates[best]]
    inside = bool(lower) and bool(higher) and min(lower + higher) > means[best]
    return f"{rates[best]:g}, {means[best]:.4f}, " + ("yes" if inside else "NO (edge of " +
                                                      ", ".join(f"{r:g}" for r in sorted(rates.values())) + ")")


def crossover_row(bench_dir: Path, train_tokens: int) -> dict:
    """The crossover at one budget: the full model's reference (the best of its rate sweep) against
    the best of the `small-alone*` variants (the half-depth model trained alone on the same FLOPs),
    each with its own rate sweep, per seed."""
    results = json.loads((bench_dir / "results.json").read_text())
    seeds = list(results["per_seed"])

    def config(name: str) -> dict:
        return yaml.safe_load((bench_dir / f"seed{seeds[0]}" / name / "config.yaml").read_text())

    def per_seed(name: str) -> list[float]:
        return results["variants"][name]["final_val_loss"]["per_seed"]

    full = list(results["baseline_sweep"])
    small = [n for n in results["variants"] if n.startswith(CONTROL)]
    means = {n: sum(per_seed(n)) / len(seeds) for n in full + small}
    best_small = min(small, key=means.get)
    reference = results["reference"]
    cfg = config(reference)
    t = cfg["training"]
    tokens_per_step = t["micro_batch_size"] * t["grad_accum"] * cfg["data"]["seq_len"]
    gap = [round(f - s, 4) for f, s in zip(per_seed(reference), per_seed(best_small))]
    return {"tokens_per_param": round(t["steps"] * tokens_per_step / non_embedding_parameters(cfg), 2),
            "steps": t["steps"],
            "epochs": [round(config(n)["training"]["steps"] * tokens_per_step / train_tokens, 2)
                       for n in (reference, best_small)],
            "full": _rate_loss({n: config(n)["optimizer"]["lr"] for n in full}, means, reference),
            "small": _rate_loss({n: config(n)["optimizer"]["lr"] for n in small}, means, best_small),
            "gap": gap, "better": "full model" if all(g < 0 for g in gap) else
            "half-depth model" if all(g > 0 for g in gap) else "mixed over seeds",
            "seeds": seeds}


def _gaps(table: dict) -> tuple[str, list[tuple[float, float]]]:
    """(label, [(tokens per parameter, mean final loss of the full model minus its smaller model's
    trained alone)]) of a crossover table, or of a budget-curve table's small-alone rows."""
    model = table["setting"]["model"]
    label = f"{model['arch'].upper()} {model['layers']} x {model['hidden']}"
    if "gap" in table["rows"][0]:
        return label, [(r["tokens_per_param"], sum(r["gap"]) / len(r["gap"])) for r in table["rows"]]
    return label + " (1 layer alone)", [(r["tokens_per_param"], -sum(r["loss_gap"]) / len(r["loss_gap"]))
                                        for r in table["rows"] if r["variant"].startswith(CONTROL)]


def crossover_plot(tables: list[dict], path: Path) -> None:
    """The full model's final loss minus its half-depth model's trained alone on the same FLOPs,
    against tokens per parameter, one line per shape: above zero the smaller model is the better
    use of the FLOPs; the crossover is where a line falls below zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for table in tables:
        label, points = _gaps(table)
        ax.plot([t for t, _ in points], [g for _, g in points], marker="o", label=label)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("tokens per non-embedding parameter (full model)")
    ax.set_ylabel("full minus half-depth final loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["gpt", "bert"], help="the architecture of the bench directories")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--command", default="", help="the command line that produced the bench outputs")
    parser.add_argument("--only", type=lambda text: text.split(","), metavar="A,B,..",
                        help="rows of these variants only (default: every variant outside the baseline sweep)")
    parser.add_argument("--date", default="2026-12-06", help="the date the bench outputs were measured")
    parser.add_argument("--wallclock", action="store_true",
                        help="with the wall-clock saving: for benches that ran one run at a time on an otherwise idle "
                             "machine (without it the column is left out: wall-clock under shared load is noise)")
    parser.add_argument("--plot", action="store_true", help="instead: draw the curve of the results tables (JSON) given "
                                                 "in place of bench directories into --out, a PNG")
    parser.add_argument("--trend", action="store_true", help="instead: fit k against log budget over the results "
                                                  "tables (JSON) given in place of bench directories into --out, a "
                                                  "results table")
    parser.add_argument("--crossover", type=Path, metavar="DATA",
                        help="instead: the crossover table (the full model's reference against the best small-alone* "
                             "variant per budget) of the bench directories, trained on the prepared corpus DATA; with "
                             "--plot, the crossover plot of crossover and budget-curve tables")
    parser.add_argument("bench_dirs", nargs="*", type=Path)
    args = parser.parse_args()
    if args.plot:
        tables = [json.loads(p.read_text()) for p in args.bench_dirs]
        if args.crossover:
            crossover_plot(tables, args.out)
        else:
            plot(tables, args.out)
        return
    if args.trend:
        tables = [json.loads(p.read_text()) for p in args.bench_dirs]
        args.out.write_text(json.dumps({
            "title": "Issue 58's budget curve: the compute multiplier k fitted against log tokens per parameter, "
                     "and read at the budgets users train at (an extrapolation from one small shape)",
            "setting": tables[0]["setting"], "columns": TREND_COLUMNS, "rows": trend_rows(tables),
            "source": ", ".join(str(p) for p in args.bench_dirs)}, indent=1) + "\n")
        return
    if args.arch is None:
        parser.error("--arch: give the architecture of the bench directories (gpt or bert)")
    import deepspeed
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    model, tokens = _shape(args.bench_dirs[0])
    if args.crossover:
        manifest = json.loads((args.crossover / "manifest.json").read_text())
        train_tokens = manifest["splits"]["train"]["tokens"]
        args.out.write_text(json.dumps({
            "title": f"The crossover, {args.arch.upper()} ({model.num_layers} x {model.hidden_size}, {tokens:,} tokens "
                     f"per step): the full model against its half-depth model trained alone on the same FLOPs, "
                     f"each the best of its own learning-rate sweep (warmup-stable-decay to zero)",
            "setting": {"machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, shared with other work",
                        "versions": f"msds {commit}, torch {torch.__version__}, deepspeed {deepspeed.__version__}",
                        "command": args.command, "date": args.date,
                        "model": {"arch": model.arch, "layers": model.num_layers, "hidden": model.hidden_size}},
            "columns": CROSSOVER_COLUMNS, "rows": [crossover_row(d, train_tokens) for d in args.bench_dirs],
            "source": ", ".join(str(d / "results.json") for d in args.bench_dirs)}, indent=1) + "\n")
        return
    table = {"title": f"The budget curve, {args.arch.upper()} ({model.num_layers} x {model.hidden_size}, {tokens:,} "
                      f"tokens per step): the V-cycle against the best of a schedule x learning-rate sweep at each "
                      f"budget",
             "setting": {"machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, " + (
                                    "one run at a time, nothing else running" if args.wallclock else
                                    "shared with other work (wall-clock savings are noisy)"),
                         "versions": f"msds {commit}, torch {torch.__version__}, deepspeed {deepspeed.__version__}",
                         "command": args.command, "date": args.date,
                         # read by msds plan (msds/plan/regime.py) to place a run among the measured budgets
                         "model": {"arch": model.arch, "layers": model.num_layers, "hidden": model.hidden_size}},
             "columns": [c for c in COLUMNS if args.wallclock or c is not WALLCLOCK],
             "rows": [row for d in args.bench_dirs for row in rows(d, args.only)],
             "source": ", ".join(str(d / "results.json") for d in args.bench_dirs)}
    args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
