"""A bench config read into run configs: the shared `base`, the `variants`, the baseline's
sweep (schedules x learning rates x warmups) and the seeds; every run checked to be a fair comparison."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

from msds.bench import sweep
from msds.config import (ConfigError, OptimizerConfig, RunConfig, parse_overrides, run_config_from_dict,
                         set_by_path)
from msds.distributed import launched_world_size
from msds.plan import build_plan

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
    """The baseline sweep (msds/bench/sweep.py): name -> {coords, optimizer} of each member. The grid
    is schedules x learning-rate factors (of the baseline variant's own peak lr) x warmup lengths;
    the recipe's own setting is `baseline`."""
    baseline = _merge(_base(bench, list(overrides), None), (bench.get("variants") or {}).get(BASELINE) or {})
    optimizer = baseline.get("optimizer") or {}
    warmup = optimizer.get("warmup_steps", OptimizerConfig().warmup_steps)
    factors = _numbers(bench, "baseline_lr_sweep", float) or [1.0]
    warmups = _numbers(bench, "baseline_warmup_sweep", int) or [warmup]
    return sweep.grid(bench, optimizer, factors, warmups, BASELINE)


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
