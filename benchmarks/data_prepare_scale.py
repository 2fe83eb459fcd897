"""Streaming `msds data prepare` at scale: peak memory of the whole process tree and MB/s per core,
next to Megatron-LM's tools/preprocess_data.py on the same file.

    nice -n 10 .venv/bin/python benchmarks/data_prepare_scale.py --work-dir DIR [--gb 1]
        [--megatron-lm PATH [--megatron-only]]

Generates a JSONL of GB gigabytes (synthetic documents of Zipf-distributed pseudo-words in
sentences, 0.5-16 KB each), then runs `msds data prepare --jsonl FILE --tokenizer gpt2 --num-proc N`
as a child process and samples, every 0.2 s from this process, the RSS and the PSS (shared pages
counted once) of it and all its descendants. With --megatron-lm (a Megatron-LM source tree whose
tools/preprocess_data.py runs with this Python; PYTHONPATH is passed through) the same file is
preprocessed by it with the same GPT-2 tokenizer (its HuggingFaceTokenizer on msds's tokenizer.json)
and the same worker count, measured the same way. CPU seconds are the children's user + system
time (getrusage), so MB per CPU-second is the throughput per busy core on a shared machine.
Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]


def generate(path: Path, gigabytes: float, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(30000)])
    target, written = int(gigabytes * 1e9), 0
    with open(path, "w") as handle:
        while written < target:
            words = vocabulary[np.minimum(rng.zipf(1.3, rng.integers(80, 2500)), len(vocabulary)) - 1]
            words[::12] = np.char.capitalize(words[::12])
            words[11::12] = np.char.add(words[11::12], ".")
            text = " ".join(words)
            line = json.dumps({"text": text}) + "\n"
            handle.write(line)
            written += len(line)


def tree_memory(process: psutil.Process) -> tuple[int, int]:
    """(RSS, PSS) summed over a process and its descendants."""
    rss = pss = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            info = member.memory_full_info()
            rss, pss = rss + info.rss, pss + info.pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return rss, pss


def measure(command: list[str], log: Path, env: dict | None = None) -> dict:
    """Run `command` (its output, progress bars included, into `log`: a pipe nobody reads while it
    runs would fill and stop it) and sample its process tree's memory until it ends."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "w") as output:
        child = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    process, peak_rss, peak_pss = psutil.Process(child.pid), 0, 0
    while child.poll() is None:
        try:
            rss, pss = tree_memory(process)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    if child.wait():
        raise SystemExit(f"{' '.join(command)} failed:\n{log.read_text()[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": cpu, "peak_rss": peak_rss, "peak_pss": peak_pss}


def megatron_tokenizer_dir(msds_out: Path, work: Path) -> Path:
    """msds's GPT-2 tokenizer.json in a folder transformers' AutoTokenizer loads."""
    folder = work / "gpt2-tokenizer"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_bytes((msds_out / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 10**9}))
    return folder


def row(name: str, size: int, result: dict, cores: int, tokens: int) -> str:
    mb = size / 1e6
    return (f"| {name} | {result['seconds']:.0f} | {mb / result['seconds']:.2f} | "
            f"{mb / result['seconds'] / cores:.2f} | {mb / result['cpu_seconds']:.2f} | "
            f"{result['peak_rss'] / 2**20:.0f} | {result['peak_pss'] / 2**20:.0f} | {tokens:,} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--gb", type=float, default=1.0, help="size of the generated JSONL (default: 1)")
    parser.add_argument("--num-proc", type=int, default=2, help="tokenizer workers of both tools")
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM source tree (tools/preprocess_data.py)")
    parser.add_argument("--megatron-only", action="store_true",
                        help="measure only Megatron-LM, on the file and with the tokenizer of an earlier run in "
                             "--work-dir (its msds-gpt2 output)")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    jsonl = args.work_dir / f"synthetic-{args.gb:g}gb.jsonl"
    if not jsonl.exists():
        generate(jsonl, args.gb)
    size, cores = jsonl.stat().st_size, min(args.num_proc, os.cpu_count() or 1)
    out = args.work_dir / "msds-gpt2"
    lines = [f"{size / 1e6:,.0f} MB JSONL, {args.num_proc} tokenizer workers, {os.cpu_count()} CPU cores",
             "| tool | wall s | MB/s | MB/s per core (wall) | MB per CPU-second | peak tree RSS MiB | "
             "peak tree PSS MiB | tokens |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    if args.megatron_only:
        if not (args.megatron_lm and (out / "manifest.json").is_file()):
            raise SystemExit(f"--megatron-only needs --megatron-lm and an earlier run's {out}")
    else:
        shutil.rmtree(out, ignore_errors=True)  # else prepare finds it up to date and does nothing
        ours = measure([sys.executable, "-m", "msds.cli", "data", "prepare", "--jsonl", str(jsonl), "--tokenizer",
                        "gpt2", "--out", str(out), "--num-proc", str(args.num_proc)], args.work_dir / "msds.log")
        splits = json.loads((out / "manifest.json").read_text())["splits"]
        lines.append(row("msds data prepare (gpt2)", size, ours, cores,
                         sum(splits[s]["tokens"] for s in ("train", "valid", "test"))))
    if args.megatron_lm:
        prefix = args.work_dir / "megatron"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(args.megatron_lm),
                                                                         os.environ.get("PYTHONPATH")]))}
        theirs = measure([sys.executable, str(args.megatron_lm / "tools" / "preprocess_data.py"), "--input",
                          str(jsonl), "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", str(megatron_tokenizer_dir(out, args.work_dir)),
                          "--workers", str(args.num_proc), "--append-eod"], args.work_dir / "megatron.log", env)
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        dataset = IndexedDataset(f"{prefix}_text_document")  # alive while its mapped index is read
        tokens = int(dataset.sequence_lengths.sum())
        lines.append(row("Megatron-LM tools/preprocess_data.py", size, theirs, cores, tokens))
    lines.append(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
