"""The GPU check of issue 18, one JSON out (40-60 s on one H100 before the fused-AdamW runs and
sections 5-9 were added: BENCHMARKS.md, "The GPU check"):

    python benchmarks/gpu_check.py --data CORPUS --json gpu_check.json          # on a CUDA machine
    python benchmarks/gpu_check.py --cpu --data CORPUS --json cpu_check.json    # CPU: tiny sizes

CORPUS is a prepared corpus with a 1024-token vocabulary (`msds data prepare --tokenizer bpe-1024
--out CORPUS`; a GPU machine without network needs it copied there). Sections of the JSON:

1. `transition`: a BERT-Large level transition (hidden, heads, FFN and layers / 2), down + up, over
   the weights and both Adam moments, streamed on the device as msds/train/transition.py streams it
   (benchmarks/transition_gpu.py `transition_seconds`; ZeRO gathers excluded), in training steps of
   section 4's msds step. Goal: <= 0.5 steps.
2. `kernels`: the fused kernels against the PyTorch reference (benchmarks/kernels_gpu.py `check`)
   and their bandwidth against a device-to-device copy (`bandwidth`). Goal: >= 80% of the copy.
3. `vcycle`: `msds train` of a small GPT V-cycle (bf16 on a GPU, fp32 on the CPU; dropout 0), once
   with multilevel.transition_backend=auto (the fused kernels for CUDA tensors, when triton is
   installed) and once with torch; per-step losses compared. A third run takes torch's fused AdamW
   (`"fused": true` beside `torch_adam`), whose step counters must live on the GPU after each
   transition; its losses are compared with the first run's (close, not identical).
4. `step`: one BERT-Large training step (bf16, sequence 128, micro-batch 64, ZeRO 1, one GPU) of the
   engine `msds train` builds (msds.train.engine) next to Hugging Face's BertForMaskedLM with fused
   AdamW (benchmarks/transition_gpu.py `bert_large_step_seconds`), and the MFU of both: the plan's
   FLOPs per step / seconds / the GPU's dense bf16 peak. Goal: msds faster, MFU >= 50%. msds's step
   is timed again with fused AdamW (`msds_fused_adamw_s`).
5. `profile`: torch.profiler over 3 of section 4's msds steps: kernels per step, the share of the
   wall time the GPU is busy, the 10 operations with the most device time (CPU time on the CPU).
6. `hf_references`: Hugging Face's BertForMaskedLM step (section 4's shape), eager and
   torch.compile'd.
7. `shapes`: msds's step at micro-batches 32/64/128 x 128 and 16 x 512 (BERT-Large) and GPT-2 small
   (124M) at 8 x 1024, with tokens/s and MFU on the plan's FLOPs per sample (msds.plan.schedule).
8. `vcycle_transitions`: a down + up transition pair of `msds train` on BERT-Large (64 x 128, one
   level halving everything), engine rebuilds included, in section 4's steps.
9. `fast_step`: msds's step with each fast-step setting turned the other way (ds_configs/README.md,
   data.max_predictions_per_seq=20, training.compile=true), against the defaults.
Sections 5-9 take about 5 of the script's at most 8 minutes on one H100 (estimated, not yet run).

--cpu (also taken when CUDA is absent) runs every section at tiny sizes on the CPU, the kernels
under the Triton interpreter (correctness only), to show that the script runs end to end:
tests/test_gpu_check.py runs it. Bandwidths, MFU and the goals are reported on a GPU only (null).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path[:0] = [str(REPO), str(BENCHMARKS)]

import kernels_gpu  # noqa: E402  (sets TRITON_INTERPRET without CUDA, before triton is imported)
import transition_gpu  # noqa: E402

warnings.filterwarnings("ignore")

# Dense bf16 peak FLOP/s by device name (vendor datasheets, without sparsity).
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
GOALS = {"transition_pair_in_steps": 0.5, "kernel_vs_copy": 0.8, "mfu": 0.5}


def peak_flops() -> float | None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


# -- 3. a V-cycle through `msds train`, kernels vs PyTorch -----------------------------------------

def vcycle(corpus: str, gpu: bool) -> dict:
    from msds.config import load_run_config
    from msds.train.loop import train
    from msds.train.metrics import read_metrics

    steps = 20 if gpu else 3
    losses, transitions = {}, {}
    for run, backend, fused in (("auto", "auto", False), ("torch", "torch", False), ("fused_adamw", "auto", True)):
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml", [
                f"data.path={corpus}", f"run_dir={run_dir}", "logging.tensorboard=false", "logging.eval_batches=1",
                f"training.precision={'bf16' if gpu else 'fp32'}", "model.hidden_dropout=0.0",
                "model.attention_dropout=0.0", f"multilevel.phase_steps=[{','.join([str(steps)] * 5)}]",
                f"multilevel.transition_backend={backend}"]
                + ([f"training.ds_config={fused_adamw_config(run_dir)}"] if fused else []))
            summary = train(cfg)
            losses[run] = [r["loss"] for r in read_metrics(run_dir, "step")]
            transitions[run] = summary.transitions
    import kernels

    diffs = [abs(a - b) for a, b in zip(losses["auto"], losses["torch"])]
    return {"precision": "bf16" if gpu else "fp32", "steps": len(losses["auto"]),
            "transitions": len(transitions["auto"]), "kernels_in_auto": gpu and kernels.triton_available(),
            "losses_auto": losses["auto"], "losses_torch": losses["torch"],
            "max_abs_loss_difference": max(diffs), "identical": diffs == [0.0] * len(diffs),
            "transition_seconds_auto": [t["seconds"] for t in transitions["auto"]],
            "losses_fused_adamw": losses["fused_adamw"], "fused_adamw_transitions": len(transitions["fused_adamw"]),
            "fused_adamw_max_abs_loss_difference": max(abs(a - b) for a, b in
                                                       zip(losses["auto"], losses["fused_adamw"]))}


def fused_adamw_config(directory: str) -> str:
    """ds_configs/zero1.json with torch's fused AdamW, written into `directory`; returns its path."""
    config = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    config["optimizer"]["params"]["fused"] = True
    path = Path(directory) / "zero1-fused-adamw.json"
    path.write_text(json.dumps(config))
    return str(path)


