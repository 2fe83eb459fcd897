"""The bench's schedule sweep (baseline_schedule_sweep), whether its reference is an interior optimum,
and the compute multiplier (reference_budgets)."""
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from msds.bench import multiplier as bench_multiplier
from msds.bench import sweep as bench_sweep
from msds.bench.run import run_bench
from msds.bench.variants import sweep_grid, variant_configs
from msds.config import ConfigError

SCHEDULES = [{"schedule": "cosine", "min_lr_ratio": 0.1}, {"schedule": "linear", "min_lr_ratio": 0.0},
             {"schedule": "wsd", "min_lr_ratio": 0.0, "decay_fraction": 0.25}]


def _bench(**more):
    return {"base": {"model": {"preset": "gpt-tiny", "vocab_size": 1024, "num_layers": 2, "hidden_dropout": 0.0,
                               "attention_dropout": 0.0},
                     "data": {"seq_len": 16}, "training": {"micro_batch_size": 4, "steps": 12},
                     "optimizer": {"lr": 0.003, "warmup_steps": 2},
                     "logging": {"interval": 4, "eval_interval": 4, "eval_batches": 2, "tensorboard": False}},
            "variants": {"baseline": {}}, **more}


def test_the_grid_is_schedules_x_rates_x_warmups_named_by_what_differs(tmp_path, train_corpus):
    bench = _bench(baseline_lr_sweep=[0.5, 1, 2], baseline_warmup_sweep=[2, 4], baseline_schedule_sweep=SCHEDULES)
    grid = sweep_grid(bench)
    assert len(grid) == 18 and list(grid)[0] == "baseline"
    assert grid["baseline"]["coords"] == {"schedule": "cosine0.1", "lr_factor": 1.0, "warmup_steps": 2}
    assert grid["baseline-wsd0-d0.25-lr2x-wu4"]["optimizer"] == {
        "schedule": "wsd", "min_lr_ratio": 0.0, "decay_fraction": 0.25, "lr": 0.006, "warmup_steps": 4}
    configs = variant_configs(bench, tmp_path, [f"data.path={train_corpus}"], world_size=1)
    linear = configs["baseline-linear0-lr0.5x"].optimizer
    assert (linear.schedule, linear.min_lr_ratio, linear.lr) == ("linear", 0.0, 0.0015)
    # Without a schedule sweep the names are those of earlier benches (their finished runs are reused).
    assert set(sweep_grid(_bench(baseline_lr_sweep=[1, 2]))) == {"baseline", "baseline-lr2x"}
    # An entry with its own rate factors: the linear decay only at the baseline's rate.
    narrower = sweep_grid(_bench(baseline_lr_sweep=[0.5, 1, 2],
                                 baseline_schedule_sweep=[SCHEDULES[0], {**SCHEDULES[1], "lr_factors": [1]}]))
    assert list(narrower) == ["baseline", "baseline-lr0.5x", "baseline-lr2x", "baseline-linear0"]
    # And one with its own warmups: the neighbours along the warmup of one schedule only.
    warm = sweep_grid(_bench(baseline_schedule_sweep=[{**SCHEDULES[2], "lr_factors": [1], "warmups": [1, 2, 4]}]))
    assert list(warm) == ["baseline", "baseline-wsd0-d0.25-wu1", "baseline-wsd0-d0.25", "baseline-wsd0-d0.25-wu4"]
    assert warm["baseline-wsd0-d0.25-wu4"]["coords"] == {"schedule": "wsd0-d0.25", "lr_factor": 1, "warmup_steps": 4}
    # A rate sweep that no schedule takes (every entry has its own factors, the baseline's own
    # schedule is not an entry) would leave the reference untuned without a word: refused.
    with pytest.raises(ConfigError, match=r"^baseline_lr_sweep: no schedule of the sweep uses it: .*list an entry "
                                          r"without lr_factors, such as \{schedule: cosine, \.\.\.\}, or drop"):
        sweep_grid(_bench(baseline_lr_sweep=[0.5, 1, 2], baseline_schedule_sweep=[{**SCHEDULES[1], "lr_factors": [1]}]))
    for bad in ([], [1.5], "4", [-1]):
        with pytest.raises(ConfigError, match=r"^baseline_schedule_sweep\[0\]\.warmups: expected a non-empty list"):
            sweep_grid(_bench(baseline_schedule_sweep=[{**SCHEDULES[2], "warmups": bad}]))
    with pytest.raises(ConfigError, match=r"^baseline_schedule_sweep\[0\]: shape is not a schedule field"):
        sweep_grid(_bench(baseline_schedule_sweep=[{"shape": "linear"}]))
    with pytest.raises(ConfigError, match=r"^variants\.baseline-wsd0\.1-d0\.99\.optimizer\.decay_fraction: 0\.99"):
        variant_configs(_bench(baseline_schedule_sweep=[{"schedule": "wsd", "decay_fraction": 0.99}]), tmp_path,
                        [f"data.path={train_corpus}"], world_size=1)


