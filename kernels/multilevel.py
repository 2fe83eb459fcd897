"""Triton kernels for the multi-level operators on a 2-D tensor: one pass, no intermediates.

A tensor's rows and columns are each described by an element-level index map (plain int32 tensors;
this package knows nothing of how the caller groups units), so every grouping runs the same two
kernels:

- `coalesce(t, row_members, col_members, scale)`: row_members is (small rows, row factor), row s
  listing the rows of `t` that small row s averages; col_members the same for columns (an axis that
  is not grouped is arange(size).view(size, 1)). Every program computes a (BLOCK_R, BLOCK_C) tile
  of the small output, gathering the row_factor * col_factor large elements behind each output
  element, and stores scale * (column-group mean of the row-group means) in the output dtype.
  Accumulation is fp32. The means are taken as first + sum(rest - first) / factor, the reference's
  formula, so coalescing copies returns them bit for bit and fp32 results agree with the reference
  (msds.multilevel.tensor_ops' PyTorch path) to rounding.
- `decoalesce(small, row_owner, col_owner, scale, saved, alpha)`: row_owner is (large rows,), the
  small row each large row copies; col_owner the same for columns. Every program computes a tile of
  the large output, gathering small[row_owner[i], col_owner[j]] / scale, rounded to the tensor dtype
  like the reference's de-coalesced tensor, and - in the same pass - interpolates with the saved
  large tensor: out = lerp(saved, that, alpha). The lerp is torch's: fma(alpha, end - start, start)
  for alpha < 0.5, else fma(alpha - 1, end - start, end), which is exactly torch.lerp on the CPU (its
  vectorised kernel uses this fma form) and exact at both ends: alpha = 0 gives saved, alpha = 1 the
  de-coalesced tensor, bit for bit.

The scale is the caller's: the kernels apply it, they do not know what it stands for.

Agreement with the reference (checked under the interpreter by tests/test_kernels.py):
- de-coalesce (+ interpolate) is bit for bit the reference in fp32, bf16 and fp16: the divisions
  are correctly rounded (div_rn: Triton's `/` may compile to an approximate division on GPUs) and
  the lerp is the fma form, as on the CPU. (torch on CUDA divides by a scalar as a multiplication by
  its reciprocal, 1 ulp apart in fp32 for scales that are not powers of two; and its lerp is two
  roundings unless nvcc contracts it to the same fma.)
- coalesce accumulates in fp32 and rounds once; the reference rounds after every step in the tensor
  dtype, so bf16/fp16 results differ by an ulp or two of that dtype. In fp32 the formula and order
  are the reference's: equal in every case tried (factors 2-4); the tests still allow 2 ulps.
  Equal members (coalescing copies) give them back bit for bit.
- every cast to bf16 rounds to nearest even (see _round_to), identically on GPUs and the interpreter.

The launchers check shapes, dtypes and devices (ValueError); the index values themselves are the
caller's to get right (checking them would synchronise with the GPU). Importing this module imports
triton; under TRITON_INTERPRET=1 (set before this import) the kernels run on CPU tensors, for the tests.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import SUPPORTED_DTYPES

# Tile shapes: 16 rows x 128 contiguous columns keeps every warp's loads and stores coalesced on
# the large tensor; the tests pass smaller tiles to put tile edges everywhere.
DEFAULT_TILE = (16, 128)


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to nearest even in `dtype`. For bf16 done on the bits: the interpreter's
    fp32 -> bf16 cast truncates (GPUs round to nearest even), and kernels that round the same way
    everywhere are what the interpreter tests check."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = 0x7FC0                                   # a low-mantissa NaN must not round to inf
        rounded = tl.where(x != x, quiet_nan, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _row_group_mean(src, row_members, rows, row_ok, col_offsets, ok, src_stride_r,
                    ROW_FACTOR: tl.constexpr):
    """fp32 tile: for each output row, the mean over its row group of src at the (already
    gathered) column offsets, as first + sum(rest - first) / factor."""
    first_row = tl.load(row_members + rows * ROW_FACTOR, mask=row_ok, other=0).to(tl.int64)
    first = tl.load(src + first_row[:, None] * src_stride_r + col_offsets[None, :], mask=ok,
                    other=0.0).to(tl.float32)
    if ROW_FACTOR > 1:
        spread = tl.zeros_like(first)
        for member in tl.static_range(1, ROW_FACTOR):
            row = tl.load(row_members + rows * ROW_FACTOR + member, mask=row_ok, other=0).to(tl.int64)
            value = tl.load(src + row[:, None] * src_stride_r + col_offsets[None, :], mask=ok,
                            other=0.0).to(tl.float32)
            spread += value - first
        first = tl.math.div_rn(spread, ROW_FACTOR) + first
    return first


@triton.jit
def _coalesce_kernel(src, out, row_members, col_members, out_rows, out_cols,
                     src_stride_r, src_stride_c, out_stride_r, out_stride_c, scale,
                     ROW_FACTOR: tl.constexpr, COL_FACTOR: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < out_rows
    col_ok = cols < out_cols
    ok = row_ok[:, None] & col_ok[None, :]
    # Rows first, then columns: the reference's order (dim 0, then dim 1).
    first_col = tl.load(col_members + cols * COL_FACTOR, mask=col_ok, other=0).to(tl.int64)
    mean = _row_group_mean(src, row_members, rows, row_ok, first_col * src_stride_c, ok,
                           src_stride_r, ROW_FACTOR)
    if COL_FACTOR > 1:
        spread = tl.zeros_like(mean)
        for member in tl.static_range(1, COL_FACTOR):
            col = tl.load(col_members + cols * COL_FACTOR + member, mask=col_ok, other=0).to(tl.int64)
            spread += _row_group_mean(src, row_members, rows, row_ok, col * src_stride_c, ok,
                                      src_stride_r, ROW_FACTOR) - mean
        mean = tl.math.div_rn(spread, COL_FACTOR) + mean
    out_offsets = rows.to(tl.int64)[:, None] * out_stride_r + cols.to(tl.int64)[None, :] * out_stride_c
    tl.store(out + out_offsets, _round_to(mean * scale, out.dtype.element_ty), mask=ok)


@triton.jit
def _decoalesce_kernel(small, saved, out, row_owner, col_owner, out_rows, out_cols,
                       small_stride_r, small_stride_c, saved_stride_r, saved_stride_c,
                       out_stride_r, out_stride_c, scale, alpha, INTERPOLATE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < out_rows
    col_ok = cols < out_cols
    ok = row_ok[:, None] & col_ok[None, :]
    src_row = tl.load(row_owner + rows, mask=row_ok, other=0).to(tl.int64)
    src_col = tl.load(col_owner + cols, mask=col_ok, other=0).to(tl.int64)
    copy = tl.load(small + src_row[:, None] * small_stride_r + src_col[None, :] * small_stride_c,
                   mask=ok, other=0.0).to(tl.float32)
    # Rounded to the dtype before interpolating: the reference interpolates the de-coalesced tensor.
    value = _round_to(tl.math.div_rn(copy, scale), out.dtype.element_ty)
    rows64 = rows.to(tl.int64)[:, None]
    cols64 = cols.to(tl.int64)[None, :]
    if INTERPOLATE:
        start = tl.load(saved + rows64 * saved_stride_r + cols64 * saved_stride_c, mask=ok,
                        other=0.0).to(tl.float32)
        end = value.to(tl.float32)
        near_start = alpha < 0.5
        weight = tl.where(near_start, alpha, alpha - 1.0)
        base = tl.where(near_start, start, end)
        value = _round_to(tl.fma(weight + tl.zeros_like(end), end - start, base), out.dtype.element_ty)
    tl.store(out + rows64 * out_stride_r + cols64 * out_stride_c, value, mask=ok)


def _grid(rows: int, cols: int, tile: tuple[int, int]):
    return (triton.cdiv(rows, tile[0]), triton.cdiv(cols, tile[1]))


def _check_matrix(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D torch.Tensor")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} has no kernel (fp32, bf16, fp16)")


def _check_index(index: torch.Tensor, dims: int, device: torch.device, name: str) -> None:
    if not isinstance(index, torch.Tensor) or index.dim() != dims or index.dtype != torch.int32:
        raise ValueError(f"{name}: expected a {dims}-D int32 index tensor")
    if index.device != device or not index.is_contiguous():
        raise ValueError(f"{name}: must be contiguous and on {device}, is on {index.device}")


def _check_like(t: Optional[torch.Tensor], shape: tuple[int, int], dtype, device, name: str) -> None:
    """ValueError unless `t` (when given) has `shape`, `dtype` and `device`."""
    if t is not None and (tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, {dtype} on {device}; got "
                         f"{tuple(t.shape)}, {t.dtype} on {t.device}")


def coalesce(t: torch.Tensor, row_members: torch.Tensor, col_members: torch.Tensor, scale: float,
             out: Optional[torch.Tensor] = None, tile: tuple[int, int] = DEFAULT_TILE) -> torch.Tensor:
    """scale * group mean of the 2-D `t` over the row groups `row_members` and column groups
    `col_members` (module doc), written into `out` (any strides) or a new tensor."""
    _check_matrix(t, "t")
    _check_index(row_members, 2, t.device, "row_members")
    _check_index(col_members, 2, t.device, "col_members")
    for name, index, size in (("row_members", row_members, t.shape[0]), ("col_members", col_members, t.shape[1])):
        if index.numel() != size:
            raise ValueError(f"{name}: lists {index.numel()} channels, t has {size} on that axis")
    small_shape = (row_members.shape[0], col_members.shape[0])
    _check_like(out, small_shape, t.dtype, t.device, "out")
    if out is None:
        out = torch.empty(small_shape, dtype=t.dtype, device=t.device)
    _coalesce_kernel[_grid(*out.shape, tile)](
        t, out, row_members, col_members, out.shape[0], out.shape[1], t.stride(0), t.stride(1),
        out.stride(0), out.stride(1), float(scale), ROW_FACTOR=row_members.shape[1],
        COL_FACTOR=col_members.shape[1], BLOCK_R=tile[0], BLOCK_C=tile[1])
    return out


def decoalesce(small: torch.Tensor, row_owner: torch.Tensor, col_owner: torch.Tensor, scale: float,
               saved: Optional[torch.Tensor] = None, alpha: float = 1.0, out: Optional[torch.Tensor] = None,
               tile: tuple[int, int] = DEFAULT_TILE) -> torch.Tensor:
    """The 2-D large tensor of shape (len(row_owner), len(col_owner)): copies of `small` / scale,
    interpolated with `saved` by `alpha` when `saved` is given (lerp(saved, copies, alpha)),
    written into `out` (any strides) or a new tensor."""
    _check_matrix(small, "small")
    _check_index(row_owner, 1, small.device, "row_owner")
    _check_index(col_owner, 1, small.device, "col_owner")
    large_shape = (row_owner.shape[0], col_owner.shape[0])
    _check_like(saved, large_shape, small.dtype, small.device, "saved")
    _check_like(out, large_shape, small.dtype, small.device, "out")
    if out is None:
        out = torch.empty(large_shape, dtype=small.dtype, device=small.device)
    interpolate = saved is not None
    saved_arg = saved if interpolate else out              # never read without INTERPOLATE
    _decoalesce_kernel[_grid(*large_shape, tile)](
        small, saved_arg, out, row_owner, col_owner, large_shape[0], large_shape[1],
        small.stride(0), small.stride(1), saved_arg.stride(0), saved_arg.stride(1),
        out.stride(0), out.stride(1), float(scale), float(alpha), INTERPOLATE=interpolate,
        BLOCK_R=tile[0], BLOCK_C=tile[1])
    return out
