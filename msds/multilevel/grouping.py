"""Groupings: which units of one model axis merge into one unit of the smaller model (docs/method.md §2).

A `Grouping` partitions `units` groupable units (hidden channels, attention heads, FFN neurons or
layers) into `units // factor` groups of `factor` units; small unit i is group i. It is data, not
code: `to_dict()` goes into checkpoints next to the level, so that de-coalescing uses exactly what
coalescing used, whatever the parallel layout at resume time.

Layouts, for an axis of n units split into m = n / g groups:
- `adjacent`: group i = {g*i, ..., g*i + g - 1};
- `strided` (the paper's): group i = {i, i + m, i + 2m, ...};
- `explicit`: the groups are listed (the authors' `width_scheme` / `depth_scheme`).

`shards` = s applies the layout inside each of s contiguous chunks of units, small chunk k coming
from large chunk k only: with s = the tensor-parallel size (heads, FFN) or the pipeline size
(layers), coalescing and de-coalescing need no communication along that axis (`shard_local`).

A grouping counts units, not channels: applied to a tensor axis of N channels, each unit is a block
of N // units consecutive channels (a head in the fused QKV output is 3 * head_dim rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from msds.config import ConfigError

Layout = Literal["adjacent", "strided", "explicit"]
LAYOUTS = ("adjacent", "strided")


@dataclass(frozen=True)
class Grouping:
    units: int
    """Groupable units of the large axis."""
    factor: int
    """Units merged into one (g >= 2)."""
    layout: Layout = "strided"
    """`adjacent`, `strided`, or `explicit` (then `groups` lists the groups)."""
    shards: int = 1
    """Apply the layout inside each of this many contiguous chunks of units (layouts only)."""
    groups: Optional[tuple[tuple[int, ...], ...]] = None
    """For layout `explicit`: group i lists the large units that merge into small unit i."""

    def __post_init__(self):
        self.validate("grouping")

    def validate(self, path: str) -> None:
        """Raise ConfigError naming `path` unless this is a partition of range(units) into groups."""
        if self.factor < 2:
            raise ConfigError(f"{path}: factor {self.factor} merges nothing; use a factor >= 2 "
                              f"or leave the axis out of the level")
        if self.layout == "explicit":
            if self.groups is None:
                raise ConfigError(f"{path}: layout 'explicit' needs the list of groups")
            if self.shards != 1:
                raise ConfigError(f"{path}: shards apply to the adjacent/strided layouts only; "
                                  f"explicit groups say where every unit goes")
            _check_partition(self.groups, self.units, path)
            return
        if self.layout not in LAYOUTS:
            raise ConfigError(f"{path}.layout: {self.layout!r} is not one of 'adjacent', 'strided'")
        if self.groups is not None:
            raise ConfigError(f"{path}: groups are listed only with layout 'explicit'")
        if self.shards < 1 or self.units % (self.factor * self.shards):
            raise ConfigError(
                f"{path}: {self.units} units cannot be split into {self.shards} shard(s) of groups of "
                f"{self.factor}; choose a factor x shards that divides {self.units}")

    @classmethod
    def from_groups(cls, groups, units: int, path: str) -> "Grouping":
        """An explicit grouping from a list of equal-size lists covering range(units) once each."""
        if not isinstance(groups, (list, tuple)) or not groups or not all(
                isinstance(g, (list, tuple)) and g for g in groups):
            raise ConfigError(f"{path}: expected a non-empty list of non-empty lists of indices, "
                              f"got {groups!r}")
        groups = tuple(tuple(g) for g in groups)
        _check_partition(groups, units, path)
        grouping = cls(units=units, factor=len(groups[0]), layout="explicit", groups=groups)
        grouping.validate(path)
        return grouping

    @property
    def small_units(self) -> int:
        return self.units // self.factor

    def members(self) -> torch.Tensor:
        """LongTensor (units // factor, factor): the large units of each small unit."""
        if self.layout == "explicit":
            return torch.tensor(self.groups, dtype=torch.long)
        chunk = self.units // self.shards              # large units per shard
        per_shard = chunk // self.factor               # small units per shard
        i = torch.arange(per_shard).unsqueeze(1)
        j = torch.arange(self.factor).unsqueeze(0)
        local = i * self.factor + j if self.layout == "adjacent" else i + j * per_shard
        offsets = (torch.arange(self.shards) * chunk).view(-1, 1, 1)
        return (local.unsqueeze(0) + offsets).reshape(self.small_units, self.factor)

    def owner(self) -> torch.Tensor:
        """LongTensor (units,): the small unit each large unit belongs to."""
        owner = torch.empty(self.units, dtype=torch.long)
        owner[self.members().flatten()] = torch.arange(self.small_units).repeat_interleave(self.factor)
        return owner

    def shard_local(self, shards: int, rank: int) -> "Grouping":
        """The grouping of one of `shards` contiguous chunks, in chunk-local unit indices.

        Valid when small chunk `rank` is made of large chunk `rank` only (true for a layout with
        `self.shards` a multiple of `shards`); otherwise the grouping crosses shards and the caller
        must gather the axis first, which this refuses to do silently."""
        if shards < 1 or self.units % shards or self.small_units % shards:
            raise ConfigError(f"grouping: {self.units} units do not split into {shards} shards of "
                              f"whole groups; use a grouping whose shards is a multiple of {shards}")
        chunk, small_chunk = self.units // shards, self.small_units // shards
        local = self.members()[rank * small_chunk:(rank + 1) * small_chunk] - rank * chunk
        if local.min() < 0 or local.max() >= chunk:
            raise ConfigError(
                f"grouping: its groups cross the {shards} shards (e.g. the authors' head i with "
                f"i + n/2); plan the level with shards={shards} so that each shard coalesces alone")
        if self.layout != "explicit" and self.shards % shards == 0:     # same layout: views, no gather
            return Grouping(chunk, self.factor, self.layout, shards=self.shards // shards)
        return Grouping.from_groups(local.tolist(), chunk, "grouping")

    def to_dict(self) -> dict:
        if self.layout == "explicit":
            return {"units": self.units, "layout": "explicit", "groups": [list(g) for g in self.groups]}
        return {"units": self.units, "factor": self.factor, "layout": self.layout, "shards": self.shards}

    @classmethod
    def from_dict(cls, data: dict, path: str = "grouping") -> "Grouping":
        if not isinstance(data, dict) or "units" not in data:
            raise ConfigError(f"{path}: expected a mapping with 'units', got {data!r}")
        if data.get("layout") == "explicit":
            return cls.from_groups(data.get("groups"), data["units"], path)
        known = {"units", "factor", "layout", "shards"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key; known keys: {', '.join(sorted(known))}")
        for key in ("units", "factor", "shards"):
            if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int)):
                raise ConfigError(f"{path}.{key}: expected an integer, got {data[key]!r}")
        if "factor" not in data:
            raise ConfigError(f"{path}.factor: required, but not given")
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("grouping", path, 1)) from None


def _check_partition(groups, units: int, path: str) -> None:
    """Every index in range(units) exactly once, in groups of one size."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ConfigError(f"{path}: groups have different sizes {sorted(sizes)}; every group must "
                          f"merge the same number of units")
    flat = [i for g in groups for i in g]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in flat):
        raise ConfigError(f"{path}: group members must be integer indices, got {groups!r}")
    seen, repeated = set(), []
    for i in flat:
        if i in seen:
            repeated.append(i)
        seen.add(i)
    if repeated:
        raise ConfigError(f"{path}: index {repeated[0]} appears in more than one group; each of the "
                          f"{units} units must belong to exactly one group")
    outside = sorted(i for i in seen if not 0 <= i < units)
    if outside:
        raise ConfigError(f"{path}: index {outside[0]} is outside 0..{units - 1}")
    missing = sorted(set(range(units)) - seen)
    if missing:
        raise ConfigError(f"{path}: index {missing[0]} is in no group; the groups must cover all "
                          f"{units} units (0..{units - 1})")
