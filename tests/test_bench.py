"""`msds bench` on a minimal config: every field of results.json, the interpolation, bad configs."""
import dataclasses
import json
import math
import signal
import os
import subprocess
import sys
import time

import pytest
import torch
import yaml

from msds.bench.report import headline, markdown
from msds.bench.run import run_bench
from msds.bench.runs import EvalPoint, Load, same_load
from msds.bench.saving import (BenchResults, LossSpread, SeedResult, Spread, VariantRun, VariantSummary,
                               first_crossing)
from msds.bench.training import pending_runs
from msds.bench.variants import sweep_variants, variant_configs
from msds.config import ConfigError, dump_yaml

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
    assert on_disk == json.loads(json.dumps(results.to_json()))
    assert set(on_disk) == {"config", "reference", "baseline_sweep", "sweep_check", "variants", "per_seed", "headline"}
    assert on_disk["headline"].startswith(("vcycle reaches the baseline", "no variant reaches the baseline"))
    assert (out / "results.md").read_text().startswith(f"**{on_disk['headline']}**")
    assert on_disk["reference"] == "baseline" and list(on_disk["per_seed"]) == ["config"]
    seed = on_disk["per_seed"]["config"]
    assert set(seed["variants"]) == {"baseline", "vcycle"}
    base, vcycle = seed["variants"]["baseline"], seed["variants"]["vcycle"]
    fields = {"final_val_loss", "total_flops", "total_seconds", "reached_target", "flops_to_target",
              "seconds_to_target", "flops_saving", "wallclock_saving", "transition_seconds", "transitions", "evals",
              "baseline_val_loss_at_same_flops", "load", "timed_like_reference"}
    assert set(base) == fields and set(vcycle) == fields
    # Each run records the load it was timed under; the reference is timed like itself.
    assert base["load"]["runs_at_once"] == 1 and base["load"]["threads"] == torch.get_num_threads()
    assert base["load"]["load_average"] >= 0 and base["timed_like_reference"] is True
    assert isinstance(vcycle["timed_like_reference"], bool)
    assert seed["target_val_loss"] == base["final_val_loss"] == base["evals"][-1]["val_loss"]
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
        assert on_disk["variants"]["vcycle"]["missed_in_seeds"] == []
    else:
        assert vcycle["flops_saving"] is None and vcycle["seconds_to_target"] is None
        assert on_disk["variants"]["vcycle"]["missed_in_seeds"] == ["config"]
        assert on_disk["variants"]["vcycle"]["flops_saving"]["mean"] is None
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
    assert again.to_json()["per_seed"]["config"]["variants"]["vcycle"]["evals"] == vcycle["evals"]
    # --only reports the chosen variants (reused here too).
    assert set(run_bench(write(tmp_path, MINIMAL), out, [f"data.path={train_corpus}"], only=["baseline"]).variants) \
        == {"baseline"}


