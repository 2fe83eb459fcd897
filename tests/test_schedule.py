"""Learning-rate schedules (optimizer.schedule: cosine, linear, wsd): each curve's values, a V-cycle's
run-long curve under each shape, what the plan refuses, `msds plan`'s curve, and a resume in the
middle of a decay that continues bit for bit."""
import json
import math
import re
from pathlib import Path

import pytest

from msds.cli import main as msds_main
from msds.config import ConfigError, load_run_config, load_yaml, run_config_from_dict
from msds.plan import build_plan
from msds.train.loop import train
from msds.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"


def _baseline(schedule: str, min_ratio: float, *more: str):
    """A 100-step baseline with a 10-step warmup at a peak of 1e-3."""
    return build_plan(load_run_config(RECIPE, ["multilevel.enabled=false", "training.steps=100",
                                               "optimizer.warmup_steps=10", f"optimizer.schedule={schedule}",
                                               f"optimizer.min_lr_ratio={min_ratio}", *more]))


def test_the_default_is_today_s_cosine_to_a_tenth_bit_for_bit():
    plan = build_plan(load_run_config(RECIPE, ["multilevel.enabled=false", "training.steps=100",
                                               "optimizer.warmup_steps=10"]))
    assert (plan.config.optimizer.schedule, plan.config.optimizer.min_lr_ratio) == ("cosine", 0.1)
    for step in range(101):
        before = (step + 1) / 10 if step < 10 else \
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 10) / 90)))   # the formula of every bench
        assert plan.lr_curves[0](step) == before


@pytest.mark.parametrize("schedule,min_ratio,expected", [
    # step: multiplier of the peak. Warmup ends at step 9; the decay runs over steps 10..100.
    ("cosine", 0.1, {0: 0.1, 9: 1.0, 10: 1.0, 55: 0.55, 100: 0.1}),
    ("linear", 0.0, {0: 0.1, 9: 1.0, 10: 1.0, 55: 0.5, 99: 1 / 90, 100: 0.0}),
    ("linear", 0.1, {55: 0.55, 100: 0.1}),
    # The last 20% decays: stable from the warmup's end to step 80, then linear to the floor.
    ("wsd", 0.0, {0: 0.1, 9: 1.0, 10: 1.0, 50: 1.0, 79: 1.0, 80: 1.0, 81: 0.95, 90: 0.5, 100: 0.0}),
    ("wsd", 0.1, {79: 1.0, 90: 0.55, 100: 0.1}),
])
def test_each_curve_at_chosen_steps(schedule, min_ratio, expected):
    curve = _baseline(schedule, min_ratio).lr_curves[0]
    assert {step: curve(step) for step in expected} == pytest.approx(expected)


def test_wsd_decay_fraction_moves_the_decay_start():
    plan = _baseline("wsd", 0.0, "optimizer.decay_fraction=0.5")
    assert plan.lr_curves[0](49) == 1.0 and plan.lr_curves[0](75) == pytest.approx(0.5)
    assert plan.lr_milestones == (10, 50)


def _prototype_vcycle(*optimizer: str):
    """The prototype's 480-step budget as a V-cycle (48 / 384 / 339 steps, 771 in all) with one
    run-long schedule."""
    bench = load_yaml(REPO / "recipes" / "bench" / "prototype-sweep-gpt.yaml")
    base = bench["base"]
    base["multilevel"] = {"enabled": True, "budget_steps": 480, "lr_schedule": "run"}
    cfg = run_config_from_dict(base)
    for item in optimizer:
        key, value = item.split("=")
        setattr(cfg.optimizer, key, type(getattr(cfg.optimizer, key))(value))
    return build_plan(cfg)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_a_v_cycle_s_run_long_curve_under_each_shape(schedule):
    """One curve over the V-cycle's 771 steps, as a 771-step baseline's, scaled by each level's peak
    and warmed up again over phase_warmup_steps after each transition; it ends at min_lr_ratio."""
    plan = _prototype_vcycle(f"schedule={schedule}", "min_lr_ratio=0.0")
    assert [(p.level, p.steps) for p in plan.phases] == [(1, 48), (2, 384), (1, 339)]
    baseline = build_plan(load_run_config(RECIPE, ["multilevel.enabled=false", "training.steps=771",
                                                   "optimizer.warmup_steps=24", f"optimizer.schedule={schedule}",
                                                   "optimizer.min_lr_ratio=0"])).lr_curves[0]
    peak = plan.config.optimizer.lr
    for phase, curve in zip(plan.phases, plan.lr_curves):
        for k in range(phase.steps):
            rewarm = 1.0 if phase.index == 0 else min(1.0, (k + 1) / phase.warmup_steps)
            assert curve(k) == pytest.approx(rewarm * baseline(phase.start_step + k))
    small = plan.phases[1]
    assert small.peak_lr == 4 * peak
    middle = small.start_step + small.steps // 2
    assert plan.lr_at(middle) == pytest.approx(4 * peak * baseline(middle))
    last = plan.phases[-1]
    assert plan.lr_curves[-1](last.steps) == 0.0 and plan.lr_at(last.end_step - 1) < 0.01 * peak
    if schedule == "wsd":
        # The small level lives in the stable stretch; the decay (the last 154 steps) ends the run at full size.
        start = 771 - round(0.2 * 771)
        assert [plan.lr_at(s) for s in (small.start_step + 48, small.end_step - 1)] == [4 * peak, 4 * peak]
        assert plan.lr_at(start) == peak and plan.lr_at(start + 77) == pytest.approx(peak / 2, rel=0.01)
        assert start in plan.lr_milestones and last.start_step < start


