"""Model files: an msds model checkpoint (weights only, no training state) and atomic directory writes.

Layout of a model checkpoint directory (docs/checkpoints.md):
    config.yaml          the ModelConfig of these weights
    model.safetensors    every parameter in msds names, full (TP=1) shapes, as trained (fp32)
    multilevel.json      optional: the LevelMap that produced these weights by coalescing

Training checkpoints (DeepSpeed engine state plus msds state) are msds/train/checkpointing.py's; the
trainer exports its model through this module.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from msds.config import ConfigError, ModelConfig, from_dict, to_dict
from msds.errors import MsdsError
from msds.model.roles import VOCABULARY_ROWS, expected_shapes

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
LEVEL_FILE = "multilevel.json"


@contextlib.contextmanager
def atomic_directory(out_dir: str | Path, overwrite: bool = False):
    """Yield a temporary directory next to `out_dir`; rename it to `out_dir` only if the block
    succeeds. On any error the temporary directory is removed and `out_dir` is untouched."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise MsdsError(f"{out_dir}: output directory already exists; choose another --out or remove it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Every expected tensor present with its expected shape, nothing unknown; else one MsdsError."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise MsdsError(f"{source}: tensor {missing[0]} is missing ({len(missing)} missing in all); "
                        f"the checkpoint does not match its config")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise MsdsError(f"{source}: unexpected tensor {unknown[0]} ({len(unknown)} in all) for a "
                        f"{cfg.arch} model with {cfg.num_layers} layers")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise MsdsError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                            f"expected {shape} from the config")


def without_vocab_padding(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (full, TP=1) with the vocabulary axis cut to cfg.vocab_size: a trained model's
    padding rows (msds.plan.RunPlan.padded_vocab_size) are dropped; unpadded tensors pass unchanged."""
    return {name: t[:cfg.vocab_size] if name in VOCABULARY_ROWS else t for name, t in tensors.items()}


def save_model(out_dir: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], *,
               level: dict | None = None, overwrite: bool = False) -> Path:
    """Write an msds model checkpoint atomically."""
    check_tensors(cfg, tensors, str(out_dir))
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        write_model_files(tmp, cfg, tensors, level=level)
    return Path(out_dir)


def write_model_files(directory: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], *,
                      level: dict | None = None) -> None:
    """The files of a model checkpoint, into an existing (temporary) directory."""
    with open(directory / CONFIG_FILE, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              str(directory / WEIGHTS_FILE), metadata={"format": "msds"})
    if level is not None:
        (directory / LEVEL_FILE).write_text(json.dumps(level, indent=1))


def is_model_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file() and (Path(directory) / WEIGHTS_FILE).is_file()


def load_model(src_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict | None]:
    """Read and verify an msds model checkpoint: (config, tensors, level record or None)."""
    src = Path(src_dir)
    cfg = read_model_config(src)
    try:
        tensors = load_file(str(src / WEIGHTS_FILE))
    except Exception as exc:  # safetensors reports truncation and corruption with many types
        raise _unreadable(src, exc) from exc
    check_tensors(cfg, tensors, str(src / WEIGHTS_FILE))
    level_path = src / LEVEL_FILE
    level = json.loads(level_path.read_text()) if level_path.is_file() else None
    return cfg, tensors, level


def read_model_config(src: Path) -> ModelConfig:
    """The ModelConfig of the msds model checkpoint `src`."""
    if not is_model_checkpoint(src):
        raise MsdsError(f"{src}: not an msds model checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(src / CONFIG_FILE) as f:
        try:
            return from_dict(ModelConfig, yaml.safe_load(f), "model").validate()
        except ConfigError as exc:
            raise MsdsError(f"{src / CONFIG_FILE}: {exc}") from exc


def _unreadable(src: Path, exc: Exception) -> MsdsError:
    return MsdsError(f"{src / WEIGHTS_FILE}: cannot be read ({exc}); the file is truncated or corrupt")


def model_shapes(src_dir: str | Path) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    """(config, the shape of every tensor) of an msds model checkpoint, verified as `load_model`
    verifies it, from the safetensors header alone: no weight is read."""
    src = Path(src_dir)
    cfg = read_model_config(src)
    try:
        shapes = header_shapes(src / WEIGHTS_FILE)
    except Exception as exc:  # as in load_model
        raise _unreadable(src, exc) from exc
    check_tensors(cfg, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()},
                  str(src / WEIGHTS_FILE))
    return cfg, shapes


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the safetensors file `path`, from its header: no weight is read."""
    with safe_open(str(path), framework="pt") as opened:
        return {name: tuple(opened.get_slice(name).get_shape()) for name in opened.keys()}


def read_model_tensors(src_dir: str | Path, names: Iterable[str],
                       pick: Callable[[str, Any, tuple[int, ...]], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, pick(name, tensor, shape)) for `names` of the msds model checkpoint `src_dir`, one at a
    time; `tensor` is a safetensors slice, indexed like a tensor: only what `pick` indexes is read."""
    src = Path(src_dir)
    with safe_open(str(src / WEIGHTS_FILE), framework="pt") as opened:
        for name in names:
            piece = opened.get_slice(name)
            yield name, pick(name, piece, tuple(piece.get_shape()))


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of an msds Transformer (TP=1) by name, detached."""
    return {name: p.detach() for name, p in model.named_parameters()}


def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full (TP=1) tensors into a TP=1 model's parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
