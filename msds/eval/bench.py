"""The `eval:` section of a bench config: each variant's model evaluated on the same tasks, and
whether a saving holds at equal quality (msds/bench/report.py renders it beside the savings).

    eval:
      tasks: [heldout-ppl, cloze]     # any fields of msds.eval.run.EvalSettings
      max_examples: 200
      at: target                      # final (default) | target

A variant is *at equal quality* when, on every task, the paired differences to the reference
baseline (variant minus reference in each seed, signed so that positive is better) have a mean of
at least zero, or of at least minus one standard error of those differences (their standard
deviation over the square root of the number of seeds; with one seed the mean must be at least
zero). Pairing by seed takes out what the seeds share (data order, validation batches). Evaluated are the
reference's final models and every variant outside the baseline sweep: its final model, or with
`at: target` its model at the first full-size evaluation at or below the reference's final
validation loss, the point its saving is counted at (msds/bench/at_target.py). Each
model's record is kept in eval.json beside it and reused while the settings and the weights are
the same.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from msds.config import ConfigError, ModelConfig, from_dict
from msds.errors import MsdsError
from msds.eval.run import TASKS, EvalSettings, check_settings, check_tasks_fit, evaluate
from msds.integrity import sha256_file

EVAL_FILE = "eval.json"


EVAL_POINTS = ("final", "target")


def bench_eval_settings(bench: dict, model: ModelConfig) -> tuple[EvalSettings, str] | None:
    """The checked `eval:` section: the settings and where the variants are evaluated (`at`); None
    when absent. Errors name `eval.<field>`."""
    if bench.get("eval") is None:
        return None
    if not isinstance(bench["eval"], dict):
        raise ConfigError(f"eval: expected a mapping of evaluation settings, got {bench['eval']!r}")
    section = dict(bench["eval"])
    at = section.pop("at", "final")
    if at not in EVAL_POINTS:
        raise ConfigError(f"eval.at: {at!r} is not a point to evaluate at; give final (each variant's final "
                          f"model) or target (its model where it first reaches the reference's final loss)")
    settings = from_dict(EvalSettings, section, "eval")
    try:
        check_settings(settings, "eval")
        check_tasks_fit(settings.tasks, model, "eval.tasks")
    except MsdsError as exc:
        raise ConfigError(str(exc)) from None
    return settings, at


def evaluate_run(run_dir: Path, data_path: str, settings: EvalSettings) -> dict[str, float]:
    """Task values of a run's model (<run_dir>/model), tokenizer from the run's corpus."""
    model = run_dir / "model"
    request = {"settings": asdict(settings), "model_sha256": sha256_file(model / "model.safetensors")}
    saved = run_dir / EVAL_FILE
    if saved.is_file():
        record = json.loads(saved.read_text())
        if record.get("request") == request:
            print(f"bench: {saved} is up to date, reusing it", flush=True)
            return {task: entry["value"] for task, entry in record["tasks"].items()}
    print(f"bench: evaluating {model}", flush=True)
    record = evaluate(model, settings, data_path)
    saved.write_text(json.dumps({"request": request, **record}, indent=1))
    return {task: entry["value"] for task, entry in record["tasks"].items()}


def _spread(values: list[float], higher_is_better: bool) -> dict:
    ordered = sorted(values, reverse=higher_is_better)
    return {"mean": statistics.fmean(values), "best": ordered[0], "worst": ordered[-1], "per_seed": values}


def paired(values: list[float], reference: list[float], higher_is_better: bool) -> dict:
    """The per-seed differences to the reference, signed so that positive is better: their mean, their
    standard error (None with one seed) and whether the variant is at equal quality on this task."""
    diffs = [(v - r) if higher_is_better else (r - v) for v, r in zip(values, reference)]
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
    return {"mean_diff": mean, "se": se, "equal": mean >= 0 or (se is not None and mean >= -se)}


def quality(values: dict[str, dict[str, dict[str, float]]], reference: str, settings: EvalSettings) -> dict:
    """From {seed: {variant: {task: value}}}: each variant's spread per task, its paired difference
    to the reference and its verdict."""
    seeds = list(values)
    names = list(values[seeds[0]])
    out = {"tasks": {t: {"metric": TASKS[t].metric, "higher_is_better": TASKS[t].higher_is_better}
                     for t in settings.tasks},
           "reference": reference, "variants": {}}
    for name in names:
        spreads = {t: _spread([values[s][name][t] for s in seeds], TASKS[t].higher_is_better) for t in settings.tasks}
        out["variants"][name] = {"tasks": spreads}
    for name, record in out["variants"].items():
        for task, spread in record["tasks"].items():
            spread["paired"] = paired(spread["per_seed"], out["variants"][reference]["tasks"][task]["per_seed"],
                                      TASKS[task].higher_is_better)
        worse = [task for task, spread in record["tasks"].items() if not spread["paired"]["equal"]]
        record["equal_quality"] = not worse
        record["worse_than_reference"] = worse
    return out


def evaluate_bench(run_dirs: dict[str, dict[str, Path]], data_paths: dict[str, str], reference: str,
                   settings: EvalSettings) -> dict:
    """Evaluate the model of every run directory (seed label -> variant -> directory; the reference
    among the variants), then `quality()`."""
    values = {label: {name: evaluate_run(run_dir, data_paths[label], settings) for name, run_dir in dirs.items()}
              for label, dirs in run_dirs.items()}
    return quality(values, reference, settings)
