"""The `msds` command. Each subcommand lives with the package that owns it and registers itself
through an `add_parser(subparsers)` function; this file only lists them.

Errors that come from bad input (config, data, checkpoints, arguments) are `MsdsError`s or
`ConfigError`s: they are printed as one line, `msds <command>: error: <message>`, with exit code 2,
instead of a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import warnings

from msds.config import ConfigError
from msds.errors import MsdsError

# (module, doc) for every subcommand; modules are imported only when their command runs, so that
# `msds --help` stays fast and a command never pays for another's imports.
SUBCOMMANDS = {
    "import-hf": ("msds.model.hf", "convert a Hugging Face BERT/GPT-2 directory into an msds checkpoint"),
    "export-hf": ("msds.model.hf", "write an msds checkpoint as a Hugging Face directory"),
    "parity": ("msds.model.parity", "check msds against transformers on the real MiniLM BERT checkpoint"),
    "map": ("msds.multilevel.cli", "coalesce / de-coalesce / interpolate checkpoints offline"),
    "data": ("msds.data.cli", "prepare, verify and export tokenized corpora"),
    "plan": ("msds.plan.cli", "check a run config and print its phases, FLOPs and memory per rank, without training"),
    "train": ("msds.train.loop", "train a model, with or without a V-cycle, under DeepSpeed"),
    "convert-checkpoint": ("msds.train.checkpointing",
                           "turn a training checkpoint (any tensor-parallel size) into a TP=1 model checkpoint"),
    "bench": ("msds.bench.cli", "train a baseline and V-cycle variants side by side and report the saving"),
    "report": ("msds.bench.doc_tables", "regenerate the tables of BENCHMARKS.md and README.md from their JSON"),
    "eval": ("msds.eval.cli", "evaluate a model on held-out perplexity, cloze and fine-tuning tasks"),
    "demo": ("msds.demo", "run the main job on its embedded default"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msds", description="Multi-level BERT/GPT pretraining on DeepSpeed.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, doc) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=doc)
            continue
        importlib.import_module(module).add_parser(sub, name, doc)
    return parser


def _without_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher passes --local_rank=N first; msds reads LOCAL_RANK from the environment."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith(("--local_rank", "--local-rank")):
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    # When this command started: before its module's imports (the start-up watchdog of `msds train`
    # counts them), not the process's start, since main may run in a process that began long ago.
    started = time.time()
    # megatron-core warns at import that apex and Transformer Engine are absent; msds does not need them.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    argv = _without_local_rank(list(sys.argv[1:] if argv is None else argv))
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    parser = build_parser(only=command or "")
    args = parser.parse_args(argv)
    args.started = started
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (MsdsError, ConfigError) as exc:
        print(f"msds {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
