"""The run plan: every cross-field check and every derived value of a run, decided once.

`build_plan(cfg, world_size)` turns a parsed RunConfig (msds.config: field types only) and the
process count into an immutable `RunPlan`: the parallel layout, the model of every level and the
level maps between them, the phases, each phase's learning-rate curve, the random-LTD schedule,
FLOPs per step, the DeepSpeed config of each phase and what `model.init_from` loads
(msds/plan/pretrained.py). Trainer, engine and transitions only read it; `msds plan` prints it.
Errors are `ConfigError`s that start with the dotted field path and say how to fix it.
`check_environment` adds what depends on this machine (the prepared data, the accelerator's
precisions): `msds train` runs both, `msds plan` reports the second as notes.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from msds.config import ConfigError, ModelConfig, RunConfig
from msds.model.roles import expected_shapes
from msds.multilevel.operators import LevelMap, check_alpha, plan_level
from msds.plan import random_ltd as random_ltd_config
from msds.plan.pretrained import InitFrom, plan_init_from
from msds.plan.random_ltd import RandomLTD
from msds.plan.schedule import Decay, LayerTokenCurve, Phase, PhaseCurve, RunCurve, flops_per_sample
from msds.resources import ds_configs_dir, ds_template, ds_template_names


@dataclass(frozen=True)
class Layout:
    """How the processes split: tensor x pipeline x data = world size."""

    world_size: int
    tensor: int
    pipeline: int

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.pipeline)


@dataclass(frozen=True)
class RunPlan:
    """Everything a run derives from its config. Read-only: `config` is the plan's own copy of the
    config as run (derived values filled in), not to be edited."""

    config: RunConfig
    layout: Layout
    levels: tuple[ModelConfig, ...]          # levels[k - 1] is level k; level 1 is the full model
    level_maps: tuple[LevelMap, ...]         # level_maps[k - 1] turns level k into level k + 1
    phases: tuple[Phase, ...]
    lr_curves: tuple[Callable[[int], float], ...]   # per phase: step in phase -> multiplier of peak_lr
    lr_milestones: tuple[int, ...]           # global steps where a warmup ends or a decay starts
    random_ltd: Optional[RandomLTD]
    ds_template: str                         # the DeepSpeed JSON, random-LTD section removed
    baseline_steps: int                      # the run without multi-level training: budget_steps or as many steps
    init_from: Optional[InitFrom] = None     # model.init_from: what the first phase's level loads

    # -- sizes ------------------------------------------------------------------------------

    @property
    def total_steps(self) -> int:
        return self.phases[-1].end_step

    @property
    def samples_per_step(self) -> int:
        t = self.config.training
        return t.micro_batch_size * t.grad_accum * self.layout.data

    @property
    def tokens_per_step(self) -> int:
        return self.samples_per_step * self.config.data.seq_len

    @property
    def multilevel(self) -> bool:
        return len(self.phases) > 1

    @property
    def grow_only(self) -> bool:
        """A run that starts at the coarsest level and only goes up (multilevel.start_level > 1):
        nothing is saved, so its transitions de-coalesce without interpolating."""
        return self.config.multilevel.enabled and self.config.multilevel.start_level > 1

    def model(self, level: int) -> ModelConfig:
        return self.levels[level - 1]

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the word embedding at every level: model.vocab_size rounded up to a multiple of
        model.make_vocab_size_divisible_by x parallel.tensor (Megatron's padding), so that every
        tensor-parallel rank holds an equal slice of the vocabulary."""
        model = self.config.model
        multiple = model.make_vocab_size_divisible_by * self.layout.tensor
        return -(-model.vocab_size // multiple) * multiple

    # -- per step ---------------------------------------------------------------------------

    def keep_tokens(self, step: int) -> Optional[int]:
        """Tokens each routed layer keeps at `step` (None: random-LTD off)."""
        return self.random_ltd.keep_tokens(step) if self.random_ltd else None

    def routed_layers(self, level: int) -> tuple[int, ...]:
        """The layers random-LTD routes at `level` (none when it is off)."""
        return self.random_ltd.routed(level) if self.random_ltd else ()

    def flops_per_step(self, level: int, step: int) -> float:
        return _step_flops(self.model(level), self.config.data.seq_len, self.keep_tokens(step),
                           len(self.routed_layers(level)), self.samples_per_step)

    def steps_flops(self, level: int, start: int, end: int) -> float:
        """FLOPs of steps start..end-1 at `level` (constant per step unless random-LTD varies it)."""
        if self.random_ltd is None:
            return (end - start) * self.flops_per_step(level, start)
        return sum(self.flops_per_step(level, s) for s in range(start, end))

    def phase_flops(self, phase: Phase) -> float:
        return self.steps_flops(phase.level, phase.start_step, phase.end_step)

    def transition_flops(self, from_level: int, to_level: int) -> float:
        return _transition_flops(self.model(min(from_level, to_level)), self.layout.data)

    def total_flops(self) -> float:
        steps = sum(self.phase_flops(p) for p in self.phases)
        moves = sum(self.transition_flops(a.level, b.level) for a, b in zip(self.phases, self.phases[1:]))
        return steps + moves

    def baseline_flops(self) -> float:
        """The run without multi-level training: `baseline_steps` at level 1."""
        return self.steps_flops(1, 0, self.baseline_steps)

    def lr_at(self, step: int) -> float:
        """The learning rate of global step `step` (0-based), as the phase's engine applies it."""
        phase = next(p for p in self.phases if p.start_step <= step < p.end_step)
        return phase.peak_lr * self.lr_curves[phase.index](step - phase.start_step)

    # -- DeepSpeed --------------------------------------------------------------------------

    def ds_config(self, phase: Phase) -> dict:
        """A fresh DeepSpeed config for the engine of `phase` (the optimizer's lr is its peak; the
        plan's curve scales it every step)."""
        ds = json.loads(self.ds_template)
        params = ds["optimizer"]["params"]
        params["lr"] = phase.peak_lr
        if params.get("fused") == "auto":
            # torch's fused AdamW (one kernel per step, not some nine passes over the state) where the
            # engine is built: on CUDA. Elsewhere the default AdamW, whose CPU arithmetic the committed
            # CPU results were trained with (ds_configs/README.md).
            from deepspeed.accelerator import get_accelerator

            params["fused"] = get_accelerator().device_name() == "cuda"
        return ds


# --------------------------------------------------------------------------------------------
# Building and checking
# --------------------------------------------------------------------------------------------

def build_plan(cfg: RunConfig, world_size: int = 1) -> RunPlan:
    """Check `cfg` for `world_size` processes and derive the whole run. The plan keeps a copy of the
    config as run (`training.steps` filled in from the phases); the caller's object is not changed."""
    cfg = copy.deepcopy(cfg)
    _check_fields(cfg)
    _check_parallel_options(cfg)
    # A level is a shape; where the run's first weights come from is the run's (model.init_from).
    model = dataclasses.replace(cfg.model, init_from="")
    maps = _level_maps(cfg, model)   # every level fits the parallel sizes, before the world size is asked
    layout = _layout(cfg, world_size)
    levels = (model,) + tuple(m.small for m in maps)
    template = _read_ds_template(cfg)
    efficiency = template.pop("data_efficiency", None) or {}
    if efficiency.get("enabled") and (efficiency.get("data_sampling") or {}).get("enabled"):
        raise ConfigError("training.ds_config: data_efficiency.data_sampling (curriculum learning) is not supported "
                          "by msds; disable it (msds implements only data_routing.random_ltd)")
    ltd = random_ltd_config.parse(efficiency, cfg.model, cfg.data.seq_len, tuple(maps))
    _check_schedule(cfg)
    phases = _phases(cfg, levels, ltd, layout)
    baseline_steps = cfg.multilevel.budget_steps or phases[-1].end_step
    _name_derived_values(cfg, phases)
    ds = _fill_ds_config(template, cfg, layout)
    first = phases[0].level
    init_from = None if not cfg.model.init_from else \
        plan_init_from(cfg.model.init_from, levels[first - 1], first, grow_only=first > 1)
    plan = RunPlan(config=cfg, layout=layout, levels=levels, level_maps=tuple(maps), phases=tuple(phases),
                   lr_curves=(), lr_milestones=(), random_ltd=ltd, ds_template=json.dumps(ds),
                   baseline_steps=baseline_steps, init_from=init_from)
    curves, milestones = _lr_curves(plan)
    return dataclasses.replace(plan, lr_curves=curves, lr_milestones=milestones)


def _name_derived_values(cfg: RunConfig, phases: list[Phase]) -> None:
    """The copy as run names what was derived, so that its config.yaml (and a plan of it) gives the
    same run: a V-cycle's length, and phases sized from budget_steps."""
    cfg.training.steps = phases[-1].end_step
    if cfg.multilevel.enabled and cfg.multilevel.budget_steps:
        cfg.multilevel.phase_steps = [p.steps for p in phases]
        cfg.multilevel.budget_steps, cfg.multilevel.phase_fractions = 0, []


def check_environment(plan: RunPlan) -> None:
    """What `msds train` also needs of this machine: the prepared data (its vocabulary fits the
    model) and an accelerator that supports the precision."""
    from msds.data.blend import DataSpec, tokenizer_info

    cfg = plan.config
    info = tokenizer_info(DataSpec.of(cfg.data))
    if info.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({info.vocab_size}) of the data; set model.vocab_size="
                          f"{info.vocab_size} or more")
    if cfg.training.precision == "fp16":
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise ConfigError(f"training.precision: fp16 is not supported by DeepSpeed's "
                              f"{get_accelerator().device_name()} accelerator; use bf16 or fp32 here")


