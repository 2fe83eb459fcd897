"""The per-tensor work of the multi-level operators, in one place.

Every function takes a tensor and the grouped axes as `(dim, Grouping)` pairs and does index /
reshape reductions and expansions, linear in the tensor's size (no dense mapping matrices). On an
axis of N channels a grouping of `units` units sees N // units consecutive channels per unit (a
block): a head of the fused QKV output is 3 * head_dim rows, one of the projection's input is
head_dim columns.

- `coalesce_tensor`: scale * (mean over each group, on every grouped axis);
- `decoalesce_tensor`: (copy of each small unit into every unit of its group) / scale;
- `decoalesce_interpolate_tensor`: torch.lerp(saved, decoalesce_tensor(small), alpha), one pass on
  the kernels.

The scale is the caller's (operators.tensor_scale holds the rule). With the same scale,
coalesce_tensor(decoalesce_tensor(t)) == t up to rounding of the division by the scale (bit for bit
when the scale is 1 or a power of 2).

`backend` chooses the implementation (msds.multilevel.backends): by default the fused Triton
kernels for CUDA tensors when triton is installed, the PyTorch code below otherwise; `torch` and
`triton` force one. On PyTorch the adjacent and strided layouts are reshaped views (no gather);
explicit groups use index_select.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from msds.errors import MsdsError
from msds.multilevel import backends
from msds.multilevel.backends import Backend
from msds.multilevel.grouping import Grouping

AxisGroupings = Sequence[tuple[int, Grouping]]


def _check_axes(t: torch.Tensor, axes: AxisGroupings, large: bool, name: str) -> None:
    """MsdsError naming `name` unless every grouped axis of `t` holds whole blocks of the
    grouping's large (or small) units."""
    side = "large" if large else "small"
    for dim, grouping in axes:
        units = grouping.units if large else grouping.small_units
        size = t.shape[dim]
        if size % units:
            raise MsdsError(f"{name} axis {dim % t.dim()}: has {size} channels, not a multiple of the "
                            f"grouping's {units} {side} units; pass the {side} tensor this grouping was "
                            f"made for, or the grouping of this axis ({grouping.units} large units, "
                            f"factor {grouping.factor})")


def _check_saved(small: torch.Tensor, saved: torch.Tensor, axes: AxisGroupings) -> None:
    """MsdsError unless `saved` is the large tensor `small` de-coalesces to: its shape, dtype, device."""
    shape = list(small.shape)
    for dim, grouping in axes:
        shape[dim] *= grouping.factor
    if not isinstance(saved, torch.Tensor):
        raise MsdsError(f"saved: expected a torch.Tensor, got {type(saved).__name__}")
    if tuple(saved.shape) != tuple(shape):
        raise MsdsError(f"saved: shape {tuple(saved.shape)} disagrees with {tuple(shape)} from small and "
                        f"the groupings; pass the large tensor that small was coalesced from")
    if saved.dtype != small.dtype:
        raise MsdsError(f"saved: dtype {saved.dtype} disagrees with small's {small.dtype}; cast one "
                        f"(e.g. saved.to(small.dtype)) so both have the same dtype")
    if saved.device != small.device:
        raise MsdsError(f"saved: is on {saved.device}, small on {small.device}; move both to one device "
                        f"(e.g. saved.to(small.device))")


