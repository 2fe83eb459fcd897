"""One entry point per operator: the fused Triton kernels for CUDA tensors, PyTorch otherwise.

Every function takes a `backend`:
- `auto` (default): the Triton kernels when the tensor is on CUDA, its dtype is fp32, bf16 or fp16
  and triton is installed (the optional extra `kernels`); otherwise the PyTorch reference path,
  msds.multilevel.tensor_ops. CPU tensors always take the PyTorch path, even under TRITON_INTERPRET,
  so setting that variable never changes what the CPU computes;
- `triton`: the kernels, or an MsdsError saying why they cannot run. CPU tensors run them under the
  Triton interpreter: TRITON_INTERPRET=1 must be set before kernels are first used (triton reads it
  when the kernels are defined). This is how the tests check the kernels without a GPU;
- `torch`: the PyTorch reference path (on CUDA too: see `pytorch_path`).

triton is imported only when a kernel runs; without it everything works on the PyTorch path.

Operators on a 1-D or 2-D tensor; `rows` / `cols` are the Groupings of axis 0 / axis 1 (None: the
axis is not grouped; a 1-D tensor - bias, norm - has rows only). Each grouping counts units; an axis
of N channels has blocks of N // units channels (see msds.multilevel.grouping):
- `coalesce_2d`: scale * (reduction over each grouped axis), a reduction being `mean` or `sum`;
- `decoalesce_2d`: copies of every small unit into each large unit of its group, / scale;
- `decoalesce_interpolate_2d`: lerp(saved, decoalesce_2d(small), alpha) in one pass, exactly
  operators.interpolate after operators.decoalesce;
- `coalesce_moments_2d`, `decoalesce_interpolate_moments_2d`: the same for Adam's exp_avg and
  exp_avg_sq with the moment scales c and c^2 (operators._scale: c = product of the output-side
  factors, times the depth factor for layer tensors; every axis averages).
`fused_coalesce_tensor` / `fused_decoalesce_tensor` take tensor_ops' arguments and return None when
the kernels do not apply, so that tensor_ops can hand CUDA tensors over without changing anything else.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from typing import Literal, Optional

import torch

from kernels.index_maps import check_axis
from msds.errors import MsdsError
from msds.multilevel import tensor_ops
from msds.multilevel.grouping import Grouping

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")
REDUCTIONS = ("mean", "sum")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Set while the PyTorch path runs on request: tensor_ops hands CUDA tensors to fused_*_tensor, which
# must then decline, or backend='torch' would not be PyTorch on CUDA.
_pytorch_requested = contextvars.ContextVar("msds_kernels_pytorch_requested", default=False)


@contextlib.contextmanager
def pytorch_path():
    """Within it, `auto` takes the PyTorch path for every tensor (a reference on CUDA)."""
    token = _pytorch_requested.set(True)
    try:
        yield
    finally:
        _pytorch_requested.reset(token)


def triton_available() -> bool:
    """Whether triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _use_triton(t: torch.Tensor, backend: str, name: str) -> bool:
    """Whether `t` goes to the kernels under `backend`; an MsdsError when `triton` cannot be honoured."""
    if backend == "torch":
        return False
    if backend == "auto":
        return not _pytorch_requested.get() and t.is_cuda and t.dtype in KERNEL_DTYPES and triton_available()
    if backend != "triton":
        raise MsdsError(f"backend: {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if not triton_available():
        raise MsdsError("backend: 'triton' needs triton, the optional extra 'kernels' "
                        "(pip install 'msds[kernels]'); or use backend='auto' for the PyTorch path")
    if not (t.is_cuda or _interpreting()):
        raise MsdsError(f"{name}: is on {t.device}; the Triton kernels run on CUDA tensors (move it "
                        f"with .cuda()), or on the CPU with TRITON_INTERPRET=1 set before kernels are "
                        f"first used; or use backend='auto'")
    if t.dtype not in KERNEL_DTYPES:
        raise MsdsError(f"{name}: dtype {t.dtype} has no kernel (fp32, bf16, fp16); cast it, or use "
                        f"backend='auto' for the PyTorch path")
    return True


def _kernels():
    import kernels.multilevel as multilevel   # imports triton: only when a kernel is launched
    return multilevel


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise MsdsError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in (1, 2):
        raise MsdsError(f"{name}: has {t.dim()} dimensions; pass a 1-D (bias, norm) or 2-D (weight, "
                        f"embedding) tensor, or use msds.multilevel.tensor_ops for other shapes")


def _check_groupings(t: torch.Tensor, rows, cols, large: bool, name: str) -> None:
    for axis, grouping in (("rows", rows), ("cols", cols)):
        if grouping is not None and not isinstance(grouping, Grouping):
            raise MsdsError(f"{axis}: expected a Grouping or None, got {type(grouping).__name__}")
    if t.dim() == 1 and cols is not None:
        raise MsdsError(f"cols: {name} is 1-D, it has no columns to group; pass its grouping as rows")
    check_axis(rows, t.shape[0], large, f"{name} axis 0 (rows)")
    if cols is not None:
        check_axis(cols, t.shape[1], large, f"{name} axis 1 (cols)")


def _check_same(t: torch.Tensor, other: torch.Tensor, name: str, other_name: str,
                shape: tuple[int, ...]) -> None:
    """MsdsError naming `other_name` unless it has `shape` and `t`'s dtype and device."""
    if not isinstance(other, torch.Tensor):
        raise MsdsError(f"{other_name}: expected a torch.Tensor, got {type(other).__name__}")
    if tuple(other.shape) != tuple(shape):
        raise MsdsError(f"{other_name}: shape {tuple(other.shape)} disagrees with {tuple(shape)} "
                        f"from {name} and the groupings; pass the large tensor that {name} was "
                        f"coalesced from, with the same groupings")
    if other.dtype != t.dtype:
        raise MsdsError(f"{other_name}: dtype {other.dtype} disagrees with {name}'s {t.dtype}; cast one "
                        f"(e.g. {other_name}.to({name}.dtype)) so both have the same dtype")
    if other.device != t.device:
        raise MsdsError(f"{other_name}: is on {other.device}, {name} on {t.device}; move both to one "
                        f"device (e.g. {other_name}.to({name}.device))")


def _check_alpha(alpha) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise MsdsError(f"alpha: {alpha!r} is outside [0, 1]; 0 keeps the saved large tensor, "
                        f"1 takes the de-coalesced one")


def _axes(rows: Optional[Grouping], cols: Optional[Grouping]) -> list[tuple[int, Grouping]]:
    return [(dim, g) for dim, g in ((0, rows), (1, cols)) if g is not None]


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1) if t.dim() == 1 else t