def _coords(grid):
    return {name: member["coords"] for name, member in grid.items()}


def test_an_interior_reference_and_one_at_the_edge():
    coords = _coords(sweep_grid(_bench(baseline_lr_sweep=[0.5, 1, 2], baseline_schedule_sweep=SCHEDULES[:2])))
    means = {"baseline-lr0.5x": 5.3, "baseline": 5.1, "baseline-lr2x": 5.2,
             "baseline-linear0-lr0.5x": 5.25, "baseline-linear0": 5.0, "baseline-linear0-lr2x": 5.05}
    check = bench_sweep.interior(coords, means, "baseline-linear0")
    assert check["interior"] is True and bench_sweep.warning(check) == ""
    assert check["dimensions"]["lr_factor"]["lower"]["member"] == "baseline-linear0-lr0.5x"
    assert check["best_per_schedule"]["cosine0.1"]["member"] == "baseline"
    assert "The reference is an interior optimum" in bench_sweep.markdown(check)
    means["baseline-linear0-lr2x"] = 4.9                      # the best now sits at the top of the rate grid
    edge = bench_sweep.interior(coords, means, "baseline-linear0-lr2x")
    assert edge["interior"] is False and edge["dimensions"]["lr_factor"]["higher"] is None
    assert bench_sweep.warning(edge).startswith("WARNING: the reference is not an interior optimum of the baseline "
                                                "sweep, at the edge in lr_factor 2 of [0.5, 1.0, 2.0] (no higher "
                                                "value was run)")
    assert bench_sweep.interior(_coords(sweep_grid(_bench())), {"baseline": 5.0}, "baseline")["interior"] is None


@pytest.mark.parametrize("loss,k", [(5.0, "< 1"), (4.9, 1.5 ** 0.5), (4.75, 1.5 * (2 / 1.5) ** 0.5),
                                    (4.8, 1.5), (4.6, "> 2")])
def test_the_multiplier_interpolates_in_log_flops(loss, k):
    curve = [(2e12, 4.7), (1e12, 5.0), (1.5e12, 4.8)]
    result = bench_multiplier.multiplier(curve, loss, 1e12)
    if isinstance(k, str):
        assert result == {"k": None, "text": k}
    else:
        assert result["k"] == pytest.approx(k) and result["text"] == f"{k:.2f}"


@pytest.mark.parametrize("loss,k", [(5.4, "< 0.5"), (5.2, 0.5 ** 0.5), (5.0, 1.0), (4.9, 1.5 ** 0.5)])
def test_budgets_below_one_give_the_multiplier_of_a_variant_above_the_1x_run(loss, k):
    curve = [(1e12, 5.0), (0.5e12, 5.4), (1.5e12, 4.8)]       # the reference at 1x, 0.5x and 1.5x
    result = bench_multiplier.multiplier(curve, loss, 1e12)
    if isinstance(k, str):
        assert result == {"k": None, "text": k}
    else:
        assert result["k"] == pytest.approx(k) and result["text"] == f"{k:.2f}"