def test_seeds_and_a_baseline_sweep(train_corpus, tmp_path, capsys):
    """Every variant once per seed (other weights and data order), the baseline also at 4x its
    learning rate; the sweep member with the lower mean final loss becomes the reference. The runs
    train two at a time (`--jobs 2`), each in its own process with its output in its own log."""
    bench = {**MINIMAL, "seeds": [1, 2], "baseline_lr_sweep": [1, 4]}
    bench["base"] = {**MINIMAL["base"], "training": {"micro_batch_size": 4, "steps": 8}}
    bench["variants"] = {"baseline": {}, "vcycle": {**MINIMAL["variants"]["vcycle"]}}
    bench["variants"]["vcycle"]["multilevel"] = {**bench["variants"]["vcycle"]["multilevel"], "phase_steps": [2, 4, 2]}
    out = tmp_path / "out"
    started = time.monotonic()
    results = run_bench(write(tmp_path, bench), out, [f"data.path={train_corpus}"], jobs=2).to_json()
    minutes = (time.monotonic() - started) / 60
    assert list(results["per_seed"]) == ["1", "2"]
    printed = capsys.readouterr().out
    # Progress lines come once a minute and when a run ends, one per running job: a finished child
    # that is joined, not polled, adds no more (polled, the loop spun while it exited).
    progress = printed.count("bench: [")
    assert progress <= 2 * (6 + int(minutes) + 1), progress
    for seed in ("1", "2"):
        for name in ("baseline", "baseline-lr4x", "vcycle"):
            assert (out / f"seed{seed}" / name / "summary.json").is_file()
            log = (out / f"seed{seed}" / name / "bench.log").read_text()
            assert "step      8/8" in log and f"bench: finished {out / f'seed{seed}' / name}" in printed
            load = json.loads((out / f"seed{seed}" / name / "summary.json").read_text())["load"]
            assert load["runs_at_once"] == 2 and load["threads"] == max(1, torch.get_num_threads() // 2)
        run = yaml.safe_load((out / f"seed{seed}" / "baseline-lr4x" / "config.yaml").read_text())
        assert run["optimizer"]["lr"] == pytest.approx(4 * 0.003) and run["training"]["seed"] == int(seed)
        assert run["data"]["seed"] == int(seed)
    finals = {s: {n: r["final_val_loss"] for n, r in results["per_seed"][s]["variants"].items()} for s in ("1", "2")}
    assert finals["1"]["baseline"] != finals["2"]["baseline"]          # the seed changed the run
    means = {n: (finals["1"][n] + finals["2"][n]) / 2 for n in ("baseline", "baseline-lr4x")}
    assert results["baseline_sweep"] == pytest.approx(means)
    assert results["reference"] == min(means, key=means.get)
    for s in ("1", "2"):
        assert results["per_seed"][s]["target_val_loss"] == finals[s][results["reference"]]
    loss = results["variants"]["vcycle"]["final_val_loss"]
    assert loss["mean"] == pytest.approx((finals["1"]["vcycle"] + finals["2"]["vcycle"]) / 2)
    assert loss["worst"] == max(finals["1"]["vcycle"], finals["2"]["vcycle"])
    savings = results["variants"]["vcycle"]["flops_saving"]
    if None not in savings["per_seed"]:
        assert savings["worst"] == min(savings["per_seed"])
    md = (out / "results.md").read_text()
    assert "### seed 1" in md and "### seed 2" in md and f"Reference: `{results['reference']}`" in md


def test_a_failed_run_of_jobs_names_itself_and_stops_the_others(train_corpus, tmp_path):
    (tmp_path / "a-file").write_text("")
    bench = {"base": {**MINIMAL["base"], "training": {"micro_batch_size": 4, "steps": 100000}},
             "variants": {"baseline": {}, "broken": {"checkpoint": {"dir": str(tmp_path / "a-file" / "ckpt"),
                                                                    "interval": 2}}}}
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"^bench: \S+/out/broken failed \(exit code 1\): .*a-file.*; its output: "
                                         r"\S+/out/broken/bench\.log\. The other runs were sent training\.exit_signal"):
        run_bench(write(tmp_path, bench), out, [f"data.path={train_corpus}"], jobs=2)
    # The baseline, far from its 100000 steps, stopped without a summary: a rerun trains it on.
    assert (out / "baseline" / "bench.log").is_file() and not (out / "baseline" / "summary.json").exists()


def test_a_stopped_bench_stops_its_runs_with_a_checkpoint(train_corpus, tmp_path):
    """SIGTERM to a `--jobs` bench (a `kill`, a scheduler) reaches its runs as their exit signal: each
    checkpoints after its current step and exits with the bench, none is left training alone."""
    bench = {"base": {**MINIMAL["base"], "training": {"micro_batch_size": 4, "steps": 100000}},
             "variants": {"baseline": {}, "other": {"optimizer": {"lr": 0.001}}}}
    out = tmp_path / "out"
    script = (f"from msds.bench.run import run_bench; run_bench({str(write(tmp_path, bench))!r}, {str(out)!r}, "
              f"['data.path={train_corpus}'], jobs=2)")
    bench_process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
    logs = [out / name / "bench.log" for name in ("baseline", "other")]
    deadline = time.monotonic() + 300
    while not all(log.is_file() and "step " in log.read_text() for log in logs):
        assert bench_process.poll() is None and time.monotonic() < deadline, "the runs never started"
        time.sleep(1)
    bench_process.send_signal(signal.SIGTERM)
    printed, _ = bench_process.communicate(timeout=300)
    assert bench_process.returncode != 0 and "bench: stopped by SIGTERM; the running runs were sent" in printed
    for name, log in zip(("baseline", "other"), logs):
        assert "(SIGUSR1); run again with the same config to resume" in log.read_text()
        assert (out / name / "checkpoints" / "latest").is_file() and not (out / name / "summary.json").exists()


