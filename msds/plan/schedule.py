"""The V-cycle's time axis: phases, the learning-rate curves (warmup, then a cosine, linear or
warmup-stable-decay decay), FLOPs per sample.

Pure functions and frozen records; `msds.plan.build` decides their values from the config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from msds.config import ModelConfig


@dataclass(frozen=True)
class Phase:
    """A stretch of the run spent at one level. Global steps `start_step` (inclusive) to
    `end_step` (exclusive)."""

    index: int
    level: int          # 1 = the full-size model
    steps: int
    start_step: int
    peak_lr: float
    warmup_steps: int

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


@dataclass(frozen=True)
class Decay:
    """What the learning rate does after the warmup (optimizer.schedule): `cosine` or `linear` from
    the peak down to `min_ratio` of it at the end of the span, or `wsd` (warmup-stable-decay): the
    peak held until the last `fraction` of the span, then a linear decay to `min_ratio`."""

    shape: str = "cosine"
    min_ratio: float = 0.1
    fraction: float = 0.2

    def decay_start(self, steps: int, warmup_steps: int) -> int:
        """The step (of a span of `steps`) at which the decay begins: right after the warmup, or
        under `wsd` at the start of its last `fraction` (the plan keeps that after the warmup)."""
        if self.shape != "wsd":
            return warmup_steps
        return steps - round(self.fraction * steps)

    def __call__(self, progress: float) -> float:
        """The multiplier of the peak at `progress` (0 to 1) through the decay."""
        if self.shape == "cosine":
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_ratio + (1 - self.min_ratio) * (1 - progress)


def lr_multiplier(phase: Phase, step_in_phase: float, decay: Decay) -> float:
    """Linear warmup over the phase's warmup steps, then `decay` over the rest of the phase (under
    `wsd` the peak first, until the decay's start)."""
    if step_in_phase < phase.warmup_steps:
        return (step_in_phase + 1) / phase.warmup_steps
    start = decay.decay_start(phase.steps, phase.warmup_steps)
    if step_in_phase < start:
        return 1.0
    span = max(1, phase.steps - start)
    return decay(min(1.0, (step_in_phase - start) / span))


@dataclass(frozen=True)
class PhaseCurve:
    """`lr_schedule: phase` (and a baseline): the phase's own warmup and decay."""

    phase: Phase
    decay: Decay

    def __call__(self, step_in_phase: int) -> float:
        return lr_multiplier(self.phase, step_in_phase, self.decay)


def layer_token_step(consumed: tuple[float, ...], step: int) -> float:
    """Random-LTD's LayerToken clock: step `step` of a span whose `consumed[k]` layer-tokens were
    processed after k steps, as the step a constant consumption would have reached."""
    steps = len(consumed) - 1
    return consumed[min(step, steps)] / consumed[-1] * steps


@dataclass(frozen=True)
class RunCurve:
    """`lr_schedule: run`: one warmup and decay over the whole run (`whole_run`, the baseline's
    schedule); every phase after the first re-warms up to that curve over its own warmup steps.
    With `consumed` (layer-tokens after k steps of the run) the curve runs on the LayerToken clock."""

    phase: Phase
    whole_run: Phase
    decay: Decay
    consumed: Optional[tuple[float, ...]] = None

    def __call__(self, step_in_phase: int) -> float:
        rewarm = 1.0 if self.phase.index == 0 else min(1.0, (step_in_phase + 1) / max(1, self.phase.warmup_steps))
        step = self.phase.start_step + step_in_phase
        clock = step if self.consumed is None else layer_token_step(self.consumed, step)
        return rewarm * lr_multiplier(self.whole_run, clock, self.decay)


@dataclass(frozen=True)
class LayerTokenCurve:
    """Random-LTD's LayerToken schedule: the phase's warmup and decay advance with consumed
    layer-tokens rather than steps, so early steps (short sequences in the routed layers) move the
    schedule less. `consumed[k]` = layer-tokens after k steps of the phase."""

    phase: Phase
    decay: Decay
    consumed: tuple[float, ...]

    def __call__(self, step_in_phase: int) -> float:
        return lr_multiplier(self.phase, layer_token_step(self.consumed, step_in_phase), self.decay)


def flops_per_sample(cfg: ModelConfig, seq_len: int, keep_tokens: Optional[int] = None, routed: int = 0) -> float:
    """Forward + backward FLOPs of one sample (docs/method.md §5.1): 6 x matmul parameters
    per token plus the attention score and value products, 12 x attention width x sequence length per
    token and layer. With random-LTD, `routed` layers (the plan's, per level) see `keep_tokens`
    tokens."""
    h, a, f = cfg.hidden_size, cfg.attention_size, cfg.ffn_size
    layer_params = 3 * a * h + a * h + 2 * f * h
    outside_layers = (h * h if cfg.arch == "bert" else 0) + cfg.vocab_size * h   # BERT transform, tied head
    routed = routed if keep_tokens is not None else 0
    kept = keep_tokens or seq_len

    def layer_flops(tokens: int) -> float:
        return 6 * layer_params * tokens + 12 * a * tokens * tokens

    return 6 * outside_layers * seq_len + (cfg.num_layers - routed) * layer_flops(seq_len) + routed * layer_flops(kept)
