"""Multi-process (gloo) training checks, one torchrun launch per suite (tests/conftest.py):

    torchrun --nproc_per_node 2 tests/dist/train_checks.py two CORPUS_DIR WORK_DIR RESULTS_JSON
    torchrun --nproc_per_node 4 tests/dist/train_checks.py four CORPUS_DIR WORK_DIR RESULTS_JSON

Every check of a suite trains in its one process group, so the launch cost is paid once. Rank 0
writes the run summaries and per-step losses to RESULTS_JSON; tests/test_train.py and
tests/test_parallel.py assert on them.
"""
import json
import math
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from msds.config import load_run_config  # noqa: E402
from msds.train.loop import train  # noqa: E402
from msds.train.metrics import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def run(name, arch, corpus, work, *overrides):
    recipe = REPO / "recipes" / f"test-vcycle-{arch}.yaml"
    cfg = load_run_config(recipe, [f"data.path={corpus}", f"run_dir={work / name}", "logging.tensorboard=false",
                                   *overrides])
    summary = train(cfg)
    dist.barrier()
    return {"run_dir": str(work / name), "summary": {"final_val_loss": summary.final_val_loss, "exited_early": summary.exited_early,
                        "state": asdict(summary.state), "transitions": summary.transitions},
            "losses": {r["step"]: r["loss"] for r in read_metrics(work / name, "step")},
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
    # Tensor parallelism: re-creates megatron's parallel state for TP=2 (data parallel 1).
    exact = [*EXACT, "parallel.tensor=2"]
    for arch in ("gpt", "bert"):
        results[f"{arch}-tp2"] = run(f"{arch}-tp2", arch, corpus, work, *exact, "checkpoint.at_transitions=true")
    first = run("gpt-tp2-resumed", "gpt", corpus, work, *exact, "checkpoint.at_transitions=true",
                "training.exit_after_steps=12")
    second = run("gpt-tp2-resumed", "gpt", corpus, work, *exact, "checkpoint.at_transitions=true")
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
    return results


def four(corpus, work):
    """Pipeline parallelism composed with data and with tensor parallelism."""
    return {"gpt-pp2-dp2": run("gpt-pp2-dp2", "gpt", corpus, work, *EXACT, "parallel.pipeline=2"),
            **{f"{arch}-pp2-tp2": run(f"{arch}-pp2-tp2", arch, corpus, work, *EXACT, "parallel.pipeline=2",
                                      "parallel.tensor=2") for arch in ("gpt", "bert")}}


def main(suite, corpus, work, results_path):
    results = {"two": two, "four": four}[suite](Path(corpus), Path(work))
    if dist.get_rank() == 0:
        finite = lambda x: None if x != x or math.isinf(x) else x  # noqa: E731 (NaN/inf are not JSON)
        Path(results_path).write_text(json.dumps(results, indent=1, default=finite))


if __name__ == "__main__":
    main(*sys.argv[1:5])