def _check_data(cfg: RunConfig) -> None:
    for number, entry in enumerate(cfg.data.blend):
        if not (len(entry) == 2 and isinstance(entry[0], (int, float)) and not isinstance(entry[0], bool)
                and entry[0] > 0 and isinstance(entry[1], str)):
            raise ConfigError(f"data.blend[{number}]: {entry!r} is not [weight, path] with a positive weight")
    if cfg.model.nsp_head and not cfg.data.sentence_order:
        raise ConfigError("model.nsp_head: no loss trains the next-sentence head without sentence pairs, so "
                          "its parameters would never learn; set data.sentence_order=true or model.nsp_head=false")
    if cfg.data.sentence_order:
        if cfg.model.arch != "bert" or not cfg.model.nsp_head:
            raise ConfigError("data.sentence_order: sentence-order pairs need a BERT model with its "
                              "next-sentence head; set model.nsp_head=true (BERT) or data.sentence_order=false")
        if cfg.parallel.pipeline > 1:
            raise ConfigError("data.sentence_order: the pipeline's last stage computes the masked-LM loss "
                              "only; set parallel.pipeline=1 or data.sentence_order=false")
    if cfg.data.prefetch < 0:
        raise ConfigError(f"data.prefetch: {cfg.data.prefetch}; set the number of batches built ahead, "
                          f"or 0 (none)")
    k = cfg.data.max_predictions_per_seq
    if k and not (cfg.model.arch == "bert" and cfg.parallel.pipeline == 1 and 0 < k <= cfg.data.seq_len - 3):
        raise ConfigError(f"data.max_predictions_per_seq: {k} needs a BERT model without a pipeline and at most "
                          f"data.seq_len - 3 = {cfg.data.seq_len - 3} predictions; set it within 1.."
                          f"{cfg.data.seq_len - 3}, or 0 (every chosen token)")


