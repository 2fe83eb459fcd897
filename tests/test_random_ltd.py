"""Random-LTD: exactness at r = S, pass-through and gradients of dropped tokens, the MSLG schedule
(against DeepSpeed's own scheduler), encoder/decoder masks, FLOPs, and bad configs."""
import copy
import json

import pytest
import torch

from msds.config import ConfigError, model_config
from msds.model.roles import routed_layers
from msds.model.transformer import Transformer, kept_positions, route_tokens, sdpa_mask
from msds.plan import random_ltd
from msds.plan.schedule import flops_per_sample

DS_LTD = {
    "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
        "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": 8, "max_value": 32, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 50, "seq_per_step": 4}}}}}}


def model(arch, layers=4):
    torch.manual_seed(0)
    return Transformer(model_config(f"{arch}-tiny", num_layers=layers, hidden_dropout=0.0,
                                    attention_dropout=0.0)).eval()


def kept_indices(seed, batch, seq_len, keep, arch="gpt"):
    """The subset route_tokens draws after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return kept_positions(batch, seq_len, keep, arch)


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_keeping_every_token_is_exactly_the_plain_model(arch):
    m = model(arch)
    ids = torch.randint(0, 512, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, -4:] = 0
    extra = {} if arch == "gpt" else {"attention_mask": mask}
    h = m.embeddings(ids)
    layer = m.layers[1]
    full = layer(h, sdpa_mask(arch, mask))
    # Routing all S tokens (a sorted permutation of every position) is the identity.
    assert torch.equal(route_tokens(layer, h, extra.get("attention_mask"), 20, arch), full)


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_dropped_tokens_pass_unchanged_and_get_no_gradient(arch):
    m = model(arch)
    layer = m.layers[1]
    h = torch.randn(2, 16, 64, requires_grad=True)
    torch.manual_seed(3)
    out = route_tokens(layer, h, None, 6, m.cfg.arch)
    kept = kept_indices(3, 2, 16, 6, arch)
    dropped = torch.ones(2, 16, dtype=torch.bool)
    dropped[torch.arange(2)[:, None], kept] = False
    assert torch.equal(out[dropped], h[dropped])
    assert not torch.allclose(out[~dropped], h[~dropped])
    # The kept tokens' outputs depend on kept tokens only: no gradient reaches a dropped token.
    out[~dropped].sum().backward()
    assert torch.count_nonzero(h.grad[dropped]) == 0
    assert torch.count_nonzero(h.grad[~dropped]) > 0


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_bert_always_routes_its_cls_token(arch):
    # A layer that adds 1 marks the tokens it saw; over 200 samples, keeping 2 of 16 tokens, a
    # token that is not forced through is kept in about 25 of them.
    torch.manual_seed(0)
    h = torch.zeros(200, 16, 8)
    out = route_tokens(lambda x, mask: x + 1, h, None, 2, arch)
    cls_kept = int((out[:, 0, 0] == 1).sum())
    assert int((out[..., 0] == 1).sum()) == 400
    assert cls_kept == 200 if arch == "bert" else 5 < cls_kept < 60


def test_routed_layers_are_all_but_first_and_last():
    m = model("gpt", layers=5)
    ids = torch.randint(0, 512, (2, 16))
    calls = []
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: calls.append((i, args[0].shape[1])))
             for i, layer in enumerate(m.layers)]
    m(ids, keep_tokens=8)
    for hook in hooks:
        hook.remove()
    assert calls == [(0, 16), (1, 8), (2, 8), (3, 8), (4, 16)]
    assert routed_layers(5) == (1, 2, 3)


def test_encoder_mask_is_the_gathered_padding_mask():
    m = model("bert")
    layer = m.layers[1]
    h = torch.randn(2, 12, 64)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 7:] = 0
    torch.manual_seed(5)
    out = route_tokens(layer, h, mask, 6, m.cfg.arch)
    kept = kept_indices(5, 2, 12, 6, "bert")
    rows = torch.arange(2)[:, None]
    expected = layer(h[rows, kept], mask[rows, kept].bool()[:, None, None, :])
    assert torch.allclose(out[rows, kept], expected, atol=1e-6)


def test_decoder_mask_is_the_top_left_causal_corner():
    m = model("gpt")
    layer = m.layers[1]
    h = torch.randn(1, 12, 64)
    torch.manual_seed(7)
    out = route_tokens(layer, h, None, 6, m.cfg.arch)
    kept = kept_indices(7, 1, 12, 6)[0]
    # Sorted indices keep order, so the subset's causal mask is the full causal mask restricted
    # to the kept rows and columns; a later kept token must not change an earlier one's output.
    changed = h.clone()
    changed[0, kept[-1]] += 10.0
    torch.manual_seed(7)
    out_changed = route_tokens(layer, changed, None, 6, m.cfg.arch)
    assert torch.equal(out[0, kept[:-1]], out_changed[0, kept[:-1]])
    assert torch.allclose(out[0, kept], layer(h[:, kept])[0], atol=1e-6)


def test_schedule_matches_deepspeed_fixed_linear():
    from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

    ltd = random_ltd.parse(copy.deepcopy(DS_LTD["data_efficiency"]), model_config("gpt-tiny", num_layers=4), 32)
    routing = DS_LTD["data_efficiency"]["data_routing"]["random_ltd"]
    reference = RandomLTDScheduler({**routing, "global_batch_size": 8,
                                    "layer_token_lr_schedule": {"enabled": False}})
    for step in range(0, 80):
        assert ltd.keep_tokens(step) == reference.get_value(step), step
    assert ltd.keep_tokens(0) == 8 and ltd.keep_tokens(25) == 20 and ltd.keep_tokens(50) == 32
    assert all(ltd.keep_tokens(s) % 4 == 0 for s in range(80))


def test_flops_use_the_effective_sequence_length():
    cfg = model_config("gpt-tiny", num_layers=4)
    full = flops_per_sample(cfg, 32)
    assert flops_per_sample(cfg, 32, 32, routed=2) == full == flops_per_sample(cfg, 32, 16, routed=0)
    half = flops_per_sample(cfg, 32, 16, routed=2)
    assert half < full
    per_layer_full = 6 * (4 * 64 * 64 + 2 * cfg.ffn_size * 64) * 32 + 12 * 64 * 32 * 32
    per_layer_half = 6 * (4 * 64 * 64 + 2 * cfg.ffn_size * 64) * 16 + 12 * 64 * 16 * 16
    assert full - half == 2 * (per_layer_full - per_layer_half)


@pytest.mark.parametrize("path,value,message", [
    (["random_ltd_layer_id"], [1, 9], r"random_ltd_layer_id: \[1, 9\] must be a non-empty list of layer indices in "
                                      r"0\.\.3 \(model\.num_layers=4\)"),
    (["random_ltd_layer_id"], [2, 2], r"random_ltd_layer_id: \[2, 2\] names a layer twice"),
    (["random_ltd_layer_num"], 1, r"random_ltd_layer_num: 1, but random_ltd_layer_id lists 2 layer\(s\) \(\[1, 2\]\); "
                                  r"set it to 2"),
    (["random_ltd_schedule", "min_value"], 64, r"min_value: 64 must be in 1\.\.32"),
    (["random_ltd_schedule", "schedule_type"], "fixed_root", r"schedule_type: 'fixed_root' is not implemented"),
    (["total_layer_num"], 6, r"total_layer_num: 6, but model.num_layers is 4"),
])
def test_bad_random_ltd_config(path, value, message, tmp_path, train_corpus):
    ds = copy.deepcopy(DS_LTD)
    node = ds["data_efficiency"]["data_routing"]["random_ltd"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=message):
        random_ltd.parse(copy.deepcopy(ds["data_efficiency"]), model_config("gpt-tiny", num_layers=4), 32)
    # Through the trainer: the same error before any training.
    from msds.config import load_run_config
    from msds.train.loop import train

    full = json.loads(open("ds_configs/zero1.json").read())
    full.update(ds)
    (tmp_path / "ds.json").write_text(json.dumps(full))
    cfg = load_run_config("recipes/test/test-vcycle-gpt.yaml", [f"data.path={train_corpus}", f"run_dir={tmp_path / 'run'}",
                                                          f"training.ds_config={tmp_path / 'ds.json'}",
                                                          "logging.tensorboard=false"])
    with pytest.raises(ConfigError, match=message):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_layer_token_lr_schedule_advances_with_layer_tokens(tmp_path, train_corpus):
    """With short routed sequences early on, a step consumes fewer layer-tokens than a full one, so
    the LayerToken schedule's warmup and decay lag the step-based schedule and meet it at the end."""
    from msds.config import load_run_config
    from msds.plan import build_plan
    from msds.plan.schedule import Decay, lr_multiplier

    ds = json.loads(open("ds_configs/zero1.json").read())
    ds.update(copy.deepcopy(DS_LTD))
    ds["data_efficiency"]["data_routing"]["random_ltd"]["layer_token_lr_schedule"] = {"enabled": True}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = load_run_config("recipes/test/test-vcycle-gpt.yaml", [
        f"data.path={train_corpus}", f"run_dir={tmp_path / 'run'}", "logging.tensorboard=false",
        "multilevel.enabled=false", "training.steps=100", "optimizer.warmup_steps=20",
        f"training.ds_config={tmp_path / 'ds.json'}"])
    plan = build_plan(cfg)
    phase = plan.phases[0]
    by_layer_tokens = plan.lr_curves[0]
    cosine = Decay("cosine", cfg.optimizer.min_lr_ratio)
    assert by_layer_tokens(10) < lr_multiplier(phase, 10, cosine)
    assert by_layer_tokens(100) == pytest.approx(lr_multiplier(phase, 100, cosine))


