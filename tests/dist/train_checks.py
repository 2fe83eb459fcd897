"""Multi-process (gloo) training checks, one torchrun launch per suite (tests/conftest.py):

    torchrun --nproc_per_node 2 tests/dist/train_checks.py two CORPUS_DIR WORK_DIR RESULTS_JSON
    torchrun --nproc_per_node 4 tests/dist/train_checks.py four CORPUS_DIR WORK_DIR RESULTS_JSON
    torchrun --nproc_per_node 2 tests/dist/train_checks.py relayout CORPUS_DIR WORK_DIR RESULTS_JSON
    MSDS_FAULT=... torchrun --nproc_per_node 2 tests/dist/train_checks.py faults CORPUS_DIR WORK_DIR -
    torchrun --nproc_per_node 2 tests/dist/train_checks.py init_from CORPUS_DIR WORK_DIR RESULTS_JSON

Every check of a suite trains in its one process group, so the launch cost is paid once. Rank 0
writes the run summaries and per-step losses to RESULTS_JSON; tests/test_train.py and
tests/test_parallel.py assert on them.
"""
import json
import math
import os
import random
import shutil
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from msds.config import load_run_config  # noqa: E402
from msds.train.loop import train  # noqa: E402
from msds.train.metrics import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def run(name, arch, corpus, work, *overrides):
    recipe = REPO / "recipes" / "test" / f"test-vcycle-{arch}.yaml"
    cfg = load_run_config(recipe, [f"data.path={corpus}", f"run_dir={work / name}", "logging.tensorboard=false",
                                   *overrides])
    summary = train(cfg)
    dist.barrier()
    return {"run_dir": str(work / name), "summary": {"final_val_loss": summary.final_val_loss, "exited_early": summary.exited_early,
                        "state": asdict(summary.state), "transitions": summary.transitions},
            "losses": {r["step"]: r["loss"] for r in read_metrics(work / name, "step")},
            "val_losses": {r["step"]: r["val_loss"] for r in read_metrics(work / name, "eval")},
            "keep_tokens": {r["step"]: r["keep_tokens"] for r in read_metrics(work / name, "step")}}


EXACT = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0"]