def _check_fields(cfg: RunConfig) -> None:
    cfg.model.validate("model")
    positive = {"data.seq_len": cfg.data.seq_len, "training.micro_batch_size": cfg.training.micro_batch_size,
                "training.grad_accum": cfg.training.grad_accum, "logging.interval": cfg.logging.interval,
                "logging.eval_interval": cfg.logging.eval_interval,
                "logging.eval_batches": cfg.logging.eval_batches, "multilevel.cycles": cfg.multilevel.cycles,
                "checkpoint.keep": cfg.checkpoint.keep, "parallel.tensor": cfg.parallel.tensor,
                "parallel.pipeline": cfg.parallel.pipeline, "optimizer.lr": cfg.optimizer.lr}
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{name}: must be positive, got {value}")
    if cfg.data.seq_len > cfg.model.max_positions:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds model.max_positions {cfg.model.max_positions}")
    _check_data(cfg)
    if cfg.training.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"training.zero_stage: must be 0, 1, 2 or 3, got {cfg.training.zero_stage}")
    _check_decay_fields(cfg)
    name = cfg.training.exit_signal
    if name and not (name.startswith("SIG") and isinstance(getattr(signal, name, None), signal.Signals)):
        raise ConfigError(f"training.exit_signal: {name!r} is not a signal name (e.g. SIGUSR1, SIGTERM); "
                          f"empty turns it off")
    _check_guards(cfg.training)
    _check_compile(cfg)


