"""Hugging Face interop: BERT (`BertForMaskedLM`, `BertForPreTraining`, `BertModel`) and
`GPT2LMHeadModel` directories <-> msds tensors, and the `msds import-hf` / `msds export-hf` commands.

The name map for each architecture lives here, next to the model. Two layouts differ from HF:
- msds fuses q, k and v into one projection laid out [head, (q, k, v), head_dim] (so a tensor-
  parallel slice holds whole heads); HF BERT keeps three Linear layers, GPT-2 one Conv1D laid out
  [(q, k, v), head, head_dim];
- GPT-2's Conv1D stores weights as (in, out); msds (torch Linear) as (out, in).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from msds.model.files import (atomic_directory, check_tensors, header_shapes, load_model, save_model,
                              without_vocab_padding)
from msds.config import ConfigError, ModelConfig, model_config
from msds.errors import MsdsError

BERT_ARCHS = {"BertForMaskedLM", "BertForPreTraining", "BertModel"}
GPT_ARCHS = {"GPT2LMHeadModel", "GPT2Model"}


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

def config_from_hf(hf: dict, source: str) -> ModelConfig:
    archs = set(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    try:
        if model_type == "bert" or archs & BERT_ARCHS:
            act = hf.get("hidden_act", "gelu")
            if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
                raise MsdsError(f"{source}: hidden_act {act!r} is not supported (gelu or gelu_new)")
            return model_config(
                arch="bert", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                ffn_size=hf["intermediate_size"], max_positions=hf["max_position_embeddings"],
                type_vocab_size=hf.get("type_vocab_size", 2), norm_eps=hf.get("layer_norm_eps", 1e-12),
                activation="gelu" if act == "gelu" else "gelu_tanh",
                hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
                attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                init_std=hf.get("initializer_range", 0.02),
                nsp_head="BertForPreTraining" in archs)
        if model_type == "gpt2" or archs & GPT_ARCHS:
            act = hf.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
                raise MsdsError(f"{source}: activation_function {act!r} is not supported")
            return model_config(
                arch="gpt", vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"],
                num_layers=hf["n_layer"], num_heads=hf["n_head"],
                ffn_size=hf.get("n_inner") or 4 * hf["n_embd"], max_positions=hf["n_positions"],
                norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                activation="gelu" if act == "gelu" else "gelu_tanh",
                hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                init_std=hf.get("initializer_range", 0.02))
    except KeyError as exc:
        raise MsdsError(f"{source}: config.json lacks the field {exc.args[0]!r}") from exc
    except ConfigError as exc:
        raise MsdsError(f"{source}: {exc}") from exc
    raise MsdsError(f"{source}: unsupported architecture {sorted(archs) or model_type!r}; msds reads "
                    f"{', '.join(sorted(BERT_ARCHS | GPT_ARCHS))}")


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.attention_size != cfg.hidden_size:
        raise MsdsError(f"model: num_heads * head_dim = {cfg.attention_size} differs from hidden_size "
                        f"{cfg.hidden_size}; Hugging Face models cannot represent that (de-coalesce first)")
    if cfg.arch == "bert":
        return {
            "architectures": ["BertForPreTraining" if cfg.nsp_head else "BertForMaskedLM"],
            "model_type": "bert", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "intermediate_size": cfg.ffn_size, "max_position_embeddings": cfg.max_positions,
            "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.norm_eps,
            "hidden_act": "gelu" if cfg.activation == "gelu" else "gelu_new",
            "hidden_dropout_prob": cfg.hidden_dropout,
            "attention_probs_dropout_prob": cfg.attention_dropout,
            "initializer_range": cfg.init_std, "pad_token_id": 0, "tie_word_embeddings": True,
        }
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
        "n_inner": cfg.ffn_size, "n_positions": cfg.max_positions,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu" if cfg.activation == "gelu" else "gelu_new",
        "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout, "initializer_range": cfg.init_std,
        "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1,
        "tie_word_embeddings": True,
    }


# --------------------------------------------------------------------------------------------
# QKV layouts
# --------------------------------------------------------------------------------------------

def _fuse_qkv(q, k, v, heads: int):
    """Three (heads*hd, ...) tensors -> one laid out [head, (q, k, v), head_dim, ...]."""
    stacked = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return stacked.reshape(-1, *q.shape[1:])


def _split_qkv(qkv, heads: int):
    """Inverse of _fuse_qkv: (q, k, v), each (heads*hd, ...)."""
    per_head = qkv.reshape(heads, 3, -1, *qkv.shape[1:])
    return tuple(per_head[:, j].reshape(-1, *qkv.shape[1:]).contiguous() for j in range(3))


# --------------------------------------------------------------------------------------------
# Name maps
# --------------------------------------------------------------------------------------------

_BERT_LAYER = {  # msds suffix -> HF suffix, inside layer i
    "attn.proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
    "mlp_norm": "output.LayerNorm",
}
_BERT_TOP = {
    "embeddings.word.weight": "embeddings.word_embeddings.weight",
    "embeddings.position.weight": "embeddings.position_embeddings.weight",
    "embeddings.token_type.weight": "embeddings.token_type_embeddings.weight",
    "embeddings.norm.weight": "embeddings.LayerNorm.weight",
    "embeddings.norm.bias": "embeddings.LayerNorm.bias",
}
_BERT_HEAD = {
    "head.transform.weight": "cls.predictions.transform.dense.weight",
    "head.transform.bias": "cls.predictions.transform.dense.bias",
    "head.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "head.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "head.bias": "cls.predictions.bias",
    "head.pooler.weight": "bert.pooler.dense.weight",
    "head.pooler.bias": "bert.pooler.dense.bias",
    "head.nsp.weight": "cls.seq_relationship.weight",
    "head.nsp.bias": "cls.seq_relationship.bias",
}
_GPT_LAYER = {"attn.proj": "attn.c_proj", "attn_norm": "ln_1", "mlp.fc1": "mlp.c_fc",
              "mlp.fc2": "mlp.c_proj", "mlp_norm": "ln_2"}
_GPT_TOP = {"embeddings.word.weight": "transformer.wte.weight",
            "embeddings.position.weight": "transformer.wpe.weight",
            "head.norm.weight": "transformer.ln_f.weight", "head.norm.bias": "transformer.ln_f.bias"}


class _Taker:
    """Reads tensors out of an HF state dict and remembers which ones were used."""

    def __init__(self, hf: dict[str, torch.Tensor]):
        self.hf, self.used = hf, set()

    def __call__(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.hf[name]

    def unused(self, ignorable) -> list[str]:
        return sorted(n for n in set(self.hf) - self.used if not ignorable(n))


def bert_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, list[str]]:
    """msds tensors from HF BERT tensors; also the HF names that msds does not use."""
    prefix = "bert." if any(k.startswith("bert.") for k in hf) else ""
    take, out = _Taker(hf), {}

    for ours, theirs in _BERT_TOP.items():
        out[ours] = take(prefix + theirs)
    for i in range(cfg.num_layers):
        p = f"{prefix}encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (take(f"{p}attention.self.{n}.{kind}") for n in ("query", "key", "value"))
            out[f"layers.{i}.attn.qkv.{kind}"] = _fuse_qkv(q, k, v, cfg.num_heads)
            for ours, theirs in _BERT_LAYER.items():
                out[f"layers.{i}.{ours}.{kind}"] = take(f"{p}{theirs}.{kind}")
    head_names = [n for n in _BERT_HEAD if not n.startswith(("head.pooler", "head.nsp")) or cfg.nsp_head]
    for ours in head_names:
        theirs = _BERT_HEAD[ours].replace("bert.", prefix, 1)
        if theirs in hf:
            out[ours] = take(theirs)
    # The tied decoder and the position-id buffer carry nothing msds does not already hold.
    return out, take.unused(lambda n: n.endswith(("decoder.weight", "decoder.bias", "position_ids")))


def bert_to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"bert." + theirs: tensors[ours] for ours, theirs in _BERT_TOP.items()}
    for i in range(cfg.num_layers):
        p = f"bert.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = _split_qkv(tensors[f"layers.{i}.attn.qkv.{kind}"], cfg.num_heads)
            for name, t in zip(("query", "key", "value"), (q, k, v)):
                out[f"{p}attention.self.{name}.{kind}"] = t
            for ours, theirs in _BERT_LAYER.items():
                out[f"{p}{theirs}.{kind}"] = tensors[f"layers.{i}.{ours}.{kind}"]
    for ours, theirs in _BERT_HEAD.items():
        if ours in tensors:
            out[theirs] = tensors[ours]
    return out


def gpt_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, list[str]]:
    prefix = "transformer." if any(k.startswith("transformer.") for k in hf) else ""
    take, out = _Taker(hf), {}

    for ours, theirs in _GPT_TOP.items():
        out[ours] = take(theirs.replace("transformer.", prefix, 1))
    for i in range(cfg.num_layers):
        p = f"{prefix}h.{i}."
        # Conv1D (in, out) with output [(q, k, v), head, hd] -> Linear (out, in) [head, (q, k, v), hd]
        q, k, v = take(p + "attn.c_attn.weight").t().chunk(3, dim=0)
        out[f"layers.{i}.attn.qkv.weight"] = _fuse_qkv(q, k, v, cfg.num_heads)
        q, k, v = take(p + "attn.c_attn.bias").chunk(3, dim=0)
        out[f"layers.{i}.attn.qkv.bias"] = _fuse_qkv(q, k, v, cfg.num_heads)
        for ours, theirs in _GPT_LAYER.items():
            weight = take(f"{p}{theirs}.weight")
            out[f"layers.{i}.{ours}.weight"] = weight if "norm" in ours else weight.t().contiguous()
            out[f"layers.{i}.{ours}.bias"] = take(f"{p}{theirs}.bias")
    # The tied head and GPT-2's causal-mask buffers carry nothing msds does not already hold.
    return out, take.unused(lambda n: n == "lm_head.weight" or n.endswith((".attn.bias", ".attn.masked_bias")))


def gpt_to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: tensors[ours] for ours, theirs in _GPT_TOP.items()}
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        q, k, v = _split_qkv(tensors[f"layers.{i}.attn.qkv.weight"], cfg.num_heads)
        out[p + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t().contiguous()
        out[p + "attn.c_attn.bias"] = torch.cat(_split_qkv(tensors[f"layers.{i}.attn.qkv.bias"], cfg.num_heads))
        for ours, theirs in _GPT_LAYER.items():
            weight = tensors[f"layers.{i}.{ours}.weight"]
            out[f"{p}{theirs}.weight"] = weight if "norm" in ours else weight.t().contiguous()
            out[f"{p}{theirs}.bias"] = tensors[f"layers.{i}.{ours}.bias"]
    return out


# --------------------------------------------------------------------------------------------
# Directories
# --------------------------------------------------------------------------------------------

def _read_hf_tensors(src: Path, meta: bool) -> dict[str, torch.Tensor]:
    """The directory's tensors; with `meta`, meta tensors of their shapes (no data is read past a
    safetensors header, and a pytorch_model.bin is only mapped)."""
    files = _safetensors_files(src)
    if files and meta:
        return {k: torch.empty(shape, device="meta") for f in files for k, shape in header_shapes(f).items()}
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    if (src / "pytorch_model.bin").is_file():
        tensors = torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=meta)
        return {k: v.to("meta") for k, v in tensors.items()} if meta else tensors
    raise MsdsError(f"{src}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _safetensors_files(src: Path) -> list[Path]:
    """model.safetensors, or the shards its index names; none when the directory has neither."""
    if (src / "model.safetensors").is_file():
        return [src / "model.safetensors"]
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return [src / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return []


def convert_hf(src_dir: str | Path, *, meta: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor], list[str]]:
    """(msds config, the msds tensors the directory holds, the HF names msds does not use), as
    `msds import-hf` converts them; a BERT without an MLM head (e.g. `BertModel`) lacks head.*
    tensors here. With `meta`, meta tensors: the names and shapes, without reading the weights."""
    src = Path(src_dir)
    if not (src / "config.json").is_file():
        raise MsdsError(f"{src}: not a Hugging Face model directory (no config.json)")
    cfg = config_from_hf(json.loads((src / "config.json").read_text()), str(src))
    hf = {k: v.float() for k, v in _read_hf_tensors(src, meta).items()}
    try:
        tensors, unused = (bert_from_hf if cfg.arch == "bert" else gpt_from_hf)(hf, cfg)
    except KeyError as exc:
        raise MsdsError(f"{src}: tensor {exc.args[0]} is missing from the checkpoint") from exc
    return cfg, tensors, unused


def read_hf(src_dir: str | Path, *, report=None,
            initialised: list[str] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(msds config, msds tensors) from a local HF directory. A BERT without an MLM head (e.g.
    `BertModel`) gets a freshly initialised one; `report` (a callable) hears about it, and
    `initialised` (a list), when given, receives the Hugging Face names of the tensors it lacked."""
    src = Path(src_dir)
    cfg, tensors, unused = convert_hf(src)
    if cfg.arch == "bert" and "head.transform.weight" not in tensors:
        fresh = _fresh_bert_head(cfg)
        tensors.update(fresh)
        if initialised is not None:
            initialised.extend(sorted(_BERT_HEAD[name] for name in fresh))
        if report:
            report(f"{src}: no MLM head in the checkpoint; initialised {', '.join(sorted(fresh))}")
    if unused and report:
        report(f"{src}: not used by msds: {', '.join(unused)}")
    check_tensors(cfg, tensors, str(src))
    return cfg, tensors


