"""The weights a run starts from (`model.init_from`): an msds model directory, or a Hugging Face
BERT / GPT-2 directory converted as `msds import-hf` converts it (msds/model/hf.py).

`inspect` reads what the run plan checks (config, tensor names and shapes) without reading a
weight; `read` yields what a rank asks for. Of an msds directory only that is read, one tensor at a
time (safetensors slices); a Hugging Face directory is converted whole first (its q, k and v are
fused, GPT-2's Conv1D weights transposed), then the asked-for tensors are handed out.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from msds.config import ModelConfig
from msds.errors import MsdsError
from msds.model.files import CONFIG_FILE, model_shapes, read_model_tensors
from msds.model.hf import convert_hf

MSDS, HUGGING_FACE = "msds", "hf"


@dataclass(frozen=True)
class Source:
    """What a pretrained directory holds, in msds names (TP=1 shapes, no vocabulary padding)."""

    path: Path
    format: str
    cfg: ModelConfig
    shapes: dict[str, tuple[int, ...]]
    unused: tuple[str, ...]
    """Tensors of the files that msds has no parameter for (a Hugging Face BERT's pooler), by their
    names there."""


def directory_format(path: Path) -> str:
    """MSDS or HUGGING_FACE: the kind of model directory `path` is."""
    is_msds, is_hf = (path / CONFIG_FILE).is_file(), (path / "config.json").is_file()
    if is_msds == is_hf:
        raise MsdsError(f"{path}: expected a Hugging Face directory (config.json) or an msds checkpoint "
                        f"({CONFIG_FILE}), found {'both' if is_msds else 'neither'}")
    return MSDS if is_msds else HUGGING_FACE


def inspect(path: str | Path) -> Source:
    """The config and tensor shapes of the msds or Hugging Face directory `path`; no weight is read."""
    path = Path(path)
    if directory_format(path) == MSDS:
        cfg, shapes = model_shapes(path)
        return Source(path, MSDS, cfg, shapes, ())
    cfg, tensors, unused = convert_hf(path, meta=True)
    return Source(path, HUGGING_FACE, cfg, {name: tuple(t.shape) for name, t in tensors.items()}, tuple(unused))


def read(source: Source, names: Iterable[str],
         pick: Callable[[str, Any, tuple[int, ...]], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, pick(name, tensor, shape) as fp32) for each of `names`, in their order: from an msds
    directory `tensor` is a safetensors slice (only what `pick` indexes is read), from a Hugging Face
    one the converted tensor."""
    if source.format == MSDS:
        yield from ((name, t.float()) for name, t in read_model_tensors(source.path, names, pick))
        return
    _, tensors, _ = convert_hf(source.path)
    for name in names:
        whole = tensors.pop(name)
        yield name, pick(name, whole, tuple(whole.shape)).float()