def _split_axis(t: torch.Tensor, dim: int, units: int) -> torch.Tensor:
    """View axis `dim` of N channels as (units, N // units)."""
    return t.unflatten(dim, (units, t.shape[dim] // units))


def _grouped(t: torch.Tensor, dim: int, grouping: Grouping) -> tuple[torch.Tensor, int]:
    """`t` with axis `dim` as (small-unit dims..., factor, ...block): a view for the adjacent and
    strided layouts (no copy), a gather for explicit groups. Returns it and the factor's dim;
    summing that dim away leaves the small units in order, in the dims from `dim` on."""
    blocks = _split_axis(t, dim, grouping.units)
    factor, shards = grouping.factor, grouping.shards
    if grouping.layout == "adjacent":                     # unit = factor * i + j
        return blocks.unflatten(dim, (grouping.small_units, factor)), dim + 1
    if grouping.layout == "strided":                      # unit = chunk * k + per_shard * j + i
        return blocks.unflatten(dim, (shards, factor, grouping.small_units // shards)), dim + 1
    members = grouping.members().to(t.device)
    gathered = blocks.index_select(dim, members.flatten())
    return gathered.unflatten(dim, tuple(members.shape)), dim + 1


def coalesce_tensor(t: torch.Tensor, axes: AxisGroupings, scale: float = 1.0, *,
                    backend: Backend = "auto") -> torch.Tensor:
    """scale * groupmean of `t` over every (dim, grouping) in `axes`; a new tensor, `t` untouched."""
    _check_axes(t, axes, large=True, name="t")
    if backends.use_kernels(t, axes, backend):
        return backends.kernel_coalesce(t, axes, scale)
    return _coalesce_torch(t, axes, scale)


def decoalesce_tensor(t: torch.Tensor, axes: AxisGroupings, scale: float = 1.0, *,
                      backend: Backend = "auto") -> torch.Tensor:
    """Copies of `t`'s small units into every large unit of their group, divided by scale."""
    _check_axes(t, axes, large=False, name="t")
    if backends.use_kernels(t, axes, backend):
        return backends.kernel_decoalesce(t, axes, scale)
    return _decoalesce_torch(t, axes, scale)


def decoalesce_interpolate_tensor(small: torch.Tensor, saved: torch.Tensor, alpha: float, axes: AxisGroupings,
                                  scale: float = 1.0, *, backend: Backend = "auto") -> torch.Tensor:
    """torch.lerp(saved, decoalesce_tensor(small, axes, scale), alpha), in one pass on the kernels
    (bit for bit the same): alpha = 0 returns `saved`, alpha = 1 the de-coalesced tensor. The range
    of alpha is the caller's to check (operators.check_alpha)."""
    _check_axes(small, axes, large=False, name="small")
    _check_saved(small, saved, axes)
    if backends.use_kernels(small, axes, backend, "small"):
        return backends.kernel_decoalesce(small, axes, scale, saved=saved, alpha=float(alpha))
    return torch.lerp(saved, _decoalesce_torch(small, axes, scale), float(alpha))


def _coalesce_torch(t: torch.Tensor, axes: AxisGroupings, scale: float) -> torch.Tensor:
    """coalesce_tensor on PyTorch."""
    out = t
    for dim, grouping in axes:
        dim = dim % out.dim()
        grouped, factor_dim = _grouped(out, dim, grouping)
        # The mean as first + mean(rest - first): exact when the members are equal, so coalescing
        # copies (de-coalesced weights, duplicated layers) gives them back bit for bit for any g.
        first = grouped.narrow(factor_dim, 0, 1)
        rest = grouped.narrow(factor_dim, 1, grouping.factor - 1)
        deviation = rest - first
        if grouping.factor > 2:                           # g = 2: one deviation, nothing to sum
            deviation = deviation.sum(factor_dim, keepdim=True)
        mean = deviation.div_(grouping.factor).add_(first).squeeze(factor_dim)
        out = mean.flatten(dim, dim + mean.dim() - out.dim())   # small units and block, from dim on
    if out is t:
        out = t.clone()
    return out.mul_(scale) if scale != 1 else out


def _decoalesce_torch(t: torch.Tensor, axes: AxisGroupings, scale: float) -> torch.Tensor:
    """decoalesce_tensor on PyTorch."""
    out = t
    for dim, grouping in axes:
        dim = dim % out.dim()
        blocks = _split_axis(out, dim, grouping.small_units)
        if grouping.layout == "explicit":
            out = blocks.index_select(dim, grouping.owner().to(out.device)).flatten(dim, dim + 1)
            continue
        # The inverse of _grouped's views: broadcast a factor dim of copies, then one copy out.
        if grouping.layout == "strided":
            blocks = blocks.unflatten(dim, (grouping.shards, grouping.small_units // grouping.shards))
        copies = blocks.unsqueeze(dim + 1)
        shape = list(copies.shape)
        shape[dim + 1] = grouping.factor
        expanded = copies.expand(shape)
        out = expanded.flatten(dim, dim + expanded.dim() - out.dim())
    if out is t:
        out = t.clone()
    return out / scale if scale != 1 else out   # out of place: `out` may be an expanded view