def test_a_stopped_one_job_bench_checkpoints_its_run(train_corpus, tmp_path):
    """The same without --jobs: the run trains in the bench's own process, and SIGTERM becomes its
    exit signal there too (a checkpoint after the current step), not a kill that loses the run."""
    bench = {"base": {**MINIMAL["base"], "training": {"micro_batch_size": 4, "steps": 100000}},
             "variants": {"baseline": {}}}
    out, printed = tmp_path / "out", tmp_path / "printed.txt"
    command = [sys.executable, "-m", "msds.cli", "bench", "--config", str(write(tmp_path, bench)), "--out", str(out),
               f"data.path={train_corpus}"]
    with open(printed, "w") as sink:
        # A fresh one-process job: not the launcher variables an earlier in-process run left here.
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                 "MASTER_PORT")}
        bench_process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while not (out / "baseline" / "metrics.jsonl").is_file() or \
                '"event": "step"' not in (out / "baseline" / "metrics.jsonl").read_text():
            assert bench_process.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(1)
        bench_process.send_signal(signal.SIGTERM)
        bench_process.wait(timeout=300)
    text = printed.read_text()
    assert bench_process.returncode != 0 and "baseline stopped early; run the same command again" in text, text[-2000:]
    assert (out / "baseline" / "checkpoints" / "latest").is_file() and not (out / "baseline" / "summary.json").exists()


def point(val_loss: float, flops: float, level: int = 1) -> EvalPoint:
    return EvalPoint(step=0, flops=flops, train_seconds=0.0, val_loss=val_loss, level=level)


def test_first_crossing_interpolates_between_evaluations():
    evals = [point(5.0, 10.0), point(4.0, 20.0), point(3.0, 30.0)]
    assert first_crossing(evals, 3.5, "flops") == pytest.approx(25.0)
    assert first_crossing(evals, 5.5, "flops") == 10.0
    assert first_crossing(evals, 2.0, "flops") is None


def test_first_crossing_counts_only_the_full_size_model():
    """A V-cycle's small model below the target does not count; nor does an interpolation across the
    up-transition: the first full-size evaluation after it counts at its own cost."""
    evals = [point(6.0, 10.0), point(4.0, 12.0, level=2), point(4.5, 20.0), point(3.5, 30.0)]
    assert first_crossing(evals, 4.2, "flops") == pytest.approx(23.0)
    assert first_crossing(evals, 4.6, "flops") == 20.0
    assert first_crossing(evals, 3.0, "flops") is None


def test_a_wall_clock_timed_under_another_load_is_marked():
    """Two wall-clocks compare only under the same load: the same threads and runs at once, and load
    averages within 25%. The report marks a saving whose pair differs, per seed and over the seeds."""
    alone = Load(cores=2, threads=1, runs_at_once=2, load_average=2.1)
    assert same_load(alone, alone) and same_load(alone, dataclasses.replace(alone, load_average=2.5))
    assert not same_load(alone, dataclasses.replace(alone, load_average=3.2))   # a third process beside the pair
    assert not same_load(alone, dataclasses.replace(alone, runs_at_once=1, threads=2))
    assert same_load(None, None) is None and same_load(alone, None) is False   # runs that recorded no load
    def run(saving, like):
        return VariantRun(final_val_loss=5.0, total_flops=1.0, total_seconds=10.0, reached_target=True,
                          flops_to_target=0.6, seconds_to_target=6.0, flops_saving=saving, wallclock_saving=saving,
                          load=None, timed_like_reference=like, baseline_val_loss_at_same_flops=5.1,
                          transition_seconds=0.0)

    def summary(loss, late_seeds):
        spread = Spread(mean=0.4, worst=0.3, per_seed=[0.5, 0.3])
        return VariantSummary(LossSpread(loss, loss, [loss, loss], best=loss), spread, spread, [], late_seeds)

    results = BenchResults(
        config="bench.yaml", reference="baseline", baseline_sweep={"baseline": 5.1},
        variants={"baseline": summary(5.1, []), "vcycle": summary(5.0, ["2"])},
        per_seed={s: SeedResult("baseline", 5.1, {"baseline": run(0.0, True), "vcycle": run(0.4, s == "1")})
                  for s in ("1", "2")})
    assert "less wall-clock (worst 30.0%) (not timed under the reference's load in seed(s) 2)" \
        in headline(results)
    md = markdown(results)
    assert "40.0% / 30.0% (not timed under the reference's load in seed(s) 2)" in md
    seed1, seed2 = md.split("### seed 2")
    assert "(not timed like" not in seed1.split("### seed 1")[1] and "| 40.0% (not timed like the reference) |" in seed2


