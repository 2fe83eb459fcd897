"""DeepSpeed engines for msds models: the engine of a plan's phase (a PipelineEngine when
parallel.pipeline > 1), one training step and one evaluation whatever the engine, and full-tensor
access to its fp32 weights and Adam moments whatever the ZeRO stage, under the flat model's names.

DeepSpeed keeps fp32 master weights (and ZeRO partitions of them) that overwrite any in-place edit
of the module's parameters at the next step (docs/method.md §8.2). msds therefore never
edits a live engine's weights: a transition reads the full tensors out one at a time, builds a
fresh model from the new tensors (one at a time again) and a fresh engine around it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import NamedTuple, Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_optimizer_state

from msds.compat import deepspeed_0_19 as ds_compat
from msds.plan import Phase, RunPlan
from msds.distributed import DeepSpeedMPU
from msds.model.pipeline import PipelineTransformer, named_parameters, pipeline_batch
from msds.model.roles import tensor_parallel_dim
from msds.model.transformer import Transformer
from msds.train import faults
from msds.train.guards import update_skipped

MOMENTS = ("exp_avg", "exp_avg_sq")


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not biases, LayerNorms or the vocabulary bias)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if len(ds_compat.full_shape(p)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# torch.nn.init's in-place fills: every initialisation msds's models make (their own, torch's
# modules' reset_parameters, megatron-core's init methods) calls them through the module attribute.
_INIT_FILLS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
               "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def weights_not_drawn():
    """Within it, torch.nn.init's fills leave their tensor as it is: a model built here has every
    parameter allocated but not initialised (whatever torch.empty's memory held), for a caller that
    then overwrites every parameter (build_engine from a transition's tensors, which raises
    when one is not given). The global RNG advances as it would (the model's seed is
    still drawn; the units draw from forked streams), so what follows draws the same numbers.
    Evidence that the result is the same: tests/test_transition.py::
    test_a_transition_builds_the_same_engine_without_drawing_weights."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FILLS}
    for name in _INIT_FILLS:
        setattr(torch.nn.init, name, _left_as_is)
    try:
        yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def _left_as_is(tensor, *args, **kwargs):
    return tensor


def build_engine(plan: RunPlan, phase: Phase, tensors: Iterable[tuple[str, torch.Tensor]] | None,
                 every_parameter: bool = True):
    """A fresh model of `phase`'s level, wrapped in a fresh DeepSpeed engine with the phase's config
    and learning-rate curve. Its weights: random, or `tensors`, (flat-model name, full tensor) pairs
    covering this stage's parameters once each (some of them, when not `every_parameter`: the rest
    keep their random initialisation), in an order that is the same on every data-parallel rank,
    consumed one at a time (a transition computes each when asked, so that no rank holds the whole
    new model). Under ZeRO 3 such a model is built partitioned (deepspeed.zero.Init): each
    parameter holds only this rank's partition, filled from its tensor through a short gather."""
    model_cfg = plan.model(phase.level)
    pipelined = plan.layout.pipeline > 1
    ds_config = plan.ds_config(phase)
    partitioned = tensors is not None and ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    # mem_efficient_linear off: Init would otherwise replace torch's linear while the model is built.
    # Weights that `tensors` overwrite are not drawn first (weights_not_drawn: same RNG, same result).
    with (deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=DeepSpeedMPU, mem_efficient_linear=False)
          if partitioned else contextlib.nullcontext()), \
            (weights_not_drawn() if tensors is not None and every_parameter and not partitioned
             else contextlib.nullcontext()):
        model = (PipelineTransformer if pipelined else Transformer)(model_cfg, padded_vocab_size=plan.padded_vocab_size,
                                                                     routed_layers=plan.routed_layers(phase.level))
    if tensors is not None:
        _fill(model, tensors, partitioned, every_parameter)
    if plan.config.training.compile:
        # Each block in place (Module.compile): parameter names, hooks and the model's type stay.
        for block in model.layers:
            block.compile()
    # A pipeline brings its own process-group grid (DeepSpeed refuses an mpu then).
    lr_curve = plan.lr_curves[phase.index]
    # A plain function, not the curve object: LambdaLR saves (and on resume restores) the attributes
    # of callable objects into checkpoints; the plan's curve is derived afresh on every start.
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model, plan.config.optimizer.weight_decay),
        config=ds_config, dist_init_required=False, mpu=None if pipelined else DeepSpeedMPU,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_curve(s)))
    ds_compat.fewer_syncs_and_launches(engine)
    return engine


