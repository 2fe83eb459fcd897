"""Which implementation runs tensor_ops' per-tensor work: the fused Triton kernels (the `kernels`
package) or PyTorch, and the translation of groupings into what the kernels read.

Every tensor_ops function takes a `backend`:
- `auto` (default): the kernels when the tensor is on CUDA, has a dtype they support (fp32, bf16,
  fp16), its grouped axes fit their matrix view (below) and triton is installed (the optional extra
  `kernels`); PyTorch otherwise. CPU tensors always take PyTorch, even under TRITON_INTERPRET, so
  setting that variable never changes what the CPU computes;
- `triton`: the kernels, or an MsdsError saying why they cannot run. CPU tensors run them under the
  Triton interpreter: TRITON_INTERPRET=1 must be set before triton is first imported. This is how
  the tests check the kernels without a GPU;
- `torch`: PyTorch, on CUDA too (the reference).

The kernels see a tensor as a matrix: rows = dim 0, columns = the other dims flattened (a 1-D
tensor is one column). Its grouped axes fit when only dim 0 and, for a 2-D tensor, dim 1 are
grouped, each once. A grouping reaches the kernels as element-level index maps, built here once
per (grouping, size, device): on an axis of `size` channels each unit is a block of size // units
consecutive channels (msds.multilevel.grouping), so
- `member_index`: int32 (size // factor, factor), row s listing the large channels that small
  channel s averages (coalesce);
- `owner_index`: int32 (size,), the small channel each large channel copies (de-coalesce).
An axis that is not grouped maps every channel onto itself. The maps are tiny and cached.

triton is imported only when a kernel runs: without it everything runs on PyTorch under `auto`.
"""
from __future__ import annotations

import functools
import os
from typing import Literal, Optional

import torch

import kernels
from msds.errors import MsdsError
from msds.multilevel.grouping import Grouping

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")
MatrixGroupings = tuple[Optional[Grouping], Optional[Grouping]]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def matrix_groupings(t: torch.Tensor, axes) -> Optional[MatrixGroupings]:
    """(rows, cols) groupings of `t` seen as the kernels' matrix, when that carries the
    `(dim, Grouping)` pairs `axes`; None when it does not (a grouped middle dim, a dim grouped
    twice) or there is nothing to launch (a scalar, an empty tensor)."""
    if t.dim() == 0 or t.numel() == 0:
        return None
    groupable = (0, 1) if t.dim() == 2 else (0,)
    grouped: dict[int, Grouping] = {}
    for dim, grouping in axes:
        dim = dim % t.dim()
        if dim in grouped or dim not in groupable:
            return None
        grouped[dim] = grouping
    return grouped.get(0), grouped.get(1)


def use_kernels(t: torch.Tensor, axes, backend: str, name: str = "t") -> bool:
    """Whether `t`, grouped along `axes`, runs on the kernels under `backend` (module doc); an
    MsdsError when `backend` is unknown or is `triton` and the kernels cannot run."""
    if backend == "torch":
        return False
    if backend == "auto":
        return (t.is_cuda and t.dtype in kernels.SUPPORTED_DTYPES and matrix_groupings(t, axes) is not None
                and kernels.triton_available())
    if backend != "triton":
        raise MsdsError(f"backend: {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    _check_kernels_can_run(t, axes, name)
    return True


def _check_kernels_can_run(t: torch.Tensor, axes, name: str) -> None:
    """MsdsError with the fix when backend='triton' cannot be honoured for `t`."""
    if not kernels.triton_available():
        raise MsdsError("backend: 'triton' needs triton, the optional extra 'kernels' "
                        "(pip install 'msds[kernels]'); or use backend='auto' for the PyTorch path")
    if not (t.is_cuda or _interpreting()):
        raise MsdsError(f"{name}: is on {t.device}; the Triton kernels run on CUDA tensors (move it "
                        f"with .cuda()), or on the CPU with TRITON_INTERPRET=1 set before triton is "
                        f"first imported; or use backend='auto'")
    if t.dtype not in kernels.SUPPORTED_DTYPES:
        raise MsdsError(f"{name}: dtype {t.dtype} has no kernel (fp32, bf16, fp16); cast it, or use "
                        f"backend='auto' for the PyTorch path")
    if matrix_groupings(t, axes) is None:
        raise MsdsError(f"{name}: its grouped dims {[dim for dim, _ in axes]} do not fit the kernels' "
                        f"matrix view (dim 0 and, for a 2-D tensor, dim 1, each grouped once; not "
                        f"empty); use backend='auto' for the PyTorch path")


@functools.lru_cache(maxsize=256)
def member_index(grouping: Optional[Grouping], size: int, device: torch.device) -> torch.Tensor:
    """int32 (size // factor, factor): the large channels behind each small channel of an axis of
    `size` large channels."""
    if grouping is None:
        return torch.arange(size, dtype=torch.int32, device=device).view(size, 1)
    block = size // grouping.units
    members = grouping.members()                                         # (small units, factor)
    channels = members.unsqueeze(1) * block + torch.arange(block).view(1, block, 1)
    return channels.reshape(-1, grouping.factor).to(device=device, dtype=torch.int32).contiguous()


@functools.lru_cache(maxsize=256)
def owner_index(grouping: Optional[Grouping], size: int, device: torch.device) -> torch.Tensor:
    """int32 (size,): the small channel that each of the `size` large channels of an axis copies."""
    channel = torch.arange(size)
    if grouping is None:
        return channel.to(device=device, dtype=torch.int32)
    block = size // grouping.units
    owner = grouping.owner()[channel // block] * block + channel % block
    return owner.to(device=device, dtype=torch.int32).contiguous()


def _kernels():
    import kernels.multilevel as multilevel   # imports triton: only when a kernel is launched
    return multilevel


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 1:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], -1) if t.dim() > 2 else t


def _from_matrix(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The kernels' matrix output in the shape of `like` but for dim 0 (unchanged for 2-D)."""
    return out.view(out.shape[0], *like.shape[1:]) if like.dim() != 2 else out


def kernel_coalesce(t: torch.Tensor, axes, scale: float) -> torch.Tensor:
    """tensor_ops.coalesce_tensor on the kernels; `axes` must fit (use_kernels said so)."""
    rows, cols = matrix_groupings(t, axes)
    matrix = _as_matrix(t)
    out = _kernels().coalesce(matrix, member_index(rows, matrix.shape[0], t.device),
                              member_index(cols, matrix.shape[1], t.device), scale)
    return _from_matrix(out, t)


def kernel_decoalesce(small: torch.Tensor, axes, scale: float, saved: Optional[torch.Tensor] = None,
                      alpha: float = 1.0) -> torch.Tensor:
    """tensor_ops.decoalesce_tensor on the kernels, interpolated with `saved` by `alpha` in the same
    pass when `saved` is given (tensor_ops.decoalesce_interpolate_tensor); `axes` must fit."""
    rows, cols = matrix_groupings(small, axes)
    matrix = _as_matrix(small)
    large_rows, large_cols = (size * g.factor if g is not None else size
                              for size, g in zip(matrix.shape, (rows, cols)))
    out = _kernels().decoalesce(matrix, owner_index(rows, large_rows, small.device),
                                owner_index(cols, large_cols, small.device), scale,
                                saved=None if saved is None else _as_matrix(saved), alpha=alpha)
    return _from_matrix(out, small)
