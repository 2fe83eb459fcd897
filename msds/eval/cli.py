"""`msds eval`: registered with the top-level CLI through `add_parser`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from msds.errors import MsdsError

DESCRIPTION = """Evaluate a model on downstream tasks, offline, from pinned registry archives (docs/evaluation.md).

tasks: heldout-ppl (GPT perplexity / BERT masked-LM pseudo-perplexity on held-out Wikipedia, Moby
Dick and Shakespeare text), cloze (GPT: last-word prediction), spam and sotu (BERT: fine-tuning on
SpamAssassin spam-vs-ham and State of the Union era, learning-rate grid x seeds, median dev accuracy
of the best learning rate), sop (BERT with the sentence-order head: accuracy on held-out pairs)."""


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            return [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
    return parse


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="msds model checkpoint (<run_dir>/model) or Hugging Face BERT / GPT-2 directory")
    parser.add_argument("--tasks", required=True, metavar="NAME[,NAME...]", help="heldout-ppl, cloze, spam, sotu, sop")
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where the results are written")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="the model's tokenizer: the prepared corpus it was trained on (the run's data.path), "
                             "a directory holding tokenizer.json, or the file (default: tokenizer.json in --model)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="archives and built example sets (default: $MSDS_CACHE or ~/.cache/msds/sources)")
    parser.add_argument("--seq-len", type=int, metavar="N", help="window / input length (default: min(128, positions))")
    parser.add_argument("--batch-size", type=int, metavar="N", help="sequences per batch (default: 16)")
    parser.add_argument("--max-examples", type=int, metavar="N",
                        help="at most N held-out documents per domain and N cloze examples (default: all)")
    parser.add_argument("--train-examples", type=int, metavar="N", help="fine-tuning examples per task (default: 500)")
    parser.add_argument("--dev-examples", type=int, metavar="N",
                        help="fine-tuning dev examples per task (default: 500)")
    parser.add_argument("--epochs", type=int, metavar="N", help="fine-tuning epochs (default: 3)")
    parser.add_argument("--lrs", type=_numbers(float), metavar="LR[,LR...]", help="fine-tuning learning rates")
    parser.add_argument("--seeds", type=_numbers(int), metavar="S[,S...]", help="fine-tuning seeds (default: 1,2,3)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from msds.eval.run import EvalSettings, evaluate

    options = ("seq_len", "batch_size", "max_examples", "train_examples", "dev_examples", "epochs", "lrs", "seeds")
    chosen = {key: getattr(args, key) for key in options if getattr(args, key) is not None}
    settings = EvalSettings(tasks=[t.strip() for t in args.tasks.split(",") if t.strip()], **chosen)
    out = Path(args.out)
    if out.is_dir():
        raise MsdsError(f"--out {out}: is a directory; give a file name such as {out / 'eval.json'}")
    record = evaluate(args.model, settings, args.tokenizer, args.cache_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0
