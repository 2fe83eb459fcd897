"""The msds transformer: BERT (post-LN encoder) and GPT (pre-LN decoder) in one implementation.

Architecture only. Parallelism comes from megatron-core's tensor-parallel layers, so the tensor-
parallel size is whatever megatron's parallel state says (msds.distributed sets it up); every other
concern (engines, checkpoints, transitions, metrics) lives outside this file.

The model is a flat sequence of units, `word embeddings -> other embeddings -> layers[0..N-1] ->
head`, so that a pipeline (msds/model/pipeline.py) can cut it between any two units and reuse these
modules unchanged. Each unit draws its initial weights from a random stream of its own, so a model
has the same weights whatever its pipeline layout. Parameter names are declared, with the meaning of
each axis, in msds/model/roles.py.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel
from torch import nn

from msds.config import ModelConfig
from msds.data.samples import IGNORE_INDEX
from msds.model.linear_loss import linear_cross_entropy
from msds.model.roles import routed_layers as default_routed_layers

try:  # NVIDIA apex's fused LayerNorm, when importable; torch's LayerNorm otherwise.
    from apex.normalization import FusedLayerNorm as LayerNorm
except ImportError:
    LayerNorm = nn.LayerNorm


def _normal_init(std: float):
    return lambda weight: nn.init.normal_(weight, mean=0.0, std=std)


def megatron_config(cfg: ModelConfig) -> ModelParallelConfig:
    # CPU initialisation builds each full weight from the global RNG and keeps this rank's slice,
    # so a model has the same weights whatever its tensor-parallel size.
    return ModelParallelConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
    )


def init_seed() -> int:
    """A model's initialisation seed, drawn from the global RNG (so `torch.manual_seed` decides it)."""
    return int(torch.randint(0, 2**31 - 1, ()))


@contextlib.contextmanager
def unit_rng(seed: int, unit: str):
    """Build one unit of the model from a random stream of its own, derived from the model's seed
    and the unit's name: a pipeline stage builds only its own units, and they must come out the same
    as in the whole model. The global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(f"{seed}/{unit}".encode()))
        yield


def _vocab_init(std: float, vocab_size: int):
    """Normal rows for the vocabulary, zero rows for the padding after it: the vocabulary's rows come
    out as in an unpadded model with the same seed, and the padding stays zero in training (its
    logits are masked, so no gradient reaches it, and weight decay keeps zero at zero)."""
    def init(weight):
        nn.init.normal_(weight[:vocab_size], mean=0.0, std=std)
        nn.init.zeros_(weight[vocab_size:])
    return init


class WordEmbedding(tensor_parallel.VocabParallelEmbedding):
    """The (vocab-parallel) word embeddings, which the output layer reuses as its weight:
    `padded_vocab_size` rows, the first cfg.vocab_size of them the vocabulary's."""

    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, padded_vocab_size: int):
        super().__init__(padded_vocab_size, cfg.hidden_size, init_method=_vocab_init(cfg.init_std, cfg.vocab_size),
                         config=mp, tp_group=parallel_state.get_tensor_model_parallel_group())