def _fill(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], partitioned: bool,
          every_parameter: bool) -> None:
    """Copy `tensors` into a model not yet in an engine (DeepSpeed makes its fp32 master copies from
    them). A partitioned parameter is gathered, written on every rank (all hold the same tensor) and
    partitioned again from rank 0's copy: one parameter's full size at a time."""
    params = dict(named_parameters(model))
    missing = set(params)
    with torch.no_grad():
        for name, value in tensors:
            param = params[name]
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=partitioned):
                param.copy_(value)
            missing.discard(name)
    if missing and every_parameter:
        raise RuntimeError(f"{sorted(missing)[0]}: no tensor given for this parameter of the new model")


def is_pipeline(engine) -> bool:
    return isinstance(engine.module, PipelineTransformer)


def train_step(engine, batches, grad_accum: int, keep_tokens: int | None,
               apply: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches; returns their mean loss (this rank's, or
    for a pipeline, already averaged over the data-parallel replicas and held by every stage).
    `apply(loss)`, when given, hears that loss before the optimizer update and says whether to make
    it (msds.train.guards); a pipeline's engine steps inside train_batch, where it hears this rank's
    share of the loss (msds.compat.deepspeed_0_19.pipeline_step_decided)."""
    faults.point("hang-before-step")
    if is_pipeline(engine):
        engine.module.routing.keep_tokens = keep_tokens
        arch = engine.module.cfg.arch
        with faults.poisoned_pipeline_loss(engine.module), \
                ds_compat.pipeline_step_decided(engine, apply or (lambda loss: True), update_skipped):
            return engine.train_batch((pipeline_batch(next(batches), arch) for _ in range(grad_accum)))
    losses = []
    for micro_batch in range(grad_accum):
        loss = faults.poisoned(engine(**on_device(next(batches), engine.device), keep_tokens=keep_tokens))
        engine.backward(loss)
        losses.append(loss.detach())
        if micro_batch < grad_accum - 1:
            engine.step()   # between accumulation boundaries: no update
    loss = torch.stack(losses).mean()
    with contextlib.nullcontext() if apply is None or apply(loss) else update_skipped(engine):
        engine.step()
    return loss


class Evaluation(NamedTuple):
    loss: float
    sop_accuracy: Optional[float]
    """With sentence-order pairs: the share whose order the next-sentence head predicts (argmax);
    else None."""


def evaluate(engine, batches: list[dict]) -> Evaluation:
    """Mean loss over `batches` (every token, no random-LTD) and, in the same pass, the
    sentence-order accuracy of batches that carry sentence-order labels (never a pipeline's: the plan
    refuses sentence-order pairs there)."""
    if is_pipeline(engine):
        engine.module.routing.keep_tokens = None
        arch = engine.module.cfg.arch
        loss = engine.eval_batch(iter([pipeline_batch(b, arch) for b in batches]), num_micro_batches=len(batches))
        return Evaluation(loss.item(), None)
    engine.eval()
    losses, correct, pairs = [], 0, 0
    with torch.no_grad():
        for batch in batches:
            batch = on_device(batch, engine.device)
            if "next_sentence_labels" in batch:
                loss, logits = engine(**batch, sentence_order_logits=True)
                correct += int((logits.argmax(dim=-1) == batch["next_sentence_labels"]).sum())
                pairs += len(logits)
            else:
                loss = engine(**batch)
            losses.append(loss.item())
    engine.train()
    return Evaluation(sum(losses) / len(losses), correct / pairs if pairs else None)


def on_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A loader batch (host tensors) on the engine's device; DeepSpeed's engine does not move inputs
    (its pipeline engine does, for the micro-batches it loads). An attention mask that masks nothing
    (msds's samples are never padded) is left out: attention without a mask may take a fused kernel
    that a mask rules out (flash attention), and the outputs are the same. Read on the host, before
    the copy (`numpy()`: host memory only), so it costs the device no sync."""
    mask = batch.get("attention_mask")
    if mask is not None and mask.device.type == "cpu" and mask.numpy().all():
        batch = {key: value for key, value in batch.items() if key != "attention_mask"}
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _plain_optimizer_state(engine, param) -> dict:
    """ZeRO stage 0 in fp32: the torch optimizer holds the parameter itself."""
    return engine.optimizer.state[param]


def full_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter's full (over data parallelism; this rank's tensor-parallel shard) fp32 value
    on the engine's device: each tensor is gathered in turn and a copy of it kept, so the result
    holds the whole model at once on every rank (for the exported model; transitions stream with
    `tensor_reader`)."""
    return {name: full_weight(p) for name, p in named_parameters(engine.module)}


def full_weight(param) -> torch.Tensor:
    """One parameter's full (over data parallelism) fp32 value, a copy: a collective of the
    data-parallel group under ZeRO 1-3, so every rank asks for the same parameters in turn."""
    full = safe_get_full_fp32_param(param)
    return (param.detach() if full is None else full).float().clone()


def gather_tensor_parallel(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole (TP=1) tensors from every tensor-parallel rank's shards, concatenated along the axis
    megatron-core splits (msds.model.roles.tensor_parallel_dim)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return tensors
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, shard in tensors.items():
        dim = tensor_parallel_dim(name)
        if dim is None:
            out[name] = shard
            continue
        pieces = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(pieces, shard.contiguous(), group=group)
        out[name] = torch.cat(pieces, dim=dim)
    return out


def gather_pipeline_stages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's tensors (host copies), merged, on every rank of this pipeline."""
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages == 1:
        return tensors
    pieces = [None] * stages
    dist.all_gather_object(pieces, {name: t.cpu() for name, t in tensors.items()},
                           group=parallel_state.get_pipeline_model_parallel_group())
    return {name: t for piece in pieces for name, t in piece.items()}


