"""Coalesce, de-coalesce and interpolate whole models (docs/method.md §3), and map Adam's moments
(docs/method.md §4), as pure functions over named tensors.

The only knowledge of the model is the parameter-role table (msds.model.roles): for each tensor
axis its role (hidden / heads / ffn / fixed), its side (out / in) and block, and the layer index of
block parameters. A `LevelMap` says how a large model maps onto a small one: the two configs and one
`Grouping` per resized axis ('hidden', 'heads', 'ffn', 'layers'; an absent key = not resized).

Rules, with g the factor of each grouped axis (all per-tensor work is in tensor_ops.py):
- parameters, width: side `out` coalesces by the group mean and de-coalesces by copying; side `in`
  coalesces by the group sum and de-coalesces by copying / g (function-preserving);
- parameters, depth: small layer i = mean of the large layers of group i; de-coalescing copies it
  into every layer of the group;
- Adam's moments: c = product of the factors of the grouped `out`-side axes, times the depth factor
  for layer tensors. exp_avg coalesces to c * groupmean (in-side axes averaged too) and
  de-coalesces to copy / c; exp_avg_sq the same with c^2. Step counts are the caller's.

Shards. The functions accept a tensor-parallel rank's pieces (its slice of qkv, proj, fc1, fc2, the
vocab-parallel embedding, ...): call them with `level.shard_local(tp_size, tp_rank)`, whose heads
and FFN groupings are that rank's chunk-local groupings (the level must have been planned with
shards = a multiple of tp_size, so that each small shard comes from one large shard). Only heads and
FFN axes are split by tensor parallelism; hidden and fixed axes may be whole or vocab slices, they
are not resized or are resized the same on every rank. A pipeline stage passes its layers under
their global names: with a layer grouping planned with shards = a multiple of the pipeline size,
every group lies in one stage; a group only partly present is an error.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from msds.config import ConfigError, ModelConfig, from_dict as config_from_dict, to_dict as config_to_dict
from msds.errors import MsdsError
from msds.model.roles import ParamRole, parameter_roles
from msds.multilevel.grouping import LAYOUTS, Grouping
from msds.multilevel.backends import Backend
from msds.multilevel.tensor_ops import coalesce_tensor, decoalesce_interpolate_tensor, decoalesce_tensor

Kind = Literal["param", "exp_avg", "exp_avg_sq"]
KINDS = ("param", "exp_avg", "exp_avg_sq")
WIDTH_AXES = ("hidden", "heads", "ffn")
AXES = WIDTH_AXES + ("layers",)


@dataclass
class LevelMap:
    """How the `large` model maps onto the `small` one (one step of the V-cycle)."""

    large: ModelConfig
    small: ModelConfig
    groupings: dict[str, Grouping]

    def factor(self, axis: str) -> int:
        grouping = self.groupings.get(axis)
        return grouping.factor if grouping is not None else 1

    def shard_local(self, tensor_parallel: int, rank: int) -> "LevelMap":
        """This level as seen by tensor-parallel rank `rank` of `tensor_parallel`: heads and FFN
        groupings in chunk-local units (see the module doc)."""
        groupings = dict(self.groupings)
        for axis in ("heads", "ffn"):
            if axis in groupings:
                groupings[axis] = groupings[axis].shard_local(tensor_parallel, rank)
        return LevelMap(self.large, self.small, groupings)

    def to_dict(self) -> dict:
        return {"large": config_to_dict(self.large), "small": config_to_dict(self.small),
                "groupings": {axis: g.to_dict() for axis, g in self.groupings.items()}}

    @classmethod
    def from_dict(cls, data: dict, path: str = "multilevel") -> "LevelMap":
        if not isinstance(data, dict) or set(data) != {"large", "small", "groupings"}:
            raise ConfigError(f"{path}: expected a mapping with keys large, small, groupings "
                              f"(written by LevelMap.to_dict), got {sorted(data) if isinstance(data, dict) else data!r}")
        unknown = sorted(set(data["groupings"]) - set(AXES))
        if unknown:
            raise ConfigError(f"{path}.groupings.{unknown[0]}: unknown axis; known: {', '.join(AXES)}")
        return cls(large=config_from_dict(ModelConfig, data["large"], f"{path}.large"),
                   small=config_from_dict(ModelConfig, data["small"], f"{path}.small"),
                   groupings={axis: Grouping.from_dict(g, f"{path}.groupings.{axis}")
                              for axis, g in data["groupings"].items()})


# --------------------------------------------------------------------------------------------
# Planning a level
# --------------------------------------------------------------------------------------------

def _units(cfg: ModelConfig) -> dict[str, int]:
    return {"hidden": cfg.hidden_size, "heads": cfg.num_heads, "ffn": cfg.ffn_size, "layers": cfg.num_layers}


def _level(large: ModelConfig, groupings: dict[str, Grouping], path: str) -> LevelMap:
    """The LevelMap of `groupings`, whose small config divides each grouped size by its factor.
    head_dim stays: merged heads keep their width and softmax scale."""
    def shrink(axis: str, size: int) -> int:
        return size // groupings[axis].factor if axis in groupings else size

    small = dataclasses.replace(
        large, hidden_size=shrink("hidden", large.hidden_size), num_heads=shrink("heads", large.num_heads),
        head_dim=large.head_dim, ffn_size=shrink("ffn", large.ffn_size),
        num_layers=shrink("layers", large.num_layers))
    return LevelMap(large=large, small=small.validate(f"{path}.small"), groupings=groupings)


def plan_level(large_cfg: ModelConfig, *, hidden: int = 1, heads: int = 1, ffn: int = 1, layers: int = 1,
               layout: str = "strided", depth_layout: str = "adjacent",
               shards: Optional[dict[str, int]] = None, path: str = "multilevel.level") -> LevelMap:
    """A level that divides hidden, heads, FFN and layers by their own factors (1 = not resized).

    `layout` groups the width axes, `depth_layout` the layers. `shards` ({'heads', 'ffn', 'layers'}
    -> s) groups inside each of s contiguous chunks: the tensor-parallel size for heads and FFN, the
    pipeline size for layers. Errors name `path.<field>`."""
    shards = dict(shards or {})
    unknown = sorted(set(shards) - {"heads", "ffn", "layers"})
    if unknown:
        raise ConfigError(f"{path}.shards.{unknown[0]}: only heads, ffn and layers are split into shards")
    for name, value in (("layout", layout), ("depth_layout", depth_layout)):
        if value not in LAYOUTS:
            raise ConfigError(f"{path}.{name}: {value!r} is not one of {', '.join(map(repr, LAYOUTS))}")
    factors = {"hidden": hidden, "heads": heads, "ffn": ffn, "layers": layers}
    units = _units(large_cfg)
    names = {"hidden": "hidden_size", "heads": "num_heads", "ffn": "ffn_size", "layers": "num_layers"}
    groupings = {}
    for axis, factor in factors.items():
        count = shards.get(axis, 1)
        for field, value in ((axis, factor), (f"shards.{axis}", count)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{path}.{field}: expected a positive integer, got {value!r}")
        if units[axis] % (factor * count):
            per = f" in each of {count} shards" if count > 1 else ""
            raise ConfigError(
                f"{path}.{axis}: factor {factor} does not divide {names[axis]} {units[axis]}{per}; "
                f"choose a factor that divides {units[axis] // count}")
        if factor > 1:
            groupings[axis] = Grouping(units=units[axis], factor=factor,
                                       layout=depth_layout if axis == "layers" else layout, shards=count)
    return _level(large_cfg, groupings, path)


AUTHORS_KEYS = ("width_scheme", "depth_scheme", "reserved_heads", "reserved_layers")
MSDS_KEYS = ("hidden", "heads", "ffn", "layers", "layout", "depth_layout", "shards")


def level_from_scheme(large_cfg: ModelConfig, scheme: dict, path: str = "scheme") -> LevelMap:
    """A level from a scheme file's content: the authors' format (`width_scheme`: groups of heads,
    `depth_scheme`: groups of layers) or msds's (`hidden`/`heads`/`ffn`/`layers` factors, `layout`,
    `depth_layout`, `shards`, as plan_level takes them).

    Authors' format: heads merge as listed; the hidden axis is grouped in blocks of hidden/heads
    channels and the FFN axis in blocks of ffn/heads, following the same groups, as their tool does."""
    if not isinstance(scheme, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {scheme!r}")
    if not any(key in scheme for key in AUTHORS_KEYS):
        unknown = sorted(set(scheme) - set(MSDS_KEYS))
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key; an msds scheme has "
                              f"{', '.join(MSDS_KEYS)}, the authors' has width_scheme, depth_scheme")
        return plan_level(large_cfg, path=path, **scheme)
    unknown = sorted(set(scheme) - set(AUTHORS_KEYS))
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown key in an authors'-format scheme; known: "
                          f"{', '.join(AUTHORS_KEYS)}")
    for key in ("reserved_heads", "reserved_layers"):
        if scheme.get(key):
            raise ConfigError(f"{path}.{key}: keeping some heads/layers out of the merge is not "
                              f"supported; leave it empty and list every index in a group")
    groupings = {}
    if "width_scheme" in scheme:
        field = f"{path}.width_scheme"
        heads = Grouping.from_groups(scheme["width_scheme"], large_cfg.num_heads, field)
        for size_name in ("hidden_size", "ffn_size"):
            size = getattr(large_cfg, size_name)
            if size % large_cfg.num_heads:
                raise ConfigError(f"{field}: {size_name} {size} is not a multiple of num_heads "
                                  f"{large_cfg.num_heads}, so it cannot follow the head groups; "
                                  f"use an msds scheme with factors instead")
        groupings.update(hidden=heads, heads=heads, ffn=heads)
    if "depth_scheme" in scheme:
        groupings["layers"] = Grouping.from_groups(scheme["depth_scheme"], large_cfg.num_layers,
                                                   f"{path}.depth_scheme")
    return _level(large_cfg, groupings, path)


# --------------------------------------------------------------------------------------------
# The operators
# --------------------------------------------------------------------------------------------

def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise MsdsError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")


def _roles_of(tensors: dict, cfg: ModelConfig, which: str) -> dict[str, ParamRole]:
    roles = parameter_roles(cfg)
    unknown = [name for name in tensors if name not in roles]
    if unknown:
        raise MsdsError(f"{unknown[0]}: not a parameter of the level's {which} model ({cfg.arch}, "
                        f"{cfg.num_layers} layers); pass the {which} model's tensors by their msds names")
    return roles


def _grouped_axes(name: str, tensor: torch.Tensor, role: ParamRole, level: LevelMap, large: bool):
    """(dim, grouping, side) of every resized axis of `tensor`, after checking its shape fits."""
    if tensor.dim() != len(role.axes):
        raise MsdsError(f"{name}: has {tensor.dim()} dimensions, its role says {len(role.axes)}; "
                        f"the tensor does not belong to this model")
    axes = []
    for dim, axis in enumerate(role.axes):
        grouping = level.groupings.get(axis.role) if axis.role else None
        if grouping is None:
            continue
        units = grouping.units if large else grouping.small_units
        size = tensor.shape[dim]
        if size % units or (size // units) % axis.block:
            raise MsdsError(
                f"{name}: axis {dim} has {size} channels, not {units} {axis.role} units of a multiple of "
                f"{axis.block}; the tensors do not match the level's {'large' if large else 'small'} "
                f"model (shapes disagree): check the source checkpoint against the level")
        axes.append((dim, grouping, axis.side))
    return axes


def tensor_scale(axes, depth_factor: int, kind: str) -> float:
    """The scale tensor_ops (and through it the kernels) applies to one tensor, the one place of this
    rule (module doc): for parameters the product of the in-side factors; for Adam's moments
    c = product of the out-side factors times `depth_factor` (1 for tensors outside the layers), c
    for exp_avg and c^2 for exp_avg_sq. `axes`: (dim, grouping, side) of each resized axis."""
    if kind == "param":
        return math.prod(g.factor for _, g, side in axes if side == "in")
    c = math.prod(g.factor for _, g, side in axes if side == "out") * depth_factor
    return c if kind == "exp_avg" else c * c


def _layer_suffix(name: str, role: ParamRole) -> str:
    return name[len(f"layers.{role.layer}."):]


def _ordered(tensors: dict, cfg: ModelConfig) -> dict:
    return {name: tensors[name] for name in parameter_roles(cfg) if name in tensors}


def coalesce_groups(names: Iterable[str], level: LevelMap) -> list[list[str]]:
    """The large model's tensors `names` (all of them, or one pipeline stage's) in the smallest sets
    that coalesce on their own, in order of first appearance: a tensor outside the layers alone, a
    layer's tensor together with the same tensor of the other layers of its depth group (alone when
    the layers are not resized). Coalescing each set and merging the results is coalescing all of
    `names`; a transition streams the model through these sets (msds.train.transition)."""
    names = list(names)
    roles = _roles_of(dict.fromkeys(names), level.large, "large")
    depth = level.groupings.get("layers")
    owner = depth.owner().tolist() if depth is not None else None
    groups: dict[tuple, list[str]] = {}
    for name in names:
        role = roles[name]
        key = (name,) if owner is None or role.layer is None else (_layer_suffix(name, role), owner[role.layer])
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def decoalesced_names(name: str, level: LevelMap) -> list[str]:
    """The large model's tensors that the small model's tensor `name` de-coalesces into: itself, or
    for a layer's tensor under a depth grouping the same tensor of every layer of its group."""
    role = _roles_of({name: None}, level.small, "small")[name]
    depth = level.groupings.get("layers")
    if depth is None or role.layer is None:
        return [name]
    suffix = _layer_suffix(name, role)
    return [f"layers.{layer}.{suffix}" for layer in depth.members()[role.layer].tolist()]


