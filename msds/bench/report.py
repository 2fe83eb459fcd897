"""A bench's report: the headline, the summary over seeds, one table per seed and the downstream
evaluation beside the savings (results.md, and what `msds bench` prints)."""
from __future__ import annotations

from typing import Optional

from msds.bench import multiplier, sweep
from msds.bench.saving import BenchResults, SeedResult, VariantRun, VariantSummary
from msds.bench.variants import CONFIG_SEEDS


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _reach(x: Optional[float]) -> str:
    return "not reached" if x is None else _pct(x)


def _number(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def seed_table(result: SeedResult) -> str:
    lines = [f"Target: the reference ({result.reference}) final validation loss, {result.target_val_loss:.4f}.",
             "",
             "| variant | final val loss | reference's val loss at the same FLOPs | total FLOPs | FLOPs to target | "
             "wall-clock to target (s) | FLOPs saving | wall-clock saving | transitions (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result.variants.items():
        lines.append(f"| {name} | {r.final_val_loss:.4f} | {_number(r.baseline_val_loss_at_same_flops, '.4f')} | "
                     f"{r.total_flops:.3e} | {_number(r.flops_to_target, '.3e')} | "
                     f"{_number(r.seconds_to_target, '.1f')} | {_reach(r.flops_saving)} | "
                     f"{_reach(r.wallclock_saving)}{_load_mark(r)} | {r.transition_seconds:.2f} |")
    return "\n".join(lines) + "\n"


def _load_mark(run: VariantRun) -> str:
    """The mark on a wall-clock saving whose run was not timed under its reference's load."""
    return " (not timed like the reference)" if run.timed_like_reference is False else ""


def _load_note(variant: VariantSummary) -> str:
    """The note on a wall-clock mean that sets runs of different loads against each other."""
    seeds = variant.not_timed_like_reference_in_seeds
    return f" (not timed under the reference's load in seed(s) {', '.join(seeds)})" if seeds else ""


def _largest_saving(pool: dict[str, VariantSummary]) -> str:
    return max(pool, key=lambda n: pool[n].flops_saving.mean)


def _where_evaluated(results: BenchResults) -> str:
    return " (the variants' models evaluated where they reach the target)" \
        if (results.eval or {}).get("at") == "target" else ""


def _saving_line(name: str, a: VariantSummary, results: BenchResults, at_equal_quality: bool) -> str:
    return (f"{name} reaches the {results.reference} final validation loss with "
            f"{_pct(a.flops_saving.mean)} fewer FLOPs (worst seed {_pct(a.flops_saving.worst)}) "
            f"and {_pct(a.wallclock_saving.mean)} less wall-clock (worst {_pct(a.wallclock_saving.worst)})"
            f"{_load_note(a)}, over {len(results.per_seed)} seed(s)"
            + (", at equal downstream quality" if at_equal_quality else "") + _where_evaluated(results))


def _headline_reached(reached: dict[str, VariantSummary], results: BenchResults) -> str:
    verdicts = results.eval["variants"] if results.eval is not None else {}
    short = (lambda n: ", ".join(verdicts[n]["worse_than_reference"]))
    equal = {n: a for n, a in reached.items() if n not in verdicts or verdicts[n]["equal_quality"]}
    more = _largest_saving(reached)
    if not equal:
        return (f"no variant that reaches the {results.reference} final validation loss is at equal "
                f"downstream quality; the largest saving, {more}'s {_pct(reached[more].flops_saving.mean)} "
                f"of the FLOPs, falls short on {short(more)}{_where_evaluated(results)}")
    name = _largest_saving(equal)
    line = _saving_line(name, equal[name], results, bool(verdicts))
    if more != name:
        line += (f"; {more} saves more ({_pct(reached[more].flops_saving.mean)} of the FLOPs) but falls "
                 f"short on {short(more)}")
    return line


def headline(results: BenchResults) -> str:
    """One line: the best variant (highest mean FLOPs saving; else the lowest mean final loss) against
    the reference, with its mean and worst saving or by how much it missed. With a downstream
    evaluation, the best is chosen among the variants at equal quality, and a variant that saves more
    without it is named with the tasks it falls short on: a saving at lower quality is not the result."""
    others = {n: a for n, a in results.variants.items() if n not in results.baseline_sweep}
    if not others:
        return f"reference: {results.reference} (no other variant)"
    reached = {n: a for n, a in others.items() if a.flops_saving.mean is not None}
    if reached:
        return _headline_reached(reached, results)
    targets = [s.target_val_loss for s in results.per_seed.values()]
    name = min(others, key=lambda n: others[n].final_val_loss.mean)
    return (f"no variant reaches the {results.reference} final validation loss in every seed: the closest, "
            f"{name}, ends at {others[name].final_val_loss.mean:.4f} (mean) vs "
            f"{sum(targets) / len(targets):.4f}; missed in seed(s) {', '.join(others[name].missed_in_seeds)}")


def markdown(results: BenchResults) -> str:
    """The summary over seeds, then one table per seed."""
    seeds = list(results.per_seed)
    lines = [f"Reference: `{results.reference}` (lowest mean final validation loss of the baseline sweep: "
             + ", ".join(f"{n} {v:.4f}" for n, v in results.baseline_sweep.items()) + "). Seeds: "
             + ("the config's own (training.seed, data.seed)" if seeds == [CONFIG_SEEDS] else ", ".join(seeds)) + ".",
             "",
             "| variant | final val loss, mean (best..worst) | FLOPs saving, mean / worst | wall-clock saving, mean / worst | "
             "missed the target in seeds |", "|---|---|---|---|---|"]
    for name, a in results.variants.items():
        loss = a.final_val_loss
        lines.append(f"| {name} | {loss.mean:.4f} ({loss.best:.4f}..{loss.worst:.4f}) | "
                     f"{_pct(a.flops_saving.mean)} / {_pct(a.flops_saving.worst)} | "
                     f"{_pct(a.wallclock_saving.mean)} / {_pct(a.wallclock_saving.worst)}{_load_note(a)} | "
                     f"{', '.join(a.missed_in_seeds) or 'none'} |")
    if results.sweep_check is not None:
        lines += ["", sweep.markdown(results.sweep_check).rstrip("\n")]
    if results.multiplier is not None:
        lines += ["", multiplier.markdown(results.multiplier).rstrip("\n")]
    for seed in seeds:
        title = "### runs" if seed == CONFIG_SEEDS else f"### seed {seed}"
        lines += ["", title, "", seed_table(results.per_seed[seed])]
    return "\n".join(lines) + "\n"


def eval_markdown(results: BenchResults) -> str:
    """The scores beside the FLOPs savings, the paired difference to the reference and the
    equal-quality verdict, one row per variant."""
    quality_record = results.eval
    tasks = quality_record["tasks"]
    header = " | ".join(f"{t} ({spec['metric']}, {'higher' if spec['higher_is_better'] else 'lower'} is better)"
                        for t, spec in tasks.items())
    lines = ["", "### downstream evaluation", "",
             f"Mean (best..worst) over the seeds, then in brackets the mean paired difference to the reference "
             f"(`{quality_record['reference']}`), signed so that positive is better, +- its standard error. At "
             f"equal quality: on every task that mean is at least zero or at least minus one standard error. "
             f"{_models_evaluated(quality_record)}", "",
             f"| variant | {header} | FLOPs saving, mean / worst | at equal quality |",
             "|---|" + "---|" * (len(tasks) + 2)]
    for name, record in quality_record["variants"].items():
        cells = " | ".join(f"{s['mean']:.4g} ({s['best']:.4g}..{s['worst']:.4g}) [{_paired(s['paired'])}]"
                           for s in record["tasks"].values())
        saving = results.variants[name].flops_saving
        verdict = "yes" if record["equal_quality"] else "no: " + ", ".join(record["worse_than_reference"])
        lines.append(f"| {name} | {cells} | {_pct(saving.mean)} / {_pct(saving.worst)} | {verdict} |")
    return "\n".join(lines + _target_steps(quality_record)) + "\n"


def _paired(paired: dict) -> str:
    se = "n/a" if paired["se"] is None else f"{paired['se']:.3g}"
    return f"{paired['mean_diff']:+.3g} +- {se}"


def _models_evaluated(quality_record: dict) -> str:
    if quality_record.get("at") != "target":
        return "Every model evaluated is its run's final model."
    return ("The reference's models are its final ones; each variant's is its model at the first full-size "
            "evaluation at or below the reference's final validation loss (the point its saving is counted "
            "at; trained again to that step unless it is the run's last), listed below.")


def _target_steps(quality_record: dict) -> list[str]:
    """Per seed and variant: the step evaluated, and the rerun's validation loss there beside the
    run's own (equal when the rerun reproduced the run)."""
    at_target = quality_record.get("at_target")
    if not at_target:
        return []
    lines = ["", "| seed | variant | step evaluated | val loss there: model evaluated / the run's |", "|---|---|---|---|"]
    for label, records in at_target.items():
        for name, entry in records.items():
            step = "final (target not reached)" if entry["step"] is None else str(entry["step"])
            lines.append(f"| {label} | {name} | {step} | {entry['val_loss']:.4f} / {entry['run_val_loss']:.4f} |")
    return lines


def results_markdown(results: BenchResults) -> str:
    """results.md's table part: the savings, and the downstream evaluation when there is one."""
    return markdown(results) + (eval_markdown(results) if results.eval is not None else "")