# -- 4. the training step: msds vs Hugging Face ------------------------------------------------------

def msds_step(gpu: bool, micro_batch: int, seq_len: int, repeats: int, ds_config: str = "",
              arch: str = "bert", overrides: tuple[str, ...] = (), profile: bool = False) -> dict:
    """Median seconds of one msds training step of BERT-Large (bert-tiny on the CPU; with
    arch="gpt", GPT-2 small, gpt-tiny on the CPU), the plan's FLOPs of that step and its MFU on the
    device's bf16 peak (null on the CPU); `ds_config` replaces ds_configs/zero1.json, `overrides`
    are more config overrides. With `profile`, torch.profiler's breakdown of the timed steps too."""
    from msds.config import load_run_config
    from msds.plan import build_plan
    from msds.plan.schedule import flops_per_sample
    from msds.train.engine import build_engine, destroy_engine, train_step

    preset, vocab, layers = {("bert", True): ("bert-large", 30522, 24), ("bert", False): ("bert-tiny", 512, 2),
                             ("gpt", True): ("gpt-base", 50257, 12), ("gpt", False): ("gpt-tiny", 512, 2)}[arch, gpu]
    cfg = load_run_config(REPO / "recipes" / "test" / f"test-vcycle-{arch}.yaml", [
        f"model.preset={preset}", f"model.vocab_size={vocab}", f"model.num_layers={layers}",
        f"model.max_positions={max(seq_len, 512)}", f"data.seq_len={seq_len}",
        f"training.micro_batch_size={micro_batch}", f"training.precision={'bf16' if gpu else 'fp32'}",
        "multilevel.enabled=false", "training.steps=100", "logging.tensorboard=false", *overrides]
        + ([f"training.ds_config={ds_config}"] if ds_config else []))
    plan = build_plan(cfg)
    model_cfg = plan.model(1)
    engine = build_engine(plan, plan.phases[0], None)
    stream = repeat(synthetic_batch(arch, micro_batch, seq_len, model_cfg.vocab_size,
                                    cfg.data.max_predictions_per_seq, engine.device))
    run = lambda: train_step(engine, stream, 1, None)  # noqa: E731
    seconds = transition_gpu.timed(run, "cuda" if gpu else "cpu", repeats)
    breakdown = profiled(run, gpu, repeats) if profile else None
    destroy_engine(engine)
    flops = flops_per_sample(model_cfg, seq_len) * micro_batch
    peak = peak_flops()
    return {"seconds": seconds, "flops": plan.flops_per_step(1, 0), "model": preset, "shape": [micro_batch, seq_len],
            "tokens_per_s": micro_batch * seq_len / seconds, "mfu": flops / seconds / peak if peak else None,
            "profile": breakdown}


