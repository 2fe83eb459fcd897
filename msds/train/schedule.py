"""The V-cycle as a list of phases, learning rates within a phase, and FLOPs per step."""
from __future__ import annotations

import math
from dataclasses import dataclass

from msds.config import ConfigError, ModelConfig, RunConfig
from msds.multilevel.operators import LevelMap, plan_level


@dataclass(frozen=True)
class Phase:
    index: int
    level: int          # 1 = the full-size model
    steps: int
    first_step: int     # global step at which the phase starts
    peak_lr: float
    warmup_steps: int

    @property
    def last_step(self) -> int:
        return self.first_step + self.steps


def level_maps(cfg: RunConfig) -> list[LevelMap]:
    """maps[k] turns level k+1 into level k+2 (0-based list; level 1 is `cfg.model`). With tensor
    parallelism, heads and FFN are grouped inside each rank's shard, so that a transition needs no
    communication along the tensor-parallel axis; a grouping that fits every shard also leaves every
    smaller level divisible by the tensor-parallel size. With pipeline parallelism, layers are
    grouped inside each stage, and every level must keep at least one layer per stage."""
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    shards = cfg.multilevel.shards or tp
    check_tensor_parallel(cfg.model, tp, "level-1")
    check_pipeline(cfg.model, pp, "level-1")
    maps, large = [], cfg.model
    if not cfg.multilevel.enabled:
        return maps
    for i, level in enumerate(cfg.multilevel.levels):
        path = f"multilevel.levels[{i}]"
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


def check_pipeline(model: ModelConfig, pp: int, where: str) -> None:
    if model.num_layers % pp:
        raise ConfigError(f"parallel.pipeline: {pp} stages cannot share the {model.num_layers} layers of the "
                          f"{where} model equally; choose a pipeline size that divides the layers at every level")


def check_tensor_parallel(model: ModelConfig, tp: int, where: str) -> None:
    for name in ("num_heads", "ffn_size", "vocab_size"):
        if getattr(model, name) % tp:
            raise ConfigError(f"parallel.tensor: {tp} does not divide {name} {getattr(model, name)} of the "
                              f"{where} model; choose a tensor-parallel size that divides it at every level")


def level_model(cfg: RunConfig, maps: list[LevelMap], level: int) -> ModelConfig:
    return cfg.model if level == 1 else maps[level - 2].small


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


def plan_phases(cfg: RunConfig, single: bool = False) -> list[Phase]:
    """The run's phases; `single`: the whole run as one level-1 phase (the baseline's schedule)."""
    if single or not cfg.multilevel.enabled:
        return [Phase(0, 1, cfg.training.steps, 0, cfg.optimizer.lr, cfg.optimizer.warmup_steps)]
    depth = len(cfg.multilevel.levels) + 1
    cycle = list(range(2, depth + 1)) + list(range(depth - 1, 0, -1))   # after the first level-1 phase
    levels = [1] + cycle * cfg.multilevel.cycles
    phases, step = [], 0
    for index, (level, steps) in enumerate(zip(levels, cfg.multilevel.phase_steps)):
        warmup = cfg.optimizer.warmup_steps if index == 0 else cfg.multilevel.phase_warmup_steps
        phases.append(Phase(index, level, steps, step, peak_lr(cfg, level), min(warmup, steps)))
        step += steps
    return phases


def lr_multiplier(phase: Phase, step_in_phase: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay from 1 to `min_ratio` over the rest of the phase."""
    if step_in_phase < phase.warmup_steps:
        return (step_in_phase + 1) / phase.warmup_steps
    span = max(1, phase.steps - phase.warmup_steps)
    progress = min(1.0, (step_in_phase - phase.warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def flops_per_sample(cfg: ModelConfig, seq_len: int, keep_tokens: int | None = None) -> float:
    """Forward + backward FLOPs of one sample (METHOD.md 1.4): 6 x matmul parameters per token plus
    the attention score and value products, 12 x attention width x sequence length per token and
    layer. With random-LTD, the routed layers (all but the first and last) see `keep_tokens` tokens."""
    h, a, f = cfg.hidden_size, cfg.attention_size, cfg.ffn_size
    layer_params = 3 * a * h + a * h + 2 * f * h
    outside_layers = (h * h if cfg.arch == "bert" else 0) + cfg.vocab_size * h   # BERT transform, tied head
    routed = max(0, cfg.num_layers - 2) if keep_tokens is not None else 0
    full_layers = cfg.num_layers - routed
    kept = keep_tokens or seq_len

    def layer_flops(tokens: int) -> float:
        return 6 * layer_params * tokens + 12 * a * tokens * tokens

    return 6 * outside_layers * seq_len + full_layers * layer_flops(seq_len) + routed * layer_flops(kept)
