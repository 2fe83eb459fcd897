"""Streamed transitions: the operators over coalescing groups and per small tensor equal the
whole-model operators, and a real engine's transition (ZeRO 1, and ZeRO 3 with the new model built
partitioned) installs exactly the whole-model result, with its memory record. The multi-process
exactness checks (alpha 0, resume after a transition, ZeRO 1/2/3, TP, PP) are in test_train.py and
test_parallel.py."""
import gc
import json
import math
import weakref
from pathlib import Path

import pytest
import torch

from msds.compat import deepspeed_0_19 as ds_compat
from msds.config import load_run_config, model_config
from msds.data import eval_batches, train_batches
from msds.errors import MsdsError
from msds.model.files import model_tensors
from msds.model.transformer import Transformer
from msds.multilevel.operators import (coalesce, coalesce_groups, decoalesce, decoalesce_interpolate,
                                       decoalesced_names, interpolate, plan_level)
from msds.plan import build_plan
from msds.train.engine import (MOMENTS, _step_counter, build_engine, destroy_engine, full_moments,
                               full_weights, optimizer_step_count, train_step)
from msds.train.transition import release_freed_memory, resident_memory_mb, run_transition

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "test" / "test-vcycle-gpt.yaml"


@pytest.mark.parametrize("depth_layout", ["adjacent", "strided"])
def test_groups_and_single_tensors_give_the_whole_model_operators(depth_layout):
    cfg = model_config("bert-tiny", num_layers=4, num_heads=4, hidden_size=32, ffn_size=64)
    level = plan_level(cfg, hidden=2, heads=2, ffn=2, layers=2, depth_layout=depth_layout)
    large = model_tensors(Transformer(cfg))
    groups = coalesce_groups(large, level)
    assert sorted(n for g in groups for n in g) == sorted(large)
    assert max(len(g) for g in groups) == 2                      # a tensor and its depth partner
    whole = coalesce(large, level, kind="exp_avg")
    streamed = {}
    for group in groups:
        streamed.update(coalesce({n: large[n] for n in group}, level, kind="exp_avg"))
    assert sorted(streamed) == sorted(whole) and all(torch.equal(streamed[n], whole[n]) for n in whole)

    small = coalesce(large, level)
    saved = {n: torch.randn_like(t) for n, t in large.items()}
    for alpha in (0.0, 0.3, 1.0):
        expected = interpolate(decoalesce(small, level), saved, alpha)
        for name, tensor in small.items():
            targets = decoalesced_names(name, level)
            got = decoalesce_interpolate({name: tensor}, {n: saved[n] for n in targets}, level, alpha)
            assert list(got) == targets and all(torch.equal(got[n], expected[n]) for n in targets)
    name = "layers.0.mlp.fc1.weight"
    with pytest.raises(MsdsError, match=r"missing from the saved tensors"):
        decoalesce_interpolate({name: small[name]}, {}, level, 0.5)
    with pytest.raises(MsdsError, match=r"^embeddings\.word\.weight: saved, but none of the small tensors"):
        decoalesce_interpolate({}, {"embeddings.word.weight": saved["embeddings.word.weight"]}, level, 0.5)


