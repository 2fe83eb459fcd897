"""One forward + backward + AdamW step: msds vs Hugging Face transformers, same shapes and weights.

    .venv/bin/python benchmarks/step_time.py [--steps 20] [--threads 2]

Both models hold the same weights (copied through msds's HF export) and run in the same process,
alternating step by step so that machine noise hits both alike. Prints the median step time of each
and the ratio msds / HF (target: at most 1.0).
"""
import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402

from msds.model.files import model_tensors  # noqa: E402
from msds.config import model_config  # noqa: E402
from msds.distributed import init_distributed  # noqa: E402
from msds.model.hf import bert_to_hf, config_to_hf, gpt_to_hf  # noqa: E402
from msds.model.transformer import Transformer  # noqa: E402

CONFIGS = {
    "bert (4L/256H/4 heads, seq 128, batch 16)": (
        dict(arch="bert", vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4,
             max_positions=128, norm_eps=1e-12, activation="gelu"), 16, 128),
    "gpt (6L/256H/8 heads, seq 128, batch 16)": (
        dict(arch="gpt", vocab_size=8192, hidden_size=256, num_layers=6, num_heads=8,
             max_positions=128, norm_eps=1e-5, activation="gelu_tanh"), 16, 128),
}


def build_pair(fields):
    cfg = model_config(**fields)
    torch.manual_seed(0)
    ours = Transformer(cfg)
    hf_cfg = config_to_hf(cfg)
    if cfg.arch == "bert":
        theirs = transformers.BertForMaskedLM(transformers.BertConfig(**hf_cfg, attn_implementation="sdpa"))
        theirs.load_state_dict(bert_to_hf(model_tensors(ours), cfg), strict=False)
    else:
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_cfg, attn_implementation="sdpa"))
        theirs.load_state_dict(gpt_to_hf(model_tensors(ours), cfg), strict=False)
    return cfg, ours.train(), theirs.train()


def step_fns(cfg, ours, theirs, batch, seq):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    if cfg.arch == "bert":
        labels[torch.rand(ids.shape, generator=g) > 0.15] = -100
        ours_labels, hf_labels = labels, labels
    else:
        ours_labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
        hf_labels = ids
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)

    def step_ours():
        opt_ours.zero_grad(set_to_none=True)
        ours(ids, labels=ours_labels).backward()
        opt_ours.step()

    def step_theirs():
        opt_theirs.zero_grad(set_to_none=True)
        theirs(ids, labels=hf_labels).loss.backward()
        opt_theirs.step()

    return step_ours, step_theirs


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    init_distributed()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {args.threads}")
    print("| configuration | msds step (ms) | HF step (ms) | msds / HF |")
    print("|---|---|---|---|")
    for name, (fields, batch, seq) in CONFIGS.items():
        cfg, ours, theirs = build_pair(fields)
        step_ours, step_theirs = step_fns(cfg, ours, theirs, batch, seq)
        for _ in range(3):  # warm-up: allocator, lazy init
            step_ours(), step_theirs()
        times_ours, times_theirs = [], []
        for _ in range(args.steps):
            times_ours.append(timed(step_ours))
            times_theirs.append(timed(step_theirs))
        a, b = statistics.median(times_ours), statistics.median(times_theirs)
        print(f"| {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