def _check_compile(cfg: RunConfig) -> None:
    """torch.compile of the blocks is verified on one flat model per process with ZeRO 0-2."""
    unsupported = {"parallel.pipeline > 1": cfg.parallel.pipeline > 1, "parallel.tensor > 1": cfg.parallel.tensor > 1,
                   "training.zero_stage=3": cfg.training.zero_stage == 3}
    clash = next((name for name, present in unsupported.items() if present), None)
    if cfg.training.compile and clash:
        raise ConfigError(f"training.compile: compiled blocks are not supported with {clash} (its layers and "
                          f"hooks are not verified under torch.compile); set training.compile=false")


def _check_guards(training) -> None:
    """The bad-step and hang guards' fields (msds.train.guards)."""
    at_least_zero = {"training.max_bad_steps": training.max_bad_steps, "training.hang_timeout_s": training.hang_timeout_s,
                     "training.startup_timeout_s": training.startup_timeout_s}
    for name, value in at_least_zero.items():
        if value < 0:
            raise ConfigError(f"{name}: must be 0 (off) or more, got {value}")
    if training.spike_factor and training.spike_factor <= 1:
        raise ConfigError(f"training.spike_factor: {training.spike_factor} would flag ordinary steps; give a "
                          f"multiple above 1 of the recent mean loss, or 0 to turn spike checks off")
    if training.spike_window < 1:
        raise ConfigError(f"training.spike_window: must be positive, got {training.spike_window}")


def _check_decay_fields(cfg: RunConfig) -> None:
    o = cfg.optimizer
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optimizer.min_lr_ratio: must be in [0, 1] (a fraction of the peak), got {o.min_lr_ratio}")
    if o.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps: must be 0 or more, got {o.warmup_steps}")
    if o.schedule == "wsd" and not 0 < o.decay_fraction <= 1:
        raise ConfigError(f"optimizer.decay_fraction: must be in (0, 1] (the share of the run that decays), "
                          f"got {o.decay_fraction}")


def _check_parallel_options(cfg: RunConfig) -> None:
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    if pp > 1 and cfg.training.zero_stage != 1:
        why = ("DeepSpeed pipelines do not support ZeRO 2 or 3" if cfg.training.zero_stage > 1 else
               "DeepSpeed 0.19.8's ZeRO-0 pipeline path clips gradients by a norm that leaves out the "
               "later stages' replicated parameters (LayerNorms, biases), so it would not train like the "
               "same run without a pipeline")
        raise ConfigError(f"training.zero_stage: {cfg.training.zero_stage} with parallel.pipeline={pp}: {why}; "
                          f"pipelines run with training.zero_stage=1")
    ml = cfg.multilevel
    if ml.enabled and ml.shards and ml.shards % tp:
        raise ConfigError(f"multilevel.shards: {ml.shards} is not a multiple of parallel.tensor {tp}; each "
                          f"tensor-parallel shard must hold whole groups")


def _layout(cfg: RunConfig, world_size: int) -> Layout:
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    if world_size <= 0 or world_size % (tp * pp):
        raise ConfigError(f"parallel: tensor ({tp}) x pipeline ({pp}) parallel sizes must divide the number of "
                          f"processes, {world_size}; launch a multiple of {tp * pp} processes or change "
                          f"parallel.tensor / parallel.pipeline")
    return Layout(world_size, tp, pp)


def _check_divisible(model: ModelConfig, tp: int, pp: int, where: str) -> None:
    # The vocabulary is padded to a multiple of tp instead (RunPlan.padded_vocab_size).
    for name in ("num_heads", "ffn_size"):
        if getattr(model, name) % tp:
            raise ConfigError(f"parallel.tensor: {tp} does not divide {name} {getattr(model, name)} of the "
                              f"{where} model; choose a tensor-parallel size that divides it at every level")
    if model.num_layers % pp:
        raise ConfigError(f"parallel.pipeline: {pp} stages cannot share the {model.num_layers} layers of the "
                          f"{where} model equally; choose a pipeline size that divides the layers at every level")