@pytest.mark.parametrize("stage", [1, 3])
def test_streamed_transitions_install_the_whole_model_operators(train_corpus, tmp_path, stage):
    """Down and up on a real engine (one process): the new engines hold exactly coalesce / the
    interpolated de-coalesce of the whole model, weights and both moments, the step count kept; the
    record carries every rank's seconds and peak memory."""
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", f"run_dir={tmp_path}", "logging.tensorboard=false",
                                   f"training.zero_stage={stage}", "multilevel.phase_steps=[1,1,1]",
                                   "multilevel.levels=[{hidden: 2, heads: 2, ffn: 2, layers: 2}]",
                                   "multilevel.alpha=0.25"])
    plan = build_plan(cfg)
    level = plan.level_maps[0]
    batches = train_batches(train_corpus, "gpt", cfg.data.seq_len, cfg.training.micro_batch_size, 0, 0, 1)
    eval_set = eval_batches(train_corpus, "valid", "gpt", cfg.data.seq_len, cfg.training.micro_batch_size, 1)
    torch.manual_seed(0)
    engine = build_engine(plan, plan.phases[0], None)
    train_step(engine, batches, 1, None)
    large, large_moments = full_weights(engine), full_moments(engine)
    saved = []
    engine, down = run_transition(engine, plan, plan.phases[0], plan.phases[1], saved, eval_set, 1)

    def assert_holds(weights, moments):
        got, got_moments = full_weights(engine), full_moments(engine)
        assert sorted(got) == sorted(weights) and all(torch.equal(got[n], weights[n]) for n in weights)
        for key in MOMENTS:
            assert all(torch.equal(got_moments[key][n], moments[key][n]) for n in weights), key
        assert optimizer_step_count(engine) == 1
        # Matrices decay, the rest does not: also for a model built partitioned (ZeRO 3).
        groups = ds_compat.base_optimizer(engine).param_groups
        assert [g["weight_decay"] for g in groups] == [cfg.optimizer.weight_decay, 0.0]

    try:
        assert_holds(coalesce(large, level), {k: coalesce(large_moments[k], level, kind=k) for k in MOMENTS})
        small, small_moments = full_weights(engine), full_moments(engine)
        engine, up = run_transition(engine, plan, plan.phases[1], plan.phases[2], saved, eval_set, 2)
        assert saved == []
        assert_holds(interpolate(decoalesce(small, level), large, 0.25),
                     {k: interpolate(decoalesce(small_moments[k], level, kind=k), large_moments[k], 0.25)
                      for k in MOMENTS})
        for record in (down, up):
            [rank] = record["ranks"]
            assert rank["rank"] == 0 and 0 < rank["seconds"] == record["seconds"]
            assert rank["rss_peak_extra_mb"] >= 0 and math.isfinite(rank["rss_peak_extra_mb"])
    finally:
        destroy_engine(engine)


def test_released_host_memory_goes_back_to_the_system():
    """What a transition frees in many small tensors (holes between live ones, which a new engine's
    large flat buffers cannot reuse) leaves the process once release_freed_memory runs."""
    tensors = [torch.ones(16 * 1024) for _ in range(4096)]     # 64 KiB each: glibc's heap, 256 MiB
    del tensors[::2]                                            # 128 MiB of holes between live ones
    held = resident_memory_mb()
    release_freed_memory()
    assert held - resident_memory_mb() > 96
    assert len(tensors) == 2048 and all(t[0] == 1 for t in tensors)


def test_a_destroyed_engine_is_freed(train_corpus, tmp_path):
    """An engine a transition replaces (ZeRO 3: module, optimizer, partitions) is freed once
    destroyed, not kept by DeepSpeed's module-global forward stack for the rest of the run."""
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", f"run_dir={tmp_path}", "logging.tensorboard=false",
                                   "training.zero_stage=3"])
    plan = build_plan(cfg)
    batches = train_batches(train_corpus, "gpt", cfg.data.seq_len, cfg.training.micro_batch_size, 0, 0, 1)
    engine = build_engine(plan, plan.phases[0], None)
    train_step(engine, batches, 1, None)
    module, optimizer = weakref.ref(engine.module), weakref.ref(engine.optimizer)
    destroy_engine(engine)
    del engine
    gc.collect()
    assert module() is None and optimizer() is None