def test_reference_budgets_must_be_positive_factors_other_than_one():
    assert bench_multiplier.check_factors({"reference_budgets": [2, 0.5, 1.5]}) == [0.5, 1.5, 2.0]
    for bad in ([1, 2], [2, 2], [0, 2], [-0.5], "2", [True]):
        with pytest.raises(ConfigError, match=r"^reference_budgets: expected a list of distinct positive budget"):
            bench_multiplier.check_factors({"reference_budgets": bad})


def test_a_bench_with_a_schedule_sweep_and_reference_budgets(train_corpus, tmp_path):
    """Two rates x two schedules; the best member trains again at 0.5x, 1.5x and 2x its steps, and
    the V-cycle's final loss is placed on that curve."""
    bench = _bench(baseline_lr_sweep=[1, 3], baseline_schedule_sweep=SCHEDULES[1:], reference_budgets=[2, 0.5, 1.5])
    bench["variants"]["vcycle"] = {"training": {"steps": 0},
                                   "optimizer": {"schedule": "wsd", "min_lr_ratio": 0.0, "decay_fraction": 0.25},
                                   "multilevel": {"enabled": True, "levels": [{"hidden": 2, "heads": 2, "ffn": 2,
                                                                               "layers": 2}],
                                                  "phase_steps": [4, 4, 8], "phase_warmup_steps": 1,
                                                  "lr_schedule": "run"}}
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(bench))
    out = tmp_path / "out"
    results = run_bench(tmp_path / "bench.yaml", out, [f"data.path={train_corpus}"]).to_json()
    members = {"baseline-linear0", "baseline-linear0-lr3x", "baseline-wsd0-d0.25", "baseline-wsd0-d0.25-lr3x",
               "baseline"}
    assert set(results["baseline_sweep"]) == members
    reference = results["reference"]
    check = results["sweep_check"]
    assert check["interior"] is False and check["dimensions"]["lr_factor"]["values"] == [1.0, 3.0]
    md = (out / "results.md").read_text()
    assert "**WARNING: the reference is not an interior optimum" in md.splitlines()[2]
    for factor, steps in ((0.5, 6), (1.5, 18), (2, 24)):
        run = out / f"{reference}-budget{factor:g}x"
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["training"]["steps"] == steps and (run / "summary.json").is_file()
    curve = results["multiplier"]["curves"]["config"]
    assert [round(f / curve[0][0], 3) for f, _ in curve] == [1, 0.5, 1.5, 2]
    vcycle = results["multiplier"]["variants"]["vcycle"]
    final = results["per_seed"]["config"]["variants"]["vcycle"]["final_val_loss"]
    assert vcycle["per_seed"] == [bench_multiplier.multiplier(curve, final, curve[0][0])["text"]]
    assert set(results["multiplier"]["variants"]) == {"vcycle"}
    assert "Compute multiplier:" in md and json.loads((out / "results.json").read_text())["multiplier"]["factors"] == [0.5, 1.5, 2]


def test_a_run_finished_before_the_schedule_fields_existed_is_reused(tmp_path, train_corpus):
    """Its summary.json has no optimizer.schedule or decay_fraction: at their defaults (today's
    cosine) it trained the same run; a bench that asks for another schedule refuses it."""
    from msds.bench.training import pending_runs as _pending

    def pending(*overrides):
        return _pending(variant_configs(_bench(), tmp_path, [f"data.path={train_corpus}", *overrides], world_size=1),
                        tmp_path)

    for name, _, record in pending():
        for field in ("schedule", "decay_fraction"):
            del record["optimizer"][field]
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"config": record, "final_val_loss": 1.0}))
    assert pending() == []
    with pytest.raises(ConfigError, match=r"variants\.baseline: .*\(optimizer\.schedule: 'cosine' there, 'linear' now\)"):
        pending("optimizer.schedule=linear")


