"""The compute multiplier: how many times the reference's FLOPs the baseline needs to match a variant.

With `reference_budgets: [1.5, 2]` in a bench config, the reference (the best member of the
baseline sweep) is also trained at 1.5x and 2x its steps, each run with its own full schedule (its
warmup as tuned, its decay over its own length). Its final validation losses at 1x, 1.5x and 2x
make a curve of loss against log FLOPs; a variant's final loss placed on it, interpolating linearly
in log FLOPs between neighbouring points, gives k: the baseline needs k x the FLOPs of its 1x run
to end where the variant ended. Factors below 1 (`[0.5, 0.75, 1.5, 2]`) extend the curve
downwards, so that a variant that ends above the 1x run still gets a number (k < 1: the variant is
worth less than the baseline's FLOPs it spent). A saving to the target depends on where the
reference's schedule happens to end; k compares finished runs only. k outside the measured range is
not extrapolated: a variant that ends above the smallest budget's run is "< {smallest}" ("< 1"
without factors below 1), one below the largest budget's run "> {largest}".
"""
from __future__ import annotations

import copy
import math
import statistics
from pathlib import Path

from msds.config import ConfigError, RunConfig
from msds.plan import build_plan
from msds.train.metrics import read_metrics


def check_factors(bench: dict) -> list[float]:
    factors = bench.get("reference_budgets") or []
    if not isinstance(factors, list) or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0
                                                and f != 1 for f in factors) or len(set(factors)) != len(factors):
        raise ConfigError(f"reference_budgets: expected a list of distinct positive budget factors other than 1 "
                          f"(e.g. [0.5, 1.5, 2]), got {factors!r}")
    return sorted(float(f) for f in factors)


def run_name(reference: str, factor: float) -> str:
    return f"{reference}-budget{factor:g}x"


def budget_configs(reference: RunConfig, reference_name: str, factors: list[float],
                   seed_dir: Path) -> dict[str, RunConfig]:
    """The reference's config at each budget factor: its steps scaled (rounded), everything else
    as tuned, in <seed_dir>/<reference>-budget<f>x."""
    configs = {}
    for factor in factors:
        cfg = copy.deepcopy(reference)
        name = run_name(reference_name, factor)
        cfg.run_dir = str(seed_dir / name)
        cfg.training.steps = round(reference.training.steps * factor)
        try:
            configs[name] = build_plan(cfg, 1).config
        except ConfigError as exc:
            raise ConfigError(f"reference_budgets: the reference at {factor:g}x its steps: {exc}") from exc
    return configs


def multiplier(curve: list[tuple[float, float]], loss: float, base_flops: float) -> dict:
    """k for a final loss `loss` on `curve`, [(FLOPs, final loss)] of the reference at 1x
    (`base_flops`) and the other budgets: {"k": number or None, "text": "1.37" or "< 1" or "> 2"}.
    The first segment (in FLOPs order) whose losses bracket `loss` is interpolated in log FLOPs."""
    curve = sorted(curve)
    smallest, largest = curve[0][0] / base_flops, curve[-1][0] / base_flops
    if loss >= curve[0][1]:
        return {"k": None, "text": f"< {smallest:.2g}"}
    for (f0, l0), (f1, l1) in zip(curve, curve[1:]):
        if l1 <= loss <= l0 or l0 <= loss <= l1:
            fraction = (l0 - loss) / (l0 - l1) if l0 != l1 else 0.0
            log_flops = math.log(f0) + fraction * (math.log(f1) - math.log(f0))
            k = math.exp(log_flops) / base_flops
            return {"k": k, "text": f"{k:.2f}"}
    return {"k": None, "text": f"> {largest:g}"}


def multipliers(seed_dirs: dict[str, Path], per_seed: dict, budgets: dict[str, dict[str, RunConfig]],
                names: list[str], factors: list[float]) -> dict:
    """Each variant's k in every seed (per_seed: label -> saving.SeedResult), on the curve of the
    reference's final loss at 1x and at each budget factor (the `budgets` runs of that seed)."""
    curves, ks = {}, {}
    for label, seed in per_seed.items():
        reference = seed.variants[seed.reference]
        finals = [read_metrics(seed_dirs[label] / name, "eval")[-1] for name in budgets[label]]
        curves[label] = [(reference.total_flops, reference.final_val_loss)] + \
            [(last["flops"], last["val_loss"]) for last in finals]
        ks[label] = {name: multiplier(curves[label], seed.variants[name].final_val_loss, reference.total_flops)
                     for name in names}
    return {"factors": factors, "curves": curves, "variants": aggregate(ks, names)}


def aggregate(per_seed: dict[str, dict[str, dict]], names: list[str]) -> dict[str, dict]:
    """Per variant: each seed's k, and the mean and worst (smallest) when every seed has a number."""
    out = {}
    for name in names:
        values = [per_seed[s][name] for s in per_seed]
        numbers = [v["k"] for v in values if v["k"] is not None]
        complete = len(numbers) == len(values)
        out[name] = {"per_seed": [v["text"] for v in values],
                     "mean": statistics.fmean(numbers) if complete else None,
                     "worst": min(numbers) if complete else None}
    return out


def text(entry: dict) -> str:
    """'1.42 / 1.31' (mean / worst), else the seeds' values."""
    if entry["mean"] is not None:
        return f"{entry['mean']:.2f} / {entry['worst']:.2f}"
    return "per seed " + ", ".join(entry["per_seed"])


def markdown(m: dict) -> str:
    lines = [f"Compute multiplier: the reference trained again at {', '.join(f'{f:g}x' for f in m['factors'])} its "
             f"steps (each with its own full schedule); k = the FLOPs the baseline needs to end at a variant's final "
             f"loss, in multiples of its 1x run (interpolated in log FLOPs, not extrapolated).", "",
             "| variant | k, mean / worst | per seed |", "|---|---|---|"]
    lines += [f"| {name} | {text(entry)} | {', '.join(entry['per_seed'])} |" for name, entry in m["variants"].items()]
    lines += ["", "Reference curve per seed (FLOPs: final val loss): " + "; ".join(
        f"{seed} " + ", ".join(f"{f:.3e}: {loss:.4f}" for f, loss in curve) for seed, curve in m["curves"].items())]
    return "\n".join(lines) + "\n"
