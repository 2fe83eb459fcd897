"""Random-LTD (random and layerwise token dropping, Yao et al. 2022) as DeepSpeed configures it:
the keys `data_efficiency.data_routing.random_ltd` of the ds_config, read here once, into a schedule.

Every routed layer processes a random sorted subset of `r` of the S tokens of each sample; the
others pass it unchanged (msds/model/transformer.py does the gather / scatter). `r` follows the MSLG
schedule (`fixed_linear`: from `min_value` to `max_value` over `require_steps`, in multiples of
`seq_per_step`) on the global step, so it continues across level transitions. The routed layers of
the full-size model are `random_ltd_layer_id` (default: every layer but the first and the last,
msds.model.roles.routed_layers); a coarser level routes a layer when every layer merged into it is
routed (`routed_through`, docs/method.md §6). DeepSpeed's own implementation (CUDA ops) is not used:
the plan removes the section from the config it hands to DeepSpeed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from msds.config import ConfigError, ModelConfig
from msds.model.roles import routed_layers
from msds.multilevel.operators import LevelMap

SCHEDULE_TYPES = ("fixed_linear",)
PATH = "training.ds_config: data_efficiency.data_routing.random_ltd"


@dataclass(frozen=True)
class RandomLTD:
    min_value: int
    max_value: int
    require_steps: int
    seq_per_step: int
    layers: tuple[tuple[int, ...], ...]     # layers[k - 1]: the layers level k routes
    layer_token_lr: bool = False

    def keep_tokens(self, step: int) -> int:
        """Tokens each routed layer keeps at global step `step` (DeepSpeed's fixed_linear formula)."""
        value = math.floor(min(1.0, step / self.require_steps) * (self.max_value - self.min_value) + self.min_value)
        value -= value % self.seq_per_step
        return max(min(value, self.max_value), min(self.seq_per_step, self.max_value))

    def routed(self, level: int) -> tuple[int, ...]:
        return self.layers[level - 1]

    def layer_tokens(self, step: int, level: int, model: ModelConfig, samples: int) -> int:
        """Layer-tokens processed in one step at `level` (`model` is its shape), the LayerToken
        schedule's clock."""
        routed = len(self.routed(level))
        return samples * (self.keep_tokens(step) * routed + self.max_value * (model.num_layers - routed))


def routed_through(layers: tuple[int, ...], level_map: LevelMap) -> tuple[int, ...]:
    """The layers the smaller level of `level_map` routes when the larger routes `layers`: small
    layer i when every large layer merged into it is routed, so that a layer that sees every token
    (the first and the last by default) passes that on to the layer it merges into."""
    grouping = level_map.groupings.get("layers")
    if grouping is None:
        return layers
    return tuple(i for i, group in enumerate(grouping.members().tolist()) if set(group) <= set(layers))


def parse(efficiency: dict, model: ModelConfig, seq_len: int,
          level_maps: tuple[LevelMap, ...] = ()) -> RandomLTD | None:
    """The random-LTD settings of a ds_config's `data_efficiency` section (None when absent or
    disabled), validated against the level-1 model and sequence length; `level_maps` (level k to
    k + 1) carry the routed layers down to every level."""
    data_routing = efficiency.get("data_routing") or {}
    routing = data_routing.get("random_ltd") or {}
    if not (efficiency.get("enabled", False) and data_routing.get("enabled", False) and routing.get("enabled", False)):
        return None
    total = routing.get("total_layer_num", model.num_layers)
    if total != model.num_layers:
        raise ConfigError(f"{PATH}.total_layer_num: {total}, but model.num_layers is {model.num_layers}")
    layers = [_routed_layers(routing, model)]
    for level_map in level_maps:
        layers.append(routed_through(layers[-1], level_map))
    if routing.get("model_type", "decoder" if model.arch == "gpt" else "encoder") != \
            ("decoder" if model.arch == "gpt" else "encoder"):
        raise ConfigError(f"{PATH}.model_type: {routing['model_type']!r} does not match model.arch {model.arch!r}")
    schedule = routing.get("random_ltd_schedule") or {}
    kind = schedule.get("schedule_type", "fixed_linear")
    if kind not in SCHEDULE_TYPES:
        raise ConfigError(f"{PATH}.random_ltd_schedule.schedule_type: {kind!r} is not implemented; "
                          f"use one of {', '.join(SCHEDULE_TYPES)}")
    sched_cfg = schedule.get("schedule_config") or {}
    result = RandomLTD(min_value=schedule.get("min_value", seq_len // 2),
                       max_value=schedule.get("max_value", seq_len),
                       require_steps=sched_cfg.get("require_steps", 1),
                       seq_per_step=sched_cfg.get("seq_per_step", 1), layers=tuple(layers),
                       layer_token_lr=bool((routing.get("layer_token_lr_schedule") or {}).get("enabled", False)))
    if not 0 < result.min_value <= seq_len:
        raise ConfigError(f"{PATH}.random_ltd_schedule.min_value: {result.min_value} must be in 1..{seq_len} "
                          f"(data.seq_len)")
    if result.max_value != seq_len:
        raise ConfigError(f"{PATH}.random_ltd_schedule.max_value: {result.max_value} must equal data.seq_len "
                          f"({seq_len}): the schedule ends at full sequences")
    if result.min_value > result.max_value or result.require_steps <= 0 or result.seq_per_step <= 0:
        raise ConfigError(f"{PATH}.random_ltd_schedule: need min_value <= max_value and positive "
                          f"require_steps and seq_per_step")
    return result


def _routed_layers(routing: dict, model: ModelConfig) -> tuple[int, ...]:
    """`random_ltd_layer_id` (default: every layer but the first and the last), checked as DeepSpeed
    checks it: `random_ltd_layer_num` must count its layers."""
    default = routed_layers(model.num_layers)
    given = "random_ltd_layer_id" in routing
    layer_ids = routing["random_ltd_layer_id"] if given else list(default)
    if given and (not isinstance(layer_ids, list) or not layer_ids or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < model.num_layers for i in layer_ids)):
        raise ConfigError(f"{PATH}.random_ltd_layer_id: {layer_ids!r} must be a non-empty list of layer indices "
                          f"in 0..{model.num_layers - 1} (model.num_layers={model.num_layers}); remove the key for "
                          f"the default {list(default)}, or disable random_ltd to route no layer")
    if len(set(layer_ids)) < len(layer_ids):
        raise ConfigError(f"{PATH}.random_ltd_layer_id: {layer_ids} names a layer twice; list each routed "
                          f"layer once")
    layer_num = routing.get("random_ltd_layer_num", len(layer_ids))
    if layer_num != len(layer_ids):
        which = "random_ltd_layer_id lists" if given else "without random_ltd_layer_id msds routes"
        raise ConfigError(f"{PATH}.random_ltd_layer_num: {layer_num}, but {which} {len(layer_ids)} layer(s) "
                          f"({sorted(layer_ids)}); set it to {len(layer_ids)}")
    return tuple(sorted(layer_ids))