def _large_shape(small: torch.Tensor, rows, cols) -> tuple[int, ...]:
    return tuple(size * g.factor if g is not None else size
                 for size, g in zip(small.shape, (rows, cols)))


def coalesce_2d(t: torch.Tensor, rows: Optional[Grouping] = None, cols: Optional[Grouping] = None, *,
                scale: float = 1.0, row_reduce: str = "mean", col_reduce: str = "mean",
                backend: Backend = "auto") -> torch.Tensor:
    """scale * (row_reduce over the row groups, col_reduce over the column groups) of `t`; a new
    tensor, `t` untouched. A sum is the mean times the factor (folded into the scale)."""
    _check_tensor(t, "t")
    _check_groupings(t, rows, cols, large=True, name="t")
    for name, reduce, grouping in (("row_reduce", row_reduce, rows), ("col_reduce", col_reduce, cols)):
        if reduce not in REDUCTIONS:
            raise MsdsError(f"{name}: {reduce!r} is not one of 'mean', 'sum'")
        if reduce == "sum" and grouping is not None:
            scale = scale * grouping.factor
    if not _use_triton(t, backend, "t"):
        with pytorch_path():
            return tensor_ops.coalesce_tensor(t, _axes(rows, cols), scale)
    out = _kernels().coalesce(_as_matrix(t), rows, cols, scale)
    return out.squeeze(1) if t.dim() == 1 else out


def decoalesce_2d(small: torch.Tensor, rows: Optional[Grouping] = None, cols: Optional[Grouping] = None,
                  *, scale: float = 1.0, backend: Backend = "auto") -> torch.Tensor:
    """Copies of `small`'s units into every large unit of their group, divided by `scale`."""
    _check_tensor(small, "small")
    _check_groupings(small, rows, cols, large=False, name="small")
    if not _use_triton(small, backend, "small"):
        with pytorch_path():
            return tensor_ops.decoalesce_tensor(small, _axes(rows, cols), scale)
    matrix = _as_matrix(small)
    out = _kernels().decoalesce(matrix, rows, cols, _large_shape(matrix, rows, cols), scale)
    return out.view(_large_shape(small, rows, cols))


def decoalesce_interpolate_2d(small: torch.Tensor, saved: torch.Tensor, alpha: float,
                              rows: Optional[Grouping] = None, cols: Optional[Grouping] = None, *,
                              scale: float = 1.0, backend: Backend = "auto") -> torch.Tensor:
    """(1 - alpha) * saved + alpha * decoalesce_2d(small) as torch.lerp computes it, in one pass on
    the kernels: alpha = 0 returns `saved`, alpha = 1 the de-coalesced tensor, bit for bit."""
    _check_tensor(small, "small")
    _check_groupings(small, rows, cols, large=False, name="small")
    _check_same(small, saved, "small", "saved", _large_shape(small, rows, cols))
    _check_alpha(alpha)
    if not _use_triton(small, backend, "small"):
        with pytorch_path():
            copies = tensor_ops.decoalesce_tensor(small, _axes(rows, cols), scale)
        return torch.lerp(saved, copies, float(alpha))
    out = _kernels().decoalesce(_as_matrix(small), rows, cols, tuple(_as_matrix(saved).shape), scale,
                                saved=_as_matrix(saved), alpha=alpha)
    return out.view(saved.shape)


