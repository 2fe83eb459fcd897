"""`msds demo` (what `make demo` runs): the main job on its embedded default.

Until the benchmark harness lands, the largest finished piece is the Hugging Face parity check on
the real all-MiniLM-L6-v2 BERT checkpoint, so that is what the demo runs, and it says so.
"""
from __future__ import annotations


def _run(args) -> int:
    from msds.model import parity

    print("msds demo: the V-cycle benchmark is not built yet; running the largest finished piece,")
    print("the Hugging Face parity check on the real all-MiniLM-L6-v2 checkpoint (msds parity).")
    return parity._run(args)


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=doc)
    parser.set_defaults(run=_run)