def random_ltd_ds_config(work, stage):
    """ds_configs/zero<stage>.json with random-LTD on layers 1 and 2 of 4 (16 -> 32 tokens over 20 steps)."""
    ltd = json.loads((REPO / "ds_configs" / f"zero{stage}.json").read_text())
    ltd["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
        "model_type": "decoder", "random_ltd_schedule": {
            "min_value": 16, "max_value": 32, "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 20, "seq_per_step": 4}}}}}
    path = work / f"zero{stage}-random-ltd.json"
    if dist.get_rank() == 0:
        path.write_text(json.dumps(ltd))
    dist.barrier()
    return path


def scramble_generators():
    """Move every generator a checkpoint keeps away from where the stopped run left it (as a new
    process would start): a resume that did not restore one of them would draw differently."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.seed(dist.get_rank() + 99)
    np.random.seed(dist.get_rank() + 99)
    torch.manual_seed(dist.get_rank() + 99)
    with get_cuda_rng_tracker().fork():
        torch.rand(1000)


def two(corpus, work):
    results = {}
    for arch in ("gpt", "bert"):
        for stage in (1, 2, 3):
            results[f"{arch}-zero{stage}"] = run(f"{arch}-zero{stage}", arch, corpus, work,
                                                 f"training.zero_stage={stage}", "checkpoint.at_transitions=true")
    results["gpt-zero2-random-ltd"] = run("gpt-zero2-random-ltd", "gpt", corpus, work, "training.zero_stage=2",
                                          f"training.ds_config={random_ltd_ds_config(work, 2)}")
    results["gpt-alpha0"] = run("gpt-alpha0", "gpt", corpus, work, "training.zero_stage=2", "multilevel.alpha=0.0")
    for stage in (1, 3):   # stop right after the second transition (step 12), then resume
        name = f"gpt-zero{stage}-resumed"
        first = run(name, "gpt", corpus, work, f"training.zero_stage={stage}", "checkpoint.at_transitions=true",
                    "training.exit_after_steps=12")
        second = run(name, "gpt", corpus, work, f"training.zero_stage={stage}", "checkpoint.at_transitions=true")
        results[name] = {"first": first, "second": second}
    results["gpt-dp2-exact"] = run("gpt-dp2-exact", "gpt", corpus, work, *EXACT)
    # Precisions and ZeRO 0: the same V-cycle as gpt-zero1 in bf16 (DeepSpeed's CPU accelerator has
    # bf16), and in fp32 with ZeRO 0.
    results["gpt-bf16"] = run("gpt-bf16", "gpt", corpus, work, "training.precision=bf16")
    results["gpt-zero0"] = run("gpt-zero0", "gpt", corpus, work, "training.zero_stage=0")
    # Tensor parallelism: re-creates megatron's parallel state for TP=2 (data parallel 1).
    exact = [*EXACT, "parallel.tensor=2"]
    for arch in ("gpt", "bert"):
        results[f"{arch}-tp2"] = run(f"{arch}-tp2", arch, corpus, work, *exact, "checkpoint.at_transitions=true")
    # 1025 tokens: padded to 1280 rows (make_vocab_size_divisible_by 128 x TP 2).
    results["gpt-tp2-padded"] = run("gpt-tp2-padded", "gpt", corpus, work, *exact, "model.vocab_size=1025")
    # Dropout 0.1 (the recipe's): attention dropout draws from megatron's per-rank tracker stream,
    # the rest from torch's generator; the resumed half starts with both scrambled, as a new process.
    dropout = ["parallel.tensor=2", "checkpoint.at_transitions=true"]
    results["gpt-tp2-dropout"] = run("gpt-tp2-dropout", "gpt", corpus, work, *dropout)
    first = run("gpt-tp2-resumed", "gpt", corpus, work, *dropout, "training.exit_after_steps=12")
    scramble_generators()
    second = run("gpt-tp2-resumed", "gpt", corpus, work, *dropout)
    results["gpt-tp2-resumed"] = {"first": first, "second": second}
    # Pipeline parallelism: two stages (data parallel 1).
    from msds.compat import deepspeed_0_19

    exact = [*EXACT, "parallel.pipeline=2"]
    for arch in ("gpt", "bert"):
        results[f"{arch}-pp2"] = run(f"{arch}-pp2", arch, corpus, work, *exact, "checkpoint.at_transitions=true")
    groups_after_first_runs = deepspeed_0_19.reused_group_count()
    first = run("gpt-pp2-resumed", "gpt", corpus, work, *exact, "checkpoint.at_transitions=true",
                "training.exit_after_steps=12")
    second = run("gpt-pp2-resumed", "gpt", corpus, work, *exact, "checkpoint.at_transitions=true")
    results["gpt-pp2-resumed"] = {"first": first, "second": second}
    results["gpt-pp2-random-ltd"] = run("gpt-pp2-random-ltd", "gpt", corpus, work, *exact,
                                        f"training.ds_config={random_ltd_ds_config(work, 1)}")
    results["pipeline_process_groups"] = [groups_after_first_runs, deepspeed_0_19.reused_group_count()]
    results["gpt-pp2-bad-steps"] = pipeline_bad_steps(corpus, work)
    return results


# tests/test_faults.py::test_pipeline_skips_bad_steps: NaN losses at steps 3, 6 and 7 of a two-stage
# pipeline (the last stage computes them); two in a row stop it at step 7. A checkpoint every step.
PIPELINE_BAD_STEPS = ("nan-loss::3,nan-loss::6+", [*EXACT, "parallel.pipeline=2", "multilevel.enabled=false",
                                                   "training.steps=10", "checkpoint.interval=1", "checkpoint.keep=20",
                                                   "checkpoint.layout_free=false", "training.max_bad_steps=2"])


def pipeline_bad_steps(corpus, work):
    from msds.errors import MsdsError
    from msds.train import faults

    spec, overrides = PIPELINE_BAD_STEPS
    faults._calls.clear()
    os.environ[faults.ENV] = spec
    try:
        run("gpt-pp2-bad-steps", "gpt", corpus, work, *overrides)
        stopped = None
    except MsdsError as error:
        stopped = str(error)
    finally:
        del os.environ[faults.ENV]
    dist.barrier()
    return {"run_dir": str(work / "gpt-pp2-bad-steps"), "stopped": stopped}


def four(corpus, work):
    """Pipeline parallelism composed with data and with tensor parallelism."""
    return {"gpt-pp2-dp2": run("gpt-pp2-dp2", "gpt", corpus, work, *EXACT, "parallel.pipeline=2"),
            **{f"{arch}-pp2-tp2": run(f"{arch}-pp2-tp2", arch, corpus, work, *EXACT, "parallel.pipeline=2",
                                      "parallel.tensor=2") for arch in ("gpt", "bert")}}


# Resuming on another layout (tests/test_relayout.py, which uses the same overrides): a short
# V-cycle, phases of 2, 2, 4, 2 and 2 steps, cut at step 6, inside its bottom phase (levels 1 and 2
# saved, with their Adam moments).
SHORT_VCYCLE = [*EXACT, "multilevel.phase_steps=[2,2,4,2,2]", "logging.eval_batches=1"]
RELAYOUT_FROM = {"dp2": [], "tp2": ["parallel.tensor=2"], "pp2": ["parallel.pipeline=2"]}


def relayout(corpus, work):
    """Each two-process layout of RELAYOUT_FROM cut at step 6, a copy of the cut run kept in
    WORK/<name>-cut (tests/test_relayout.py resumes it on one process), then continued on its own
    layout: the reference. And the one-process run the test left cut in WORK/dp1-to-dp2, resumed on
    two processes with half the micro-batch (the same global batch)."""
    results = {}
    for name, layout in RELAYOUT_FROM.items():
        run(name, "gpt", corpus, work, *SHORT_VCYCLE, *layout, "training.exit_after_steps=6")
        if dist.get_rank() == 0:
            shutil.copytree(work / name, work / f"{name}-cut")
        dist.barrier()
        results[name] = run(name, "gpt", corpus, work, *SHORT_VCYCLE, *layout)
    results["dp1-to-dp2"] = run("dp1-to-dp2", "gpt", corpus, work, *SHORT_VCYCLE, "training.micro_batch_size=2")
    return results


def faults(corpus, work):
    """tests/test_faults.py's chain of faulted runs: the uninterrupted reference (no fault), then
    the chain's first run, which MSDS_FAULT kills: this launch never returns results (the test reads
    both runs' metrics.jsonl); it saves the chain one launch. WORK/overrides.json holds the runs'
    overrides of recipes/test/test-vcycle-gpt.yaml."""
    overrides = json.loads((work / "overrides.json").read_text())
    spec = os.environ.pop("MSDS_FAULT")
    run("reference", "gpt", corpus, work, *overrides)
    os.environ["MSDS_FAULT"] = spec
    run("chain", "gpt", corpus, work, *overrides)
    return {}


def init_from(corpus, work):
    """tests/test_init_from.py's runs from a pretrained model: WORK/runs.json maps each run's name
    to its overrides of recipes/test/test-vcycle-gpt.yaml."""
    runs = json.loads((work / "runs.json").read_text())
    return {name: run(name, "gpt", corpus, work, *overrides) for name, overrides in runs.items()}


def main(suite, corpus, work, results_path):
    results = {"two": two, "four": four, "relayout": relayout, "faults": faults,
               "init_from": init_from}[suite](Path(corpus), Path(work))
    if dist.get_rank() == 0:
        finite = lambda x: None if x != x or math.isinf(x) else x  # noqa: E731 (NaN/inf are not JSON)
        Path(results_path).write_text(json.dumps(results, indent=1, default=finite))


if __name__ == "__main__":
    main(*sys.argv[1:5])
