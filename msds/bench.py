"""`msds bench`: the baseline and its V-cycle variants side by side, and the saving at equal quality.

    msds bench --config recipes/bench-gpt-cpu.yaml --out bench_out/gpt [--seeds 1 2 3] [key=value ...]

A bench config has a `base` run config (model, data, optimizer, training, logging, ...) shared by
every run, `variants`: name -> overrides of `base` (one must be named `baseline`), and optionally:
- `seeds: [1, 2, 3]` (or `--seeds`): every variant runs once per seed, with `training.seed` and
  `data.seed` set to it (initial weights, dropout, data order and validation batches all change).
  Run directories are <out>/seed<s>/<variant>; without seeds, <out>/<variant> with the config's seeds.
- `baseline_lr_sweep: [0.5, 1, 2, 4]` and `baseline_warmup_sweep: [24, 48]`: the baseline is also
  trained at each factor of its peak learning rate and each warmup length (variants named
  `baseline-lr2x`, `baseline-lr2x-wu48`, ...; the recipe's own setting stays `baseline`). The member
  with the lowest mean final validation loss over the seeds is the *reference*: a saving against an
  untuned baseline is not a saving.
- `baseline_schedule_sweep: [{schedule: cosine, min_lr_ratio: 0.1}, {schedule: linear, min_lr_ratio: 0},
  {schedule: wsd, min_lr_ratio: 0, decay_fraction: 0.2}]`: the sweep's grid also runs over these
  schedules (optimizer.schedule and its fields; names gain e.g. `-linear0`, `-wsd0-d0.2` where the
  schedule is not the baseline's own). The report says whether the reference is an interior optimum
  (along the learning rate and the warmup, where more than one value was swept, both neighbours
  were run and ended worse) and warns loudly when it sits at a grid edge (msds/bench_sweep.py).
- `reference_budgets: [1.5, 2]`: the reference is also trained at these multiples of its steps, each
  with its own full schedule, and each other variant gets its compute multiplier k: the FLOPs the
  baseline needs to end at the variant's final loss, in multiples of its own (msds/bench_multiplier.py).
- `eval: {tasks: [...], ...}` (msds/eval/bench.py, docs/evaluation.md): the reference and every variant
  outside the sweep are evaluated downstream in every seed; results.md shows the scores beside the
  savings and says which variants are at equal quality; the headline then names the largest saving
  among those, and any variant that saves more below the reference's spread. With `at: target` a
  variant's quality is that of its model where it first reaches the target, the point its saving
  is counted at: its run is trained again to that evaluation's step (<run>/at-target), not its end.

Every variant of a seed trains on the same data order with the same tokens per step and the same
evaluation points. For each seed and variant the report gives the final validation loss, the FLOPs
and wall-clock at which its validation loss first reaches the reference's final validation loss of
that seed (linearly interpolated between evaluations; only the full-size model's evaluations count,
not a smaller level's), the saving = 1 - that cost / the reference's
cost, and the time spent in transitions; then, over the seeds, the mean and the worst saving (a
variant that misses the target in any seed has no mean, and says in which seeds it missed).
Wall-clock is training time: steps plus transitions, evaluations excluded (the same for every
variant); it is only comparable between runs made under the same load, such as N runs that
`--jobs N` trains at the same time (each in its own process with 1/N of the threads, its output in
<run>/bench.log; `make demo` uses `--jobs 2`). Each run's summary.json records the load it trained
under (cores, threads, runs at once, the machine's mean 1-minute load average), and the report marks
a wall-clock saving not timed under its reference's load (`same_load`; a run without a record beside
one with a record counts as not), as when a reused reference trained alone and the variant beside
others. Stopping such a bench (SIGTERM, Ctrl-C) stops its runs with a checkpoint. Finished runs of
the same config are reused; a run directory of another config is refused with the field that
differs, since starting it again would resume its checkpoints. Outputs: results.json, results.md,
loss_vs_flops.png, loss_vs_time.png (every seed drawn).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import statistics
import threading
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from msds import bench_multiplier, bench_sweep
from msds.config import (ConfigError, OptimizerConfig, RunConfig, load_yaml, parse_overrides, run_config_from_dict,
                         set_by_path)
from msds.distributed import launched_world_size
from msds.eval.bench import EVAL_POINTS, bench_eval_settings, eval_markdown, evaluate_bench
from msds.eval.run import EvalSettings
from msds.plan import build_plan
from msds.train.metrics import read_metrics

BASELINE = "baseline"
CONFIG_SEEDS = "config"      # the label of a bench run without seeds: the config's own training.seed, data.seed
BENCH_KEYS = ("base", "variants", "seeds", "baseline_lr_sweep", "baseline_warmup_sweep", "baseline_schedule_sweep",
              "reference_budgets", "eval")


def _merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _factor_name(value: float) -> str:
    return f"{value:g}"


def _numbers(bench: dict, key: str, kind: type) -> list:
    values = bench.get(key) or []
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               and v > 0 and (kind is float or v == int(v)) for v in values):
        raise ConfigError(f"{key}: expected a list of positive {'numbers' if kind is float else 'integers'}, "
                          f"got {values!r}")
    return [kind(v) for v in values]


def _base(bench: dict, overrides: list[str], seed: Optional[int]) -> dict:
    """The shared `base` with the command line's overrides and the seed applied."""
    base = copy.deepcopy(bench.get("base") or {})
    for key, value in parse_overrides(overrides):
        set_by_path(base, key, value)
    if seed is not None:
        set_by_path(base, "training.seed", seed)
        set_by_path(base, "data.seed", seed)
    return base


