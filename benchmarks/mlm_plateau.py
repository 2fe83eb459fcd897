"""Where a masked LM sits when it has learned only the token frequencies, and whether Hugging Face's
own BERT leaves that plateau on msds's batches (docs/experiments/2026-11-30-tuned-baseline-gpt.md).

- The unigram reference: the cross-entropy of the validation targets (msds's masked-LM samples,
  the evaluation batches `msds train` uses) under a unigram fitted on the targets of 200 training
  batches (add-0.5 smoothing). A masked LM at this loss uses no context.
- With --steps N: a freshly initialised `transformers.BertForMaskedLM` (post-LN, the shape given)
  trained N steps on the same training batches with torch's AdamW (weight decay 0.01 on matrices,
  linear warmup over 5% of the steps, cosine to 10%, gradient clipping 1.0), the validation loss every
  32 steps. If it stays at the unigram reference as msds's BERT does, the plateau is the regime,
  not msds.

    msds data prepare --tokenizer bpe-8192 --out data/default-bpe-8192
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mlm_plateau.py --data data/default-bpe-8192 --seq 128 \\
        [--steps 480 --lr 2e-3 --layers 6 --hidden 256]
"""
from __future__ import annotations

import argparse
import collections
import math
import time

import torch

from msds.data import eval_batches, load_tokenizer_info, train_batches

MICRO_BATCH = 32
EVAL_BATCHES = 12
UNIGRAM_BATCHES = 200


def targets(batch: dict) -> list[int]:
    labels = batch["labels"]
    return labels[labels >= 0].tolist()


def unigram_cross_entropy(data: str, seq: int, vocab: int, validation: list[dict]) -> float:
    counts = collections.Counter()
    for _, batch in zip(range(UNIGRAM_BATCHES), train_batches(data, "bert", seq, MICRO_BATCH, 99, 0, 1)):
        counts.update(targets(batch))
    total = sum(counts.values())
    losses = [-math.log((counts[t] + 0.5) / (total + 0.5 * vocab)) for batch in validation for t in targets(batch)]
    return sum(losses) / len(losses)


def train_hf(args, vocab: int, validation: list[dict]) -> None:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(args.seed)
    model = BertForMaskedLM(BertConfig(
        vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32, intermediate_size=4 * args.hidden, max_position_embeddings=args.seq,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.01}, {"params": others, "weight_decay": 0.0}],
                                  lr=args.lr)
    warmup = max(1, args.steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    batches = train_batches(args.data, "bert", args.seq, MICRO_BATCH, args.seed, 0, 1)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = model(**next(batches)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 32 == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                val = sum(model(**batch).loss.item() for batch in validation) / len(validation)
            model.train()
            print(f"step {step}: train loss {loss.item():.4f}, validation loss {val:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/default-bpe-8192", help="a prepared corpus (msds data prepare)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234, help="initial weights, data order and validation batches")
    parser.add_argument("--steps", type=int, default=0, help="also train Hugging Face's BERT this many steps")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256, help="a multiple of 32 (heads of 32)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    vocab = load_tokenizer_info(args.data).vocab_size
    validation = eval_batches(args.data, "valid", "bert", args.seq, MICRO_BATCH, EVAL_BATCHES, seed=args.seed)
    print(f"{args.data}, seq {args.seq}: unigram cross-entropy of the validation targets "
          f"{unigram_cross_entropy(args.data, args.seq, vocab, validation):.4f}", flush=True)
    if args.steps:
        train_hf(args, vocab, validation)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