def test_layer_token_lr_schedule_under_one_run_long_cosine(tmp_path):
    """`lr_schedule: run` keeps the LayerToken clock: the run-long cosine advances with the layer-tokens
    the whole run consumes, each level counting its own layers and routed layers (a V-cycle's small
    levels, with fewer layers, move it less per step), and meets the step clock at the end of the run."""
    from msds.config import load_run_config
    from msds.plan import build_plan
    from msds.plan.schedule import Decay, Phase, lr_multiplier

    ds = json.loads(open("ds_configs/zero1.json").read())
    ds.update(copy.deepcopy(DS_LTD))
    ds["data_efficiency"]["data_routing"]["random_ltd"]["layer_token_lr_schedule"] = {"enabled": True}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    recipe = "recipes/test/test-vcycle-gpt.yaml"
    plan = build_plan(load_run_config(recipe, ["multilevel.lr_schedule=run",
                                               f"training.ds_config={tmp_path / 'ds.json'}"]))
    by_steps = build_plan(load_run_config(recipe, ["multilevel.lr_schedule=run"]))
    cfg, total = plan.config, plan.total_steps
    whole_run = Phase(0, 1, total, 0, cfg.optimizer.lr, cfg.optimizer.warmup_steps)
    level_of = [p.level for p in plan.phases for _ in range(p.steps)]
    consumed = [0]
    for step, level in enumerate(level_of):
        routed, layers = len(plan.routed_layers(level)), plan.model(level).num_layers
        consumed.append(consumed[-1] + plan.samples_per_step * (plan.keep_tokens(step) * routed
                                                                + 32 * (layers - routed)))
    for phase, curve in zip(plan.phases, plan.lr_curves):
        for k in range(phase.steps):
            rewarm = 1.0 if phase.index == 0 else min(1.0, (k + 1) / phase.warmup_steps)
            clock = consumed[phase.start_step + k] / consumed[-1] * total
            assert curve(k) == pytest.approx(rewarm * lr_multiplier(whole_run, clock, Decay("cosine", 0.1)))
    assert plan.routed_layers(1) == (1, 2) and plan.routed_layers(2) == plan.routed_layers(3) == ()
    assert plan.lr_curves[2](3) != pytest.approx(by_steps.lr_curves[2](3))    # not the step clock
    last = plan.phases[-1]
    assert plan.lr_curves[-1](last.steps) == pytest.approx(by_steps.lr_curves[-1](last.steps))


