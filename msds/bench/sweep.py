"""The bench's baseline sweep as a grid, and whether its reference is an interior optimum.

The grid is schedules (`baseline_schedule_sweep`) x learning-rate factors (`baseline_lr_sweep`) x
warmup lengths (`baseline_warmup_sweep`); msds/bench/run.py trains every member and takes the one with
the lowest mean final validation loss as the reference. A reference at the edge of a numeric
dimension (the learning rate, the warmup) may be beaten by a member the grid did not run, so a
saving against it may be a saving against an untuned baseline: `interior` says so per dimension.
Schedules have no order; the report names the best member of each.
"""
from __future__ import annotations

import itertools
from typing import Optional

from msds.config import ConfigError, OptimizerConfig

SCHEDULE_KEYS = ("schedule", "min_lr_ratio", "decay_fraction")
OWN_SWEEPS = {"lr_factors": (int, float), "warmups": int}   # an entry's own grid instead of the bench's
ORDERED = ("lr_factor", "warmup_steps")


def schedule_options(bench: dict, optimizer: dict) -> list[dict]:
    """The swept schedules, each a complete {schedule, min_lr_ratio, decay_fraction} (fields not
    given are the baseline's own), with `lr_factors` and `warmups` where an entry sweeps its own rate
    factors or warmup lengths instead of baseline_lr_sweep's and baseline_warmup_sweep's; without
    `baseline_schedule_sweep`, only the baseline's own."""
    defaults = OptimizerConfig()
    own = {key: optimizer.get(key, getattr(defaults, key)) for key in SCHEDULE_KEYS}
    entries = bench.get("baseline_schedule_sweep") or []
    if not isinstance(entries, list):
        raise ConfigError(f"baseline_schedule_sweep: expected a list of {{schedule, min_lr_ratio, decay_fraction}} "
                          f"mappings, got {entries!r}")
    options = []
    for i, entry in enumerate(entries):
        unknown = sorted(set(entry) - set(SCHEDULE_KEYS) - set(OWN_SWEEPS)) if isinstance(entry, dict) \
            else ["(not a mapping)"]
        if unknown:
            raise ConfigError(f"baseline_schedule_sweep[{i}]: {unknown[0]} is not a schedule field; give "
                              f"{', '.join(SCHEDULE_KEYS)} (and lr_factors, warmups: this schedule's own rate "
                              f"factors and warmup lengths)")
        for key, kind in OWN_SWEEPS.items():
            values = entry.get(key, [1])
            if not isinstance(values, list) or not values or not all(
                    isinstance(v, kind) and not isinstance(v, bool) and (v > 0 or key == "warmups" and v == 0)
                    for v in values):
                what = "whole numbers of steps" if key == "warmups" else "positive factors"
                raise ConfigError(f"baseline_schedule_sweep[{i}].{key}: expected a non-empty list of {what}, "
                                  f"got {values!r}")
        options.append({**own, **entry})
    return options or [own]


def schedule_label(option: dict) -> str:
    """A member name's schedule part: cosine0.1, linear0, wsd0-d0.2."""
    label = f"{option['schedule']}{option['min_lr_ratio']:g}"
    return label + (f"-d{option['decay_fraction']:g}" if option["schedule"] == "wsd" else "")


def grid(bench: dict, optimizer: dict, factors: list[float], warmups: list[int], prefix: str) -> dict[str, dict]:
    """name -> {"coords": the member's place in the grid, "optimizer": its optimizer settings}. The
    baseline's own setting is `prefix` itself, first and always a member; a name spells only what
    differs from it."""
    defaults = OptimizerConfig()
    lr, warmup = optimizer.get("lr", defaults.lr), optimizer.get("warmup_steps", defaults.warmup_steps)
    own_option = schedule_options({}, optimizer)[0]
    own = schedule_label(own_option)
    members = {prefix: {"coords": {"schedule": own, "lr_factor": 1.0, "warmup_steps": warmup},
                        "optimizer": {**own_option, "lr": lr, "warmup_steps": warmup}}}
    options = schedule_options(bench, optimizer)
    for key, values, own_key in (("baseline_lr_sweep", factors, "lr_factors"),
                                 ("baseline_warmup_sweep", warmups, "warmups")):
        if len(values) > 1 and all(own_key in option for option in options):
            raise ConfigError(f"{key}: no schedule of the sweep uses it: every baseline_schedule_sweep entry gives "
                              f"its own {own_key} (the baseline's own schedule, {own}, is swept only as an entry); "
                              f"list an entry without {own_key}, such as {{schedule: {own_option['schedule']}, ...}}, "
                              f"or drop {key}")
    for option in options:
        option = dict(option)
        own_factors, own_warmups = option.pop("lr_factors", factors), option.pop("warmups", warmups)
        for steps, factor in itertools.product(own_warmups, own_factors):
            _add_member(members, option, factor, steps, (prefix, own, lr, warmup))
    return members


