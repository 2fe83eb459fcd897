"""The regime of a run: its tokens per non-embedding parameter, and what msds has measured nearest to it.

A V-cycle's saving depends on the budget (BENCHMARKS.md, "The saving as the budget grows" and "The
saving past the crossover"): it saved at a few tokens per parameter and nothing from about 12 on,
and below the crossover (the budget where the full model first beats its half-depth model trained
alone on the same FLOPs) a smaller model trained alone saved as much. So `msds plan` states where a
run lies, read from the committed budget-curve tables (benchmarks/results/, shipped as the package
`msds.results`), and says plainly when it lies where no saving was measured.

Tokens per parameter count the parameters outside the word, position and token-type embeddings
(the convention of scaling-law work) and the tokens of the run's budget: the full-size steps that
cost the run's FLOPs (a V-cycle's `budget_steps`; a baseline's `training.steps`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

from msds import resources
from msds.config import ModelConfig
from msds.model.roles import expected_shapes

EMBEDDINGS = ("embeddings.word.weight", "embeddings.position.weight", "embeddings.token_type.weight")
CONTROL = "small-alone"     # a bench variant of this name (or prefix) is a smaller model trained alone
CURVE_GLOB = "budget-curve-*.json"


def non_embedding_parameters(model: ModelConfig) -> int:
    """Parameters outside the embeddings (the tied output head included in them)."""
    return sum(math.prod(shape) for name, shape in expected_shapes(model).items() if name not in EMBEDDINGS)


@dataclass(frozen=True)
class Point:
    """One budget of a committed budget-curve table: the best V-cycle and the control there."""
    source: str                   # the table's file name in benchmarks/results/
    arch: str
    layers: int
    hidden: int
    tokens_per_param: float
    best: Optional[dict]          # the V-cycle row that saved most in every seed (None: none saved)
    control: Optional[dict]       # the small model alone (None: not run at this budget)
    tried: int                    # V-cycle rows measured at this budget


def _k(row: dict) -> str:
    """The compute multiplier per seed, where the bench measured it."""
    k = row.get("multiplier") or ""
    return "" if not k or set(k.replace(",", " ").split()) == {"n/a"} else f"; k {k}"


def _saving(row: Optional[dict]) -> Optional[float]:
    """The mean FLOPs saving (percent, over seeds) of a row that reached the reference in every
    seed, else None."""
    if row is None or row.get("flops_saving") is None:
        return None
    return sum(row["flops_saving"]) / len(row["flops_saving"])


def measured_points(arch: str) -> list[Point]:
    """Every budget of the shipped budget-curve tables of `arch` whose `setting.model` names its shape."""
    points = []
    for path in sorted(resources.results_dir().glob(CURVE_GLOB)):
        table = json.loads(path.read_text())
        model = (table.get("setting") or {}).get("model")
        if not model or model.get("arch") != arch:
            continue
        budgets: dict[float, list[dict]] = {}
        for row in table["rows"]:
            budgets.setdefault(row["tokens_per_param"], []).append(row)
        for tpp, rows in sorted(budgets.items()):
            controls = [r for r in rows if r["variant"].startswith(CONTROL)]
            vcycles = [r for r in rows if not r["variant"].startswith(CONTROL)]
            saved = [r for r in vcycles if _saving(r) is not None and _saving(r) > 0]
            control = max(controls, key=lambda r: _saving(r) if _saving(r) is not None else -math.inf, default=None)
            points.append(Point(path.name, arch, model["layers"], model["hidden"], tpp,
                                max(saved, key=_saving, default=None), control, len(vcycles)))
    return points


def nearest(points: list[Point], layers: int, hidden: int, tokens_per_param: float) -> Optional[Point]:
    """The measured budget closest to the run: by the log of tokens per parameter, then by depth and
    width (the crossover moves with both: BENCHMARKS.md, "The saving past the crossover")."""
    def distance(p: Point) -> tuple[float, float]:
        return (abs(math.log(p.tokens_per_param / tokens_per_param)) + 0.5 * abs(math.log(p.layers / layers))
                + 0.5 * abs(math.log(p.hidden / hidden)), p.tokens_per_param)
    return min(points, key=distance, default=None)


def tokens_per_parameter(model: ModelConfig, baseline_steps: int, tokens_per_step: int) -> float:
    return baseline_steps * tokens_per_step / non_embedding_parameters(model)


def _control_as_well(p: Point) -> bool:
    """The smaller model alone reached the reference and saved at least as much as the best V-cycle."""
    c = _saving(p.control)
    return c is not None and (p.best is None or c >= _saving(p.best))


def _point_line(p: Point) -> str:
    where = f"{p.arch.upper()} {p.layers} x {p.hidden} at {p.tokens_per_param:.3g} tokens per parameter ({p.source})"
    if p.tried == 0:
        verdict = "no V-cycle schedule was measured there"
    elif p.best is None:
        verdict = f"none of the {p.tried} V-cycle schedules measured there reached the reference in every seed"
    else:
        verdict = (f"the best V-cycle schedule, {p.best['variant']}, saved {_saving(p.best):.1f}% / "
                   f"{min(p.best['flops_saving']):.1f}% of the FLOPs (mean / worst over seeds{_k(p.best)})")
    if p.control is None:
        control = "the smaller model alone was not measured there"
    else:
        c = _saving(p.control)
        reached = (f"saved {c:.1f}% of the FLOPs (mean{_k(p.control)})" if c is not None
                   else f"missed the reference ({_k(p.control)[2:] or 'in some seed'})")
        control = f"the smaller model trained alone on the same FLOPs {reached}" + \
            (": as well or better, so train the smaller model" if _control_as_well(p) else "")
    return f"nearest measured point: {where}: {verdict}; {control}"


def regime(model: ModelConfig, baseline_steps: int, tokens_per_step: int, multilevel: bool) -> dict:
    """What `msds plan` says of the budget of a run that costs the FLOPs of `baseline_steps` steps of
    the full-size `model`: tokens per non-embedding parameter, and for a
    V-cycle the nearest measured point and whether the run lies where no saving was measured
    (`no_saving_measured`); `lines` is the text it prints."""
    params = non_embedding_parameters(model)
    tpp = tokens_per_parameter(model, baseline_steps, tokens_per_step)
    out = {"tokens_per_param": tpp, "non_embedding_parameters": params, "nearest": None,
           "no_saving_measured": None,
           "lines": [f"regime: {tpp:.3g} tokens per non-embedding parameter ({baseline_steps} full-size steps x "
                     f"{tokens_per_step} tokens over {params:,} parameters outside the embeddings)"]}
    if not multilevel:
        return out
    point = nearest(measured_points(model.arch), model.num_layers, model.hidden_size, tpp)
    if point is None:
        out["no_saving_measured"] = True
        out["lines"].append(f"WARNING: no {model.arch.upper()} V-cycle has been measured: nothing says this run saves")
        return out
    far = abs(math.log(point.tokens_per_param / tpp)) > math.log(2)
    out["nearest"] = {"source": point.source, "layers": point.layers, "hidden": point.hidden,
                      "tokens_per_param": point.tokens_per_param,
                      "best_vcycle": None if point.best is None else point.best["variant"],
                      "control_as_well": point.control is not None and _control_as_well(point)}
    out["no_saving_measured"] = point.best is None or far
    out["lines"].append(_point_line(point))
    if out["no_saving_measured"]:
        why = ("the nearest measurement is more than 2x away in budget" if far
               else "no V-cycle saved at the nearest measured budget")
        out["lines"].append(f"WARNING: this run lies where no saving was measured ({why}); expect none until a "
                            f"bench at this shape and budget says otherwise (msds bench with reference_budgets)")
    return out