def test_routed_layers_follow_the_keys_down_the_levels():
    """A coarser level routes a layer when every layer merged into it is routed; width-only levels
    keep the set (docs/method.md §6)."""
    from msds.multilevel import plan_level

    cfg = model_config("gpt-tiny", num_layers=8)
    pairs = plan_level(cfg, layers=2)                                      # {0, 1}, {2, 3}, ...
    narrow = plan_level(pairs.small, hidden=2, heads=2, ffn=2)             # width only
    stacked = plan_level(narrow.small, layers=2, depth_layout="strided")   # {0, 2}, {1, 3}
    efficiency = copy.deepcopy(DS_LTD["data_efficiency"])
    routing = efficiency["data_routing"]["random_ltd"]
    routing.update(total_layer_num=8, random_ltd_layer_id=[6, 1, 2, 3, 5, 4], random_ltd_layer_num=6)
    ltd = random_ltd.parse(efficiency, cfg, 32, (pairs, narrow, stacked))
    assert [ltd.routed(k) for k in (1, 2, 3, 4)] == [(1, 2, 3, 4, 5, 6), (1, 2), (1, 2), ()]
    routing.update(random_ltd_layer_id=[0, 1, 4, 5, 7], random_ltd_layer_num=5)
    ltd = random_ltd.parse(efficiency, cfg, 32, (pairs, narrow, stacked))
    assert [ltd.routed(k) for k in (1, 2, 3, 4)] == [(0, 1, 4, 5, 7), (0, 2), (0, 2), (0,)]
    # The FLOPs and the LayerToken clock count each level's own routed layers.
    assert ltd.layer_tokens(0, 4, stacked.small, 2) == 2 * (ltd.keep_tokens(0) * 1 + 32 * 1)
