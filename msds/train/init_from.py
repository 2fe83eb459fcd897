"""The first engine of a run started from a pretrained model (`model.init_from`, planned by
msds/plan/pretrained.py): the checkpoint's tensors go into the fresh model before DeepSpeed
wraps it, as a resume on another layout puts its whole tensors in (msds/train/relayout.py): each
rank reads only the tensors its pipeline stage holds, and of an msds directory only its
tensor-parallel slices of them (the vocabulary padded with zero rows); under ZeRO 3 each parameter
is then partitioned at once.
The parameters the checkpoint lacks keep the model's initialisation from training.seed. Nothing
else is taken from the checkpoint: the optimizer, the schedule and the sampler start at step 0.
"""
from __future__ import annotations

from megatron.core import parallel_state

from msds.model import pretrained
from msds.plan import Phase, RunPlan
from msds.train.engine import build_engine
from msds.train.relayout import local_shard, stage_names


def pretrained_engine(plan: RunPlan, phase: Phase):
    """The engine of the run's first phase with plan.init_from's weights."""
    init = plan.init_from
    stage = parallel_state.get_pipeline_model_parallel_rank()
    names = sorted(stage_names(plan, phase.level, stage) & set(init.loaded))   # the same order on every rank
    shards = pretrained.read(init.source, names, lambda name, whole, shape: local_shard(name, whole, shape, plan))
    return build_engine(plan, phase, shards, every_parameter=False)

