"""The msds transformer as a DeepSpeed pipeline (`parallel.pipeline` > 1), from transformer.py's
modules, unchanged.

Layer specs, in order (N layers, P stages):

    0          word embeddings (tied)       first stage: looks the input ids up
    1          other embeddings             first stage
    2..N+1     blocks 0..N-1                N/P per stage, in order
    N+2        word embeddings (tied)       last stage: hands its weight to the head
    N+3        head                         last stage: logits (BERT: of the labelled positions); the
                                            loss is `token_loss` (BERT: `labeled_token_loss`)

DeepSpeed keeps the two copies of the word embeddings equal (the last stage's copy is broadcast
from the first at start and after loading; their gradients are summed before each step). Between
stages the activations are `(hidden, *extras)`: none for GPT; BERT's attention mask and its labels,
which the head needs to run on the labelled positions only (msds.model.transformer.labeled_positions).
The first stage receives `(input_ids,)` (GPT) or `(input_ids, token_type_ids, attention_mask,
labels)` (BERT) and the last the labels for the loss (`pipeline_batch`).

Each unit is built from its own random stream (`unit_rng`), so a pipeline has the initial weights of
the flat model with the same seed, and every parameter has the flat model's name
(`named_parameters`): transitions, checkpoint conversion and exports see the same tensors whatever
the pipeline layout. Stages hold equal numbers of blocks, so a depth grouping planned with
shards = P (msds.plan.build, the level maps) keeps every group of layers inside one stage.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state

from msds.compat import deepspeed_0_19 as ds_compat
from msds.config import ModelConfig
from msds.data.samples import IGNORE_INDEX
from msds.model.roles import routed_layers as default_routed_layers
from msds.model.transformer import (Block, Embeddings, LMHead, WordEmbedding, init_seed,
                                    labeled_positions, megatron_config, route_tokens, sdpa_mask,
                                    token_loss, unit_rng)

TIED_WORD = "word"


class Routing:
    """The random-LTD token count of the current batch (None: every token), shared by a stage's
    blocks; the trainer sets it before each batch."""

    keep_tokens: Optional[int] = None


class PipeWordEmbedding(WordEmbedding):
    def __init__(self, cfg: ModelConfig, seed: int, padded_vocab_size: int):
        with unit_rng(seed, "embeddings.word"):
            super().__init__(cfg, megatron_config(cfg), padded_vocab_size)

    def forward(self, inputs):
        input_ids, *rest = inputs
        return (super().forward(input_ids), *rest)


def _hand_over_weight(word: PipeWordEmbedding, inputs):
    """The last stage's use of the tied word embeddings: the head's output weight, after the
    activations."""
    return (*inputs, word.weight)


class PipeEmbeddings(Embeddings):
    def __init__(self, cfg: ModelConfig, seed: int):
        with unit_rng(seed, "embeddings"):
            super().__init__(cfg, megatron_config(cfg), word=None)

    def forward(self, inputs):
        if self.arch == "gpt":
            return (self.add_positions(inputs[0]),)
        word_vectors, token_type_ids, attention_mask, labels = inputs
        return self.add_positions(word_vectors, token_type_ids), attention_mask, labels


class PipeBlock(Block):
    def __init__(self, cfg: ModelConfig, index: int, seed: int, routing: Routing, routable: bool):
        with unit_rng(seed, f"layers.{index}"):
            super().__init__(cfg, megatron_config(cfg))
        self.arch = cfg.arch
        self.routing = routing
        self.routable = routable

    def forward(self, inputs):
        # With tensor parallelism DeepSpeed partitions the activations sent between stages and
        # hands a one-element tuple over as the bare tensor.
        h, *extras = (inputs,) if torch.is_tensor(inputs) else inputs
        attention_mask = extras[0] if extras else None
        keep = self.routing.keep_tokens
        if self.routable and keep is not None and keep < h.shape[1]:
            h = route_tokens(super().forward, h, attention_mask, keep, self.arch)
        else:
            h = super().forward(h, sdpa_mask(self.arch, attention_mask))
        return (h, *extras)


class PipeHead(LMHead):
    def __init__(self, cfg: ModelConfig, seed: int, padded_vocab_size: int):
        with unit_rng(seed, "head"):
            super().__init__(cfg, megatron_config(cfg), padded_vocab_size)

    def forward(self, inputs):
        h, *extras, word_weight = inputs
        if self.arch == "bert":   # extras: the attention mask and the labels
            h, _ = labeled_positions(h, extras[1])
        return super().forward(h, word_weight)


def labeled_token_loss(labeled_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """BERT's pipeline loss: the head's logits are those of the labelled positions only (PipeHead)."""
    return token_loss(labeled_logits, labels[labels != IGNORE_INDEX])


def unit_prefixes(cfg: ModelConfig) -> list[Optional[str]]:
    """The flat model's name prefix of each layer spec's parameters, by spec index (None: the tied
    repeat on the last stage, whose parameters are the first stage's)."""
    return ["embeddings.word.", "embeddings.", *(f"layers.{i}." for i in range(cfg.num_layers)), None, "head."]


class PipelineTransformer(PipelineModule):
    """This process's stage of the pipeline over megatron-core's parallel state (pipeline, tensor
    and data parallel sizes). `seed`, `padded_vocab_size` and `routed_layers` as for Transformer."""

    def __init__(self, cfg: ModelConfig, seed: Optional[int] = None, padded_vocab_size: Optional[int] = None,
                 routed_layers: Optional[tuple[int, ...]] = None):
        cfg.validate()
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        seed = init_seed() if seed is None else seed
        vocab = padded_vocab_size or cfg.vocab_size
        routing = Routing()
        routed = default_routed_layers(cfg.num_layers) if routed_layers is None else routed_layers
        # In unit_prefixes' order: that list names each spec's parameters.
        specs = [TiedLayerSpec(TIED_WORD, PipeWordEmbedding, cfg, seed, vocab, tied_weight_attr="weight"),
                 LayerSpec(PipeEmbeddings, cfg, seed),
                 *(LayerSpec(PipeBlock, cfg, i, seed, routing, i in routed) for i in range(cfg.num_layers)),
                 TiedLayerSpec(TIED_WORD, PipeWordEmbedding, cfg, seed, vocab, forward_fn=_hand_over_weight,
                               tied_weight_attr="weight"),
                 LayerSpec(PipeHead, cfg, seed, vocab)]
        # DeepSpeed's axes (pipe, data, model) are megatron's order (pipeline slowest, tensor fastest).
        topology = PipeModelDataParallelTopology(
            num_pp=stages, num_mp=parallel_state.get_tensor_model_parallel_world_size(),
            num_dp=parallel_state.get_data_parallel_world_size())
        # Every engine of a run (one per V-cycle phase) has this layout: reuse its process groups.
        with ds_compat.reused_process_groups():
            super().__init__(specs, topology=topology, partition_method="type:^PipeBlock$",
                             loss_fn=labeled_token_loss if cfg.arch == "bert" else token_loss)
        self.cfg = cfg
        self.routing = routing
        self._prefixes = unit_prefixes(cfg)
        self._check_layout(stages)

    def _check_layout(self, stages: int) -> None:
        dp_ranks, pp_ranks = ds_compat.pipeline_group_ranks(self)
        same = (dist.get_process_group_ranks(parallel_state.get_data_parallel_group()) == dp_ranks
                and dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()) == pp_ranks)
        if not same:
            raise RuntimeError("DeepSpeed's pipeline topology and megatron-core's parallel state disagree on "
                               "the data- or pipeline-parallel groups")
        per_stage = self.cfg.num_layers // stages
        blocks = [i for i in ds_compat.local_layer_indices(self) if self._prefixes[i] and
                  self._prefixes[i].startswith("layers.")]
        if len(blocks) != per_stage:
            raise RuntimeError(f"pipeline stage {self.stage_id} holds {len(blocks)} blocks, expected {per_stage}")

    def canonical_name(self, name: str) -> str:
        head, rest = name.split(".", 1)
        if head == "tied_modules":
            key, rest = rest.split(".", 1)
            assert key == TIED_WORD, name
            return "embeddings.word." + rest
        return self._prefixes[int(head)] + rest


def named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """A model's parameters under the flat model's names (msds.model.roles), pipeline stage or not."""
    if isinstance(model, PipelineTransformer):
        for name, param in model.named_parameters():
            yield model.canonical_name(name), param
    else:
        yield from model.named_parameters()


def pipeline_batch(batch: dict[str, torch.Tensor], arch: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A loader batch as DeepSpeed's pipeline takes it: (first stage's inputs, last stage's labels)."""
    if arch == "gpt":
        return (batch["input_ids"],), batch["labels"]
    return (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], batch["labels"]), batch["labels"]