def _fresh_bert_head(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    h = cfg.hidden_size
    return {
        "head.transform.weight": torch.randn(h, h, generator=generator) * cfg.init_std,
        "head.transform.bias": torch.zeros(h),
        "head.norm.weight": torch.ones(h),
        "head.norm.bias": torch.zeros(h),
        "head.bias": torch.zeros(cfg.vocab_size),
    }


def write_hf(out_dir: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], *,
             overwrite: bool = False) -> Path:
    """Write `config.json` + `model.safetensors` that transformers' `from_pretrained` loads.
    `tensors` may hold a trained model's vocabulary padding: it is not exported."""
    tensors = without_vocab_padding(cfg, tensors)
    check_tensors(cfg, tensors, "export")
    hf_config = config_to_hf(cfg)
    hf = (bert_to_hf if cfg.arch == "bert" else gpt_to_hf)(tensors, cfg)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        save_file({k: v.detach().float().contiguous() for k, v in hf.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(out_dir)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _run_import(args) -> int:
    cfg, tensors = read_hf(args.src, report=print)
    save_model(args.out, cfg, tensors)
    print(f"wrote msds checkpoint {args.out} ({cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size})")
    return 0


def _run_export(args) -> int:
    cfg, tensors, _ = load_model(args.src)
    write_hf(args.out, cfg, tensors)
    print(f"wrote Hugging Face directory {args.out} ({config_to_hf(cfg)['architectures'][0]})")
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=doc)
    if name == "import-hf":
        parser.add_argument("src", metavar="SRC_DIR", help="local Hugging Face model directory")
        parser.add_argument("out", metavar="OUT_DIR", help="msds checkpoint to create")
        parser.set_defaults(run=_run_import)
    else:
        parser.add_argument("src", metavar="CKPT_DIR", help="msds model checkpoint")
        parser.add_argument("out", metavar="OUT_DIR", help="Hugging Face directory to create")
        parser.set_defaults(run=_run_export)