def sdpa_mask(arch: str, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """SDPA mask from a (batch, seq) keep-mask; None when nothing is masked (GPT: causal only)."""
    if attention_mask is None or arch == "gpt":
        return None
    return attention_mask.bool()[:, None, None, :]


def kept_positions(batch: int, seq_len: int, keep_tokens: int, arch: str, device=None) -> torch.Tensor:
    """Random-LTD's draw: for each sample, a random sorted subset of `keep_tokens` positions
    ([batch, keep_tokens]), for BERT always including [CLS]. Sorted so the kept tokens stay in
    order: the causal mask of the subset is then the top-left corner of the full one."""
    scores = torch.rand(batch, seq_len, device=device)
    if arch == "bert":
        # BERT's [CLS] (position 0) is always kept: it has no masked-LM label, yet fine-tuning
        # classifies from its final hidden state, which would otherwise skip each routed layer
        # with probability 1 - keep_tokens / seq_len (docs/method.md §6.1).
        scores[:, 0] = -1.0
    return scores.argsort(dim=1)[:, :keep_tokens].sort(dim=1).values


def route_tokens(layer, h: torch.Tensor, attention_mask: Optional[torch.Tensor], keep_tokens: int,
                 arch: str) -> torch.Tensor:
    """Random-LTD: `layer(h, sdpa_mask)` sees the `kept_positions` of each sample, a fresh draw per
    layer; the other tokens skip it unchanged (and get no gradient through it)."""
    batch, seq_len, width = h.shape
    kept = kept_positions(batch, seq_len, keep_tokens, arch, h.device)
    index = kept.unsqueeze(-1).expand(batch, keep_tokens, width)
    mask = None if attention_mask is None else sdpa_mask(arch, attention_mask.gather(1, kept))
    return h.scatter(1, index, layer(h.gather(1, index), mask))


class Embeddings(nn.Module):
    """Word (vocab-parallel) + learned position (+ token-type and LayerNorm for BERT) embeddings.
    `word` is None in a pipeline, where the first stage's tied word embedding looks the words up."""

    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig,
                 word: Optional[WordEmbedding]):
        super().__init__()
        self.arch = cfg.arch
        self.word = word
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        nn.init.normal_(self.position.weight, std=cfg.init_std)
        if cfg.arch == "bert":
            self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
            nn.init.normal_(self.token_type.weight, std=cfg.init_std)
            self.norm = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids, token_type_ids=None):
        return self.add_positions(self.word(input_ids), token_type_ids)

    def add_positions(self, word_vectors, token_type_ids=None):
        h = word_vectors + self.position.weight[:word_vectors.shape[1]]
        if self.arch == "bert":
            if token_type_ids is None:
                h = h + self.token_type.weight[0]
            else:
                h = h + self.token_type(token_type_ids)
            h = self.norm(h)
        return self.dropout(h)


class Attention(nn.Module):
    """Multi-head self-attention with a fused QKV projection laid out as [head, (q, k, v), head_dim],
    so that a tensor-parallel slice of the output holds whole heads."""

    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, output_init):
        super().__init__()
        tp = mp.tensor_model_parallel_size
        self.heads = cfg.num_heads // tp
        self.head_dim = cfg.head_dim
        self.causal = cfg.arch == "gpt"
        self.dropout_p = cfg.attention_dropout
        self.qkv = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size, 3 * cfg.attention_size, config=mp, init_method=_normal_init(cfg.init_std),
            bias=True, gather_output=False, tp_group=parallel_state.get_tensor_model_parallel_group())
        self.proj = tensor_parallel.RowParallelLinear(
            cfg.attention_size, cfg.hidden_size, config=mp, init_method=output_init,
            bias=True, input_is_parallel=True, skip_bias_add=False,
            tp_group=parallel_state.get_tensor_model_parallel_group())

    def forward(self, x, attn_mask=None):
        batch, seq_len, _ = x.shape
        qkv, _ = self.qkv(x)
        q, k, v = qkv.view(batch, seq_len, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p and parallel_state.get_tensor_model_parallel_world_size() > 1:
            # Each tensor-parallel rank holds different heads: draw their dropout from the
            # rank-specific stream, not the stream all ranks share.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal=self.causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal=self.causal)
        out = out.transpose(1, 2).reshape(batch, seq_len, self.heads * self.head_dim)
        return self.proj(out)[0]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, output_init):
        super().__init__()
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size, cfg.ffn_size, config=mp, init_method=_normal_init(cfg.init_std),
            bias=True, gather_output=False, tp_group=parallel_state.get_tensor_model_parallel_group())
        self.fc2 = tensor_parallel.RowParallelLinear(
            cfg.ffn_size, cfg.hidden_size, config=mp, init_method=output_init,
            bias=True, input_is_parallel=True, skip_bias_add=False,
            tp_group=parallel_state.get_tensor_model_parallel_group())
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)[0], approximate=self.approximate))[0]