def _level_maps(cfg: RunConfig, model: ModelConfig) -> list[LevelMap]:
    """maps[k] turns level k+1 into level k+2. With tensor parallelism, heads and FFN are grouped
    inside each rank's shard, so that a transition needs no communication along the tensor-parallel
    axis; a grouping that fits every shard also leaves every smaller level divisible by the
    tensor-parallel size. With pipeline parallelism, layers are grouped inside each stage, and every
    level must keep at least one layer per stage. `model` is level 1."""
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    _check_divisible(model, tp, pp, "level-1")
    if not cfg.multilevel.enabled:
        return []
    shards = cfg.multilevel.shards or tp
    maps, large = [], model
    if not cfg.multilevel.levels:
        raise ConfigError("multilevel.levels: at least one coarser level is needed")
    for i, level in enumerate(cfg.multilevel.levels):
        path = f"multilevel.levels[{i}]"
        if level.lr < 0:
            raise ConfigError(f"{path}.lr: must be positive (or 0 for the default), got {level.lr}")
        small_layers, rest = divmod(large.num_layers, level.layers)
        if pp > 1 and not rest and small_layers % pp:
            raise ConfigError(f"{path}.layers: level {i + 2} would have {small_layers} layer(s), which the "
                              f"parallel.pipeline={pp} stages cannot share equally (each stage keeps whole groups "
                              f"of layers at every level); use a smaller layers factor or fewer pipeline stages")
        try:
            level_map = plan_level(large, hidden=level.hidden, heads=level.heads, ffn=level.ffn,
                                   layers=level.layers, layout=level.layout, depth_layout=level.depth_layout,
                                   shards={"heads": shards, "ffn": shards, "layers": pp}, path=path)
        except ConfigError as exc:
            if shards == 1:
                raise
            raise ConfigError(f"{exc} (heads and FFN are grouped inside each of the {shards} shards of "
                              f"parallel.tensor={tp} / multilevel.shards)") from exc
        maps.append(level_map)
        large = level_map.small
    return maps


def _check_schedule(cfg: RunConfig) -> None:
    ml = cfg.multilevel
    if not ml.enabled:
        if cfg.training.steps <= 0:
            raise ConfigError(f"training.steps: must be positive, got {cfg.training.steps}")
        return
    check_alpha(ml.alpha, "multilevel.alpha")
    if ml.phase_warmup_steps < 0:
        raise ConfigError(f"multilevel.phase_warmup_steps: must be 0 or more, got {ml.phase_warmup_steps}")
    coarsest = len(ml.levels) + 1
    if ml.start_level != 1 and ml.start_level != coarsest:
        raise ConfigError(f"multilevel.start_level: {ml.start_level}, but multilevel.levels define levels "
                          f"1..{coarsest}; use 1 (V-cycles from the full-size model) or {coarsest} (grow from the "
                          f"coarsest level)")
    if ml.start_level > 1 and ml.cycles != 1:
        raise ConfigError(f"multilevel.cycles: {ml.cycles}, but a grow-only run (start_level {ml.start_level}) goes "
                          f"up once; set cycles to 1")
    if ml.budget_steps < 0:
        raise ConfigError(f"multilevel.budget_steps: must be 0 or more, got {ml.budget_steps}")
    if ml.budget_steps and ml.phase_steps:
        raise ConfigError("multilevel.phase_steps: give either phase_steps or budget_steps (with phase_fractions), "
                          "not both")
    if ml.phase_fractions and not ml.budget_steps:
        raise ConfigError("multilevel.phase_fractions: only used with multilevel.budget_steps; set budget_steps "
                          "or give phase_steps instead")


def _phase_count(cfg: RunConfig, verb: str, verb_singular: str) -> str:
    """What decides the number of phases, for error messages ('... need(s) N phases')."""
    ml, order = cfg.multilevel, _level_order(cfg)
    if ml.start_level > 1:
        return f"a grow-only run from level {ml.start_level} {verb_singular} {len(order)} phases (levels {order})"
    return f"{len(ml.levels) + 1} levels and {ml.cycles} cycle(s) {verb} {len(order)} phases"


def _check_phase_steps(cfg: RunConfig, steps: list[int]) -> None:
    ml = cfg.multilevel
    if len(steps) != len(_level_order(cfg)):
        shape = "" if ml.start_level > 1 else " (down, bottom, up)"
        raise ConfigError(f"multilevel.phase_steps: {_phase_count(cfg, 'need', 'needs')}{shape}, got {len(steps)}; "
                          f"or size them from multilevel.budget_steps")
    for i, n in enumerate(steps):
        if n <= 0:
            raise ConfigError(f"multilevel.phase_steps[{i}]: must be positive, got {n}")
    if cfg.training.steps not in (0, sum(steps), ml.budget_steps):   # a converted baseline keeps its steps
        raise ConfigError(f"training.steps: {cfg.training.steps} differs from the sum of multilevel.phase_steps "
                          f"({sum(steps)}); set it to 0 or to that sum")


