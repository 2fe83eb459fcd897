"""Element-level index maps of a grouped axis: the one description every kernel reads.

A `Grouping` counts units; on an axis of `size` channels each unit is a block of `size // units`
consecutive channels (a head of the fused QKV output is 3 * head_dim rows). The kernels need the
grouping per channel, so it is expanded here, once per (grouping, size, device) on the host:

- `member_index(grouping, size)`: int32 (small_size, factor); row s lists the `factor` large
  channels that small channel s reduces over (coalesce);
- `owner_index(grouping, size)`: int32 (size,); the small channel each large channel copies
  (de-coalesce).

Adjacent, strided, block, shard-local and explicit groupings are all just different maps, so one
kernel covers them. An axis that is not grouped (`grouping is None`) maps every channel onto itself
with factor 1. The maps are tiny (one int per channel) and cached; the kernels gather through them.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from msds.errors import MsdsError
from msds.multilevel.grouping import Grouping


def check_axis(grouping: Optional[Grouping], size: int, large: bool, what: str) -> None:
    """MsdsError naming `what` unless an axis of `size` channels fits `grouping`'s large (or small)
    side in whole blocks."""
    if grouping is None:
        return
    units = grouping.units if large else grouping.small_units
    if size % units:
        side = "large" if large else "small"
        raise MsdsError(f"{what}: has {size} channels, not a multiple of the grouping's {units} {side} "
                        f"units; pass the {side} tensor this grouping was made for, or the grouping of "
                        f"this axis ({grouping.units} large units, factor {grouping.factor})")


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
