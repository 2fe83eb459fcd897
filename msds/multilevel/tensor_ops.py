"""The per-tensor work of the multi-level operators, in one place.

Both functions take a tensor and the grouped axes as `(dim, Grouping)` pairs and do index / reshape
reductions and expansions, linear in the tensor's size (no dense mapping matrices). On an axis of N
channels a grouping of `units` units sees N // units consecutive channels per unit (a block): a head
of the fused QKV output is 3 * head_dim rows, one of the projection's input is head_dim columns.

- `coalesce_tensor`: scale * (mean over each group, on every grouped axis);
- `decoalesce_tensor`: (copy of each small unit into every unit of its group) / scale.

The scale carries the rule (operators.py): a parameter's input-side axes sum (scale = product of
their factors), Adam's moments get the product of the output-side factors (squared for the second
moment). With the same scale, coalesce_tensor(decoalesce_tensor(t)) == t.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from msds.multilevel.grouping import Grouping

AxisGroupings = Sequence[tuple[int, Grouping]]


def _split_axis(t: torch.Tensor, dim: int, units: int) -> torch.Tensor:
    """View axis `dim` of N channels as (units, N // units)."""
    return t.unflatten(dim, (units, t.shape[dim] // units))


def coalesce_tensor(t: torch.Tensor, axes: AxisGroupings, scale: float = 1.0) -> torch.Tensor:
    """scale * groupmean of `t` over every (dim, grouping) in `axes`; a new tensor, `t` untouched."""
    out, merged = t, 1
    for dim, grouping in axes:
        dim = dim % out.dim()
        members = grouping.members().to(out.device)
        small, factor = members.shape
        blocks = _split_axis(out, dim, grouping.units)
        gathered = blocks.index_select(dim, members.flatten())           # group members side by side
        summed = gathered.unflatten(dim, (small, factor)).sum(dim + 1)
        out = summed.flatten(dim, dim + 1)
        merged *= factor
    if out is t:
        out = t.clone()
    # Divide rather than multiply by 1/g when possible: a mean of g equal values is then exact.
    if scale == 1:
        out = out.div_(merged) if merged != 1 else out
    elif scale != merged:
        out = out.mul_(scale / merged)
    return out


def decoalesce_tensor(t: torch.Tensor, axes: AxisGroupings, scale: float = 1.0) -> torch.Tensor:
    """Copies of `t`'s small units into every large unit of their group, divided by scale."""
    out = t
    for dim, grouping in axes:
        dim = dim % out.dim()
        owner = grouping.owner().to(out.device)
        blocks = _split_axis(out, dim, grouping.small_units)
        out = blocks.index_select(dim, owner).flatten(dim, dim + 1)
    if out is t:
        out = t.clone()
    return out.div_(scale) if scale != 1 else out