def repeat(batch: dict):
    while True:
        yield batch


def synthetic_batch(arch: str, micro_batch: int, seq_len: int, vocab: int, max_predictions: int, device) -> dict:
    """Random tokens in the data loader's batch format (msds/data/samples.py); BERT: 15% labelled,
    with `max_predictions`, the first that many labelled positions of each sample."""
    ids = torch.randint(0, vocab, (micro_batch, seq_len + (arch == "gpt")), device=device)
    if arch == "gpt":
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    chosen = torch.rand(ids.shape, device=device) < 0.15
    chosen[:, 0] = False
    if max_predictions:
        chosen &= chosen.cumsum(dim=1) <= max_predictions
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
             "labels": torch.where(chosen, ids, torch.full_like(ids, -100))}
    if max_predictions:
        position = torch.arange(seq_len, device=device)
        positions = torch.where(chosen, position, seq_len + position).sort(dim=1).values[:, :max_predictions]
        batch["masked_positions"] = torch.where(positions < seq_len, positions, torch.zeros_like(positions))
    return batch


def profiled(run, gpu: bool, steps: int) -> dict:
    """torch.profiler over `steps` calls of `run`: kernels per step, the share of the wall time the
    device is busy (the union of kernel intervals), and the 10 operations taking the most device
    time (CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            run()
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if gpu and e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, -math.inf
    for k_start, k_end in kernels:   # the union of intervals: concurrent kernels count once
        busy += max(0.0, k_end - max(k_start, end))
        end = max(end, k_end)
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    top = sorted(prof.key_averages(), key=lambda a: getattr(a, key), reverse=True)[:10]
    return {"steps": steps, "kernels_per_step": len(kernels) / steps if gpu else None,
            "device_busy_fraction": busy / wall_us if gpu else None, "time": "device" if gpu else "cpu",
            "top10": [{"name": a.key, "ms_per_step": getattr(a, key) / 1e3 / steps, "calls_per_step": a.count / steps}
                      for a in top]}


def step(gpu: bool) -> dict:
    micro_batch, seq_len, repeats = (64, 128, 10) if gpu else (4, 32, 3)
    ours = msds_step(gpu, micro_batch, seq_len, repeats)
    out = {"shape": [micro_batch, seq_len], "msds_s": ours["seconds"], "flops_per_step": ours["flops"],
           "model": ours["model"], "hf_s": None, "msds_over_hf": None, "msds_mfu": None, "hf_mfu": None}
    with tempfile.TemporaryDirectory() as directory:
        out["msds_fused_adamw_s"] = msds_step(gpu, micro_batch, seq_len, repeats,
                                              fused_adamw_config(directory))["seconds"]
    if gpu:
        out["hf_s"] = transition_gpu.bert_large_step_seconds(micro_batch, seq_len, repeats)
        out["msds_over_hf"] = out["msds_s"] / out["hf_s"]
        peak = peak_flops()
        if peak:
            out["msds_mfu"] = ours["flops"] / out["msds_s"] / peak
            out["hf_mfu"] = ours["flops"] / out["hf_s"] / peak
    return out


# -- 5-9. where msds's step stands: profile, references, shapes, a real transition, fast-step settings ----

def profile_step(gpu: bool) -> dict:
    micro_batch, seq_len, repeats = (64, 128, 3) if gpu else (4, 32, 2)
    return msds_step(gpu, micro_batch, seq_len, repeats, profile=True)["profile"]


def hf_references(gpu: bool) -> dict:
    """Hugging Face's BertForMaskedLM step (fused AdamW; bf16 autocast on a GPU), eager and
    torch.compile'd: BERT-Large at 64 x 128 on a GPU; on the CPU a 2-layer width-64 model, compiled
    with the "eager" backend (dynamo only: the code path, not inductor's speed)."""
    micro_batch, seq_len, repeats = (64, 128, 10) if gpu else (4, 32, 2)
    out = {"shape": [micro_batch, seq_len]}
    for name, compiled in (("eager_s", False), ("compiled_s", True)):
        out[name] = transition_gpu.hf_bert_step_seconds(micro_batch, seq_len, repeats, gpu, compiled)
    return out


def shapes(gpu: bool) -> list[dict]:
    """msds's step over shapes: BERT at micro-batches 32/64/128 x 128 and at 16 x 512, GPT-2 small
    (124M) at 8 x 1024 (on the CPU: tiny models and sizes). MFU: the plan's FLOPs per sample
    (msds.plan.schedule.flops_per_sample) x micro-batch / seconds / the device's bf16 peak."""
    runs = ([("bert", b, 128) for b in (32, 64, 128)] + [("bert", 16, 512), ("gpt", 8, 1024)] if gpu else
            [("bert", 2, 32), ("bert", 4, 32), ("bert", 2, 64), ("gpt", 2, 64)])
    rows = []
    for arch, micro_batch, seq_len in runs:
        row = msds_step(gpu, micro_batch, seq_len, 5 if gpu else 1, arch=arch)
        rows.append({k: row[k] for k in ("model", "shape", "seconds", "tokens_per_s", "mfu")})
    return rows


def vcycle_transitions(corpus: str, gpu: bool, step_seconds: float) -> dict:
    """A down + up transition pair of `msds train` (BERT-Large at 64 x 128 on a GPU, the corpus's
    1024-token vocabulary; bert-tiny on the CPU), one level halving everything: its seconds include
    the reads of the old engine's tensors, the coalescing and the new engine's build, not the
    evaluations; `pair_in_steps` against section 4's step."""
    from msds.config import load_run_config
    from msds.train.loop import train

    preset, layers, shape = ("bert-large", 24, (64, 128)) if gpu else ("bert-tiny", 2, (4, 32))
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-bert.yaml", [
            f"data.path={corpus}", f"run_dir={run_dir}", f"model.preset={preset}", "model.vocab_size=1024",
            f"model.num_layers={layers}", f"data.seq_len={shape[1]}", f"training.micro_batch_size={shape[0]}",
            f"training.precision={'bf16' if gpu else 'fp32'}", "multilevel.levels=[{}]",
            "multilevel.phase_steps=[2,2,2]", "logging.tensorboard=false", "logging.eval_batches=1"])
        transitions = train(cfg).transitions
    seconds = {t["direction"]: t["seconds"] for t in transitions}
    return {"model": preset, "down_s": seconds["down"], "up_s": seconds["up"],
            "pair_in_steps": (seconds["down"] + seconds["up"]) / step_seconds}


