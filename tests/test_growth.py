"""Grow-only schedules (multilevel.start_level): the plan's phases and FLOPs, G_stack stacking and
interleaving as depth de-coalescing without interpolation (against hand-built stacked tensors), growth
by 4x in one transition, random-LTD's routed layers through a depth transition, and a real run that
starts at level 2 and grows."""
import json
from pathlib import Path

import pytest
import torch

from msds.config import ConfigError, load_run_config
from msds.data import eval_batches, train_batches
from msds.model.files import load_model
from msds.plan import build_plan
from msds.train.engine import (MOMENTS, build_engine, destroy_engine, full_moments, full_weights,
                               optimizer_step_count, train_step)
from msds.train.loop import train
from msds.train.metrics import read_metrics
from msds.train.transition import run_transition

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"
DEPTH_ONLY = "{{hidden: 1, heads: 1, ffn: 1, layers: {g}, depth_layout: {layout}}}"


def grow_cfg(*overrides, g=2, layout="strided"):
    return load_run_config(RECIPE, [f"multilevel.levels=[{DEPTH_ONLY.format(g=g, layout=layout)}]",
                                    "multilevel.start_level=2", "multilevel.phase_steps=[3,3]",
                                    "logging.tensorboard=false", *overrides])


def ltd_ds_config(tmp_path, layers: int, layer_ids: list[int]) -> str:
    """The packaged random-LTD template (sequence 64) for `layers` layers routing `layer_ids`."""
    ds = json.loads((REPO / "ds_configs" / "zero1-random-ltd-seq64.json").read_text())
    routing = ds["data_efficiency"]["data_routing"]["random_ltd"]
    routing.update(total_layer_num=layers, random_ltd_layer_id=layer_ids, random_ltd_layer_num=len(layer_ids))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

def test_grow_only_plan_goes_up_once_and_counts_its_flops():
    plan = build_plan(grow_cfg(g=2))
    assert plan.grow_only and [(p.level, p.start_step, p.steps) for p in plan.phases] == [(2, 0, 3), (1, 3, 3)]
    assert plan.model(2).num_layers == 2 and plan.model(2).hidden_size == plan.model(1).hidden_size
    assert plan.phases[0].warmup_steps == 3 and plan.phases[1].warmup_steps == 2   # optimizer's, then the phase's
    assert plan.phases[0].peak_lr == 2 * plan.phases[1].peak_lr                     # x2 depth: x2 lr
    expected = 3 * plan.flops_per_step(2, 0) + 3 * plan.flops_per_step(1, 0) + plan.transition_flops(2, 1)
    assert plan.total_flops() == pytest.approx(expected)
    assert plan.flops_per_step(2, 0) < plan.flops_per_step(1, 0)
    assert plan.baseline_flops() == 6 * plan.flops_per_step(1, 0)
    again = build_plan(plan.config)                       # the copy as run plans the same run
    assert again.phases == plan.phases and again.grow_only


def test_grow_only_plan_from_a_budget_and_bad_settings(capsys):
    from msds.cli import main as msds_main

    plan = build_plan(grow_cfg("multilevel.phase_steps=[]", "multilevel.budget_steps=40",
                               "multilevel.phase_fractions=[0.25]", g=4, layout="adjacent"))
    small, last = plan.phases
    assert (small.level, small.steps, last.level) == (2, 10, 1)
    assert plan.total_flops() <= plan.baseline_flops() < plan.total_flops() + plan.flops_per_step(1, 0)
    assert last.steps > 30                      # the small phase was cheap: the budget buys more full steps
    bad = [(["multilevel.start_level=3"], r"^multilevel\.start_level: 3, but multilevel\.levels define levels 1\.\.2"),
           (["multilevel.cycles=2"], r"^multilevel\.cycles: 2, but a grow-only run \(start_level 2\) goes up once"),
           (["multilevel.phase_steps=[3,3,3]"],
            r"^multilevel\.phase_steps: a grow-only run from level 2 needs 2 phases \(levels \[2, 1\]\), got 3"),
           (["multilevel.phase_steps=[]", "multilevel.budget_steps=40"],
            r"^multilevel\.phase_fractions: a grow-only run from level 2 has 2 phases \(levels \[2, 1\]\); give the "
            r"first 1")]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            build_plan(grow_cfg(*overrides))
    # msds plan prints the grow-only schedule and its FLOPs.
    capsys.readouterr()
    assert msds_main(["plan", "--config", str(RECIPE), "multilevel.start_level=2", "multilevel.phase_steps=[3,3]",
                      f"multilevel.levels=[{DEPTH_ONLY.format(g=2, layout='strided')}]"]) == 0
    out = capsys.readouterr().out
    assert "grow-only: starts with a fresh level-2 model and only goes up" in out
    assert f"total: 6 steps, {build_plan(grow_cfg()).total_flops():.3e} FLOPs" in out


# --------------------------------------------------------------------------------------------
# Growing a real engine
# --------------------------------------------------------------------------------------------

def _grow(plan, corpus):
    """The plan's first level after one real step (so that Adam's moments are not zero), its full
    weights and moments, and the engine and record of the transition up."""
    cfg = plan.config
    torch.manual_seed(cfg.training.seed)
    engine = build_engine(plan, plan.phases[0], None)
    batches = train_batches(corpus, cfg.model.arch, cfg.data.seq_len, cfg.training.micro_batch_size,
                            cfg.data.seed, 0, 1)
    train_step(engine, batches, 1, plan.keep_tokens(0))
    small, small_moments = full_weights(engine), full_moments(engine)
    eval_set = eval_batches(corpus, "valid", cfg.model.arch, cfg.data.seq_len, cfg.training.micro_batch_size, 1,
                            seed=cfg.data.seed)
    saved = []
    grown, entry = run_transition(engine, plan, plan.phases[0], plan.phases[1], saved, eval_set, 1)
    assert saved == [] and entry["direction"] == "up" and "alpha" not in entry
    return small, small_moments, grown, entry