def sweep_grid(bench: dict, overrides: list[str] = ()) -> dict[str, dict]:
    """The baseline sweep (msds/bench_sweep.py): name -> {coords, optimizer} of each member. The grid
    is schedules x learning-rate factors (of the baseline variant's own peak lr) x warmup lengths;
    the recipe's own setting is `baseline`."""
    baseline = _merge(_base(bench, list(overrides), None), (bench.get("variants") or {}).get(BASELINE) or {})
    optimizer = baseline.get("optimizer") or {}
    warmup = optimizer.get("warmup_steps", OptimizerConfig().warmup_steps)
    factors = _numbers(bench, "baseline_lr_sweep", float) or [1.0]
    warmups = _numbers(bench, "baseline_warmup_sweep", int) or [warmup]
    return bench_sweep.grid(bench, optimizer, factors, warmups, BASELINE)


def sweep_variants(bench: dict, overrides: list[str] = ()) -> dict[str, dict]:
    """The baseline sweep: name -> the changes of each member to the baseline variant."""
    return {name: {} if name == BASELINE else {"optimizer": member["optimizer"]}
            for name, member in sweep_grid(bench, overrides).items()}


def bench_seeds(bench: dict, cli_seeds: Optional[list[int]]) -> list[Optional[int]]:
    """The seeds to run: --seeds, else the config's `seeds`, else [None] (the config's own seeds)."""
    seeds = _numbers({"seeds": cli_seeds}, "seeds", int) if cli_seeds else _numbers(bench, "seeds", int)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: {seeds} repeats a seed")
    return list(seeds) or [None]


def variant_configs(bench: dict, out_dir: Path, overrides: list[str], world_size: int = 0,
                    seed: Optional[int] = None) -> dict[str, RunConfig]:
    """Validated run configs of every variant (the baseline sweep first) as run, for one seed (None:
    the config's own); errors name `variants.<name>.<field>`."""
    unknown = sorted(set(bench) - set(BENCH_KEYS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key in a bench config; it has {', '.join(BENCH_KEYS)}")
    base = _base(bench, overrides, seed)
    variants = bench.get("variants") or {}
    if BASELINE not in variants:
        raise ConfigError(f"variants.{BASELINE}: a bench needs a variant named {BASELINE!r} (it may be empty)")
    members = sweep_variants(bench, overrides)
    clash = sorted(set(members) & set(variants) - {BASELINE})
    if clash:
        raise ConfigError(f"variants.{clash[0]}: this name belongs to the baseline sweep; rename the variant")
    baseline = _merge(base, variants[BASELINE] or {})
    runs = {**{name: _merge(baseline, changes) for name, changes in members.items()},
            **{name: _merge(base, changes or {}) for name, changes in variants.items() if name != BASELINE}}
    configs = {}
    for name, data in runs.items():
        data["run_dir"] = str(out_dir / name)
        try:
            configs[name] = build_plan(run_config_from_dict(data), world_size or launched_world_size()).config
        except ConfigError as exc:
            raise ConfigError(f"variants.{name}.{exc}") from exc
    _check_fair(configs)
    return configs


def _check_fair(configs: dict[str, RunConfig]) -> None:
    reference = configs[BASELINE]
    for name, cfg in configs.items():
        tokens = (cfg.training.micro_batch_size * cfg.training.grad_accum, cfg.data.seq_len)
        if tokens != (reference.training.micro_batch_size * reference.training.grad_accum, reference.data.seq_len):
            raise ConfigError(f"variants.{name}: tokens per step differ from the baseline's; a fair comparison "
                              f"keeps batch size and sequence length")
        if (cfg.logging.eval_interval, cfg.logging.eval_batches, cfg.data.path, cfg.data.seed) != \
                (reference.logging.eval_interval, reference.logging.eval_batches, reference.data.path, reference.data.seed):
            raise ConfigError(f"variants.{name}: data or evaluation settings differ from the baseline's")


def crossing_index(evals: list[dict], target: float) -> Optional[int]:
    """The index in `evals` of the first full-size evaluation (level 1) whose val_loss is at or
    below `target`, or None. Evaluations of a smaller level do not count: the run delivers the
    full-size model, and a small model can reach a loss the full-size one has not."""
    return next((i for i, record in enumerate(evals)
                 if record.get("level", 1) == 1 and record["val_loss"] <= target), None)


def first_crossing(evals: list[dict], target: float, key: str) -> float | None:
    """The `key` value (flops or train_seconds) at which the full-size model's val_loss first reaches
    `target` (`crossing_index`), interpolated linearly from the evaluation just before it. No
    interpolation spans a transition: a full-size evaluation that reaches the target right after one
    counts at its own cost."""
    index = crossing_index(evals, target)
    if index is None:
        return None
    record = evals[index]
    previous = evals[index - 1] if index > 0 and evals[index - 1].get("level", 1) == 1 else None
    if previous is None:
        return record[key]
    span = previous["val_loss"] - record["val_loss"]
    fraction = (previous["val_loss"] - target) / span if span > 0 else 1.0
    return previous[key] + fraction * (record[key] - previous[key])


def value_at(evals: list[dict], key: str, x: float) -> float | None:
    """val_loss at `key` = x, interpolated linearly between evaluations (None outside the curve)."""
    for a, b in zip(evals, evals[1:]):
        if a[key] <= x <= b[key]:
            fraction = (x - a[key]) / (b[key] - a[key]) if b[key] > a[key] else 1.0
            return a["val_loss"] + fraction * (b["val_loss"] - a["val_loss"])
    return None


def recorded_load(run_dir: Path) -> Optional[dict]:
    """The load a finished run was timed under, from its summary.json (None for a run of a version
    that did not record it)."""
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()).get("load") if summary.is_file() else None


def same_load(a: Optional[dict], b: Optional[dict]) -> Optional[bool]:
    """Whether two runs' wall-clocks compare: the same cores, threads and runs trained at once, and
    mean load averages within 25% of each other (of 1, on a machine near idle). None when neither
    run has a record (both from a version that kept none); False when only one has."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        return False
    if any(a[k] != b[k] for k in ("cores", "threads", "runs_at_once")):
        return False
    return abs(a["load_average"] - b["load_average"]) <= 0.25 * max(a["load_average"], b["load_average"], 1.0)


def summarize(seed_dir: Path, names: list[str], reference: str = BASELINE) -> dict:
    """One seed: every variant against the reference baseline's final validation loss and cost."""
    runs = {name: {"evals": read_metrics(seed_dir / name, "eval"),
                   "transitions": read_metrics(seed_dir / name, "transition"),
                   "load": recorded_load(seed_dir / name)} for name in names}
    reference_evals = runs[reference]["evals"]
    target = reference_evals[-1]["val_loss"]
    base_flops, base_seconds = reference_evals[-1]["flops"], reference_evals[-1]["train_seconds"]
    results = {"reference": reference, "target_val_loss": target, "variants": {}}
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
            "load": runs[name]["load"],
            "timed_like_reference": same_load(runs[name]["load"], runs[reference]["load"]),
            # What the reference had reached with this variant's whole compute: the comparison at
            # equal cost when the variant does not reach the target.
            "baseline_val_loss_at_same_flops": value_at(reference_evals, "flops", evals[-1]["flops"]),
            "transition_seconds": sum(t["seconds"] for t in runs[name]["transitions"]),
            "transitions": [{k: t[k] for k in ("step", "direction", "from_level", "to_level", "seconds",
                                                "loss_before", "loss_after")} for t in runs[name]["transitions"]],
            "evals": [{k: e[k] for k in ("step", "flops", "train_seconds", "val_loss")} for e in evals],
        }
    return results