def coalesce(tensors: dict[str, torch.Tensor], level: LevelMap, kind: Kind = "param",
             backend: Backend = "auto") -> dict[str, torch.Tensor]:
    """The small model's tensors (names and shapes of `level.small`) from the large model's.
    The inputs are left untouched. `backend`: tensor_ops'."""
    _check_kind(kind)
    roles = _roles_of(tensors, level.large, "large")
    depth = level.groupings.get("layers")
    out = {}
    by_suffix: dict[str, dict[int, str]] = defaultdict(dict)     # depth groups, gathered below
    for name, tensor in tensors.items():
        role = roles[name]
        if depth is not None and role.layer is not None:
            by_suffix[_layer_suffix(name, role)][role.layer] = name
            continue
        axes = _grouped_axes(name, tensor, role, level, large=True)
        out[name] = coalesce_tensor(tensor, [(d, g) for d, g, _ in axes], tensor_scale(axes, 1, kind),
                                    backend=backend)
    if depth is not None:
        whole_group = Grouping(units=depth.factor, factor=depth.factor, layout="adjacent")
        groups = depth.members().tolist()
        for suffix, names in by_suffix.items():
            for small_layer, group in enumerate(groups):
                present = [layer for layer in group if layer in names]
                if not present:
                    continue                                       # another pipeline stage's group
                if len(present) < len(group):
                    missing = next(layer for layer in group if layer not in names)
                    raise MsdsError(f"layers.{missing}.{suffix}: missing, but layers {group} merge "
                                    f"into one; pass every layer of a depth group together")
                members = [tensors[names[layer]] for layer in group]
                if len({t.shape for t in members}) > 1:
                    raise MsdsError(f"layers.{group[0]}.{suffix}: layers {group} have different shapes "
                                    f"{[tuple(t.shape) for t in members]}; layers that merge must agree")
                axes = _grouped_axes(names[group[0]], members[0], roles[names[group[0]]], level, large=True)
                # Width first, layer by layer, then the layer mean over the (smaller) results.
                narrow = [coalesce_tensor(t, [(d, g) for d, g, _ in axes], tensor_scale(axes, 1, kind),
                                          backend=backend) for t in members]
                merged = coalesce_tensor(torch.stack(narrow), [(0, whole_group)],
                                         tensor_scale([], depth.factor, kind), backend=backend)
                out[f"layers.{small_layer}.{suffix}"] = merged.squeeze(0)
    return _ordered(out, level.small)