@pytest.mark.parametrize("g,layout", [(2, "strided"), (4, "strided"), (2, "adjacent")],
                         ids=["stack-x2", "stack-x4", "interleave-x2"])
def test_growth_equals_the_hand_built_stacked_model(g, layout, train_corpus):
    """G_stack stacks the whole small model (large layer j = small layer j mod L_small: depth_layout
    strided); interleaving repeats each layer in place (j // g: adjacent). The grown engine holds
    exactly those tensors, with Adam's moments copied by the depth rule (/ g, / g^2) and the step
    count kept; nothing is interpolated."""
    plan = build_plan(grow_cfg(f"data.path={train_corpus}", "model.num_layers=8", g=g, layout=layout))
    small_layers = plan.model(2).num_layers
    assert small_layers == 8 // g
    small, small_moments, grown, entry = _grow(plan, train_corpus)
    try:
        source = (lambda j: j % small_layers) if layout == "strided" else (lambda j: j // g)

        def stacked(tensors, depth_scale):
            out = {}
            for name, tensor in tensors.items():
                if not name.startswith("layers."):
                    out[name] = tensor
                    continue
                _, i, suffix = name.split(".", 2)
                for j in range(8):
                    if source(j) == int(i):
                        out[f"layers.{j}.{suffix}"] = tensor / depth_scale
            return out

        weights, moments = full_weights(grown), full_moments(grown)
        expected = stacked(small, 1)
        assert sorted(weights) == sorted(expected) and len(expected) > len(small)
        assert all(torch.equal(weights[n], expected[n]) for n in weights)
        for key, power in zip(MOMENTS, (1, 2)):
            expected = stacked(small_moments[key], g ** power)
            assert all(torch.equal(moments[key][n], expected[n]) for n in weights), key
            assert any(torch.count_nonzero(t) for t in expected.values())
        assert optimizer_step_count(grown) == 1
    finally:
        destroy_engine(grown)


def test_routed_layers_follow_the_keys_and_survive_a_depth_transition(tmp_path, train_corpus):
    """random_ltd_layer_id [1, 2, 5, 6] of 8 layers; G_stack x2 merges layer i with i + 4, so the
    4-layer level routes 1 and 2 (both of their layers are routed) and not 0 and 3 (layers 0, 3, 4
    and 7 see every token). After growing, the 8-layer model routes the configured layers again."""
    plan = build_plan(grow_cfg(f"data.path={train_corpus}", "model.num_layers=8", "data.seq_len=64",
                               f"training.ds_config={ltd_ds_config(tmp_path, 8, [1, 2, 5, 6])}"))
    assert plan.routed_layers(1) == (1, 2, 5, 6) and plan.routed_layers(2) == (1, 2)
    _, _, grown, _ = _grow(plan, train_corpus)

    def tokens_per_layer(module):
        seen = {}
        hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: seen.update({i: args[0].shape[1]}))
                 for i, layer in enumerate(module.layers)]
        module(torch.randint(0, 512, (2, 64)), keep_tokens=16)
        for hook in hooks:
            hook.remove()
        return seen

    try:
        assert tokens_per_layer(grown.module) == {0: 64, 1: 16, 2: 16, 3: 64, 4: 64, 5: 16, 6: 16, 7: 64}
        small_plan_engine = build_engine(plan, plan.phases[0], None)
        try:
            assert tokens_per_layer(small_plan_engine.module) == {0: 64, 1: 16, 2: 16, 3: 64}
        finally:
            destroy_engine(small_plan_engine)
    finally:
        destroy_engine(grown)


# --------------------------------------------------------------------------------------------
# A real run
# --------------------------------------------------------------------------------------------

def test_a_run_that_starts_at_level_2_and_grows(tmp_path, train_corpus):
    """`msds train` from a fresh half-width, half-depth model, with random-LTD on: 6 steps at level 2,
    one transition up without interpolation, 6 steps at level 1; FLOPs as the plan counts them."""
    run_dir = tmp_path / "run"
    cfg = load_run_config(RECIPE, [
        f"data.path={train_corpus}", f"run_dir={run_dir}", "logging.tensorboard=false", "logging.eval_batches=1",
        "multilevel.levels=[{hidden: 2, heads: 2, ffn: 2, layers: 2, depth_layout: strided}]",
        "multilevel.start_level=2", "multilevel.phase_steps=[6,6]", "data.seq_len=64",
        "training.ds_config=zero1-random-ltd-seq64.json"])
    plan = build_plan(cfg)
    summary = train(cfg)
    steps = read_metrics(run_dir, "step")
    assert [r["level"] for r in steps] == [2] * 6 + [1] * 6
    assert {r["keep_tokens"] for r in steps} == {32}
    (transition,) = summary.transitions
    assert (transition["direction"], transition["from_level"], transition["to_level"], transition["step"]) ==         ("up", 2, 1, 6)
    assert "loss_before_coalescing" not in transition and "alpha" not in transition
    assert summary.state.flops == pytest.approx(plan.total_flops())
    assert summary.final_val_loss is not None and summary.final_val_loss < steps[0]["loss"]
    exported = load_run_config(run_dir / "config.yaml")
    assert exported.multilevel.start_level == 2
    model, _, _ = load_model(run_dir / "model")
    assert (model.num_layers, model.hidden_size) == (4, 64)