def fast_step(gpu: bool) -> list[dict]:
    """msds's step with each fast-step setting turned the other way (ds_configs/README.md,
    data.max_predictions_per_seq, training.compile), against the defaults (first row)."""
    micro_batch, seq_len, repeats = (64, 128, 5) if gpu else (4, 32, 1)
    ds_changes = {"throughput timer on": ("timers", {"throughput": {"enabled": True}}),
                  "bf16 overflow check on": ("bf16", {"check_grad_overflow": True}),
                  "wall-clock breakdown on": ("wall_clock_breakdown", True),
                  "unfused AdamW": ("optimizer", "unfused")}
    rows = [("defaults", "", ()), ("data.max_predictions_per_seq=20", "", ("data.max_predictions_per_seq=20",)),
            ("training.compile=true", "", ("training.compile=true",))]
    out = []
    with tempfile.TemporaryDirectory() as directory:
        rows[1:1] = [(name, changed_config(directory, key, value), ()) for name, (key, value) in ds_changes.items()]
        for name, ds_config, overrides in rows:
            row = msds_step(gpu, micro_batch, seq_len, repeats, ds_config, overrides=overrides)
            out.append({"setting": name, "seconds": row["seconds"], "mfu": row["mfu"]})
    for row in out:
        row["vs_defaults"] = row["seconds"] / out[0]["seconds"]
    return out


