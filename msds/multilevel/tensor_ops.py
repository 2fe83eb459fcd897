"""The per-tensor work of the multi-level operators, in one place.

Both functions take a tensor and the grouped axes as `(dim, Grouping)` pairs and do index / reshape
reductions and expansions, linear in the tensor's size (no dense mapping matrices). On an axis of N
channels a grouping of `units` units sees N // units consecutive channels per unit (a block): a head
of the fused QKV output is 3 * head_dim rows, one of the projection's input is head_dim columns.

- `coalesce_tensor`: scale * (mean over each group, on every grouped axis);
- `decoalesce_tensor`: (copy of each small unit into every unit of its group) / scale.

The adjacent and strided layouts are reshaped views (no gather); explicit groups use index_select.
The scale carries the rule (operators.py): a parameter's input-side axes sum (scale = product of
their factors), Adam's moments get the product of the output-side factors (squared for the second
moment). With the same scale, coalesce_tensor(decoalesce_tensor(t)) == t up to rounding of the
division by the scale (bit for bit when the scale is 1 or a power of 2).

This module is the one place for per-tensor work, so that other devices' kernels can take over here.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from msds.multilevel.grouping import Grouping

AxisGroupings = Sequence[tuple[int, Grouping]]


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


def coalesce_tensor(t: torch.Tensor, axes: AxisGroupings, scale: float = 1.0) -> torch.Tensor:
    """scale * groupmean of `t` over every (dim, grouping) in `axes`; a new tensor, `t` untouched."""
    if t.is_cuda:                          # one fused Triton pass when triton is installed
        from kernels.dispatch import fused_coalesce_tensor
        fused = fused_coalesce_tensor(t, axes, scale)
        if fused is not None:
            return fused
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


def decoalesce_tensor(t: torch.Tensor, axes: AxisGroupings, scale: float = 1.0) -> torch.Tensor:
    """Copies of `t`'s small units into every large unit of their group, divided by scale."""
    if t.is_cuda:                          # one fused Triton pass when triton is installed
        from kernels.dispatch import fused_decoalesce_tensor
        fused = fused_decoalesce_tensor(t, axes, scale)
        if fused is not None:
            return fused
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
