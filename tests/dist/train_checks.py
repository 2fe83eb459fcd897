"""Two-process (gloo) training checks, run by tests/test_train.py as one torchrun launch:

    torchrun --nproc_per_node 2 tests/dist/train_checks.py CORPUS_DIR WORK_DIR RESULTS_JSON

Every check trains in this one process group, so the launch cost is paid once. Rank 0 writes the
run summaries and per-step losses to RESULTS_JSON; tests/test_train.py asserts on them.
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


def main(corpus, work, results_path):
    corpus, work = Path(corpus), Path(work)
    results = {}
    for arch in ("gpt", "bert"):
        for stage in (1, 2, 3):
            results[f"{arch}-zero{stage}"] = run(f"{arch}-zero{stage}", arch, corpus, work,
                                                 f"training.zero_stage={stage}", "checkpoint.at_transitions=true")
    ltd = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    ltd["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
        "model_type": "decoder", "random_ltd_schedule": {
            "min_value": 16, "max_value": 32, "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 20, "seq_per_step": 4}}}}}
    if dist.get_rank() == 0:
        (work / "zero2-random-ltd.json").write_text(json.dumps(ltd))
    dist.barrier()
    results["gpt-zero2-random-ltd"] = run("gpt-zero2-random-ltd", "gpt", corpus, work, "training.zero_stage=2",
                                          f"training.ds_config={work / 'zero2-random-ltd.json'}")
    results["gpt-alpha0"] = run("gpt-alpha0", "gpt", corpus, work, "training.zero_stage=2", "multilevel.alpha=0.0")
    for stage in (1, 3):   # stop right after the second transition (step 12), then resume
        name = f"gpt-zero{stage}-resumed"
        first = run(name, "gpt", corpus, work, f"training.zero_stage={stage}", "checkpoint.at_transitions=true",
                    "training.exit_after_steps=12")
        second = run(name, "gpt", corpus, work, f"training.zero_stage={stage}", "checkpoint.at_transitions=true")
        results[name] = {"first": first, "second": second}
    # Tensor parallelism last: it re-creates megatron's parallel state for TP=2 (data parallel 1).
    exact = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0", "parallel.tensor=2"]
    for arch in ("gpt", "bert"):
        results[f"{arch}-tp2"] = run(f"{arch}-tp2", arch, corpus, work, *exact, "checkpoint.at_transitions=true")
    first = run("gpt-tp2-resumed", "gpt", corpus, work, *exact, "checkpoint.at_transitions=true",
                "training.exit_after_steps=12")
    second = run("gpt-tp2-resumed", "gpt", corpus, work, *exact, "checkpoint.at_transitions=true")
    results["gpt-tp2-resumed"] = {"first": first, "second": second}
    if dist.get_rank() == 0:
        Path(results_path).write_text(json.dumps(results, indent=1, default=lambda x: None if x != x or math.isinf(x) else x))


if __name__ == "__main__":
    main(*sys.argv[1:4])