def test_a_wsd_v_cycle_whose_decay_would_reach_a_smaller_level_is_refused(capsys):
    message = (r"^optimizer\.decay_fraction: 0\.5 of the V-cycle's 771 steps starts the decay at step 385, before "
               r"its last phase at full size \(steps 432-771\), .*; use a decay_fraction of at most 0\.439 \(the last "
               r"phase's share of the run\) or lengthen the last phase")
    with pytest.raises(ConfigError, match=message):
        _prototype_vcycle("schedule=wsd", "decay_fraction=0.5")
    assert _prototype_vcycle("schedule=wsd", "decay_fraction=0.439").lr_milestones[-1] >= 432


@pytest.mark.parametrize("override,message", [
    ("optimizer.min_lr_ratio=1.5", r"^optimizer\.min_lr_ratio: must be in \[0, 1\]"),
    ("optimizer.decay_fraction=0", r"^optimizer\.decay_fraction: must be in \(0, 1\]"),
    ("optimizer.decay_fraction=0.99", r"^optimizer\.decay_fraction: 0\.99 of the 100 steps of the run starts the "
                                      r"decay at step 1, inside its 10-step warmup; use a decay_fraction of at most "
                                      r"0\.900"),
    ("optimizer.schedule=step", r"^optimizer\.schedule: 'step' is not one of 'cosine', 'linear', 'wsd'"),
])
def test_bad_schedule_settings_are_one_error(override, message, capsys):
    args = ["multilevel.enabled=false", "training.steps=100", "optimizer.warmup_steps=10", "optimizer.schedule=wsd",
            override]
    assert msds_main(["plan", "--config", str(RECIPE), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0].split("error: ", 1)[1]), err


def test_msds_plan_prints_the_curve(capsys):
    args = ["multilevel.enabled=false", "training.steps=100", "optimizer.warmup_steps=10", "optimizer.schedule=wsd",
            "optimizer.min_lr_ratio=0"]
    assert msds_main(["plan", "--config", str(RECIPE), *args]) == 0
    out = capsys.readouterr().out
    assert ("learning rate: 10 warmup steps, then warmup-stable-decay (last 0.2 decays linearly) to 0 of the peak, "
            "over the whole run") in out
    # The ends, the quarters, and each side of the warmup's end and the decay's start.
    assert ("phase 0 (level 1): 0: 1.000e-04, 9: 1.000e-03, 10: 1.000e-03, 25: 1.000e-03, 50: 1.000e-03, "
            "75: 1.000e-03, 79: 1.000e-03, 80: 1.000e-03, 99: 5.000e-05") in out
    assert msds_main(["plan", "--config", str(RECIPE), "--json", "multilevel.lr_schedule=run"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["lr"] == {"shape": "cosine", "min_lr_ratio": 0.1, "warmup_steps": 4, "span": "run"}
    second = facts["phases"][1]["lr_curve"]
    assert second[0][0] == 6 and second[-1][0] == 11 and second[1] == [7, pytest.approx(4 * 0.001 *
                                                                                         (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 26))))]


@pytest.mark.parametrize("schedule,multilevel", [("wsd", ["multilevel.lr_schedule=run"]),
                                                  ("linear", ["multilevel.enabled=false", "training.steps=30"])])
def test_a_resume_in_the_middle_of_a_decay_continues_bit_for_bit(train_corpus, tmp_path, schedule, multilevel):
    """Stopped at step 27 of 30 (a decay to zero over the last 6 steps, or a linear decay over the
    run), then resumed: every step's loss and learning rate equal the uninterrupted run's."""
    args = [f"data.path={train_corpus}", "logging.tensorboard=false", f"optimizer.schedule={schedule}",
            "optimizer.min_lr_ratio=0", *multilevel]
    train(load_run_config(RECIPE, [f"run_dir={tmp_path / 'whole'}", *args]))
    first = train(load_run_config(RECIPE, [f"run_dir={tmp_path / 'resumed'}", "training.exit_after_steps=27", *args]))
    assert first.exited_early and first.state.step == 27
    train(load_run_config(RECIPE, [f"run_dir={tmp_path / 'resumed'}", *args]))
    assert read_metrics(tmp_path / "resumed", "resume")[-1]["step"] == 27

    def history(run: str) -> list[tuple[int, float, float]]:
        return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(tmp_path / run, "step")]

    whole = history("whole")
    assert [s for s, _, _ in whole] == list(range(1, 31))
    lrs = [lr for _, _, lr in whole]
    # Mid-decay at the stop; a step's record holds the rate the scheduler set for the next step.
    assert lrs[26] < lrs[25] < lrs[24] and lrs[-1] == 0.0
    assert history("resumed") == whole