class Block(nn.Module):
    """One transformer block. BERT normalises after each residual sum (post-LN), GPT before each
    branch (pre-LN); the parameters are the same, so the multi-level operators treat both alike."""

    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig):
        super().__init__()
        self.pre_norm = cfg.arch == "gpt"
        # GPT-2 scales the init of residual-output projections by 1/sqrt(2 N) so the residual
        # stream's variance does not grow with depth; BERT does not.
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers) if self.pre_norm else cfg.init_std
        self.attn_norm = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg, mp, _normal_init(out_std))
        self.mlp_norm = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, mp, _normal_init(out_std))
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x, attn_mask=None):
        if self.pre_norm:
            x = x + self.dropout(self.attn(self.attn_norm(x), attn_mask))
            return x + self.dropout(self.mlp(self.mlp_norm(x)))
        x = self.attn_norm(x + self.dropout(self.attn(x, attn_mask)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class LMHead(nn.Module):
    """Output head tied to the word embeddings. GPT: final LayerNorm. BERT: MLM transform (dense,
    GELU, LayerNorm) and a vocabulary bias, plus the optional pooler and next-sentence classifier.
    The logits of the padding rows (`padded_vocab_size` beyond cfg.vocab_size) are -inf."""

    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, padded_vocab_size: int):
        super().__init__()
        self.arch = cfg.arch
        vocab_per_rank = padded_vocab_size // mp.tensor_model_parallel_size
        # Index, within this rank's slice, of the first padding column (>= the slice: none here).
        self.first_padding = cfg.vocab_size - parallel_state.get_tensor_model_parallel_rank() * vocab_per_rank
        if cfg.arch == "bert":
            self.transform = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            nn.init.normal_(self.transform.weight, std=cfg.init_std)
            nn.init.zeros_(self.transform.bias)
            self.bias = nn.Parameter(torch.zeros(vocab_per_rank))
            tensor_parallel.set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
            if cfg.nsp_head:
                self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
                self.nsp = nn.Linear(cfg.hidden_size, 2)
                for layer in (self.pooler, self.nsp):
                    nn.init.normal_(layer.weight, std=cfg.init_std)
                    nn.init.zeros_(layer.bias)
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.gelu_approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, h, word_embeddings, labels=None):
        """Vocab-parallel logits (this rank's slice of the vocabulary); with `labels`, the mean token
        loss instead (`token_loss` of those logits). Without tensor parallelism the loss never forms
        the logits: `linear_cross_entropy` computes it a block of rows at a time."""
        if self.arch == "bert":
            h = F.gelu(self.transform(h), approximate=self.gelu_approximate)
        h = self.norm(h)
        h = tensor_parallel.copy_to_tensor_model_parallel_region(
            h, group=parallel_state.get_tensor_model_parallel_group())
        if labels is not None and parallel_state.get_tensor_model_parallel_world_size() == 1:
            return linear_cross_entropy(h, word_embeddings, self.bias if self.arch == "bert" else None, labels,
                                        self.first_padding)
        logits = F.linear(h, word_embeddings)
        if self.arch == "bert":
            logits = logits + self.bias
        if self.first_padding < logits.shape[-1]:
            # Never predicted: no probability, and so no gradient, reaches the padding rows.
            padding = torch.arange(logits.shape[-1], device=logits.device) >= self.first_padding
            logits = logits.masked_fill(padding, float("-inf"))
        return logits if labels is None else token_loss(logits, labels)

    def next_sentence_logits(self, h):
        return self.nsp(torch.tanh(self.pooler(h[:, 0])))