def test_bench_without_baseline_or_with_unfair_variant(tmp_path, train_corpus):
    no_baseline = {"base": MINIMAL["base"], "variants": {"vcycle": MINIMAL["variants"]["vcycle"]}}
    with pytest.raises(ConfigError, match=r"^variants\.baseline: a bench needs a variant named 'baseline'"):
        run_bench(write(tmp_path, no_baseline), tmp_path / "out", [f"data.path={train_corpus}"])
    unfair = {"base": MINIMAL["base"], "variants": {"baseline": {}, "big": {"training": {"micro_batch_size": 8}}}}
    with pytest.raises(ConfigError, match=r"^variants\.big: tokens per step differ"):
        run_bench(write(tmp_path, unfair), tmp_path / "out", [f"data.path={train_corpus}"])
    with pytest.raises(ConfigError, match=r"^--only: 'nope' is not a variant of .*; its variants: baseline, vcycle"):
        run_bench(write(tmp_path, MINIMAL), tmp_path / "out", [f"data.path={train_corpus}"], only=["nope"])
    with pytest.raises(ConfigError, match=r"^--jobs: 0 is not a number of runs; give 1"):
        run_bench(write(tmp_path, MINIMAL), tmp_path / "out", [f"data.path={train_corpus}"], jobs=0)
    assert not (tmp_path / "out").exists()


def test_the_sweep_scales_the_baseline_variant_s_own_settings(tmp_path, train_corpus):
    bench = {**MINIMAL, "baseline_lr_sweep": [1, 2], "baseline_warmup_sweep": [2, 5],
             "variants": {"baseline": {"optimizer": {"lr": 0.01}}}}
    members = sweep_variants(bench)
    assert set(members) == {"baseline", "baseline-wu5", "baseline-lr2x", "baseline-lr2x-wu5"}
    configs = variant_configs(bench, tmp_path, [f"data.path={train_corpus}"], world_size=1)
    assert configs["baseline"].optimizer.lr == 0.01 and configs["baseline-lr2x-wu5"].optimizer.lr == 0.02
    assert configs["baseline-lr2x-wu5"].optimizer.warmup_steps == 5
    # A command-line warmup becomes the recipe's own setting: the sweep's names follow it.
    overridden = variant_configs(bench, tmp_path, [f"data.path={train_corpus}", "optimizer.warmup_steps=5"], world_size=1)
    assert set(overridden) == {"baseline", "baseline-wu2", "baseline-lr2x", "baseline-lr2x-wu2"}
    assert set(sweep_variants(bench, ["optimizer.warmup_steps=5"])) == set(overridden)


def test_a_finished_run_is_reused_only_while_it_would_train_the_same(tmp_path, train_corpus):
    """A summary.json of the same config marks a run finished. A run without multi-level training
    reads nothing of `multilevel`, so a change there (a new default, say) keeps it; a run directory
    of another config, finished or started, is refused with the field that differs (training "again"
    would resume its checkpoints and report the old run under the new config)."""
    def pending(*overrides):
        configs = variant_configs(MINIMAL, tmp_path, [f"data.path={train_corpus}", *overrides], world_size=1)
        return pending_runs(configs, tmp_path)

    for name, _, record in pending():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"config": record, "final_val_loss": 1.0}))
    assert pending() == []
    # Only the V-cycle reads multilevel.alpha: the finished baseline stays, the V-cycle is refused.
    with pytest.raises(ConfigError, match=r"variants\.vcycle: .*finished with another config \(multilevel\.alpha: "
                                          r"0\.\d+ there, 0\.5 now\).*move that directory away"):
        pending("multilevel.alpha=0.5")
    with pytest.raises(ConfigError, match=r"variants\.baseline: .*\(optimizer\.lr: "):
        pending("optimizer.lr=0.004")
    # A started run (config.yaml, no summary) resumes under its own config and is refused under another.
    vcycle = variant_configs(MINIMAL, tmp_path, [f"data.path={train_corpus}"], world_size=1)["vcycle"]
    (tmp_path / "vcycle" / "summary.json").unlink()
    dump_yaml(vcycle, tmp_path / "vcycle" / "config.yaml")
    assert [name for name, _, _ in pending()] == ["vcycle"]
    with pytest.raises(ConfigError, match=r"variants\.vcycle: .*started with another config \(multilevel\.alpha"):
        pending("multilevel.alpha=0.5")



def test_a_variant_named_with_a_plus_is_a_run_directory_and_an_only_argument(tmp_path, train_corpus):
    """Variants are named for what they are (`vcycle+random-ltd`): the name is its run directory and
    `--only` takes it as written."""
    from msds.cli import build_parser

    bench = {"base": MINIMAL["base"], "variants": {"baseline": {}, "vcycle+random-ltd": MINIMAL["variants"]["vcycle"]}}
    args = build_parser("bench").parse_args(["bench", "--config", "b.yaml", "--out", "o", "data.path=x",
                                             "--only", "vcycle+random-ltd"])
    assert args.only == ["vcycle+random-ltd"] and args.overrides == ["data.path=x"]
    configs = variant_configs(bench, tmp_path, [f"data.path={train_corpus}"], world_size=1)
    assert configs["vcycle+random-ltd"].run_dir == str(tmp_path / "vcycle+random-ltd")