def _check_moment_pair(exp_avg, exp_avg_sq, first: str, second: str, c) -> None:
    _check_tensor(exp_avg, first)
    _check_same(exp_avg, exp_avg_sq, first, second, tuple(exp_avg.shape))
    if isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0:
        raise MsdsError(f"c: {c!r} is not a positive number; c is the product of the output-side "
                        f"factors (times the depth factor for layer tensors), 1 when none is grouped")


def coalesce_moments_2d(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, rows: Optional[Grouping] = None,
                        cols: Optional[Grouping] = None, *, c: float,
                        backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's moments of a large tensor coalesced: (c * groupmean(exp_avg), c^2 * groupmean(exp_avg_sq))."""
    _check_moment_pair(exp_avg, exp_avg_sq, "exp_avg", "exp_avg_sq", c)
    return (coalesce_2d(exp_avg, rows, cols, scale=c, backend=backend),
            coalesce_2d(exp_avg_sq, rows, cols, scale=c * c, backend=backend))


def decoalesce_interpolate_moments_2d(
        small_exp_avg: torch.Tensor, small_exp_avg_sq: torch.Tensor, saved_exp_avg: torch.Tensor,
        saved_exp_avg_sq: torch.Tensor, alpha: float, rows: Optional[Grouping] = None,
        cols: Optional[Grouping] = None, *, c: float,
        backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's moments de-coalesced (copies / c and / c^2) and interpolated with the saved ones."""
    _check_moment_pair(small_exp_avg, small_exp_avg_sq, "small_exp_avg", "small_exp_avg_sq", c)
    return (decoalesce_interpolate_2d(small_exp_avg, saved_exp_avg, alpha, rows, cols, scale=c,
                                      backend=backend),
            decoalesce_interpolate_2d(small_exp_avg_sq, saved_exp_avg_sq, alpha, rows, cols,
                                      scale=c * c, backend=backend))


def _matrix_groupings(t: torch.Tensor, axes) -> Optional[tuple[Optional[Grouping], Optional[Grouping]]]:
    """(rows, cols) groupings of `t` seen as a matrix - rows = dim 0, columns = the other dims
    flattened - when that carries tensor_ops' `axes`; None when it does not (a grouped middle dim,
    a dim grouped twice) or there is nothing to launch."""
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


def fused_coalesce_tensor(t: torch.Tensor, axes, scale: float = 1.0) -> Optional[torch.Tensor]:
    """tensor_ops.coalesce_tensor(t, axes, scale) on the kernels, or None when `auto` would not use
    them for `t` or its axes do not fit a matrix (the caller then runs the PyTorch path)."""
    groupings = _matrix_groupings(t, axes)
    if groupings is None or not _use_triton(t, "auto", "t"):
        return None
    rows, cols = groupings
    matrix = t.reshape(t.shape[0], -1) if t.dim() > 2 else _as_matrix(t)
    check_axis(rows, matrix.shape[0], True, "t axis 0")
    check_axis(cols, matrix.shape[1], True, "t axis 1")
    out = _kernels().coalesce(matrix, rows, cols, scale)
    small_rows = out.shape[0]
    return out.view(small_rows, *t.shape[1:]) if t.dim() != 2 else out


def fused_decoalesce_tensor(t: torch.Tensor, axes, scale: float = 1.0) -> Optional[torch.Tensor]:
    """tensor_ops.decoalesce_tensor(t, axes, scale) on the kernels, or None (see fused_coalesce_tensor)."""
    groupings = _matrix_groupings(t, axes)
    if groupings is None or not _use_triton(t, "auto", "t"):
        return None
    rows, cols = groupings
    matrix = t.reshape(t.shape[0], -1) if t.dim() > 2 else _as_matrix(t)
    check_axis(rows, matrix.shape[0], False, "t axis 0")
    check_axis(cols, matrix.shape[1], False, "t axis 1")
    out = _kernels().decoalesce(matrix, rows, cols, _large_shape(matrix, rows, cols), scale)
    return out.view(out.shape[0], *t.shape[1:]) if t.dim() != 2 else out


__all__ = ["BACKENDS", "KERNEL_DTYPES", "coalesce_2d", "coalesce_moments_2d", "decoalesce_2d",
           "decoalesce_interpolate_2d", "decoalesce_interpolate_moments_2d", "fused_coalesce_tensor",
           "fused_decoalesce_tensor", "pytorch_path", "triton_available"]