# Phase lengths as fractions of the baseline's budget, for one cycle of two levels: coalesce after
# 10% of it, then 80% of its steps at half width and depth, each of which costs about a quarter of a
# full-size step. With multilevel.phase_warmup_steps' default (48) this is the layout that met the
# bar on every seed of both architectures against their swept baselines (BENCHMARKS.md, "The
# speedup at the prototype scale"; docs/method.md §7.7);
# coalescing after 20% saved less there, and with a 10-step re-warmup coalescing after 10% left
# one BERT seed on the unigram plateau (§7.5).
DEFAULT_PHASE_FRACTIONS = (0.1, 0.8)


def _budget_phase_steps(cfg: RunConfig, levels: tuple[ModelConfig, ...], ltd: Optional[RandomLTD],
                        layout: Layout) -> list[int]:
    """Phase lengths from multilevel.budget_steps: the fractions for every phase but the last, and
    the last (level-1) phase as long as the budget's FLOPs allow."""
    ml = cfg.multilevel
    budget = ml.budget_steps
    order = _level_order(cfg)
    count = len(order)
    vcycle_of_two = ml.start_level == 1 and count == 3
    fractions = list(ml.phase_fractions) or (list(DEFAULT_PHASE_FRACTIONS) if vcycle_of_two else [])
    if len(fractions) != count - 1:
        raise ConfigError(f"multilevel.phase_fractions: {_phase_count(cfg, 'have', 'has')}; give the first "
                          f"{count - 1} as fractions of budget_steps (the default {list(DEFAULT_PHASE_FRACTIONS)} is "
                          f"for one V-cycle of two levels)")
    for i, f in enumerate(fractions):
        if not 0 < f < 1:
            raise ConfigError(f"multilevel.phase_fractions[{i}]: must be in (0, 1), got {f}")
    samples = cfg.training.micro_batch_size * cfg.training.grad_accum * layout.data

    def step_flops(level: int, step: int) -> float:
        if ltd is None:
            return _step_flops(levels[level - 1], cfg.data.seq_len, None, 0, samples)
        return _step_flops(levels[level - 1], cfg.data.seq_len, ltd.keep_tokens(step), len(ltd.routed(level)), samples)

    steps = [max(1, round(f * budget)) for f in fractions]
    spent, step = 0.0, 0
    for level, n in zip(order, steps):
        spent += sum(step_flops(level, s) for s in range(step, step + n))
        step += n
    spent += sum(_transition_flops(levels[min(a, b) - 1], layout.data) for a, b in zip(order, order[1:]))
    allowed = budget * step_flops(1, 0) if ltd is None else sum(step_flops(1, s) for s in range(budget))
    if ltd is None:                      # constant cost per step: no need to walk the steps
        last = int((allowed - spent) // step_flops(1, 0))
    else:
        last = 0
        while spent + step_flops(1, step + last) <= allowed:
            spent += step_flops(1, step + last)
            last += 1
    if last <= 0:
        raise ConfigError(f"multilevel.phase_fractions: the first {count - 1} phases already spend the FLOPs of "
                          f"budget_steps={budget} full-size steps; shorten them so the last phase has steps left")
    return steps + [last]


def peak_lr(cfg: RunConfig, level: int) -> float:
    """The level's own `lr`, else optimizer.lr times the product of hidden and layer factors down to
    it (smaller models take a larger learning rate: 4x for half width and half depth, the paper's)."""
    if level == 1:
        return cfg.optimizer.lr
    spec = cfg.multilevel.levels[level - 2]
    if spec.lr > 0:
        return spec.lr
    scale = 1
    for down in cfg.multilevel.levels[:level - 1]:
        scale *= down.hidden * down.layers
    return cfg.optimizer.lr * scale


def _level_order(cfg: RunConfig) -> list[int]:
    """The level of each phase: level 1, then for each cycle down to the coarsest and back up; a
    grow-only run goes from its start level up to level 1."""
    if not cfg.multilevel.enabled:
        return [1]
    if cfg.multilevel.start_level > 1:
        return list(range(cfg.multilevel.start_level, 0, -1))
    depth = len(cfg.multilevel.levels) + 1
    return [1] + (list(range(2, depth + 1)) + list(range(depth - 1, 0, -1))) * cfg.multilevel.cycles


def _phases(cfg: RunConfig, levels: tuple[ModelConfig, ...], ltd: Optional[RandomLTD], layout: Layout) -> list[Phase]:
    """The run's phases; the baseline is one level-1 phase. Warmup is the optimizer's for the first
    phase (as given) and multilevel.phase_warmup_steps, at most the phase's length, for the others."""
    if not cfg.multilevel.enabled:
        return [Phase(0, 1, cfg.training.steps, 0, cfg.optimizer.lr, cfg.optimizer.warmup_steps)]
    steps = _budget_phase_steps(cfg, levels, ltd, layout) if cfg.multilevel.budget_steps else cfg.multilevel.phase_steps
    _check_phase_steps(cfg, steps)
    phases, start = [], 0
    for index, (level, n) in enumerate(zip(_level_order(cfg), steps)):
        warmup = cfg.optimizer.warmup_steps if index == 0 else cfg.multilevel.phase_warmup_steps
        phases.append(Phase(index, level, n, start, peak_lr(cfg, level), min(warmup, n)))
        start += n
    return phases


def _step_flops(model: ModelConfig, seq_len: int, keep_tokens: Optional[int], routed: int, samples: int) -> float:
    return flops_per_sample(model, seq_len, keep_tokens, routed) * samples


def _transition_flops(larger: ModelConfig, data_parallel: int) -> float:
    """A transition costs about ten elementwise passes over the parameters and moments of the
    larger model on every data-parallel replica: negligible next to a step, but counted."""
    return 10 * sum(math.prod(s) for s in expected_shapes(larger).values()) * data_parallel


def _lr_curves(plan: RunPlan) -> tuple[tuple[Callable[[int], float], ...], tuple[int, ...]]:
    """Each phase's learning-rate curve: its own warmup and decay, or (`lr_schedule: run`) its part
    of one run-long schedule; on random-LTD's LayerToken clock when layer_token_lr_schedule is on.
    With them, the global steps at which a warmup ends and a decay starts (for `msds plan`)."""
    cfg = plan.config
    decay = Decay(cfg.optimizer.schedule, cfg.optimizer.min_lr_ratio, cfg.optimizer.decay_fraction)
    layer_tokens = plan.random_ltd is not None and plan.random_ltd.layer_token_lr
    if run_long_schedule(cfg):
        whole_run = Phase(0, 1, plan.total_steps, 0, cfg.optimizer.lr, cfg.optimizer.warmup_steps)
        _check_wsd_run(plan, decay, whole_run)
        consumed = _consumed_layer_tokens(plan, plan.phases) if layer_tokens else None
        return (tuple(RunCurve(phase, whole_run, decay, consumed) for phase in plan.phases),
                _milestones(decay, [whole_run], plan.phases[1:]))
    for phase in plan.phases:
        _check_decay_after_warmup(decay, phase, "the run" if not plan.multilevel else f"phase {phase.index}")
    milestones = _milestones(decay, plan.phases)
    if not layer_tokens:
        return tuple(PhaseCurve(phase, decay) for phase in plan.phases), milestones
    return (tuple(LayerTokenCurve(phase, decay, _consumed_layer_tokens(plan, [phase])) for phase in plan.phases),
            milestones)


def _milestones(decay: Decay, decaying, rewarming=()) -> tuple[int, ...]:
    """Global steps (on the step clock) where each decaying span's warmup ends and its decay starts,
    and where each re-warming phase of a run-long schedule rejoins it."""
    steps = {p.start_step + p.warmup_steps for p in rewarming}
    for span in decaying:
        steps.add(span.start_step + span.warmup_steps)
        steps.add(span.start_step + decay.decay_start(span.steps, span.warmup_steps))
    return tuple(sorted(steps))


def run_long_schedule(cfg: RunConfig) -> bool:
    """Whether one learning-rate schedule spans the whole run (a V-cycle with lr_schedule: run)."""
    return cfg.multilevel.enabled and cfg.multilevel.lr_schedule == "run"


def _check_decay_after_warmup(decay: Decay, span: Phase, what: str) -> None:
    start = decay.decay_start(span.steps, span.warmup_steps)
    if start < span.warmup_steps:
        raise ConfigError(f"optimizer.decay_fraction: {decay.fraction} of the {span.steps} steps of {what} starts the "
                          f"decay at step {start}, inside its {span.warmup_steps}-step warmup; use a decay_fraction "
                          f"of at most {(span.steps - span.warmup_steps) / span.steps:.3f} or a shorter warmup")


def _check_wsd_run(plan: RunPlan, decay: Decay, whole_run: Phase) -> None:
    """Under a run-long warmup-stable-decay the smaller levels train in the stable stretch: the decay
    must start within the last phase, at full size, so that it ends the run as the baseline's does."""
    if decay.shape != "wsd":
        return
    _check_decay_after_warmup(decay, whole_run, "the run")
    last = plan.phases[-1]
    start = decay.decay_start(whole_run.steps, whole_run.warmup_steps)
    if start < last.start_step:
        raise ConfigError(f"optimizer.decay_fraction: {decay.fraction} of the V-cycle's {whole_run.steps} steps starts "
                          f"the decay at step {start}, before its last phase at full size (steps {last.start_step}-"
                          f"{last.end_step}), so a smaller level or a transition would fall in the decay; use a "
                          f"decay_fraction of at most {math.floor(1000 * last.steps / whole_run.steps) / 1000:.3f} "
                          f"(the last phase's share of the run) or lengthen the last phase "
                          f"(multilevel.phase_steps / phase_fractions)")


def _consumed_layer_tokens(plan: RunPlan, phases) -> tuple[float, ...]:
    """Layer-tokens processed after k steps of `phases` (consecutive), for k = 0 .. their steps; each
    level counts its own layers and routed layers."""
    consumed = [0.0]
    for phase in phases:
        model = plan.model(phase.level)
        for step in range(phase.start_step, phase.end_step):
            consumed.append(consumed[-1] + plan.random_ltd.layer_tokens(step, phase.level, model,
                                                                        plan.samples_per_step))
    return tuple(consumed)


def _read_ds_template(cfg: RunConfig) -> dict:
    """The DeepSpeed JSON the run starts from (training.ds_config, else the packaged
    ds_configs/zero<stage>.json)."""
    path = Path(cfg.training.ds_config) if cfg.training.ds_config else ds_template(cfg.training.zero_stage)
    if not path.is_file() and path.parent in (Path("."), Path("ds_configs")):
        path = ds_configs_dir() / path.name           # a template shipped with msds, by name
    if not path.is_file():
        raise ConfigError(f"training.ds_config: {cfg.training.ds_config} does not exist; give a path to a DeepSpeed "
                          f"JSON or the name of a packaged one ({', '.join(ds_template_names())})")
    try:
        template = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"training.ds_config: {path} is not valid JSON ({exc})") from exc
    if not isinstance(template, dict):
        raise ConfigError(f"training.ds_config: {path} must hold a JSON object")
    return template