def test_the_budget_curve_trend_fits_k_against_log_budget():
    """benchmarks/budget_curve.py --trend: log10 k = a + b log10(T) through the numeric mean k's of
    a variant, where it crosses 1, and nothing for a variant with fewer than three numeric budgets."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import budget_curve

    def row(variant, t, ks):
        return {"variant": variant, "tokens_per_param": t, "multiplier": ks}

    # k = 2 T^(-0.15): 2 at 1, 2 / 10^0.15 at 10, 1 at 10^(0.30103 / 0.15).
    k = lambda t: 2 * t ** -0.15
    rows = [row("vcycle", 1, f"{k(1) - 0.1}, {k(1) + 0.1}"), row("vcycle", 10, f"{k(10)}, {k(10)}"),
            row("vcycle", 100, f"{k(100)}, {k(100)}"), row("vcycle", 1000, "< 0.5, 0.8"),
            row("other", 1, "1.2, 1.2"), row("other", 10, "> 2, 1.1"), row("other", 100, "n/a, n/a")]
    trend = budget_curve.trend_rows([{"title": "budget curve, GPT (2 x 64)", "rows": rows}])
    assert [t["variant"] for t in trend] == ["vcycle"] and trend[0]["arch"] == "GPT"
    assert trend[0]["budgets"] == [1, 10, 100] and trend[0]["slope"] == pytest.approx(-0.15, abs=2e-3)
    assert trend[0]["k_one_at"] == pytest.approx(10 ** (math.log10(2) / 0.15), rel=0.02)
    assert trend[0]["k_at_20"] == pytest.approx(k(20), rel=0.01) and trend[0]["k_at_430"] > 0
    # A longer budget where every seed ended above the reference overrules a fit still above 1 there.
    flat = [row("depth", t, "1.3, 1.3") for t in (1, 4, 12)] + [row("depth", 102, "< 1, < 1")]
    bounded = budget_curve.trend_rows([{"title": "budget curve, GPT (2 x 64)", "rows": flat}])[0]
    assert bounded["budgets"] == [1, 4, 12] and bounded["k_one_at"] == "below 102 (measured)"
    assert bounded["k_at_20"] == pytest.approx(1.3) and bounded["k_at_118"] == "< 1 (measured at 102)"


def test_the_budget_curve_names_a_reference_it_did_not_sweep():
    """A bench without a baseline sweep (its reference chosen by another bench) is "not swept here",
    never an edge: the sweep check's `interior` is None there."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import budget_curve

    assert budget_curve._interior({"interior": None, "dimensions": {}}) == "not swept here"
    assert budget_curve._interior({"interior": True, "dimensions": {}}) == "yes"
    edge = {"interior": False, "dimensions": {"lr_factor": {"interior": False}, "warmup_steps": {"interior": True}}}
    assert budget_curve._interior(edge) == "NO (lr_factor edge)"


def test_the_crossover_table_checks_each_model_s_rate_is_interior():
    """benchmarks/budget_curve.py --crossover: a model's best rate is interior only when a lower and a
    higher rate were both run and ended worse; the best of several small-alone rates is the control."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import budget_curve

    rates = {"a": 0.004, "b": 0.008, "c": 0.016}
    assert budget_curve._rate_loss(rates, {"a": 4.5, "b": 4.4, "c": 4.45}, "b") == "0.008, 4.4000, yes"
    assert budget_curve._rate_loss(rates, {"a": 4.5, "b": 4.45, "c": 4.4}, "c").endswith(
        "NO (edge of 0.004, 0.008, 0.016)")
    results = {"variants": {"small-alone": {"final_val_loss": {"mean": 4.3}},
                            "small-alone-lr2x": {"final_val_loss": {"mean": 4.2}},
                            "depth": {"final_val_loss": {"mean": 4.1}}}}
    assert budget_curve._best_control(results) == "small-alone-lr2x"