def full_moments(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's exp_avg and exp_avg_sq of every parameter, like `full_weights` (for tests: transitions
    stream with `tensor_reader`)."""
    names, read = tensor_reader(engine, moments=True)
    return {key: {name: read(key, name) for name in names} for key in MOMENTS}


def tensor_reader(engine, moments: bool) -> tuple[list[str], Callable[[str, str], torch.Tensor]]:
    """This stage's parameter names and `read(kind, name)`: one parameter's full fp32 weight (kind
    "param", full_weight) or Adam moment (full_moment; `moments` must be true), a fresh copy. Every
    read is a collective, so every data-parallel rank reads the same tensors in the same order."""
    params = dict(named_parameters(engine.module))
    if moments:
        ds_compat.relink_hp_optimizer_states(engine)   # every group's moments visible (a DeepSpeed 0.19.8 bug)

    def read(kind: str, name: str) -> torch.Tensor:
        return full_weight(params[name]) if kind == "param" else full_moment(engine, params[name], kind)

    return list(params), read


def full_moment(engine, param, key: str) -> torch.Tensor:
    """One parameter's full Adam moment `key` (a copy), a collective like `full_weight`. Call
    ds_compat.relink_hp_optimizer_states(engine) once before (as `tensor_reader` does)."""
    full = safe_get_full_optimizer_state(param, key)
    if full is None:
        full = _plain_optimizer_state(engine, param).get(key, torch.zeros_like(param))
    return full.float().clone()


def optimizer_step_count(engine) -> int:
    """The optimizer steps taken so far (AdamW's `step` of the first state that has one), 0 before
    the first step."""
    for state in ds_compat.base_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def _materialise_optimizer_state(engine, key: str) -> None:
    """torch's AdamW creates its state at the first step and ZeRO 1/2 link their per-parameter
    views to it only then; a fresh engine that is to receive mapped moments needs both now, for
    moment `key` (one moment at a time: a transition then holds one moment's zeros, not both, next
    to the values it installs)."""
    base = ds_compat.base_optimizer(engine)
    for flat in ds_compat.optimizer_state_flats(engine):
        state = base.state[flat]
        state.setdefault("step", _step_counter(base, flat, 0))
        if key not in state:
            state[key] = torch.zeros_like(flat)
    ds_compat.relink_hp_optimizer_states(engine)   # every group's moments visible (a DeepSpeed 0.19.8 bug)


def set_moments(engine, moments: Callable[[str], Iterable[tuple[str, torch.Tensor]]], step: int) -> None:
    """Install Adam's moments and the step count into a fresh engine's (partitioned) state.
    `moments(key)` yields (flat-model name, full tensor) for every parameter of this stage, in the
    same order on every data-parallel rank; each tensor is installed (this rank's part of it kept)
    before the next is asked for."""
    base = ds_compat.base_optimizer(engine)
    params = dict(named_parameters(engine.module))
    for key in MOMENTS:
        _materialise_optimizer_state(engine, key)
        missing = set(params)
        for name, value in moments(key):
            p = params[name]
            if ds_compat.is_zero_managed(p):
                safe_set_full_optimizer_state(p, value.to(p.device), key)
            else:
                base.state[p][key].copy_(value)
            missing.discard(name)
        if missing:
            raise RuntimeError(f"{sorted(missing)[0]}: no {key} given for this parameter of the new engine")
    for flat, state in base.state.items():
        state["step"] = _step_counter(base, flat, step)


def _step_counter(base, flat: torch.Tensor, step: int) -> torch.Tensor:
    """AdamW's step counter as torch creates it: a host scalar, but on the parameter's device for a
    fused or capturable AdamW, whose kernels read it there (a host counter fails its first step on
    a GPU: "state_steps is on cpu")."""
    on_device = base.defaults.get("fused") or base.defaults.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=flat.device if on_device else "cpu")


def destroy_engine(engine) -> None:
    """Release an engine's optimizer, partitions and hooks before the next one is built."""
    engine.destroy()
    ds_compat.release_zero3_references(engine.module)
    engine.module = None
    engine.optimizer = None