def _decoalescing(small_tensors: dict[str, torch.Tensor], level: LevelMap, kind: Kind):
    """(name, tensor, grouped axes, scale) of each small tensor: what de-coalescing it needs."""
    _check_kind(kind)
    roles = _roles_of(small_tensors, level.small, "small")
    depth = level.groupings.get("layers")
    for name, tensor in small_tensors.items():
        role = roles[name]
        axes = _grouped_axes(name, tensor, role, level, large=False)
        in_layers = depth is not None and role.layer is not None
        yield name, tensor, [(d, g) for d, g, _ in axes], tensor_scale(axes, depth.factor if in_layers else 1, kind)


def decoalesce(small_tensors: dict[str, torch.Tensor], level: LevelMap, kind: Kind = "param",
               backend: Backend = "auto") -> dict[str, torch.Tensor]:
    """The large model's tensors (names and shapes of `level.large`) from the small model's:
    copies, with in-side axes divided by their factor (parameters) or the moment scale.
    `backend`: tensor_ops'."""
    out = {}
    for name, tensor, groups, scale in _decoalescing(small_tensors, level, kind):
        large = decoalesce_tensor(tensor, groups, scale, backend=backend)
        for k, large_name in enumerate(decoalesced_names(name, level)):
            out[large_name] = large if k == 0 else large.clone()
    return _ordered(out, level.large)