def changed_config(directory: str, key: str, value) -> str:
    """ds_configs/zero1.json with `key` set to `value` ("unfused": AdamW's fused false), written into
    `directory`; returns its path."""
    config = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    if value == "unfused":
        config["optimizer"]["params"]["fused"] = False
    elif isinstance(value, dict):
        config[key] = {**config.get(key, {}), **value}
    else:
        config[key] = value
    path = Path(directory) / f"zero1-{key}.json"
    path.write_text(json.dumps(config))
    return str(path)


# -- 1 and 2 -------------------------------------------------------------------------------------------

def transition(gpu: bool, step_seconds: float) -> dict:
    from msds.config import model_config

    cfg = model_config("bert-large") if gpu else model_config("bert-tiny", num_layers=4)
    result = transition_gpu.transition_seconds("cuda" if gpu else "cpu", 5 if gpu else 1, cfg)
    result["pair_in_steps"] = (result["down_s"] + result["up_s"]) / step_seconds
    return result


def kernel_checks(gpu: bool) -> dict:
    dtypes = ["fp32", "bf16"] if gpu else ["fp32"]
    failures, rows = [], []
    device = "cuda" if gpu else "cpu"
    for name, shape, rows_g, cols_g, sides in kernels_gpu.cases(tiny=not gpu):
        for kind, scale in kernels_gpu.scales(rows_g, cols_g, sides).items():
            for dtype in dtypes:
                failures += kernels_gpu.check(f"{name}.{kind}", kernels_gpu.DTYPES[dtype], shape, rows_g, cols_g,
                                              scale, device)
        if gpu:
            for dtype in dtypes:
                rows.append(kernels_gpu.bandwidth(name, kernels_gpu.DTYPES[dtype], shape, rows_g, cols_g,
                                                  kernels_gpu.scales(rows_g, cols_g, sides)["param"]))
    worst = min((min(r["coalesce_vs_copy"], r["decoalesce_interpolate_vs_copy"]) for r in rows), default=None)
    return {"correct": not failures, "failures": failures, "bandwidth": rows, "worst_vs_copy": worst}


def dump(results: dict) -> str:
    return json.dumps(results, indent=1, default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (taken when CUDA is absent)")
    parser.add_argument("--data", default=str(Path.home() / ".cache" / "msds" / "test-data" / "default-bpe-1024"),
                        help="a prepared corpus with a 1024-token vocabulary")
    parser.add_argument("--json", type=Path, help="write the results here (also printed)")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__}

    def save() -> str:
        results["seconds"] = time.perf_counter() - start
        text = dump(results)
        if args.json:
            args.json.write_text(text)
        return text

    def section(name, run):
        # The JSON is rewritten after every section, so a run stopped at its time limit keeps the
        # sections it finished.
        results[name] = run()
        save()
        print(f"gpu_check: {name} done at {results['seconds']:.0f} s", flush=True)

    section("vcycle", lambda: vcycle(args.data, gpu))     # first: `msds train` sets up the process group
    section("step", lambda: step(gpu))
    section("transition", lambda: transition(gpu, results["step"]["msds_s"]))
    section("kernels", lambda: kernel_checks(gpu))
    section("profile", lambda: profile_step(gpu))
    section("hf_references", lambda: hf_references(gpu))
    section("shapes", lambda: shapes(gpu))
    section("vcycle_transitions", lambda: vcycle_transitions(args.data, gpu, results["step"]["msds_s"]))
    section("fast_step", lambda: fast_step(gpu))
    results["goals"] = None if not gpu else {
        "transition_pair_in_steps": results["transition"]["pair_in_steps"] <= GOALS["transition_pair_in_steps"],
        "kernel_vs_copy": results["kernels"]["worst_vs_copy"] >= GOALS["kernel_vs_copy"],
        "msds_faster_than_hf": results["step"]["msds_over_hf"] < 1.0,
        "mfu": results["step"]["msds_mfu"] is not None and results["step"]["msds_mfu"] >= GOALS["mfu"]}
    print(save())
    return 0 if results["kernels"]["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
