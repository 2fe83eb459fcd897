"""Data pipeline throughput on this machine: prepare time, tokenization tokens/s, loader samples/s.

    nice .venv/bin/python benchmarks/data_throughput.py [--cache-dir DIR] [--work-dir DIR] [--seconds S]

Uses the real default corpus (downloaded into the cache on first use). Tokenization is timed on
the whole corpus through the same worker processes `msds data prepare` streams through (--num-proc
workers, `encoded_batches`); the loader is timed on `train_batches` (micro-batch 32, seq 128), which is what the
trainer iterates. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from msds.data import train_batches
from msds.data.prepare import encoded_batches, prepare, resolve_inputs
from msds.data.sources import default_cache_dir
from msds.data.tokenizer import build_tokenizer, parse_tokenizer_name


def measure_loader(data_dir: Path, arch: str, seq_len: int, micro_batch: int,
                   seconds: float) -> tuple[float, float]:
    """(seconds until the first batch, including file verification; samples per second after)."""
    start = time.perf_counter()
    batches = train_batches(data_dir, arch, seq_len, micro_batch, seed=0, dp_rank=0, dp_size=1)
    next(batches)
    first = time.perf_counter() - start
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(batches)
        count += micro_batch
    return first, count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--work-dir", type=Path, help="where the corpus is prepared (default: a temp dir)")
    parser.add_argument("--num-proc", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--seconds", type=float, default=5.0, help="loader measurement time per case")
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="msds-data-bench-"))
    out = work / "bpe-8192"
    shutil.rmtree(out, ignore_errors=True)

    # A first run fills the archive cache, so the timed run measures preparation, not downloads.
    prepare("bpe-8192", out, cache_dir=args.cache_dir, num_proc=args.num_proc, log=lambda _: None)
    shutil.rmtree(out)
    start = time.perf_counter()
    prepare("bpe-8192", out, cache_dir=args.cache_dir, num_proc=args.num_proc, log=lambda _: None)
    prepare_seconds = time.perf_counter() - start

    _, load_sources, _ = resolve_inputs(None, None, "text", args.cache_dir)
    records = load_sources()
    texts = [doc.text for record in records for doc in record.read(record.skipped)]
    characters = sum(map(len, texts))
    print(f"cpu cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}, tokenizer workers: "
          f"{args.num_proc}, corpus: {len(texts)} documents, {characters / 1e6:.1f} M characters\n")
    print(f"`msds data prepare --tokenizer bpe-8192` (default corpus, archives cached): {prepare_seconds:.1f} s\n")
    print("| tokenizer | tokens | seconds | tokens/s | M characters/s |")
    print("|---|---:|---:|---:|---:|")
    for name in ("bpe-8192", "bert", "gpt2"):
        tokenizer = (Tokenizer.from_file(str(out / "tokenizer.json")) if name == "bpe-8192"
                     else build_tokenizer(parse_tokenizer_name(name), [], args.cache_dir))
        dtype = np.dtype(np.uint16 if tokenizer.get_vocab_size() < 2**16 else np.uint32)
        start = time.perf_counter()
        tokens = sum(len(batch[2]) for batch in encoded_batches(records, tokenizer, dtype, args.num_proc))
        seconds = time.perf_counter() - start
        print(f"| {name} | {tokens:,} | {seconds:.1f} | {tokens / seconds:,.0f} | "
              f"{characters / seconds / 1e6:.2f} |")

    print("\n| loader (train_batches) | seq_len | micro-batch | first batch incl. size checks (s) | samples/s |")
    print("|---|---:|---:|---:|---:|")
    for arch in ("gpt", "bert"):
        first, rate = measure_loader(out, arch, 128, 32, args.seconds)
        print(f"| {arch} | 128 | 32 | {first:.3f} | {rate:,.0f} |")
    if args.work_dir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
