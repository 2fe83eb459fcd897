"""The run plan and `msds plan`: every recipe plans, bad layouts are one clear error, derived values
(phases, FLOPs, DeepSpeed configs, memory) are what training uses."""
import json
import re
from pathlib import Path

import pytest

from msds.cli import main as msds_main
from msds.config import ConfigError, load_run_config, model_config
from msds.plan import build_plan
from msds.plan import memory
from msds.plan.schedule import flops_per_sample

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
# The paper-scale recipes are planned at a cluster's size; the CPU ones on this machine's.
CLUSTER = {"bert-base-vcycle2", "bert-large-baseline", "bert-large-vcycle2", "bert-large-vcycle3",
           "gpt-base-baseline", "gpt-base-vcycle2"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_plans(recipe, capsys):
    world = "32" if recipe.stem in CLUSTER else "1"
    assert msds_main(["plan", "--config", str(recipe), "--world-size", world, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plans = report.values() if "variants" in recipe.read_text() else [report]
    for facts in plans:
        assert facts["layout"]["world_size"] == int(world)
        assert sum(p["steps"] for p in facts["phases"]) == facts["total_steps"] > 0
        steps_flops = sum(p["flops"] for p in facts["phases"])      # the total adds the transitions' small cost
        assert steps_flops <= facts["total_flops"] <= 1.01 * steps_flops
        multilevel = len(facts["phases"]) > 1
        assert (facts["flops_ratio"] < 1) == multilevel


def test_plan_table_for_a_cluster(capsys):
    assert msds_main(["plan", "--config", str(REPO / "recipes" / "paper" / "bert-large-vcycle3.yaml"),
                      "--world-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "32 process(es) = data 32 x tensor 1 x pipeline 1; ZeRO 1, bf16" in out
    assert re.search(r"^ +2 +3 6x256, 4h, ffn 1024 ", out, re.M)            # the coarsest of 3 levels
    assert "ratio 0.458" in out


def test_prototype_baseline_flops_match_the_recorded_bench(capsys):
    """The bench's FLOPs axis comes from the plan: the prototype baseline's 480 steps are the
    8.504e13 FLOPs that BENCHMARKS.md records for it."""
    assert msds_main(["plan", "--config", str(REPO / "recipes" / "bench" / "prototype-sweep-gpt.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["baseline"]["total_flops"] == pytest.approx(8.504e13, rel=1e-4)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.tensor=2"], 3, r"^parallel: tensor \(2\) x pipeline \(1\) parallel sizes must divide the number of "
                               r"processes, 3; launch a multiple of 2 processes"),
    (["parallel.tensor=3"], 3, r"^parallel\.tensor: 3 does not divide num_heads 4 of the level-1 model"),
    (["parallel.pipeline=2", "training.zero_stage=3"], 2,
     r"^training\.zero_stage: 3 with parallel\.pipeline=2: DeepSpeed pipelines do not support ZeRO 2 or 3"),
    (["parallel.pipeline=3"], 3, r"^parallel\.pipeline: 3 stages cannot share the 4 layers of the level-1 model"),
    (["multilevel.shards=3", "parallel.tensor=2"], 2, r"^multilevel\.shards: 3 is not a multiple of parallel\.tensor 2"),
    (["model.arch=bert", "model.nsp_head=true"], 1, r"^model\.nsp_head: no loss trains the next-sentence head"),
    (["multilevel.phase_steps=[6,6]"], 1, r"^multilevel\.phase_steps: 3 levels and 1 cycle\(s\) need 5 phases"),
    (["training.steps=7"], 1, r"^training\.steps: 7 differs from the sum of multilevel\.phase_steps \(30\)"),
    (["data.prefetch=-1"], 1, r"^data\.prefetch: -1; set the number of batches built ahead"),
])
def test_bad_layouts_and_settings_are_one_error(overrides, world, message, capsys):
    recipe = str(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml")
    with pytest.raises(ConfigError, match=message):
        build_plan(load_run_config(recipe, overrides), world)
    assert msds_main(["plan", "--config", recipe, "--world-size", str(world), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0].split("error: ", 1)[1]), err


def test_plan_keeps_its_own_copy_and_fills_the_run_length():
    cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml", [])
    plan = build_plan(cfg)
    assert cfg.training.steps == 0 and plan.config.training.steps == plan.total_steps == 30
    cfg.optimizer.lr = 123.0
    assert plan.config.optimizer.lr != 123.0
    assert [(p.level, p.start_step, p.end_step) for p in plan.phases] == \
        [(1, 0, 6), (2, 6, 12), (3, 12, 18), (2, 18, 24), (1, 24, 30)]
    # Planning the copy as run gives the same run (its config.yaml is a config).
    again = build_plan(plan.config)
    assert again.phases == plan.phases and again.config == plan.config


def test_ds_config_per_phase_is_fresh_and_carries_the_peak_lr():
    plan = build_plan(load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml", []))
    first, coarse = plan.ds_config(plan.phases[0]), plan.ds_config(plan.phases[2])
    assert first["optimizer"]["params"]["lr"] == plan.phases[0].peak_lr
    assert coarse["optimizer"]["params"]["lr"] == plan.phases[2].peak_lr == 8 * plan.phases[0].peak_lr   # x4, then x2 (width only)
    assert "data_efficiency" not in first and first["train_micro_batch_size_per_gpu"] == 4
    first["optimizer"]["params"]["lr"] = -1
    assert plan.ds_config(plan.phases[0])["optimizer"]["params"]["lr"] == plan.phases[0].peak_lr


def test_flops_per_step_is_the_formula_times_the_global_batch():
    plan = build_plan(load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml", []), world_size=1)
    small = plan.model(3)
    assert plan.flops_per_step(3, 12) == flops_per_sample(small, 32) * plan.samples_per_step
    assert plan.phase_flops(plan.phases[2]) == 6 * plan.flops_per_step(3, 12)


def test_memory_estimate_splits_like_the_parallel_layout():
    model = model_config("gpt-tiny", vocab_size=1024, num_layers=4)
    whole = sum(memory.stage_parameters(model, 1, 1))
    # Two stages: the tied word embeddings live on both.
    assert sum(memory.stage_parameters(model, 1, 2)) == whole + model.vocab_size * model.hidden_size
    fp32 = memory.training_state(model, 1, 1, data=4, zero_stage=1, precision="fp32")
    assert fp32.weights == fp32.gradients == 4 * whole and fp32.optimizer == 8 * whole / 4
    zero3 = memory.training_state(model, 1, 1, data=4, zero_stage=3, precision="bf16")
    assert zero3.weights == zero3.gradients == 2 * whole / 4 and zero3.optimizer == 12 * whole / 4
    tp2 = max(memory.stage_parameters(model, 2, 1))
    assert whole / 2 < tp2 < whole                 # norms and position embeddings stay replicated


def _prototype(multilevel: dict, **training):
    from msds.config import load_yaml, run_config_from_dict

    base = load_yaml(REPO / "recipes" / "bench" / "prototype-sweep-gpt.yaml")["base"]
    base["training"] = {**base["training"], **training}
    return run_config_from_dict({**base, "multilevel": {"enabled": True, **multilevel}})


def test_budget_steps_alone_gives_the_documented_phases():
    """Adding `multilevel: {enabled: true, budget_steps: 480}` to the 480-step baseline recipe: 10%
    of the budget at full size, 80% of its steps at half width and depth, then full size until the
    V-cycle has spent the baseline's FLOPs (the transitions included): 48 / 384 / 339, the layout
    BENCHMARKS.md measures (its recipes give 340, 0.1% past the budget), with 48 warmup steps after
    each transition."""
    baseline = build_plan(_prototype({"enabled": False}))
    plan = build_plan(_prototype({"budget_steps": 480}))
    assert [(p.level, p.steps) for p in plan.phases] == [(1, 48), (2, 384), (1, 339)]
    assert [p.warmup_steps for p in plan.phases] == [baseline.phases[0].warmup_steps, 48, 48]
    last = plan.phases[2]
    assert plan.total_flops() <= baseline.total_flops() < plan.total_flops() + plan.flops_per_step(1, 0)
    assert plan.config.multilevel.phase_steps == [48, 384, last.steps]      # the copy as run names them
    assert plan.config.training.steps == plan.total_steps == 48 + 384 + last.steps


def test_budget_steps_with_explicit_fractions_and_bad_input():
    plan = build_plan(_prototype({"budget_steps": 1000, "phase_fractions": [0.1, 0.5]}, steps=0))
    assert [p.steps for p in plan.phases[:2]] == [100, 500]
    three_levels = {"budget_steps": 480, "levels": [{}, {"layers": 1}]}
    with pytest.raises(ConfigError, match=r"^multilevel\.phase_fractions: 3 levels and 1 cycle\(s\) have 5 phases; "
                                          r"give the first 4"):
        build_plan(_prototype(three_levels))
    with pytest.raises(ConfigError, match=r"^multilevel\.phase_fractions: the first 2 phases already spend"):
        build_plan(_prototype({"budget_steps": 480, "phase_fractions": [0.9, 0.9]}))
    with pytest.raises(ConfigError, match=r"^multilevel\.phase_steps: give either phase_steps or budget_steps"):
        build_plan(_prototype({"budget_steps": 480, "phase_steps": [1, 2, 3]}))
    with pytest.raises(ConfigError, match=r"^multilevel\.phase_fractions: only used with multilevel\.budget_steps"):
        build_plan(_prototype({"phase_fractions": [0.2, 0.4], "phase_steps": [1, 2, 3]}, steps=0))


def test_a_budget_sized_plan_replans_to_the_same_run():
    plan = build_plan(_prototype({"budget_steps": 480}))
    again = build_plan(plan.config)
    assert again.phases == plan.phases and again.config.multilevel.budget_steps == 0
    # msds plan compares with the baseline the V-cycle was sized from: about the same FLOPs.
    assert 0.99 < plan.total_flops() / plan.baseline_flops() <= 1.0


def test_the_baseline_keeps_its_warmup_as_given():
    plan = build_plan(load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml",
                                      ["multilevel.enabled=false", "training.steps=10", "optimizer.warmup_steps=20"]))
    assert plan.phases[0].warmup_steps == 20 and plan.lr_curves[0](0) == pytest.approx(1 / 20)


def test_packaged_ds_config_found_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = str(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml")
    for name in ("ds_configs/zero1-random-ltd-seq64.json", "zero1-random-ltd-seq64.json"):
        cfg = load_run_config(recipe, [f"training.ds_config={name}", "data.seq_len=64", "model.max_positions=64"])
        assert build_plan(cfg).random_ltd.max_value == 64
    with pytest.raises(ConfigError, match=r"^training\.ds_config: nope\.json does not exist; give a path to a "
                                          r"DeepSpeed JSON or the name of a packaged one \(zero0\.json"):
        build_plan(load_run_config(recipe, ["training.ds_config=nope.json"]))


def test_unsupported_deepspeed_sections_are_errors(tmp_path):
    ds = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    ds["data_efficiency"] = {"enabled": True, "data_sampling": {"enabled": True}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    recipe = str(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml")
    with pytest.raises(ConfigError, match=r"data_efficiency\.data_sampling \(curriculum learning\) is not supported"):
        build_plan(load_run_config(recipe, [f"training.ds_config={tmp_path / 'ds.json'}"]))
    ds = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    ds["optimizer"]["params"]["lr"] = 0.5
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match=r"^training\.ds_config: optimizer\.params\.lr is 0\.5 but the msds config "
                                          r"says 0\.001"):
        build_plan(load_run_config(recipe, [f"training.ds_config={tmp_path / 'ds.json'}"]))


def test_engine_checkpoints_do_not_carry_the_plan_s_curves():
    """LambdaLR saves the attributes of callable objects (and restores them on resume); the engine
    hands it a plain function, so a resumed run always follows the plan it was started with."""
    from msds.train.engine import build_engine, destroy_engine

    plan = build_plan(load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml", []))
    engine = build_engine(plan, plan.phases[0], None)
    try:
        assert engine.lr_scheduler.state_dict()["lr_lambdas"] == [None, None]
    finally:
        destroy_engine(engine)


def test_bert_prototype_recipe_plans_the_v_cycles_benchmarks_measured(tmp_path):
    """BENCHMARKS.md's BERT rounds since the first (pw48 at alpha 0.75, 0.6 and 0.5, the 48 / 192 /
    387 and 96-step-warmup tries) ran the first phase warmed up over all its 48 steps (the 96 / 384
    / 292 try over its 96); the recipe once gave it the base's 24, so reproducing the headline
    trained another run."""
    from msds.bench.variants import variant_configs
    from msds.config import load_yaml

    bench = load_yaml(REPO / "recipes" / "bench" / "prototype-sweep-bert.yaml")
    configs = variant_configs(bench, tmp_path, [], world_size=1, seed=1234)
    measured = {"vcycle-lr2x-f48-s384-pw48": ([48, 384, 340], [48, 48, 48], 0.75),
                "vcycle-lr2x-f48-s384-pw48-a50": ([48, 384, 340], [48, 48, 48], 0.5),
                "vcycle-lr2x-f48-s192-pw48": ([48, 192, 387], [48, 48, 48], 0.75),
                "vcycle-lr2x-f48-s384-pw48-a60": ([48, 384, 340], [48, 48, 48], 0.6),
                "vcycle-tuned": ([48, 384, 340], [48, 96, 96], 0.5),
                "vcycle-lr2x-f96-s384-pw48-a50": ([96, 384, 292], [96, 48, 48], 0.5)}
    for name, (steps, warmups, alpha) in measured.items():
        plan = build_plan(configs[name], 1)
        assert [p.steps for p in plan.phases] == steps, name
        assert [p.warmup_steps for p in plan.phases] == warmups, name
        assert [p.peak_lr for p in plan.phases] == [1e-3, 4e-3, 1e-3], name
        assert plan.config.multilevel.alpha == alpha, name


@pytest.mark.parametrize("overrides", [["data.max_predictions_per_seq=30"], ["data.max_predictions_per_seq=4",
                                                                             "parallel.pipeline=2"]])
def test_max_predictions_needs_bert_without_a_pipeline_and_room(overrides):
    cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-bert.yaml", overrides)
    with pytest.raises(ConfigError, match=r"^data\.max_predictions_per_seq: .* within 1\.\.29, or 0"):
        build_plan(cfg, world_size=2)


def test_fused_adamw_is_chosen_where_the_engine_is_built():
    """ds_configs' "fused": "auto" becomes true on CUDA only (the CPU results use the default AdamW)."""
    import torch

    plan = build_plan(load_run_config(REPO / "recipes" / "test" / "test-vcycle-bert.yaml", []))
    assert plan.ds_config(plan.phases[0])["optimizer"]["params"]["fused"] is torch.cuda.is_available()