def decoalesce_interpolate(small_tensors: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], level: LevelMap,
                           alpha: float, kind: Kind = "param", backend: Backend = "auto") -> dict[str, torch.Tensor]:
    """interpolate(decoalesce(small_tensors, level, kind), saved, alpha), one pass per large tensor
    (tensor_ops.decoalesce_interpolate_tensor: the fused kernel for CUDA tensors under `auto`,
    PyTorch otherwise; bit for bit the same on the CPU). `saved` holds exactly the large tensors that
    `small_tensors` de-coalesce into (decoalesced_names), in their dtype and on their device."""
    check_alpha(alpha)
    out = {}
    for name, tensor, groups, scale in _decoalescing(small_tensors, level, kind):
        for large_name in decoalesced_names(name, level):
            if large_name not in saved:
                raise MsdsError(f"{large_name}: missing from the saved tensors; interpolating {name} needs the "
                                f"large model's {', '.join(decoalesced_names(name, level))}")
            out[large_name] = decoalesce_interpolate_tensor(tensor, saved[large_name], alpha, groups, scale,
                                                            backend=backend)
    extra = sorted(set(saved) - set(out))
    if extra:
        raise MsdsError(f"{extra[0]}: saved, but none of the small tensors de-coalesces into it; pass the saved "
                        f"tensors of exactly the small tensors given")
    return _ordered(out, level.large)


