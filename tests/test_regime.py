"""The product states the regime of a run: `msds plan` prints its tokens per non-embedding parameter
and, for a V-cycle, the nearest budget msds measured (from the committed budget-curve tables) with a
warning where no saving was measured; `msds demo` says its budget is tiny and its reference untuned;
the bench never calls an unswept reference an interior optimum."""
import json
from pathlib import Path

import pytest

from msds import resources
from msds.bench import sweep
from msds.cli import main as msds_main
from msds.demo import regime_line
from msds.plan.regime import Point, measured_points, nearest, non_embedding_parameters
from msds.config import model_config

REPO = Path(__file__).resolve().parents[1]


def _plan(capsys, recipe: str, *overrides: str, text: bool = False):
    assert msds_main(["plan", "--config", recipe, *([] if text else ["--json"]), *overrides]) == 0
    out = capsys.readouterr().out
    return out if text else json.loads(out)


def test_the_shipped_tables_give_measured_points_with_their_shapes():
    """The budget-curve tables ship with the package and name their model, so the plan can read them."""
    assert (resources.results_dir() / "budget-curve-gpt.json").is_file()
    points = measured_points("gpt")
    assert {(p.layers, p.hidden) for p in points} >= {(2, 64)}
    assert all(p.source.startswith("budget-curve-") for p in points)
    assert any(p.best is None for p in points) and any(p.best is not None for p in points)


def test_plan_places_a_vcycle_among_the_measured_budgets(capsys):
    """At 102 tokens per parameter nothing saved: the plan warns; at 37 the depth-only V-cycle saved
    and the smaller model alone did as well: the plan says so, without the warning."""
    long = _plan(capsys, "budget-curve-gpt-10000")["lever-depth"]["regime"]
    assert long["tokens_per_param"] == pytest.approx(10000 * 1024 / 100_096, rel=1e-3)
    assert long["nearest"]["tokens_per_param"] == pytest.approx(102.3, abs=0.1)
    assert long["nearest"]["best_vcycle"] is None and long["no_saving_measured"] is True
    assert any(line.startswith("WARNING: this run lies where no saving was measured") for line in long["lines"])

    mid = _plan(capsys, "budget-curve-gpt-3600")["lever-depth"]["regime"]
    assert mid["nearest"]["best_vcycle"] == "lever-depth" and mid["no_saving_measured"] is False
    assert mid["nearest"]["control_as_well"] is True
    text = _plan(capsys, "budget-curve-gpt-3600", text=True)
    assert "36.8 tokens per non-embedding parameter" in text and "as well or better, so train the smaller model" in text


def test_plan_warns_far_from_any_measurement_and_states_a_baseline_s_budget(capsys):
    """The test suite's V-cycle (0.01 tokens per parameter, 40x below the shortest measured budget)
    lies where nothing was measured; a baseline gets its tokens per parameter and nothing else."""
    far = _plan(capsys, "test-vcycle-gpt")["regime"]
    assert far["tokens_per_param"] < 0.41 / 2 and far["no_saving_measured"] is True
    assert "more than 2x away in budget" in far["lines"][-1]
    baseline = _plan(capsys, "budget-curve-gpt-3600")["baseline"]["regime"]
    assert baseline["nearest"] is None and len(baseline["lines"]) == 1


def test_demo_states_its_tiny_budget_and_untuned_reference():
    line = regime_line(resources.recipe("demo"), [])
    params = non_embedding_parameters(model_config("gpt-small", vocab_size=8192, num_layers=6, hidden_size=256,
                                                   num_heads=8, ffn_size=1024, max_positions=128))
    assert f"{240 * 16 * 128 / params:.2g} tokens per non-embedding parameter" in line
    assert "untuned reference" in line


def test_an_unswept_reference_is_never_called_an_interior_optimum():
    """A bench without a numeric sweep (the demo's) says its reference is untuned."""
    coords = {"baseline": {"schedule": "cosine0.1", "lr_factor": 1.0, "warmup_steps": 48}}
    check = sweep.interior(coords, {"baseline": 5.0}, "baseline")
    text = sweep.markdown(check)
    assert check["interior"] is None and "interior optimum" not in text and "untuned" in text


def test_nearest_weighs_width_beside_depth_and_budget():
    """Two shapes of one depth measured at one budget: a run is placed at its own width's point (the
    crossover moves with the width), and a run between two budgets of its shape stays on its shape."""
    narrow = Point("narrow.json", "gpt", 8, 32, 30.0, None, None, 1)
    wide = Point("wide.json", "gpt", 8, 64, 30.0, None, None, 1)
    wide_long = Point("wide.json", "gpt", 8, 64, 90.0, None, None, 1)
    assert nearest([narrow, wide], layers=8, hidden=64, tokens_per_param=30.0) is wide
    assert nearest([wide, narrow], layers=8, hidden=32, tokens_per_param=30.0) is narrow
    assert nearest([narrow, wide, wide_long], layers=8, hidden=64, tokens_per_param=45.0) is wide


def test_plan_places_an_8x64_run_at_the_8x64_measurements(capsys):
    """The shipped 8 x 64 table (benchmarks/budget_curve.py over the deep-gpt64 benches) is where
    the plan places an 8 x 64 V-cycle at 30 tokens per parameter; an 8 x 32 one stays on 8 x 32."""
    wide = _plan(capsys, "deep-gpt64-12000")["grow-late"]["regime"]
    assert (wide["nearest"]["source"], wide["nearest"]["layers"], wide["nearest"]["hidden"]) == \
        ("budget-curve-gpt64.json", 8, 64)
    assert wide["nearest"]["tokens_per_param"] == pytest.approx(30.72, abs=0.01)
    narrow = _plan(capsys, "deep-gpt-3000")["grow-late"]["regime"]
    assert (narrow["nearest"]["source"], narrow["nearest"]["hidden"]) == ("budget-curve-gpt-deep.json", 32)