def _add_member(members: dict, option: dict, factor: float, steps: int, baseline: tuple) -> None:
    """The grid's member of schedule `option`, rate factor and warmup `steps`, named after what
    differs from the baseline's own (prefix, schedule label, peak lr, warmup)."""
    prefix, own, lr, warmup = baseline
    label = schedule_label(option)
    name = prefix + (f"-{label}" if label != own else "") + (f"-lr{factor:g}x" if factor != 1 else "") + \
        (f"-wu{steps}" if steps != warmup else "")
    if name in members and name != prefix:
        raise ConfigError(f"baseline_schedule_sweep: two entries give the schedule {label}; list each once")
    members[name] = {"coords": {"schedule": label, "lr_factor": factor, "warmup_steps": steps},
                     "optimizer": {**option, "lr": lr * factor, "warmup_steps": steps}}


def _neighbour(coords: dict[str, dict], reference: str, dim: str, side: int) -> Optional[str]:
    """The member next to `reference` along `dim` (side -1: the next smaller value, +1: larger),
    every other coordinate equal; None at the grid's edge."""
    here = coords[reference]
    same_line = {name: c[dim] for name, c in coords.items()
                 if all(c[k] == here[k] for k in c if k != dim) and (c[dim] - here[dim]) * side > 0}
    return min(same_line, key=lambda n: abs(same_line[n] - here[dim])) if same_line else None


def interior(coords: dict[str, dict], means: dict[str, float], reference: str) -> dict:
    """Whether the reference is an interior optimum: along every numeric dimension the grid sweeps
    (more than one value), its neighbours on both sides were run and ended worse (higher mean final
    loss). Per dimension the values, both neighbours and their means; per schedule its best member."""
    dims = {}
    for dim in ORDERED:
        values = sorted({c[dim] for c in coords.values()})
        if len(values) < 2:
            continue
        sides = {side: _neighbour(coords, reference, dim, step) for side, step in (("lower", -1), ("higher", 1))}
        ok = all(name is not None and means[name] > means[reference] for name in sides.values())
        dims[dim] = {"values": values, "reference": coords[reference][dim], "interior": ok,
                     **{side: None if name is None else {"member": name, "mean_final_val_loss": means[name]}
                        for side, name in sides.items()}}
    by_schedule = {}
    for name, c in coords.items():
        best = by_schedule.get(c["schedule"])
        if best is None or means[name] < means[best]:
            by_schedule[c["schedule"]] = name
    return {"interior": all(d["interior"] for d in dims.values()) if dims else None,
            "reference_coords": coords[reference], "dimensions": dims,
            "best_per_schedule": {label: {"member": name, "mean_final_val_loss": means[name]}
                                  for label, name in by_schedule.items()}}


def warning(check: dict) -> str:
    """The loud line of a reference at a grid edge ("" when interior or nothing numeric was swept)."""
    if check["interior"] is not False:
        return ""
    edges = []
    for dim, d in check["dimensions"].items():
        if d["interior"]:
            continue
        missing = [side for side in ("lower", "higher") if d[side] is None]
        what = f"no {' or '.join(missing)} value was run" if missing else "a neighbour ties it"
        edges.append(f"{dim} {d['reference']:g} of {[float(v) for v in d['values']]} ({what})")
    return ("WARNING: the reference is not an interior optimum of the baseline sweep, at the edge in "
            + "; ".join(edges) + ": a better baseline may lie outside the grid, and savings against this "
            "reference may be overstated; widen the sweep")


def markdown(check: dict) -> str:
    """The sweep's verdict as a few lines of results.md. A reference chosen without sweeping a number
    (one learning rate, one warmup) is called untuned, never an interior optimum."""
    if check["interior"] is None:
        verdict = ("The reference is untuned: the sweep varied neither its learning rate nor its warmup, so it is "
                   "the recipe's own setting, and a saving against it may be a saving against a poor baseline.")
    else:
        verdict = warning(check) or ("The reference is an interior optimum of the sweep: " + "; ".join(
            f"{dim} {d['reference']:g} beats {d['lower']['member']} and {d['higher']['member']}"
            for dim, d in check["dimensions"].items()) + ".")
    lines = [verdict, "", "Best member per schedule: " + ", ".join(
        f"{label} {b['member']} ({b['mean_final_val_loss']:.4f})" for label, b in check["best_per_schedule"].items())
        + "."]
    return "\n".join(lines) + "\n"