def check_alpha(alpha, path: str = "alpha") -> None:
    """The one check of an interpolation weight (run plans, `msds map`, `interpolate`)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"{path}: {alpha!r} is outside [0, 1]; 0 keeps the saved large weights, "
                          f"1 takes the de-coalesced ones (the paper uses 0.25-0.5)")


def interpolate(decoalesced: dict[str, torch.Tensor], saved: dict[str, torch.Tensor],
                alpha: float) -> dict[str, torch.Tensor]:
    """(1 - alpha) * saved + alpha * decoalesced, per tensor. torch.lerp is exact at both ends:
    alpha = 0 returns the saved weights bit for bit, alpha = 1 the de-coalesced ones."""
    check_alpha(alpha)
    for name in list(decoalesced) + list(saved):
        if name not in saved or name not in decoalesced:
            which = "saved" if name not in saved else "de-coalesced"
            raise MsdsError(f"{name}: missing from the {which} tensors; interpolate needs the same "
                            f"model on both sides (the saved weights are the large model's, before coalescing)")
        if decoalesced[name].shape != saved[name].shape:
            raise MsdsError(f"{name}: de-coalesced shape {tuple(decoalesced[name].shape)} disagrees with "
                            f"the saved {tuple(saved[name].shape)}; the saved weights must be the large "
                            f"model this level was coalesced from")
    return {name: torch.lerp(saved[name], decoalesced[name].to(saved[name].dtype), float(alpha))
            for name in saved}
