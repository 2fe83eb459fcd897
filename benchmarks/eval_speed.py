"""Wall-clock of `msds eval` with its default settings on the prototype scale (docs/evaluation.md):

- the GPT tasks (heldout-ppl, cloze) on a 6-layer, 256-wide GPT (8 heads, FFN 1024, 128 positions,
  vocabulary 8192: recipes/bench/prototype-sweep-gpt.yaml's model); target <= 3 minutes on 2 cores;
- the BERT fine-tuning suite (spam, sotu: 2 learning rates x 3 seeds each) on a BERT of the same
  shape; target <= 15 minutes on 2 cores.

The timing does not depend on the weights, so without --gpt / --bert the models are freshly
initialised ones of that shape. The example sets are built (and cached) before the clock starts.
Run:

    msds data prepare --tokenizer bpe-8192 --out data/default-bpe-8192
    nice .venv/bin/python benchmarks/eval_speed.py [--data data/default-bpe-8192] [--gpt DIR] [--bert DIR]
        [--threads 2] [--out eval_speed.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from msds.config import model_config
from msds.distributed import init_distributed
from msds.eval import examples
from msds.eval.run import EvalSettings, evaluate
from msds.model.files import model_tensors, save_model
from msds.model.transformer import Transformer

SHAPE = dict(vocab_size=8192, hidden_size=256, num_layers=6, num_heads=8, ffn_size=1024, max_positions=128)
TARGETS = {"gpt": 180.0, "bert": 900.0}
SUITES = {"gpt": ["heldout-ppl", "cloze"], "bert": ["spam", "sotu"]}


def fresh_model(arch: str, directory: Path) -> Path:
    preset = "gpt-small" if arch == "gpt" else "bert-small"
    cfg = model_config(preset, **SHAPE)
    return save_model(directory / f"fresh-{arch}", cfg, model_tensors(Transformer(cfg, seed=0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/default-bpe-8192", help="prepared corpus (its tokenizer)")
    parser.add_argument("--gpt", help="a 6x256 GPT model directory (default: freshly initialised)")
    parser.add_argument("--bert", help="a 6x256 BERT model directory (default: freshly initialised)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=list(SUITES), help="time one suite")
    parser.add_argument("--out", help="write the timings and both records as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    init_distributed()
    for build in (examples.heldout_documents, examples.cloze_examples, examples.spam_examples, examples.sotu_examples):
        build()
    report = {"threads": args.threads, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as scratch:
        for arch, tasks in SUITES.items():
            if args.only and arch != args.only:
                continue
            model = getattr(args, arch) or fresh_model(arch, Path(scratch))
            start = time.perf_counter()
            record = evaluate(model, EvalSettings(tasks=tasks), args.data)
            seconds = time.perf_counter() - start
            report[arch] = {"seconds": seconds, "target_seconds": TARGETS[arch],
                            "per_task_seconds": {t: e["seconds"] for t, e in record["tasks"].items()},
                            "record": record}
            print(f"{arch}: {', '.join(tasks)} in {seconds:.0f} s (target {TARGETS[arch]:.0f} s): "
                  + ", ".join(f"{t} {e['seconds']:.0f} s" for t, e in record["tasks"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