def _fill(section: dict, key: str, value, path: str) -> None:
    """Set an "auto" or absent value; a different explicit value contradicts the msds config."""
    current = section.get(key, "auto")
    if current == "auto":
        section[key] = value
    elif current != value:
        raise ConfigError(f"training.ds_config: {path} is {current!r} but the msds config says {value!r}; "
                          f"set it to \"auto\" in the JSON or change the msds config")


def _fill_ds_config(ds: dict, cfg: RunConfig, layout: Layout) -> dict:
    """The JSON template with msds's values filled in (the optimizer's lr is set per phase)."""
    t, o = cfg.training, cfg.optimizer
    _fill(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size, "train_micro_batch_size_per_gpu")
    _fill(ds, "gradient_accumulation_steps", t.grad_accum, "gradient_accumulation_steps")
    if "train_batch_size" in ds and ds["train_batch_size"] != "auto":
        _fill(ds, "train_batch_size", t.micro_batch_size * t.grad_accum * layout.data, "train_batch_size")
    ds.pop("train_batch_size", None)
    _fill(ds, "gradient_clipping", o.grad_clip, "gradient_clipping")
    zero = ds.setdefault("zero_optimization", {})
    _fill(zero, "stage", t.zero_stage, "zero_optimization.stage")
    optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    if optimizer.get("type", "AdamW").lower() not in ("adamw", "adam"):
        raise ConfigError(f"training.ds_config: optimizer.type {optimizer['type']!r}; msds trains with "
                          f"AdamW (its moments are what transitions map)")
    params = optimizer.setdefault("params", {})
    _fill(params, "lr", o.lr, "optimizer.params.lr")   # each phase's engine then gets its level's peak
    _fill(params, "betas", [o.beta1, o.beta2], "optimizer.params.betas")
    _fill(params, "eps", o.eps, "optimizer.params.eps")
    _fill(params, "weight_decay", o.weight_decay, "optimizer.params.weight_decay")
    for name in ("bf16", "fp16"):
        _fill(ds.setdefault(name, {}), "enabled", t.precision == name, f"{name}.enabled")
    if "scheduler" in ds:
        raise ConfigError("training.ds_config: remove the \"scheduler\" section; msds schedules the "
                          "learning rate per V-cycle phase (optimizer.* and multilevel.* in the msds config)")
    return ds