def best_baseline(seed_dirs: list[Path], members: list[str]) -> tuple[str, dict[str, float]]:
    """The sweep member with the lowest mean final validation loss over the seeds, and every
    member's mean."""
    means = {name: statistics.fmean(read_metrics(d / name, "eval")[-1]["val_loss"] for d in seed_dirs)
             for name in members}
    return min(means, key=means.get), means


def _spread(values: list[Optional[float]], worst) -> dict:
    known = [v for v in values if v is not None]
    complete = len(known) == len(values)
    return {"mean": statistics.fmean(known) if complete else None,
            "worst": worst(known) if complete else None, "per_seed": values}


def aggregate(per_seed: dict[str, dict], names: list[str]) -> dict:
    """Mean and worst over seeds of each variant's final loss and savings."""
    out = {}
    for name in names:
        records = [per_seed[s]["variants"][name] for s in per_seed]
        out[name] = {"final_val_loss": {**_spread([r["final_val_loss"] for r in records], max),
                                        "best": min(r["final_val_loss"] for r in records)},
                     "flops_saving": _spread([r["flops_saving"] for r in records], min),
                     "wallclock_saving": _spread([r["wallclock_saving"] for r in records], min),
                     "missed_in_seeds": [s for s, r in zip(per_seed, records) if not r["reached_target"]],
                     "not_timed_like_reference_in_seeds": [s for s, r in zip(per_seed, records)
                                                           if r["timed_like_reference"] is False]}
    return out


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def seed_table(results: dict) -> str:
    lines = [f"Target: the reference ({results['reference']}) final validation loss, {results['target_val_loss']:.4f}.",
             "",
             "| variant | final val loss | reference's val loss at the same FLOPs | total FLOPs | FLOPs to target | "
             "wall-clock to target (s) | FLOPs saving | wall-clock saving | transitions (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["variants"].items():
        flops = "-" if r["flops_to_target"] is None else f"{r['flops_to_target']:.3e}"
        secs = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        same = "-" if r["baseline_val_loss_at_same_flops"] is None else f"{r['baseline_val_loss_at_same_flops']:.4f}"
        reach = (lambda x: "not reached" if x is None else _pct(x))
        lines.append(f"| {name} | {r['final_val_loss']:.4f} | {same} | {r['total_flops']:.3e} | {flops} | {secs} | "
                     f"{reach(r['flops_saving'])} | {reach(r['wallclock_saving'])}{_load_mark(r)} | "
                     f"{r['transition_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def _load_mark(run: dict) -> str:
    """The mark on a wall-clock saving whose run was not timed under its reference's load."""
    return " (not timed like the reference)" if run["timed_like_reference"] is False else ""


def _load_note(variant: dict) -> str:
    """The note on a wall-clock mean that sets runs of different loads against each other."""
    seeds = variant["not_timed_like_reference_in_seeds"]
    return f" (not timed under the reference's load in seed(s) {', '.join(seeds)})" if seeds else ""


def _largest_saving(pool: dict) -> str:
    return max(pool, key=lambda n: pool[n]["flops_saving"]["mean"])


def _where_evaluated(results: dict) -> str:
    return " (the variants' models evaluated where they reach the target)" \
        if results.get("eval", {}).get("at") == "target" else ""


def headline(results: dict) -> str:
    """One line: the best variant (highest mean FLOPs saving; else the lowest mean final loss) against
    the reference, with its mean and worst saving or by how much it missed. With a downstream
    evaluation, the best is chosen among the variants at equal quality, and a variant that saves more
    without it is named with the tasks it falls short on: a saving at lower quality is not the result."""
    others = {n: a for n, a in results["variants"].items() if n not in results["baseline_sweep"]}
    if not others:
        return f"reference: {results['reference']} (no other variant)"
    reached = {n: a for n, a in others.items() if a["flops_saving"]["mean"] is not None}
    targets = [s["target_val_loss"] for s in results["per_seed"].values()]
    if reached:
        verdicts = results["eval"]["variants"] if "eval" in results else {}
        short = (lambda n: ", ".join(verdicts[n]["worse_than_reference_spread"]))
        equal = {n: a for n, a in reached.items() if n not in verdicts or verdicts[n]["equal_quality"]}
        more = _largest_saving(reached)
        if not equal:
            return (f"no variant that reaches the {results['reference']} final validation loss is at equal "
                    f"downstream quality; the largest saving, {more}'s {_pct(reached[more]['flops_saving']['mean'])} "
                    f"of the FLOPs, falls short on {short(more)}{_where_evaluated(results)}")
        name = _largest_saving(equal)
        a = equal[name]
        line = (f"{name} reaches the {results['reference']} final validation loss with "
                f"{_pct(a['flops_saving']['mean'])} fewer FLOPs (worst seed {_pct(a['flops_saving']['worst'])}) "
                f"and {_pct(a['wallclock_saving']['mean'])} less wall-clock (worst {_pct(a['wallclock_saving']['worst'])})"
                f"{_load_note(a)}, "
                f"over {len(targets)} seed(s)" + (", at equal downstream quality" if verdicts else "")
                + _where_evaluated(results))
        if more != name:
            line += (f"; {more} saves more ({_pct(reached[more]['flops_saving']['mean'])} of the FLOPs) but falls "
                     f"short on {short(more)}")
        return line
    name = min(others, key=lambda n: others[n]["final_val_loss"]["mean"])
    return (f"no variant reaches the {results['reference']} final validation loss in every seed: the closest, "
            f"{name}, ends at {others[name]['final_val_loss']['mean']:.4f} (mean) vs "
            f"{sum(targets) / len(targets):.4f}; missed in seed(s) {', '.join(others[name]['missed_in_seeds'])}")


def markdown(results: dict) -> str:
    """The summary over seeds, then one table per seed."""
    seeds = list(results["per_seed"])
    lines = [f"Reference: `{results['reference']}` (lowest mean final validation loss of the baseline sweep: "
             + ", ".join(f"{n} {v:.4f}" for n, v in results["baseline_sweep"].items()) + "). Seeds: "
             + ("the config's own (training.seed, data.seed)" if seeds == [CONFIG_SEEDS] else ", ".join(seeds)) + ".",
             "",
             "| variant | final val loss, mean (best..worst) | FLOPs saving, mean / worst | wall-clock saving, mean / worst | "
             "missed the target in seeds |", "|---|---|---|---|---|"]
    for name, a in results["variants"].items():
        loss = a["final_val_loss"]
        lines.append(f"| {name} | {loss['mean']:.4f} ({loss['best']:.4f}..{loss['worst']:.4f}) | "
                     f"{_pct(a['flops_saving']['mean'])} / {_pct(a['flops_saving']['worst'])} | "
                     f"{_pct(a['wallclock_saving']['mean'])} / {_pct(a['wallclock_saving']['worst'])}"
                     f"{_load_note(a)} | "
                     f"{', '.join(a['missed_in_seeds']) or 'none'} |")
    if "sweep_check" in results:          # results.json of an earlier version has none
        lines += ["", bench_sweep.markdown(results["sweep_check"]).rstrip("\n")]
    if "multiplier" in results:
        lines += ["", bench_multiplier.markdown(results).rstrip("\n")]
    for seed in seeds:
        title = "### runs" if seed == CONFIG_SEEDS else f"### seed {seed}"
        lines += ["", title, "", seed_table(results["per_seed"][seed])]
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = ["-", "--", ":", "-."]
    paths = []
    for key, label, filename in (("flops", "cumulative training FLOPs", "loss_vs_flops.png"),
                                 ("train_seconds", "training wall-clock (s)", "loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(8, 5))
        colors = {}
        for i, (seed, per_seed) in enumerate(results["per_seed"].items()):
            for name, r in per_seed["variants"].items():
                kwargs = {"color": colors[name]} if name in colors else {}
                line, = ax.plot([e[key] for e in r["evals"]], [e["val_loss"] for e in r["evals"]],
                                linestyle=styles[i % len(styles)], marker=".", markersize=3,
                                label=name if name not in colors else None, **kwargs)
                colors.setdefault(name, line.get_color())
            ax.axhline(per_seed["target_val_loss"], color="black", linewidth=0.8, linestyle=styles[i % len(styles)])
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.set_title("validation loss; one line style per seed, black: the reference's final loss")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        finals = [r["final_val_loss"] for s in results["per_seed"].values() for r in s["variants"].values()]
        tops = [r["evals"][1]["val_loss"] for s in results["per_seed"].values() for r in s["variants"].values()
                if len(r["evals"]) > 1]
        ax.set_ylim(min(finals) - 0.2, max(tops or finals) + 0.1)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=120)
        plt.close(fig)
        paths.append(out_dir / filename)
    return paths


def _with_new_fields(stored: dict, defaults: dict) -> dict:
    """A record written before some config fields existed, with those fields at their defaults:
    every field added since keeps, at its default, the behaviour from before it (e.g.
    optimizer.schedule: cosine), so an earlier run stays reusable."""
    out = dict(stored)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _with_new_fields(out[key], value)
    return out


def _computes_the_same(stored: dict, record: dict) -> bool:
    """Whether a finished run's config record and a new one train the same run. A run without
    multi-level training reads nothing of its `multilevel` section, so a changed default there
    (e.g. phase_warmup_steps) leaves a finished baseline reusable."""
    def used(config: dict) -> dict:
        return config if config["multilevel"]["enabled"] else {k: v for k, v in config.items() if k != "multilevel"}
    return used(stored) == used(record)


def _first_difference(stored: dict, record: dict, prefix: str = "") -> str:
    """The first dotted field whose value differs between two config records, with both values."""
    for key in sorted(set(stored) | set(record)):
        old, new = stored.get(key), record.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            found = _first_difference(old, new, f"{prefix}{key}.")
            if found:
                return found
        elif old != new:
            return f"{prefix}{key}: {old!r} there, {new!r} now"
    return ""


def _stored_record(run_dir: Path) -> Optional[tuple[dict, bool]]:
    """What a run directory says it computes, and whether it finished: a finished run's summary.json,
    else the config.yaml a started run wrote (its checkpoints are what a new start would resume);
    fields added to the config since, at their defaults."""
    done, started = run_dir / "summary.json", run_dir / "config.yaml"
    defaults = _config_record(RunConfig())
    if done.is_file():
        return _with_new_fields(json.loads(done.read_text())["config"], defaults), True
    if started.is_file():
        record = json.loads(json.dumps(load_yaml(started)))
        return _with_new_fields({k: v for k, v in record.items() if k != "run_dir"}, defaults), False
    return None


def _config_record(cfg: RunConfig) -> dict:
    """What a run computes, as JSON; where it was written does not count (a bench directory may move)."""
    return {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(cfg))).items() if k != "run_dir"}


def _pending(configs: dict[str, RunConfig], seed_dir: Path) -> list[tuple[str, RunConfig, dict]]:
    """The runs of a seed still to train: those without a summary.json of the same config. A run
    directory of another config is refused, not trained again: the trainer would resume its
    checkpoints, so the old run would be reported under the new config."""
    pending = []
    for name, cfg in configs.items():
        record = _config_record(cfg)
        stored = _stored_record(seed_dir / name)
        if stored is not None and not _computes_the_same(stored[0], record):
            raise ConfigError(f"variants.{name}: {seed_dir / name} {'finished' if stored[1] else 'started'} with "
                              f"another config ({_first_difference(stored[0], record)}); a new start would resume "
                              f"its checkpoints, not train this config: move that directory away (or bench into "
                              f"another --out) to train it, or restore the config to reuse it")
        if stored is not None and stored[1]:
            print(f"bench: {cfg.run_dir} already finished, reusing it", flush=True)
        else:
            pending.append((name, cfg, record))
    return pending


class _LoadWatch:
    """The machine's load while a run trains: its 1-minute load average (every process on the
    machine, not only this bench's), sampled every 30 s by a daemon thread and once at the end."""

    def __init__(self):
        self.samples: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(30):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "_LoadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])


def _train_one(name: str, cfg: RunConfig, record: dict, runs_at_once: int = 1) -> None:
    """One run, and its summary.json: the config it computed, its final loss and the load it was
    timed under (threads, runs the bench trained at once, the machine's mean load average), which
    the report compares before it sets two wall-clocks against each other. A run resumed after a
    stop records the load of its last start only: its wall-clock spans every start."""
    import torch

    from msds.train.loop import train

    with _LoadWatch() as watch:
        summary = train(cfg)
    if summary.exited_early:
        raise SystemExit(f"bench: {name} stopped early; run the same command again to continue")
    if dist.get_rank() == 0:
        load = {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "runs_at_once": runs_at_once,
                "load_average": round(statistics.fmean(watch.samples), 2)}
        (Path(cfg.run_dir) / "summary.json").write_text(
            json.dumps({"config": record, "final_val_loss": summary.final_val_loss, "load": load}))


def _train_in_child(work, name: str, cfg: RunConfig, record: dict, threads: int, runs_at_once: int,
                    log: str) -> None:
    """One run (`work`: `_train_one` or `_train_to_target`) in a worker process of `--jobs`: its own
    share of the cores, its output in its log."""
    import sys

    import torch

    torch.set_num_threads(threads)
    # Each run is a one-process job of its own: drop the launcher variables the parent may hold (a
    # one-process launcher's, or those an earlier in-process run set), or they would name one group.
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(variable, None)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        work(name, cfg, record, runs_at_once)


def _last_line(path: Path, starts: tuple[str, ...] = ("step", "eval")) -> str:
    """The last line of a run's output that starts with one of `starts` ("" for any line)."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return next((line for line in reversed(lines) if line.strip() and line.startswith(starts)), "")


def _stop(running: dict) -> None:
    """Send each running child its `training.exit_signal`, as a preemption would (a checkpoint after
    its current step; terminated if it has none), and wait for it to exit."""
    import signal

    for process, (cfg, _) in running.items():
        try:
            if cfg.training.exit_signal:
                os.kill(process.pid, getattr(signal, cfg.training.exit_signal))
            else:
                process.terminate()
        except ProcessLookupError:    # it exited on its own meanwhile (e.g. on the same Ctrl-C)
            pass
    for process in running:
        process.join()


def _train_concurrently(runs: list[tuple[str, RunConfig, dict]], jobs: int, work) -> None:
    """Train `runs` `jobs` at a time, each in its own process with 1/jobs of the threads (side by side
    on the same cores, so their wall-clock stays comparable); every minute, each running job's
    latest progress line. If one fails, or the bench itself is stopped (SIGTERM, Ctrl-C), the
    running ones get their `training.exit_signal` (a checkpoint after the current step), so that
    running the command again continues them and no run is left training on its own."""
    import multiprocessing
    import multiprocessing.connection
    import signal
    import time

    import torch

    def stopped(signum, _frame):
        raise SystemExit(f"bench: stopped by {signal.Signals(signum).name}; the running runs were sent "
                         "training.exit_signal (a checkpoint after their current step); run the same command "
                         "again to continue them")

    threads = max(1, torch.get_num_threads() // jobs)
    spawn = multiprocessing.get_context("spawn")
    queue, running, started = list(runs), {}, time.monotonic()
    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        while queue or running:
            while queue and len(running) < jobs:
                name, cfg, record = queue.pop(0)
                log = Path(cfg.run_dir) / "bench.log"
                process = spawn.Process(target=_train_in_child, args=(work, name, cfg, record, threads, jobs, str(log)))
                process.start()
                running[process] = (cfg, log)
                print(f"bench: training {cfg.run_dir} ({threads} thread(s); its output goes to {log})", flush=True)
            ready = multiprocessing.connection.wait([process.sentinel for process in running], timeout=60)
            # A ready sentinel means the child is exiting, not yet reaped (its exitcode can still read
            # None): join it, or this loop would spin on it printing progress lines.
            for process in [p for p in running if p.sentinel in ready]:
                process.join()
                cfg, log = running.pop(process)
                if process.exitcode != 0:
                    raise SystemExit(f"bench: {cfg.run_dir} failed (exit code {process.exitcode}): "
                                     f"{_last_line(log, ('',)) or 'no message'}; its output: {log}. The other "
                                     "runs were sent training.exit_signal (a checkpoint after their current step); "
                                     "run the same command again to continue them")
                print(f"bench: finished {cfg.run_dir}", flush=True)
            minutes = (time.monotonic() - started) / 60
            for cfg, log in running.values():
                print(f"bench: [{minutes:.1f} min] {cfg.run_dir}: {_last_line(log) or 'starting'}", flush=True)
    except BaseException:
        _stop(running)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train_runs(runs: list[tuple[str, RunConfig, dict]], jobs: int, work=_train_one) -> None:
    """`work` each run: one after the other, or `jobs` at a time."""
    if jobs == 1:
        for name, cfg, record in runs:
            print(f"bench: training {cfg.run_dir}", flush=True)
            work(name, cfg, record)
    elif runs:
        _train_concurrently(runs, jobs, work)


def _train_missing(configs: dict[str, dict[str, RunConfig]], seed_dirs: dict[str, Path], jobs: int) -> None:
    """Train every run (seed label -> variant -> config) that has not finished."""
    _train_runs([run for label, seed_configs in configs.items() for run in _pending(seed_configs, seed_dirs[label])],
                jobs)


# -- each variant's model where it first reaches the target ------------------------------------

AT_TARGET = "at-target"           # <run_dir>/at-target: the run again, stopped at its target step
AT_TARGET_FILE = "at_target.json"


def _rerun_config(cfg: RunConfig, step: int) -> RunConfig:
    """`cfg` again in <run_dir>/at-target, stopped with a checkpoint after `step` steps: the same
    schedule, seeds and data order (the trainer is deterministic on the same threads), so the run's
    own model at that step. Its checkpoints go to its own directory and are not resumed."""
    rerun = copy.deepcopy(cfg)
    rerun.run_dir = str(Path(cfg.run_dir) / AT_TARGET)
    rerun.training.exit_after_steps = step
    rerun.checkpoint = dataclasses.replace(cfg.checkpoint, dir="", interval=0, at_transitions=False, keep=1,
                                           resume="never", layout_free=False)
    rerun.logging.tensorboard = False
    phase_end = next((p for p in build_plan(cfg, 1).phases[:-1] if p.end_step == step), None)
    if phase_end is not None:   # the trainer would leave the phase before it stops
        raise ConfigError(f"eval.at: {cfg.run_dir} first reaches the target at step {step}, where phase "
                          f"{phase_end.index} ends, and its model there is not kept; evaluate final models "
                          f"(eval.at: final)")
    return rerun


def _train_to_target(name: str, cfg: RunConfig, record: dict, runs_at_once: int = 1) -> None:
    """One rerun to its target step: its checkpoint there converted to <run_dir>/model and removed,
    then at_target.json (the config, the step, the rerun's validation loss there)."""
    from msds.train.checkpointing import convert_to_model
    from msds.train.loop import train

    summary = train(cfg)
    run_dir, step = Path(cfg.run_dir), cfg.training.exit_after_steps
    if not summary.exited_early or summary.state.step != step:
        raise SystemExit(f"bench: {name}'s rerun to step {step} ended at step {summary.state.step}")
    if dist.get_rank() == 0:
        convert_to_model(run_dir / "checkpoints", None, run_dir / "model")
        shutil.rmtree(run_dir / "checkpoints")
        last = read_metrics(run_dir, "eval")[-1]
        (run_dir / AT_TARGET_FILE).write_text(json.dumps({"config": record, "step": last["step"],
                                                          "val_loss": last["val_loss"]}))


def models_at_target(configs: dict[str, dict[str, RunConfig]], seed_dirs: dict[str, Path], per_seed: dict,
                     names: list[str], jobs: int) -> dict[str, dict[str, dict]]:
    """seed label -> variant -> where its model at the target is: {run_dir, step, val_loss (the
    model's), run_val_loss (the run's own evaluation there)}. A run that first reaches the target at
    its last evaluation, or never, is its final model (step None when never); the others are trained
    again to their target step (`jobs` at a time) unless an at_target.json of the same config is there."""
    where, pending = {}, []
    for label, seed_dir in seed_dirs.items():
        where[label] = {}
        for name in names:
            run_dir = seed_dir / name
            evals = read_metrics(run_dir, "eval")
            index = crossing_index(evals, per_seed[label]["target_val_loss"])
            step = None if index is None else evals[index]["step"]
            run_val_loss = evals[-1 if index is None else index]["val_loss"]
            where[label][name] = {"run_dir": run_dir, "step": step, "val_loss": run_val_loss,
                                  "run_val_loss": run_val_loss}
            if step is None or step == evals[-1]["step"]:
                continue
            rerun = _rerun_config(configs[label][name], step)
            record, done = _config_record(rerun), Path(rerun.run_dir) / AT_TARGET_FILE
            where[label][name]["run_dir"] = Path(rerun.run_dir)
            if done.is_file() and json.loads(done.read_text())["config"] == record:
                print(f"bench: {rerun.run_dir} is up to date, reusing it", flush=True)
            else:
                shutil.rmtree(rerun.run_dir, ignore_errors=True)   # a stopped rerun starts again
                pending.append((name, rerun, record))
    _train_runs(pending, jobs, _train_to_target)
    for records in where.values():
        for entry in records.values():
            done = entry["run_dir"] / AT_TARGET_FILE
            if done.is_file():
                entry["val_loss"] = json.loads(done.read_text())["val_loss"]
    return where


def _evaluate(configs: dict[str, dict[str, RunConfig]], seed_dirs: dict[str, Path], per_seed: dict,
              names: list[str], reference: str, eval_settings: tuple[EvalSettings, str], jobs: int) -> dict:
    """The reference's final models and the variants' models (final, or at the target with
    `eval.at: target`) evaluated downstream in every seed, and the equal-quality verdicts."""
    settings, at = eval_settings
    run_dirs = {label: {name: seed_dir / name for name in [reference] + names} for label, seed_dir in seed_dirs.items()}
    where = models_at_target(configs, seed_dirs, per_seed, names, jobs) if at == "target" else {}
    for label, records in where.items():
        run_dirs[label].update({name: entry["run_dir"] for name, entry in records.items()})
    out = evaluate_bench(run_dirs, {label: c[BASELINE].data.path for label, c in configs.items()}, reference,
                         settings)
    out["at"] = at
    if where:
        out["at_target"] = {label: {name: {k: v for k, v in entry.items() if k != "run_dir"}
                                    for name, entry in records.items()} for label, records in where.items()}
    return out


def run_bench(config_path: str | Path, out_dir: str | Path, overrides: list[str] = (),
              only: list[str] | None = None, seeds: list[int] | None = None, jobs: int = 1,
              eval_at: str | None = None) -> dict:
    """Train every variant for every seed (or the variants in `only`, plus the baseline sweep;
    reusing finished runs; `jobs` runs at a time), then write results.json, results.md and plots.
    `eval_at` (final or target) replaces the config's `eval.at`."""
    out_dir = Path(out_dir)
    if jobs < 1:
        raise ConfigError(f"--jobs: {jobs} is not a number of runs; give 1 (one run after the other) or more")
    if jobs > 1 and launched_world_size() > 1:
        raise ConfigError(f"--jobs: {jobs} runs at a time need a one-process bench, but this one was launched "
                          f"on {launched_world_size()} processes; drop --jobs or run the bench without a launcher")
    bench = load_yaml(config_path)
    if eval_at is not None:
        if not isinstance(bench.get("eval"), dict):
            raise ConfigError(f"--eval-at: {config_path} has no eval: section to evaluate with; add one "
                              f"(eval.tasks) or drop --eval-at")
        bench["eval"] = {**bench["eval"], "at": eval_at}
    seed_list = bench_seeds(bench, seeds)
    budget_factors = bench_multiplier.check_factors(bench)
    seed_dirs = {(CONFIG_SEEDS if s is None else str(s)): out_dir if s is None else out_dir / f"seed{s}"
                 for s in seed_list}
    configs = {label: variant_configs(bench, seed_dirs[label], list(overrides), seed=s)
               for label, s in zip(seed_dirs, seed_list)}
    members = list(sweep_variants(bench, list(overrides)))
    names = list(next(iter(configs.values())))
    eval_settings = bench_eval_settings(bench, next(iter(configs.values()))[BASELINE].model)
    if eval_settings is not None and eval_settings[1] == "target" and launched_world_size() > 1:
        raise ConfigError(f"eval.at: target trains each variant again to its target step in one process, but this "
                          f"bench was launched on {launched_world_size()} processes; run it without a launcher "
                          f"or evaluate final models (eval.at: final)")
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ConfigError(f"--only: {unknown[0]!r} is not a variant of {config_path}; its variants: "
                              f"{', '.join(names)}")
        names = [n for n in names if n in only or n in members]
    _train_missing({label: {n: c[n] for n in names} for label, c in configs.items()}, seed_dirs, jobs)
    reference, sweep = best_baseline(list(seed_dirs.values()), members)
    longer = {label: bench_multiplier.longer_configs(c[reference], reference, budget_factors, seed_dirs[label])
              for label, c in configs.items()}
    _train_missing(longer, seed_dirs, jobs)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    per_seed = {label: summarize(seed_dirs[label], names, reference) for label in seed_dirs}
    coords = {name: member["coords"] for name, member in sweep_grid(bench, list(overrides)).items()}
    results = {"config": str(config_path), "reference": reference, "baseline_sweep": sweep,
               "sweep_check": bench_sweep.interior(coords, sweep, reference),
               "variants": aggregate(per_seed, names), "per_seed": per_seed}
    if budget_factors:
        results["multiplier"] = _multipliers(seed_dirs, per_seed, longer, [n for n in names if n not in members],
                                             budget_factors)
    if eval_settings is not None:
        results["eval"] = _evaluate(configs, seed_dirs, per_seed, [n for n in names if n not in members], reference,
                                    eval_settings, jobs)
    results["headline"] = headline(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown(results) + (eval_markdown(results) if eval_settings is not None else "")
    edge = bench_sweep.warning(results["sweep_check"])
    (out_dir / "results.md").write_text(f"**{results['headline']}**\n\n" + (f"**{edge}**\n\n" if edge else "") + table)
    plots = plot(results, out_dir)
    print(f"bench: {results['headline']}\n" + (f"bench: {edge}\n" if edge else ""))
    print(table)
    print(f"results: {out_dir / 'results.json'}; plots: {', '.join(str(p) for p in plots)}", flush=True)
    return results


def _multipliers(seed_dirs: dict[str, Path], per_seed: dict, longer: dict[str, dict[str, RunConfig]],
                 names: list[str], factors: list[float]) -> dict:
    """Each variant's compute multiplier k in every seed, on the curve of the reference's final loss at
    1x and at each budget factor (msds/bench_multiplier.py)."""
    curves, ks = {}, {}
    for label, seed in per_seed.items():
        reference = seed["variants"][seed["reference"]]
        finals = [read_metrics(seed_dirs[label] / name, "eval")[-1] for name in longer[label]]
        curves[label] = [(reference["total_flops"], reference["final_val_loss"])] + \
            [(last["flops"], last["val_loss"]) for last in finals]
        ks[label] = {name: bench_multiplier.multiplier(curves[label], seed["variants"][name]["final_val_loss"])
                     for name in names}
    return {"factors": factors, "curves": curves, "variants": bench_multiplier.aggregate(ks, names)}


def _run(args) -> int:
    run_bench(args.config, args.out, args.overrides, args.only, args.seeds, args.jobs, args.eval_at)
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    import argparse

    parser = subparsers.add_parser(name, help=doc, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="bench config, or a packaged recipe's name (bench-*)")
    parser.add_argument("--out", required=True, help="output directory (one run directory per variant and seed)")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                        help="run every variant once per seed (overrides the config's `seeds`)")
    parser.add_argument("--only", nargs="+", metavar="VARIANT", help="train and report only these variants and "
                        "the baseline sweep (which always runs); put key=value overrides before --only")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="train N runs at a time, each in its own process with 1/N of the threads "
                             "(one-process benches only; default: %(default)s)")
    parser.add_argument("--eval-at", choices=EVAL_POINTS, help="where the config's eval: section scores each "
                        "variant, replacing its `eval.at`: final (its final model) or target (its model where it "
                        "first reaches the reference's final loss)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the shared `base` config")
    parser.set_defaults(run=_run)
