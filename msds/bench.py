"""`msds bench`: the baseline and its V-cycle variants side by side, and the saving at equal quality.

    msds bench --config recipes/bench-gpt-cpu.yaml --out bench_out/gpt [key=value ...]

A bench config has a `base` run config (model, data, optimizer, training, logging, ...) shared by
every run, and `variants`: name -> overrides of `base`. The variant named `baseline` is the
reference. Every variant trains on the same data order with the same tokens per step and the same
evaluation points (the evaluation batches and interval come from `base`).

For each variant the report gives the final validation loss and the FLOPs and wall-clock at which
its validation loss first reaches the baseline's final validation loss (linearly interpolated
between evaluations), the saving = 1 - that cost / the baseline's cost, and the time spent in
transitions. Wall-clock is training time: steps plus transitions, evaluations excluded (they are
the same for every variant). Outputs: results.json, results.md, loss_vs_flops.png, loss_vs_time.png.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch.distributed as dist

from msds.config import MODEL_PRESETS, ConfigError, RunConfig, from_dict, load_yaml, parse_overrides, set_by_path
from msds.train.metrics import read_metrics

BASELINE = "baseline"


def _merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def variant_configs(bench: dict, out_dir: Path, overrides: list[str]) -> dict[str, RunConfig]:
    """Validated run configs of every variant (errors name `variants.<name>.<field>`)."""
    unknown = sorted(set(bench) - {"base", "variants"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key in a bench config; it has `base` and `variants`")
    base = bench.get("base") or {}
    for key, value in parse_overrides(overrides):
        set_by_path(base, key, value)
    variants = bench.get("variants") or {}
    if BASELINE not in variants:
        raise ConfigError(f"variants.{BASELINE}: a bench needs a variant named {BASELINE!r} (it may be empty)")
    configs = {}
    for name, changes in variants.items():
        data = _merge(base, changes or {})
        data["run_dir"] = str(out_dir / name)
        model = data.get("model") or {}
        preset = model.pop("preset", None)
        if preset is not None:
            if preset not in MODEL_PRESETS:
                raise ConfigError(f"variants.{name}.model.preset: unknown size {preset!r}")
            data["model"] = {**MODEL_PRESETS[preset], **model}
        try:
            configs[name] = from_dict(RunConfig, data).validate()
        except ConfigError as exc:
            raise ConfigError(f"variants.{name}.{exc}") from exc
    reference = configs[BASELINE]
    for name, cfg in configs.items():
        tokens = (cfg.training.micro_batch_size * cfg.training.grad_accum, cfg.data.seq_len)
        if tokens != (reference.training.micro_batch_size * reference.training.grad_accum, reference.data.seq_len):
            raise ConfigError(f"variants.{name}: tokens per step differ from the baseline's; a fair comparison "
                              f"keeps batch size and sequence length")
        if (cfg.logging.eval_interval, cfg.logging.eval_batches, cfg.data.path, cfg.data.seed) != \
                (reference.logging.eval_interval, reference.logging.eval_batches, reference.data.path, reference.data.seed):
            raise ConfigError(f"variants.{name}: data or evaluation settings differ from the baseline's")
    return configs


def first_crossing(evals: list[dict], target: float, key: str) -> float | None:
    """The `key` value (flops or train_seconds) at which val_loss first reaches `target`,
    interpolated linearly between the two evaluations around the crossing."""
    previous = None
    for record in evals:
        if record["val_loss"] <= target:
            if previous is None:
                return record[key]
            span = previous["val_loss"] - record["val_loss"]
            fraction = (previous["val_loss"] - target) / span if span > 0 else 1.0
            return previous[key] + fraction * (record[key] - previous[key])
        previous = record
    return None


def value_at(evals: list[dict], key: str, x: float) -> float | None:
    """val_loss at `key` = x, interpolated linearly between evaluations (None outside the curve)."""
    for a, b in zip(evals, evals[1:]):
        if a[key] <= x <= b[key]:
            fraction = (x - a[key]) / (b[key] - a[key]) if b[key] > a[key] else 1.0
            return a["val_loss"] + fraction * (b["val_loss"] - a["val_loss"])
    return None


def summarize(out_dir: Path, names: list[str]) -> dict:
    runs = {name: {"evals": read_metrics(out_dir / name, "eval"),
                   "transitions": read_metrics(out_dir / name, "transition")} for name in names}
    baseline_evals = runs[BASELINE]["evals"]
    target = baseline_evals[-1]["val_loss"]
    base_flops, base_seconds = baseline_evals[-1]["flops"], baseline_evals[-1]["train_seconds"]
    results = {"target_val_loss": target, "variants": {}}
    for name in names:
        evals = runs[name]["evals"]
        flops_at = first_crossing(evals, target, "flops")
        seconds_at = first_crossing(evals, target, "train_seconds")
        results["variants"][name] = {
            "final_val_loss": evals[-1]["val_loss"],
            "total_flops": evals[-1]["flops"],
            "total_seconds": evals[-1]["train_seconds"],
            "reached_target": flops_at is not None,
            "flops_to_target": flops_at,
            "seconds_to_target": seconds_at,
            "flops_saving": None if flops_at is None else 1 - flops_at / base_flops,
            "wallclock_saving": None if seconds_at is None else 1 - seconds_at / base_seconds,
            # What the baseline had reached with this variant's whole compute: the comparison at
            # equal cost when the variant does not reach the target.
            "baseline_val_loss_at_same_flops": value_at(baseline_evals, "flops", evals[-1]["flops"]),
            "transition_seconds": sum(t["seconds"] for t in runs[name]["transitions"]),
            "transitions": [{k: t[k] for k in ("step", "direction", "from_level", "to_level", "seconds",
                                                "loss_before", "loss_after")} for t in runs[name]["transitions"]],
            "evals": [{k: e[k] for k in ("step", "flops", "train_seconds", "val_loss")} for e in evals],
        }
    return results


def markdown_table(results: dict) -> str:
    def pct(x):
        return "not reached" if x is None else f"{100 * x:.1f}%"

    lines = [f"Target: the baseline's final validation loss, {results['target_val_loss']:.4f}.", "",
             "| variant | final val loss | baseline's val loss at the same FLOPs | total FLOPs | FLOPs to target | "
             "wall-clock to target (s) | FLOPs saving | wall-clock saving | transitions (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["variants"].items():
        flops = "-" if r["flops_to_target"] is None else f"{r['flops_to_target']:.3e}"
        secs = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        same = "-" if r["baseline_val_loss_at_same_flops"] is None else f"{r['baseline_val_loss_at_same_flops']:.4f}"
        lines.append(f"| {name} | {r['final_val_loss']:.4f} | {same} | {r['total_flops']:.3e} | {flops} | {secs} | "
                     f"{pct(r['flops_saving'])} | {pct(r['wallclock_saving'])} | {r['transition_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, filename in (("flops", "cumulative training FLOPs", "loss_vs_flops.png"),
                                 ("train_seconds", "training wall-clock (s)", "loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, r in results["variants"].items():
            xs = [e[key] for e in r["evals"]]
            ys = [e["val_loss"] for e in r["evals"]]
            line, = ax.plot(xs, ys, marker=".", label=name)
            for t in r["transitions"]:   # mark each transition on the variant's own curve
                at = next((e for e in r["evals"] if e["step"] >= t["step"]), None)
                if at is not None:
                    ax.axvline(at[key], color=line.get_color(), alpha=0.25, linestyle="--")
        ax.axhline(results["target_val_loss"], color="black", linewidth=0.8, linestyle=":",
                   label="baseline final val loss")
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.set_title("validation loss (dashed: level transitions)")
        ax.legend()
        ax.grid(alpha=0.3)
        top = max(e["val_loss"] for r in results["variants"].values() for e in r["evals"][1:] or r["evals"])
        ax.set_ylim(results["target_val_loss"] - 0.3, top + 0.1)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=120)
        plt.close(fig)
        paths.append(out_dir / filename)
    return paths


def run_bench(config_path: str | Path, out_dir: str | Path, overrides: list[str] = (),
              only: list[str] | None = None) -> dict:
    """Train every variant (or those in `only`; reusing finished ones), then write results.json,
    results.md and plots."""
    from msds.train.loop import train

    out_dir = Path(out_dir)
    configs = variant_configs(load_yaml(config_path), out_dir, list(overrides))
    if only:
        unknown = sorted(set(only) - set(configs))
        if unknown:
            raise ConfigError(f"--only: {unknown[0]!r} is not a variant of {config_path}; its variants: "
                              f"{', '.join(configs)}")
        if BASELINE not in only:
            raise ConfigError(f"--only: include {BASELINE}; every variant is measured against it")
        configs = {name: cfg for name, cfg in configs.items() if name in only}
    for name, cfg in configs.items():
        done = out_dir / name / "summary.json"
        # What the run computes; where it was written does not count (a bench directory may move).
        record = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(cfg))).items() if k != "run_dir"}
        if done.is_file() and json.loads(done.read_text())["config"] == record:
            print(f"bench: {name} already finished in {done.parent}, reusing it", flush=True)
            continue
        print(f"bench: training {name}", flush=True)
        summary = train(cfg)
        if summary.exited_early:
            raise SystemExit(f"bench: {name} stopped early; run the same command again to continue")
        if dist.get_rank() == 0:
            done.write_text(json.dumps({"config": record, "final_val_loss": summary.final_val_loss}))
    if dist.get_rank() != 0:
        return {}
    results = summarize(out_dir, list(configs))
    results["config"] = str(config_path)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(results)
    (out_dir / "results.md").write_text(table)
    plots = plot(results, out_dir)
    print(table)
    print(f"results: {out_dir / 'results.json'}; plots: {', '.join(str(p) for p in plots)}", flush=True)
    return results


def _run(args) -> int:
    run_bench(args.config, args.out, args.overrides, args.only)
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    import argparse

    parser = subparsers.add_parser(name, help=doc, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="bench config (recipes/bench-*.yaml)")
    parser.add_argument("--out", required=True, help="output directory (one run directory per variant)")
    parser.add_argument("--only", nargs="+", metavar="VARIANT", help="train and report only these variants "
                        "(baseline included), e.g. for a second seed of the interesting ones; put key=value "
                        "overrides before --only")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the shared `base` config")
    parser.set_defaults(run=_run)
