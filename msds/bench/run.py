"""`run_bench`: every variant trained for every seed, the reference chosen (and checked to be an
interior optimum of the sweep, and trained at larger budgets for the compute multiplier), the
savings computed, the downstream evaluation run, and results.json, results.md and the plots written."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from msds.bench import multiplier, sweep
from msds.bench.at_target import models_at_target
from msds.bench.plots import plot
from msds.bench.report import headline, results_markdown
from msds.bench.saving import BenchResults, SeedResult, aggregate, best_baseline, summarize
from msds.bench.training import train_missing
from msds.bench.variants import BASELINE, CONFIG_SEEDS, bench_seeds, sweep_grid, sweep_variants, variant_configs
from msds.config import ConfigError, RunConfig, load_yaml
from msds.distributed import launched_world_size
from msds.eval.bench import bench_eval_settings, evaluate_bench
from msds.eval.run import EvalSettings


def _evaluate(configs: dict[str, dict[str, RunConfig]], seed_dirs: dict[str, Path], per_seed: dict[str, SeedResult],
              names: list[str], reference: str, eval_settings: tuple[EvalSettings, str], jobs: int) -> dict:
    """The reference's final models and the variants' models (final, or at the target with
    `eval.at: target`) evaluated downstream in every seed, and the equal-quality verdicts."""
    settings, at = eval_settings
    run_dirs = {label: {name: seed_dir / name for name in [reference] + names} for label, seed_dir in seed_dirs.items()}
    where = models_at_target(configs, seed_dirs, per_seed, names, jobs) if at == "target" else {}
    for label, records in where.items():
        run_dirs[label].update({name: entry.run_dir for name, entry in records.items()})
    out = evaluate_bench(run_dirs, {label: c[BASELINE].data.path for label, c in configs.items()}, reference,
                         settings)
    out["at"] = at
    if where:
        out["at_target"] = {label: {name: entry.to_json() for name, entry in records.items()}
                            for label, records in where.items()}
    return out


def _check_jobs(jobs: int) -> None:
    if jobs < 1:
        raise ConfigError(f"--jobs: {jobs} is not a number of runs; give 1 (one run after the other) or more")
    if jobs > 1 and launched_world_size() > 1:
        raise ConfigError(f"--jobs: {jobs} runs at a time need a one-process bench, but this one was launched "
                          f"on {launched_world_size()} processes; drop --jobs or run the bench without a launcher")


def _load_bench(config_path: str | Path, eval_at: Optional[str]) -> dict:
    """The bench config, with `eval_at` (final or target) replacing its `eval.at`."""
    bench = load_yaml(config_path)
    if eval_at is not None:
        if not isinstance(bench.get("eval"), dict):
            raise ConfigError(f"--eval-at: {config_path} has no eval: section to evaluate with; add one "
                              f"(eval.tasks) or drop --eval-at")
        bench["eval"] = {**bench["eval"], "at": eval_at}
    return bench


def _check_eval_at(eval_settings: Optional[tuple[EvalSettings, str]]) -> None:
    if eval_settings is not None and eval_settings[1] == "target" and launched_world_size() > 1:
        raise ConfigError(f"eval.at: target trains each variant again to its target step in one process, but this "
                          f"bench was launched on {launched_world_size()} processes; run it without a launcher "
                          f"or evaluate final models (eval.at: final)")


def _selected(names: list[str], only: Optional[list[str]], members: list[str], config_path) -> list[str]:
    """The variants in `only` plus the baseline sweep (every variant without `only`)."""
    if not only:
        return names
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise ConfigError(f"--only: {unknown[0]!r} is not a variant of {config_path}; its variants: "
                          f"{', '.join(names)}")
    return [n for n in names if n in only or n in members]


def _write(results: BenchResults, out_dir: Path) -> None:
    """results.json, results.md and the plots; the headline and the table printed."""
    (out_dir / "results.json").write_text(json.dumps(results.to_json(), indent=1))
    table = results_markdown(results)
    edge = sweep.warning(results.sweep_check) if results.sweep_check is not None else ""
    (out_dir / "results.md").write_text(f"**{results.headline}**\n\n" + (f"**{edge}**\n\n" if edge else "") + table)
    plots = plot(results, out_dir)
    print(f"bench: {results.headline}\n" + (f"bench: {edge}\n" if edge else ""))
    print(table)
    print(f"results: {out_dir / 'results.json'}; plots: {', '.join(str(p) for p in plots)}", flush=True)


def run_bench(config_path: str | Path, out_dir: str | Path, overrides: list[str] = (),
              only: list[str] | None = None, seeds: list[int] | None = None, jobs: int = 1,
              eval_at: str | None = None) -> Optional[BenchResults]:
    """Train every variant for every seed (or the variants in `only`, plus the baseline sweep;
    reusing finished runs; `jobs` runs at a time), then write results.json, results.md and plots.
    `eval_at` (final or target) replaces the config's `eval.at`. None on ranks other than 0."""
    out_dir = Path(out_dir)
    _check_jobs(jobs)
    bench = _load_bench(config_path, eval_at)
    seed_list = bench_seeds(bench, seeds)
    budget_factors = multiplier.check_factors(bench)
    seed_dirs = {(CONFIG_SEEDS if s is None else str(s)): out_dir if s is None else out_dir / f"seed{s}"
                 for s in seed_list}
    configs = {label: variant_configs(bench, seed_dirs[label], list(overrides), seed=s)
               for label, s in zip(seed_dirs, seed_list)}
    members = list(sweep_variants(bench, list(overrides)))
    eval_settings = bench_eval_settings(bench, next(iter(configs.values()))[BASELINE].model)
    _check_eval_at(eval_settings)
    names = _selected(list(next(iter(configs.values()))), only, members, config_path)
    train_missing({label: {n: c[n] for n in names} for label, c in configs.items()}, seed_dirs, jobs)
    reference, means = best_baseline(list(seed_dirs.values()), members)
    budgets = {label: multiplier.budget_configs(c[reference], reference, budget_factors, seed_dirs[label])
              for label, c in configs.items()}
    train_missing(budgets, seed_dirs, jobs)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    per_seed = {label: summarize(seed_dirs[label], names, reference) for label in seed_dirs}
    results = BenchResults(str(config_path), reference, means, aggregate(per_seed, names), per_seed)
    coords = {name: member["coords"] for name, member in sweep_grid(bench, list(overrides)).items()}
    results.sweep_check = sweep.interior(coords, means, reference)
    if budget_factors:
        results.multiplier = multiplier.multipliers(seed_dirs, per_seed, budgets,
                                                    [n for n in names if n not in members], budget_factors)
    if eval_settings is not None:
        results.eval = _evaluate(configs, seed_dirs, per_seed, [n for n in names if n not in members], reference,
                                 eval_settings, jobs)
    results.headline = headline(results)
    _write(results, out_dir)
    return results