class Transformer(nn.Module):
    """BERT or GPT, as `cfg.arch` says. `forward` returns the mean token loss when `labels` are
    given (label IGNORE_INDEX = nothing to predict), else this rank's vocab slice of the logits.
    `seed` fixes the initial weights (default: drawn from the global RNG). `padded_vocab_size` (default
    cfg.vocab_size) is the word embedding's row count, which the run plan pads for tensor
    parallelism (msds.plan.RunPlan.padded_vocab_size). `routed_layers`: the layers random-LTD routes
    (default msds.model.roles.routed_layers; a run's are the plan's, RunPlan.routed_layers)."""

    def __init__(self, cfg: ModelConfig, seed: Optional[int] = None, padded_vocab_size: Optional[int] = None,
                 routed_layers: Optional[tuple[int, ...]] = None):
        super().__init__()
        cfg.validate()   # the run plan checked the parallel layout; this is the model's own shape
        self.cfg = cfg
        routed = default_routed_layers(cfg.num_layers) if routed_layers is None else routed_layers
        self.routed_layers = frozenset(routed)
        seed = init_seed() if seed is None else seed
        padded_vocab_size = padded_vocab_size or cfg.vocab_size
        mp = megatron_config(cfg)
        with unit_rng(seed, "embeddings.word"):
            word = WordEmbedding(cfg, mp, padded_vocab_size)
        with unit_rng(seed, "embeddings"):
            self.embeddings = Embeddings(cfg, mp, word)
        self.layers = nn.ModuleList()
        for i in range(cfg.num_layers):
            with unit_rng(seed, f"layers.{i}"):
                self.layers.append(Block(cfg, mp))
        with unit_rng(seed, "head"):
            self.head = LMHead(cfg, mp, padded_vocab_size)

    def hidden_states(self, input_ids, token_type_ids=None, attention_mask=None, keep_tokens=None):
        """Final hidden states. With `keep_tokens` r < seq_len (random-LTD), every routed layer sees
        only a random subset of r tokens of each sample (`route_tokens`)."""
        mask = sdpa_mask(self.cfg.arch, attention_mask)
        h = self.embeddings(input_ids, token_type_ids)
        drop = keep_tokens is not None and keep_tokens < h.shape[1]
        for i, layer in enumerate(self.layers):
            if drop and i in self.routed_layers:
                h = route_tokens(layer, h, attention_mask, keep_tokens, self.cfg.arch)
            else:
                h = layer(h, mask)
        return h

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None, keep_tokens=None,
                next_sentence_labels=None, sentence_order_logits=False, masked_positions=None):
        """The loss with `labels`, else the LM logits of every position. With labels, BERT's head runs
        on the labelled (masked) positions only (`labeled_positions`, or with `masked_positions`, a fixed
        number per sample: `gathered_positions`). With `next_sentence_labels`
        (sentence-order pairs), the loss adds the next-sentence head's cross entropy to the masked-LM
        loss, as BERT's pretraining loss does; with `sentence_order_logits` as well, (loss, the head's
        [batch, 2] logits: 0 in order, 1 swapped), so that an evaluation scores both in one pass."""
        h = self.hidden_states(input_ids, token_type_ids, attention_mask, keep_tokens)
        if labels is None:
            return self.head(h, self.embeddings.word.weight)
        if self.cfg.arch != "bert":
            predicted, predicted_labels = h, labels
        elif masked_positions is not None:
            predicted, predicted_labels = gathered_positions(h, labels, masked_positions)
        else:
            predicted, predicted_labels = labeled_positions(h, labels)
        loss = self.head(predicted, self.embeddings.word.weight, predicted_labels)
        if next_sentence_labels is not None:
            order_logits = self.head.next_sentence_logits(h).float()
            loss = loss + F.cross_entropy(order_logits, next_sentence_labels)
            if sentence_order_logits:
                return loss, order_logits
        return loss


def labeled_positions(h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states and labels of the positions that have a label ([n, width], [n]): BERT's
    masked tokens, about 15% of a sample. Only they reach the loss, so the head (a [tokens, width] x
    [width, vocabulary] product and a softmax over the vocabulary) runs on them alone, as NVIDIA's
    BERT does with `dense_seq_output`: the same loss and gradients, for a fraction of the head's
    cost, which is most of a small level's step. FLOPs are still counted for every position
    (msds.plan.schedule.flops_per_sample), as for the dense model."""
    chosen = labels != IGNORE_INDEX
    return h[chosen], labels[chosen]


def gathered_positions(h: torch.Tensor, labels: torch.Tensor,
                       positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`labeled_positions` with a fixed count: the hidden states and labels at `positions` ([batch,
    k], data.max_predictions_per_seq; the padding points at position 0, whose label is IGNORE_INDEX):
    [batch, k, width] and [batch, k], shapes known before the step, no host read."""
    index = positions.unsqueeze(-1).expand(-1, -1, h.shape[-1])
    return h.gather(1, index), labels.gather(1, positions)


def token_loss(vocab_parallel_logits, labels):
    """Mean cross entropy over the tokens whose label is not IGNORE_INDEX, with the vocabulary split
    over tensor-parallel ranks (megatron's vocab-parallel cross entropy)."""
    keep = labels != IGNORE_INDEX
    per_token = tensor_parallel.vocab_parallel_cross_entropy(
        vocab_parallel_logits.float(), labels.masked_fill(~keep, 0))
    return (per_token * keep).sum() / keep.sum().clamp(min=1)
