"""The new model a transition builds before DeepSpeed wraps it, timed on the CPU with its weights
drawn and then overwritten (as before issue 59's change) and with them not drawn
(msds.train.engine.weights_not_drawn, what msds.train.engine.build_engine does now): model
construction, and construction plus the copy of the transition's tensors (msds.train.engine._fill).
Wall and process CPU time (user + system; the wall time of a shared machine is noisy), repetitions
interleaved.

    .venv/bin/python benchmarks/transition_build.py [--repeats 4] [--hidden 768 --layers 12]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path.home() / ".cache" / "msds" / "test-data" / "default-bpe-1024"))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from msds.config import load_run_config
    from msds.distributed import init_distributed
    from msds.model.pipeline import named_parameters
    from msds.model.transformer import Transformer
    from msds.train.engine import weights_not_drawn
    from msds.plan import build_plan
    from msds.train.engine import _fill

    init_distributed()
    cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml", [
        f"data.path={args.data}", "run_dir=unused", f"model.hidden_size={args.hidden}",
        f"model.num_heads={args.hidden // 64}", f"model.num_layers={args.layers}", f"model.ffn_size={4 * args.hidden}"])
    plan = build_plan(cfg)
    torch.manual_seed(0)
    reference = Transformer(plan.model(1), padded_vocab_size=plan.padded_vocab_size)
    tensors = {name: p.detach().clone() for name, p in named_parameters(reference)}
    print(f"{sum(t.numel() for t in tensors.values()):,} parameters")
    del reference
    for _ in range(args.repeats):
        for mode, context in (("drawn", contextlib.nullcontext), ("not drawn", weights_not_drawn)):
            wall, cpu = time.perf_counter(), _cpu_seconds()
            with context():
                model = Transformer(plan.model(1), padded_vocab_size=plan.padded_vocab_size)
            built = time.perf_counter() - wall, _cpu_seconds() - cpu
            _fill(model, tensors.items(), False)
            filled = time.perf_counter() - wall, _cpu_seconds() - cpu
            print(f"{mode:>9}: construct {built[0]:.2f} s wall / {built[1]:.2f} s CPU, with the copy "
                  f"{filled[0]:.2f} s wall / {filled[1]:.2f} s CPU", flush=True)
            del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
