"""Memory per rank of one level's training state, estimated from the parameter table.

Counted: weights, gradients and the optimizer state (fp32 master weights where the precision is
mixed, Adam's two moments), on the rank whose pipeline stage holds the most parameters, with the
tensor-parallel split of megatron-core's layers and the ZeRO partitioning over data-parallel ranks:
stage 1 partitions the optimizer state, stage 2 also the gradients, stage 3 also the weights.
Not counted: activations (they depend on the micro-batch, sequence and recomputation), DeepSpeed's
buffers and the CUDA context. Host memory: the V-cycle keeps each rank's 1/dp share of every larger
level's fp32 weights (and moments, under `optimizer_policy: map`) while it trains a smaller one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from msds.config import ModelConfig
from msds.model.roles import expected_shapes, tensor_parallel_dim

GIB = 2.0 ** 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def stage_parameters(model: ModelConfig, tensor: int, pipeline: int) -> list[int]:
    """Parameters held by one tensor-parallel rank of each pipeline stage. The first stage holds the
    embeddings, the last the head; with more than one stage the tied word embeddings live on both."""
    per_stage = [0] * pipeline
    layers_per_stage = model.num_layers // pipeline
    for name, shape in expected_shapes(model).items():
        numel = math.prod(shape) // (tensor if tensor_parallel_dim(name) is not None else 1)
        if name.startswith("layers."):
            stages = [int(name.split(".")[1]) // layers_per_stage]
        elif name == "embeddings.word.weight":
            stages = sorted({0, pipeline - 1})
        elif name.startswith("embeddings."):
            stages = [0]
        else:
            stages = [pipeline - 1]
        for stage in stages:
            per_stage[stage] += numel
    return per_stage


def training_state(model: ModelConfig, tensor: int, pipeline: int, data: int, zero_stage: int,
                   precision: str) -> MemoryEstimate:
    params = max(stage_parameters(model, tensor, pipeline))
    mixed = precision in ("bf16", "fp16")
    weight_bytes = 2 if mixed else 4
    optimizer_bytes = (4 if mixed else 0) + 8          # fp32 master copy when mixed, exp_avg, exp_avg_sq
    return MemoryEstimate(weights=params * weight_bytes / (data if zero_stage >= 3 else 1),
                          gradients=params * weight_bytes / (data if zero_stage >= 2 else 1),
                          optimizer=params * optimizer_bytes / (data if zero_stage >= 1 else 1))


def saved_level(model: ModelConfig, tensor: int, pipeline: int, data: int, with_moments: bool) -> float:
    """Host bytes one rank keeps of a larger level while a smaller one trains (fp32, 1/dp share)."""
    params = max(stage_parameters(model, tensor, pipeline))
    return params * (12 if with_moments else 4) / data
