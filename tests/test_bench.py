"""`msds bench` on a minimal config: every field of results.json, the interpolation, bad configs."""
import json
import math

import pytest
import yaml

from msds.bench import first_crossing, run_bench
from msds.config import ConfigError

MINIMAL = {
    "base": {
        "model": {"preset": "gpt-tiny", "vocab_size": 1024, "num_layers": 2, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0},
        "data": {"seq_len": 16},
        "training": {"micro_batch_size": 4, "steps": 12},
        "optimizer": {"lr": 0.003, "warmup_steps": 2},
        "logging": {"interval": 4, "eval_interval": 4, "eval_batches": 2, "tensorboard": False},
    },
    "variants": {
        "baseline": {},
        "vcycle": {"training": {"steps": 0},
                   "multilevel": {"enabled": True, "levels": [{"hidden": 2, "heads": 2, "ffn": 2, "layers": 2}],
                                  "phase_steps": [4, 4, 4], "phase_warmup_steps": 1}},
    },
}


def write(tmp_path, bench):
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(bench))
    return path


def test_minimal_bench_results(train_corpus, tmp_path):
    out = tmp_path / "out"
    results = run_bench(write(tmp_path, MINIMAL), out, [f"data.path={train_corpus}"])
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert set(on_disk) == {"target_val_loss", "variants", "config"}
    assert set(on_disk["variants"]) == {"baseline", "vcycle"}
    base, vcycle = on_disk["variants"]["baseline"], on_disk["variants"]["vcycle"]
    fields = {"final_val_loss", "total_flops", "total_seconds", "reached_target", "flops_to_target",
              "seconds_to_target", "flops_saving", "wallclock_saving", "transition_seconds", "transitions", "evals",
              "baseline_val_loss_at_same_flops"}
    assert set(base) == fields and set(vcycle) == fields
    assert on_disk["target_val_loss"] == base["final_val_loss"] == base["evals"][-1]["val_loss"]
    # The baseline reaches its own final loss at its own cost: saving 0 by construction.
    assert base["reached_target"] and base["flops_saving"] == 0 and base["wallclock_saving"] == 0
    assert base["transitions"] == [] and base["transition_seconds"] == 0
    assert [e["step"] for e in base["evals"]] == [e["step"] for e in vcycle["evals"]] == [4, 8, 12]
    # The V-cycle ran a cheaper middle phase: fewer FLOPs for the same 12 steps.
    assert vcycle["total_flops"] < base["total_flops"]
    assert [t["direction"] for t in vcycle["transitions"]] == ["down", "up"]
    assert vcycle["transition_seconds"] == pytest.approx(sum(t["seconds"] for t in vcycle["transitions"]))
    if vcycle["reached_target"]:
        assert vcycle["flops_saving"] == pytest.approx(1 - vcycle["flops_to_target"] / base["total_flops"])
        assert vcycle["wallclock_saving"] == pytest.approx(1 - vcycle["seconds_to_target"] / base["total_seconds"])
    else:
        assert vcycle["flops_saving"] is None and vcycle["seconds_to_target"] is None
    assert all(math.isfinite(e["val_loss"]) for e in vcycle["evals"])
    assert base["baseline_val_loss_at_same_flops"] == pytest.approx(base["final_val_loss"])
    # The V-cycle's compute lies inside the baseline's curve: an interpolated baseline loss there.
    evals = base["evals"]
    at = vcycle["baseline_val_loss_at_same_flops"]
    assert min(e["val_loss"] for e in evals) <= at <= max(e["val_loss"] for e in evals) or \
        vcycle["total_flops"] < evals[0]["flops"] and at is None
    assert (out / "results.md").read_text().count("|") > 10
    for plot in ("loss_vs_flops.png", "loss_vs_time.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
    # A second run reuses both finished variants instead of training again.
    again = run_bench(write(tmp_path, MINIMAL), out, [f"data.path={train_corpus}"])
    assert again["variants"]["vcycle"]["evals"] == vcycle["evals"]
    # --only reports the chosen variants (reused here too).
    assert set(run_bench(write(tmp_path, MINIMAL), out, [f"data.path={train_corpus}"], only=["baseline"])["variants"]) \
        == {"baseline"}


def test_first_crossing_interpolates_between_evaluations():
    evals = [{"val_loss": 5.0, "flops": 10.0}, {"val_loss": 4.0, "flops": 20.0}, {"val_loss": 3.0, "flops": 30.0}]
    assert first_crossing(evals, 3.5, "flops") == pytest.approx(25.0)
    assert first_crossing(evals, 5.5, "flops") == 10.0
    assert first_crossing(evals, 2.0, "flops") is None


def test_bench_without_baseline_or_with_unfair_variant(tmp_path, train_corpus):
    no_baseline = {"base": MINIMAL["base"], "variants": {"vcycle": MINIMAL["variants"]["vcycle"]}}
    with pytest.raises(ConfigError, match=r"^variants\.baseline: a bench needs a variant named 'baseline'"):
        run_bench(write(tmp_path, no_baseline), tmp_path / "out", [f"data.path={train_corpus}"])
    unfair = {"base": MINIMAL["base"], "variants": {"baseline": {}, "big": {"training": {"micro_batch_size": 8}}}}
    with pytest.raises(ConfigError, match=r"^variants\.big: tokens per step differ"):
        run_bench(write(tmp_path, unfair), tmp_path / "out", [f"data.path={train_corpus}"])
    with pytest.raises(ConfigError, match=r"^--only: 'nope' is not a variant of .*; its variants: baseline, vcycle"):
        run_bench(write(tmp_path, MINIMAL), tmp_path / "out", [f"data.path={train_corpus}"], only=["nope"])
    with pytest.raises(ConfigError, match=r"^--only: include baseline"):
        run_bench(write(tmp_path, MINIMAL), tmp_path / "out", [f"data.path={train_corpus}"], only=["vcycle"])
    assert not (tmp_path / "out").exists()
