"""A whole BERT-Large level transition on one GPU, next to a BERT-Large training step.

    python benchmarks/transition_gpu.py [--json out.json]

The transition is the operator work msds/train/transition.py streams on each rank between reading
the engine's fp32 weights and Adam moments and building the next engine: coalesce the parameters
and both moments a coalescing group at a time (down), and de-coalesce + interpolate them with the
saved large state a small tensor at a time (up), for the level hidden/2, heads/2, FFN/2, layers/2
(BERT-Large 24L/1024H -> 12L/512H); the ZeRO gathers around it are not included. It runs twice: on
CUDA tensors (the fused Triton kernels: tensor_ops' default backend `auto` picks them there) and on
the same tensors in host memory (the PyTorch path a CPU run takes). benchmarks/gpu_check.py reuses
it.

The training step is Hugging Face's BertForMaskedLM with BERT-Large's shapes, bf16 autocast,
fused AdamW, at BERT's phase-1 shape (micro-batch 64 x 128 tokens) - the step a V-cycle phase
repeats hundreds of times between two transitions. It needs only torch and transformers, so the
script runs where DeepSpeed and megatron-core are not installed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msds.config import model_config  # noqa: E402
from msds.model.roles import expected_shapes  # noqa: E402
from msds.multilevel.operators import (coalesce, coalesce_groups, decoalesce_interpolate,  # noqa: E402
                                       decoalesced_names, plan_level)

KINDS = ("param", "exp_avg", "exp_avg_sq")


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs after one warm-up."""
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transition_seconds(device: str, repeats: int, cfg=None, backend: str = "auto") -> dict:
    """Median seconds of the down and the up pass over the weights and both moments of `cfg`
    (BERT-Large by default), streamed as msds/train/transition.py streams them."""
    cfg = cfg or model_config("bert-large")
    level = plan_level(cfg, hidden=2, heads=2, ffn=2, layers=2)
    gen = torch.Generator().manual_seed(0)
    large = {kind: {n: torch.randn(s, generator=gen).abs().to(device) for n, s in expected_shapes(cfg).items()}
             for kind in KINDS}
    small = {kind: coalesce(large[kind], level, kind=kind, backend=backend) for kind in KINDS}
    groups = coalesce_groups(large["param"], level)

    def down():
        for group in groups:
            for kind in KINDS:
                coalesce({n: large[kind][n] for n in group}, level, kind=kind, backend=backend)

    def up():
        for name in small["param"]:
            targets = decoalesced_names(name, level)
            for kind in KINDS:
                decoalesce_interpolate({name: small[kind][name]}, {n: large[kind][n] for n in targets}, level,
                                       0.5, kind=kind, backend=backend)

    numel = sum(t.numel() for t in large["param"].values())
    return {"device": device, "parameters": numel, "down_s": timed(down, device, repeats),
            "up_s": timed(up, device, repeats)}


def bert_large_step_seconds(micro_batch: int, seq_len: int, repeats: int) -> float:
    return hf_bert_step_seconds(micro_batch, seq_len, repeats, gpu=True)


def hf_bert_step_seconds(micro_batch: int, seq_len: int, repeats: int, gpu: bool, compiled: bool = False) -> float:
    """Median seconds of a Hugging Face BertForMaskedLM step with AdamW: BERT-Large, bf16 autocast
    and fused AdamW on a GPU; a 2-layer width-64 model in fp32 on the CPU. `compiled`: the model
    torch.compile'd (inductor on a GPU, the "eager" backend on the CPU)."""
    import transformers

    device = "cuda" if gpu else "cpu"
    sizes = (dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096) if gpu else
             dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256))
    config = transformers.BertConfig(**sizes, attn_implementation="sdpa")
    model = transformers.BertForMaskedLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=gpu)
    forward = torch.compile(model, backend="inductor" if gpu else "eager") if compiled else model
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
    labels = torch.where(torch.rand(ids.shape, device=device) < 0.15, ids, torch.full_like(ids, -100))

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
            loss = forward(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    return timed(step, device, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("transition_gpu.py needs a CUDA GPU")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": transition_seconds("cuda", repeats=5), "cpu": transition_seconds("cpu", repeats=1)}
    step = bert_large_step_seconds(args.micro_batch, args.seq_len, repeats=10)
    results["bert_large_step_s"] = step
    results["step_shape"] = [args.micro_batch, args.seq_len]
    cuda = results["cuda"]
    results["transition_pair_in_steps"] = (cuda["down_s"] + cuda["up_s"]) / step
    print(json.dumps(results, indent=1))
    print(f"\nBERT-Large transition on {results['gpu']}: down {cuda['down_s'] * 1e3:.1f} ms, up "
          f"{cuda['up_s'] * 1e3:.1f} ms (host: {results['cpu']['down_s']:.2f} s / {results['cpu']['up_s']:.2f} s); "
          f"training step {step * 1e3:.1f} ms: a down+up pair costs {results['transition_pair_in_steps']:.2f} steps")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