def test_fused_adamw_steps_after_a_transition(train_corpus, tmp_path):
    """A fused AdamW (`"fused": true` beside `torch_adam`) reads its step counters on the parameters'
    device: the counters a transition installs are made there, as torch makes its own, and the new
    engine steps on from the old count."""
    ds_config = tmp_path / "fused.json"
    config = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "zero1.json").read_text())
    config["optimizer"]["params"]["fused"] = True
    ds_config.write_text(json.dumps(config))
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", f"run_dir={tmp_path}", "logging.tensorboard=false",
                                   f"training.ds_config={ds_config}", "multilevel.phase_steps=[1,1,1]",
                                   "multilevel.levels=[{hidden: 2, heads: 2, ffn: 2, layers: 2}]"])
    plan = build_plan(cfg)
    batches = train_batches(train_corpus, "gpt", cfg.data.seq_len, cfg.training.micro_batch_size, 0, 0, 1)
    eval_set = eval_batches(train_corpus, "valid", "gpt", cfg.data.seq_len, cfg.training.micro_batch_size, 1)
    engine = build_engine(plan, plan.phases[0], None)
    try:
        train_step(engine, batches, 1, None)
        engine, _ = run_transition(engine, plan, plan.phases[0], plan.phases[1], [], eval_set, 1)
        base = ds_compat.base_optimizer(engine)
        assert base.defaults["fused"] is True
        for flat, state in base.state.items():
            assert state["step"].device == flat.device and state["step"].dtype == torch.float32
        assert torch.isfinite(train_step(engine, batches, 1, None))
        assert optimizer_step_count(engine) == 2
    finally:
        destroy_engine(engine)
    # The rule itself, for a parameter on another device (meta stands in for a GPU here): a fused
    # AdamW's counter goes with the parameter, a plain AdamW's stays on the host.
    param = torch.nn.Parameter(torch.zeros(2))
    elsewhere = torch.empty(2, device="meta")
    fused, plain = torch.optim.AdamW([param], fused=True), torch.optim.AdamW([param])
    assert _step_counter(fused, elsewhere, 3).device.type == "meta"
    assert _step_counter(plain, elsewhere, 3).device.type == "cpu"


def test_a_transition_builds_the_same_engine_without_drawing_weights(train_corpus, tmp_path, monkeypatch):
    """A transition's new model is built without drawing the weights its tensors then overwrite
    (msds.train.engine.weights_not_drawn): the same engine weights, the same global RNG after it,
    and a V-cycle's per-step losses and transition records equal to the bit with the weights drawn."""
    import contextlib

    from msds.model.pipeline import named_parameters
    from msds.train import engine as engine_module
    from msds.train.loop import train
    from msds.train.metrics import read_metrics

    def run(name):
        run_dir = tmp_path / name
        train(load_run_config(RECIPE, [f"data.path={train_corpus}", f"run_dir={run_dir}",
                                       "logging.tensorboard=false", "multilevel.phase_steps=[3,3,3,3,3]"]))
        return ([(r["step"], r["loss"]) for r in read_metrics(run_dir, "step")],
                [(r["loss_before"], r["loss_after"]) for r in read_metrics(run_dir, "transition")])

    def rebuilt():
        plan = build_plan(load_run_config(RECIPE, [f"data.path={train_corpus}", f"run_dir={tmp_path / 'b'}"]))
        torch.manual_seed(3)
        model = Transformer(plan.model(1), padded_vocab_size=plan.padded_vocab_size)
        tensors = {name: p.detach().clone() for name, p in named_parameters(model)}
        torch.manual_seed(5)
        engine = build_engine(plan, plan.phases[0], tensors.items())
        try:
            return full_weights(engine), torch.get_rng_state()
        finally:
            destroy_engine(engine)

    fast, fast_engine = run("not-drawn"), rebuilt()
    monkeypatch.setattr(engine_module, "weights_not_drawn", contextlib.nullcontext)
    drawn, drawn_engine = run("drawn"), rebuilt()
    assert len(fast[0]) == 15 and len(fast[1]) == 4 and fast == drawn
    assert sorted(fast_engine[0]) == sorted(drawn_engine[0])
    assert all(torch.equal(fast_engine[0][n], drawn_engine[0][n]) for n in fast_engine[0])
    assert torch.equal(fast_engine[1], drawn_engine[1])
