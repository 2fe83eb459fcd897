"""Parameter roles: what each axis of each parameter of the msds transformer means.

The multi-level operators (msds.multilevel) consume this table and nothing else about the model, so
they stay model-agnostic pure functions over named tensors.

An axis has
- a `role`: which model dimension it indexes: `hidden` (residual stream), `heads` (concatenated
  attention heads; grouped in blocks), `ffn` (MLP inner width), or `None` for axes that are never
  resized (vocabulary, positions, token types, classifier outputs);
- a `block` size: how many consecutive indices form one groupable unit (a head is `head_dim`
  channels; the fused QKV output holds q, k and v of one head together, `3 * head_dim`);
- a `side`:
  * `out`: the axis *produces* the dimension (rows of a weight, biases, norms, embedding columns).
    Coalescing averages over a group, de-coalescing copies;
  * `in`: the axis *consumes* the dimension (columns of a weight). Coalescing sums over a group,
    de-coalescing copies and divides by the factor, so that a duplicated input gives the same
    output: this makes width de-coalescing function-preserving.

The last LayerNorm before the tied output head is declared with side `in` on its hidden axis: the
head computes `logits = E h` with the (copied) embedding E, which over a duplicated h would multiply
the logits by g. Scaling that LayerNorm's gamma and beta by 1/g on de-coalescing (and summing them on
coalescing), exactly what side `in` does, keeps the logits for both post-LN BERT and pre-LN GPT.

A parameter inside transformer block i also carries `layer = i`: depth coalescing averages it over
a group of layers, depth de-coalescing copies it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from msds.config import ModelConfig

Role = Literal["hidden", "heads", "ffn"]
Side = Literal["out", "in"]


@dataclass(frozen=True)
class Axis:
    role: Optional[Role]
    side: Side = "out"
    block: int = 1


@dataclass(frozen=True)
class ParamRole:
    """The meaning of one parameter: one `Axis` per tensor dimension, and its block index."""

    axes: tuple[Axis, ...]
    layer: Optional[int] = None


FIXED = Axis(None)
HIDDEN_OUT = Axis("hidden", "out")
HIDDEN_IN = Axis("hidden", "in")


def _block_roles(cfg: ModelConfig, i: int) -> dict[str, ParamRole]:
    """Roles of the parameters of transformer block i (same names for BERT and GPT)."""
    qkv_out = Axis("heads", "out", block=3 * cfg.head_dim)   # layout: [head, (q, k, v), head_dim]
    heads_in = Axis("heads", "in", block=cfg.head_dim)
    ffn_out, ffn_in = Axis("ffn", "out"), Axis("ffn", "in")
    p = f"layers.{i}."
    return {
        p + "attn_norm.weight": ParamRole((HIDDEN_OUT,), i),
        p + "attn_norm.bias": ParamRole((HIDDEN_OUT,), i),
        p + "attn.qkv.weight": ParamRole((qkv_out, HIDDEN_IN), i),
        p + "attn.qkv.bias": ParamRole((qkv_out,), i),
        p + "attn.proj.weight": ParamRole((HIDDEN_OUT, heads_in), i),
        p + "attn.proj.bias": ParamRole((HIDDEN_OUT,), i),
        p + "mlp_norm.weight": ParamRole((HIDDEN_OUT,), i),
        p + "mlp_norm.bias": ParamRole((HIDDEN_OUT,), i),
        p + "mlp.fc1.weight": ParamRole((ffn_out, HIDDEN_IN), i),
        p + "mlp.fc1.bias": ParamRole((ffn_out,), i),
        p + "mlp.fc2.weight": ParamRole((HIDDEN_OUT, ffn_in), i),
        p + "mlp.fc2.bias": ParamRole((HIDDEN_OUT,), i),
    }


def parameter_roles(cfg: ModelConfig) -> dict[str, ParamRole]:
    """Every parameter of `Transformer(cfg)` (TP=1 names and full shapes) mapped to its role."""
    roles = {
        "embeddings.word.weight": ParamRole((FIXED, HIDDEN_OUT)),
        "embeddings.position.weight": ParamRole((FIXED, HIDDEN_OUT)),
    }
    if cfg.arch == "bert":
        roles["embeddings.token_type.weight"] = ParamRole((FIXED, HIDDEN_OUT))
        roles["embeddings.norm.weight"] = ParamRole((HIDDEN_OUT,))
        roles["embeddings.norm.bias"] = ParamRole((HIDDEN_OUT,))
    for i in range(cfg.num_layers):
        roles.update(_block_roles(cfg, i))
    if cfg.arch == "gpt":
        roles["head.norm.weight"] = ParamRole((HIDDEN_IN,))   # ln_f, scaled 1/g (see module doc)
        roles["head.norm.bias"] = ParamRole((HIDDEN_IN,))
    else:
        roles["head.transform.weight"] = ParamRole((HIDDEN_OUT, HIDDEN_IN))
        roles["head.transform.bias"] = ParamRole((HIDDEN_OUT,))
        roles["head.norm.weight"] = ParamRole((HIDDEN_IN,))   # last LN before the tied decoder
        roles["head.norm.bias"] = ParamRole((HIDDEN_IN,))
        roles["head.bias"] = ParamRole((FIXED,))
        if cfg.nsp_head:
            roles["head.pooler.weight"] = ParamRole((HIDDEN_OUT, HIDDEN_IN))
            roles["head.pooler.bias"] = ParamRole((HIDDEN_OUT,))
            roles["head.nsp.weight"] = ParamRole((FIXED, HIDDEN_IN))
            roles["head.nsp.bias"] = ParamRole((FIXED,))
    return roles


# The axis megatron-core splits over tensor-parallel ranks, by parameter-name suffix (column-parallel
# layers split their output rows, row-parallel layers their input columns, the vocab-parallel
# embedding and the BERT output bias the vocabulary); parameters not listed are replicated.
TENSOR_PARALLEL_DIM = {
    "attn.qkv.weight": 0, "attn.qkv.bias": 0, "attn.proj.weight": 1,
    "mlp.fc1.weight": 0, "mlp.fc1.bias": 0, "mlp.fc2.weight": 1,
    "embeddings.word.weight": 0, "head.bias": 0,
}


# The parameters whose first axis is the vocabulary. In training it has the run plan's padded size
# (RunPlan.padded_vocab_size); model checkpoints and exports hold the first cfg.vocab_size rows.
VOCABULARY_ROWS = ("embeddings.word.weight", "head.bias")


def tensor_parallel_dim(name: str) -> Optional[int]:
    """The axis of parameter `name` that tensor parallelism splits, or None if it is replicated."""
    for suffix, dim in TENSOR_PARALLEL_DIM.items():
        if name.endswith(suffix):
            return dim
    return None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full (TP=1) shape of every parameter, derived from the roles and the config."""
    size = {"hidden": cfg.hidden_size, "heads": cfg.attention_size, "ffn": cfg.ffn_size}
    fixed = {
        "embeddings.word.weight": cfg.vocab_size,
        "embeddings.position.weight": cfg.max_positions,
        "embeddings.token_type.weight": cfg.type_vocab_size,
        "head.bias": cfg.vocab_size,
        "head.nsp.weight": 2,
        "head.nsp.bias": 2,
    }
    shapes = {}
    for name, role in parameter_roles(cfg).items():
        dims = []
        for axis in role.axes:
            if axis.role is None:
                dims.append(fixed[name])
            elif axis.role == "heads" and axis.block == 3 * cfg.head_dim:
                dims.append(3 * cfg.attention_size)
            else:
                dims.append(size[axis.role])
        shapes[name] = tuple(dims)
    return shapes


def routed_layers(num_layers: int) -> tuple[int, ...]:
    """The layers random-LTD routes unless its `random_ltd_layer_id` says otherwise, in order: every
    layer but the first and the last, which see every token. The model's default; a run's, per
    level, are the plan's (msds.plan.RunPlan.routed_layers)."""
    return tuple(range(1, num_layers - 1))
