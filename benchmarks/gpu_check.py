"""The GPU check of issue 18, one JSON out (40-60 s on one H100 before the fused-AdamW runs were
added: BENCHMARKS.md, "The GPU check"):

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

def msds_step(gpu: bool, micro_batch: int, seq_len: int, repeats: int, ds_config: str = "") -> dict:
    """Median seconds of one msds training step of BERT-Large (bert-tiny on the CPU) and the plan's
    FLOPs of that step; `ds_config` replaces ds_configs/zero1.json."""
    from msds.config import load_run_config
    from msds.plan import build_plan
    from msds.train.engine import build_engine, destroy_engine, train_step

    preset = "bert-large" if gpu else "bert-tiny"
    cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-bert.yaml", [
        f"model.preset={preset}", f"model.vocab_size={30522 if gpu else 512}", "model.num_layers="
        f"{24 if gpu else 2}", f"data.seq_len={seq_len}", f"training.micro_batch_size={micro_batch}",
        f"training.precision={'bf16' if gpu else 'fp32'}", "multilevel.enabled=false", "training.steps=100",
        "logging.tensorboard=false"] + ([f"training.ds_config={ds_config}"] if ds_config else []))
    plan = build_plan(cfg)
    model_cfg = plan.model(1)
    engine = build_engine(plan, plan.phases[0], None)
    device = engine.device
    ids = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len), device=device)
    labels = torch.where(torch.rand(ids.shape, device=device) < 0.15, ids, torch.full_like(ids, -100))
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
             "labels": labels}

    def batches():
        while True:
            yield batch

    stream = batches()
    seconds = transition_gpu.timed(lambda: train_step(engine, stream, 1, None), "cuda" if gpu else "cpu", repeats)
    destroy_engine(engine)
    return {"seconds": seconds, "flops": plan.flops_per_step(1, 0), "model": preset}


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
    results["goals"] = None if not gpu else {
        "transition_pair_in_steps": results["transition"]["pair_in_steps"] <= GOALS["transition_pair_in_steps"],
        "kernel_vs_copy": results["kernels"]["worst_vs_copy"] >= GOALS["kernel_vs_copy"],
        "msds_faster_than_hf": results["step"]["msds_over_hf"] < 1.0,
        "mfu": results["step"]["msds_mfu"] is not None and results["step"]["msds_mfu"] >= GOALS["mfu"]}
    print(save())
    return 0 if results["kernels"]["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
