"""`msds plan`: check a run config and show what `msds train` would do with it, without training.

    msds plan --config recipes/paper/bert-large-vcycle2.yaml --world-size 32 [key=value ...]

Prints, per phase, the level, model shape, parameters, steps, peak learning rate, FLOPs and an
estimate of memory per rank (weights, gradients, optimizer state at the chosen ZeRO stage; see
msds/plan/memory.py for what is and is not counted), the learning-rate curve (its value at a
handful of steps of each phase: ends, quarters, each side of a warmup's end and a decay's start),
then the totals and the FLOPs ratio to the same
run without multi-level training, and the run's regime: its tokens per non-embedding parameter and,
for a V-cycle, the nearest budget msds has measured and what saved there (msds/plan/regime.py),
with a warning when the run lies where no saving was measured. Any config `msds train` would refuse, including a layout that
does not fit the world size, ends with one error line and exit status 2. What depends on this
machine (prepared data, the accelerator's precisions) is checked too and reported as a note, since
the plan is often made for another machine. A bench config (`base` + `variants`, msds bench) gets
one plan per variant. `--json` writes the same facts as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from msds.config import ConfigError, load_run_config, load_yaml
from msds.errors import MsdsError
from msds.plan import memory
from msds.plan.build import RunPlan, build_plan, check_environment, run_long_schedule
from msds.plan.pretrained import describe
from msds.plan.regime import regime


def _shape(plan: RunPlan, level: int) -> str:
    m = plan.model(level)
    return f"{m.num_layers}x{m.hidden_size}, {m.num_heads}h, ffn {m.ffn_size}"


def _params(plan: RunPlan, level: int) -> int:
    return sum(memory.stage_parameters(plan.model(level), 1, 1))


def _state(plan: RunPlan, level: int) -> memory.MemoryEstimate:
    lay, t = plan.layout, plan.config.training
    return memory.training_state(plan.model(level), lay.tensor, lay.pipeline, lay.data, t.zero_stage, t.precision)


def _saved_host(plan: RunPlan, phase_index: int) -> float:
    """Host bytes of the larger levels kept while `phase_index` runs (those above its level on the
    way down of the current cycle; none in a grow-only run)."""
    if plan.grow_only:
        return 0.0
    lay = plan.layout
    moments = plan.config.multilevel.optimizer_policy == "map"
    level = plan.phases[phase_index].level
    return sum(memory.saved_level(plan.model(k), lay.tensor, lay.pipeline, lay.data, moments)
               for k in range(1, level))


def lr_points(plan: RunPlan, phase) -> list[tuple[int, float]]:
    """(global step, learning rate) at a handful of the phase's steps: its first and last, its
    quarters, and each side of every warmup end and decay start that falls in it."""
    first, last = phase.start_step, phase.end_step - 1
    steps = {first, last, *(first + k * phase.steps // 4 for k in (1, 2, 3))}
    for milestone in plan.lr_milestones:
        steps.update({milestone - 1, milestone})
    return [(s, plan.lr_at(s)) for s in sorted(steps) if first <= s <= last]


def _schedule(plan: RunPlan) -> dict:
    o = plan.config.optimizer
    return {"shape": o.schedule, "min_lr_ratio": o.min_lr_ratio, "warmup_steps": o.warmup_steps,
            **({"decay_fraction": o.decay_fraction} if o.schedule == "wsd" else {}),
            "span": "run" if run_long_schedule(plan.config) or not plan.multilevel else "phase"}


def summary(plan: RunPlan) -> dict:
    cfg, lay = plan.config, plan.layout
    phases = []
    for phase in plan.phases:
        state = _state(plan, phase.level)
        phases.append({"phase": phase.index, "level": phase.level, "model": _shape(plan, phase.level),
                       "parameters": _params(plan, phase.level), "steps": phase.steps,
                       "start_step": phase.start_step, "peak_lr": phase.peak_lr,
                       "flops": plan.phase_flops(phase),
                       "memory_per_rank_bytes": {"weights": state.weights, "gradients": state.gradients,
                                                 "optimizer": state.optimizer, "total": state.total},
                       "saved_levels_host_bytes": _saved_host(plan, phase.index),
                       "lr_curve": [[step, lr] for step, lr in lr_points(plan, phase)]})
    total, baseline = plan.total_flops(), plan.baseline_flops()
    return {"layout": {"world_size": lay.world_size, "data": lay.data, "tensor": lay.tensor,
                       "pipeline": lay.pipeline},
            "zero_stage": cfg.training.zero_stage, "precision": cfg.training.precision,
            "samples_per_step": plan.samples_per_step, "tokens_per_step": plan.tokens_per_step,
            "total_steps": plan.total_steps, "lr_schedule": cfg.multilevel.lr_schedule if plan.multilevel else "phase",
            "grow_only": plan.grow_only, "lr": _schedule(plan),
            "random_ltd": None if plan.random_ltd is None else {
                "min_tokens": plan.random_ltd.min_value, "max_tokens": plan.random_ltd.max_value,
                "require_steps": plan.random_ltd.require_steps, "layer_token_lr": plan.random_ltd.layer_token_lr,
                "routed_layers": {str(k): list(plan.routed_layers(k)) for k in range(1, len(plan.levels) + 1)}},
            "init_from": _init_from(plan), "phases": phases, "total_flops": total, "baseline_flops": baseline,
            "flops_ratio": total / baseline,
            "regime": regime(plan.model(1), round(plan.baseline_steps * total / baseline), plan.tokens_per_step,
                             plan.multilevel)}


def _init_from(plan: RunPlan) -> dict | None:
    init = plan.init_from
    if init is None:
        return None
    return {"path": str(init.source.path), "format": init.source.format, "level": init.level,
            "loaded": list(init.loaded), "initialised": list(init.initialised), "ignored": list(init.ignored)}


def table(plan: RunPlan, facts: dict) -> str:
    cfg, lay = plan.config, plan.layout
    t = cfg.training
    lines = [f"{lay.world_size} process(es) = data {lay.data} x tensor {lay.tensor} x pipeline {lay.pipeline}; "
             f"ZeRO {t.zero_stage}, {t.precision}; {plan.samples_per_step} samples/step (micro {t.micro_batch_size} "
             f"x accum {t.grad_accum} x data {lay.data}) of {cfg.data.seq_len} tokens",
             f"{'phase':>5} {'level':>5} {'model (layers x hidden)':<26} {'params':>9} {'steps':>8} {'start':>8} "
             f"{'peak lr':>9} {'FLOPs':>10} {'GiB/rank w+g+opt':>20} {'host GiB':>9}"]
    for p in facts["phases"]:
        m = p["memory_per_rank_bytes"]
        gib = f"{m['weights'] / memory.GIB:.2f}+{m['gradients'] / memory.GIB:.2f}+{m['optimizer'] / memory.GIB:.2f}"
        lines.append(f"{p['phase']:>5} {p['level']:>5} {p['model']:<26} {p['parameters'] / 1e6:>8.2f}M "
                     f"{p['steps']:>8} {p['start_step']:>8} {p['peak_lr']:>9.2e} {p['flops']:>10.3e} {gib:>20} "
                     f"{p['saved_levels_host_bytes'] / memory.GIB:>9.2f}")
    lines += _curve_lines(facts)
    lines.append(f"total: {facts['total_steps']} steps, {facts['total_flops']:.3e} FLOPs; the same steps without "
                 f"multi-level training: {facts['baseline_flops']:.3e} FLOPs (ratio {facts['flops_ratio']:.3f})")
    if plan.grow_only:
        start = "the pretrained" if plan.init_from else "a fresh"
        lines.append(f"grow-only: starts with {start} level-{plan.phases[0].level} model and only goes up; nothing is "
                     f"saved, so de-coalescing is not interpolated")
    if plan.init_from:
        lines.append(f"init_from: {describe(plan.init_from)}; the optimizer, schedule and sampler start at step 0 "
                     f"(a training checkpoint in checkpoint.dir is resumed instead)")
    if plan.random_ltd:
        r = plan.random_ltd
        routed = "; ".join(f"level {k}: {list(plan.routed_layers(k))}" for k in range(1, len(plan.levels) + 1))
        clock = ", learning rate on the LayerToken clock" if r.layer_token_lr else ""
        lines.append(f"random-LTD: routed layers keep {r.min_value} -> {r.max_value} tokens over {r.require_steps} "
                     f"steps{clock}; routed layers {routed}")
    lines += facts["regime"]["lines"]
    lines.append("memory: model state only (activations, DeepSpeed buffers and the CUDA context come on top); "
                 "host GiB: larger levels kept for the way up")
    return "\n".join(lines)


def _curve_lines(facts: dict) -> list[str]:
    lr = facts["lr"]
    shape = {"cosine": "cosine", "linear": "linear", "wsd": f"warmup-stable-decay (last {lr.get('decay_fraction')} "
                                                            f"decays linearly)"}[lr["shape"]]
    lines = [f"learning rate: {lr['warmup_steps']} warmup steps, then {shape} to {lr['min_lr_ratio']:g} of the peak, "
             f"over the {'whole run' if lr['span'] == 'run' else 'phase'}; step: lr (global steps from 0)"]
    for p in facts["phases"]:
        lines.append(f"  phase {p['phase']} (level {p['level']}): "
                     + ", ".join(f"{step}: {value:.3e}" for step, value in p["lr_curve"]))
    return lines


def _plans(args, world: int) -> dict[str, RunPlan]:
    """The plan of a run config, or of every variant of a bench config (`base` + `variants`)."""
    data = load_yaml(args.config) if args.config else {}
    if "variants" not in data:
        return {"": build_plan(load_run_config(args.config, args.overrides), world)}
    from msds.bench.variants import variant_configs

    configs = variant_configs(data, Path("bench_out"), args.overrides, world)
    return {name: build_plan(cfg, world) for name, cfg in configs.items()}


def _run(args) -> int:
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    plans = _plans(args, world)
    report = {}
    for name, plan in plans.items():
        facts = summary(plan)
        try:
            check_environment(plan)
        except (ConfigError, MsdsError) as exc:
            facts["note"] = f"on this machine msds train would stop: {exc}"
        report[name] = facts
        if not args.json:
            print(f"== {name} ==" if name else "", end="\n" if name else "")
            print(table(plan, facts))
            if "note" in facts:
                print(f"note: {facts['note']}")
    if args.json:
        print(json.dumps(report[""] if list(report) == [""] else report, indent=1))
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=False, help="YAML run or bench config, or a packaged recipe's name")
    parser.add_argument("--world-size", type=int, default=0, metavar="N",
                        help="number of processes of the run (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config fields")
    parser.set_defaults(run=_run)
