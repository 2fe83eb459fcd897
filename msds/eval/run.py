"""`evaluate()`: check every input, then run the tasks on one model and return the JSON record.

Order: the settings, the model directory (msds checkpoint or Hugging Face directory, fully read and
verified), the tasks against the model's architecture, the tokenizer, the sources; only then the
work. The model is written once as a Hugging Face directory in a temporary folder and every task
loads it from there with transformers (`GPT2LMHeadModel`, `BertForMaskedLM`,
`BertForSequenceClassification`), as a user would.
"""
from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from tokenizers import Tokenizer

from msds.config import ModelConfig
from msds.data import indexed
from msds.data.tokenizer import TokenizerInfo
from msds.errors import MsdsError
from msds.eval import examples as ex
from msds.eval.finetune import glue_protocol
from msds.eval.lm import bert_nll, cloze_scores, gpt_nll, sentence_order_scores
from msds.integrity import sha256_file
from msds.model.files import is_model_checkpoint, load_model
from msds.model.hf import read_hf, write_hf

DEFAULT_SEQ_LEN = 128


@dataclass
class EvalSettings:
    """What `msds eval` runs and how (the `eval:` section of a bench config holds the same fields)."""

    tasks: list[str] = field(default_factory=list)
    """Task names: heldout-ppl (GPT, BERT), cloze (GPT), spam and sotu (BERT), sop (BERT with the
    sentence-order head, `model.nsp_head`)."""
    seq_len: Optional[int] = None
    """Tokens per window / classifier input; default min(128, the model's max_positions)."""
    batch_size: int = 16
    """Sequences per forward pass, and the fine-tuning batch size."""
    max_examples: Optional[int] = None
    """At most this many held-out documents per domain, cloze examples and sentence-order pairs,
    the first ones in the fixed order. Default: all."""
    train_examples: int = 500
    """Fine-tuning training examples per task (the first ones in the fixed order)."""
    dev_examples: int = 500
    """Fine-tuning dev examples per task (the first ones in the fixed order)."""
    epochs: int = 3
    """Fine-tuning epochs. Three, as BERT's own GLUE fine-tuning: one epoch (32 steps of 16 on the
    default 500 examples) left prototype-scale BERTs under-trained (docs/evaluation.md, "Why three
    epochs")."""
    lrs: list[float] = field(default_factory=lambda: [1e-4, 3e-4, 1e-3])
    """The fine-tuning learning-rate grid. 1e-3 joined 1e-4 and 3e-4 when prototype-scale BERTs
    scored best at 3e-4, the grid's top, and higher still at 1e-3 (docs/evaluation.md, "The
    learning-rate grid"); a record notes a best rate at the grid's end."""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """Fine-tuning seeds, each run at every learning rate."""


@dataclass(frozen=True)
class Task:
    archs: tuple[str, ...]
    metric: str
    higher_is_better: bool
    scores_lm_head: bool = False
    """Whether the task scores the model's own language-model head (the fine-tuning tasks bring
    their own classifier)."""


TASKS = {
    "heldout-ppl": Task(("gpt", "bert"), "perplexity", False, scores_lm_head=True),
    "cloze": Task(("gpt",), "accuracy", True, scores_lm_head=True),
    "spam": Task(("bert",), "accuracy", True),
    "sotu": Task(("bert",), "accuracy", True),
    "sop": Task(("bert",), "accuracy", True),
}


def _name(path: str, option: str) -> str:
    """How the user spelled a setting: `eval.lrs` in a bench config, `--lrs` on the command line."""
    return f"{path}.{option}" if path else "--" + option.replace("_", "-")


def check_settings(settings: EvalSettings, path: str = "") -> None:
    """Every setting in range and every task known (MsdsError naming the setting)."""
    if not settings.tasks:
        raise MsdsError(f"{_name(path, 'tasks')}: no task given; choose from {', '.join(TASKS)}")
    for task in settings.tasks:
        if task not in TASKS:
            raise MsdsError(f"{_name(path, 'tasks')}: unknown task {task!r}; known: {', '.join(TASKS)}")
    for option in ("seq_len", "batch_size", "max_examples", "train_examples", "dev_examples", "epochs"):
        value = getattr(settings, option)
        if value is not None and value < 1:
            raise MsdsError(f"{_name(path, option)}: must be at least 1, got {value}")
    if not settings.lrs or any(lr <= 0 for lr in settings.lrs):
        raise MsdsError(f"{_name(path, 'lrs')}: expected positive learning rates, got {settings.lrs}")
    if not settings.seeds or len(set(settings.seeds)) != len(settings.seeds):
        raise MsdsError(f"{_name(path, 'seeds')}: expected distinct seeds, got {settings.seeds}")


def check_tasks_fit(tasks: list[str], cfg: ModelConfig, where: str, untrained: list[str] = ()) -> None:
    """Each task fits the model: its architecture, and the heads it scores, which must not be among
    `untrained` (tensors the checkpoint lacked, initialised on loading)."""
    arch = cfg.arch
    for task in tasks:
        if arch not in TASKS[task].archs:
            fitting = [t for t, spec in TASKS.items() if arch in spec.archs]
            raise MsdsError(f"{where}: task {task!r} needs a {' or '.join(a.upper() for a in TASKS[task].archs)} "
                            f"model, this one is {arch.upper()}; its tasks: {', '.join(fitting)}")
        if TASKS[task].scores_lm_head and untrained:
            raise MsdsError(f"{where}: task {task!r} scores the model's language-model head, which the checkpoint "
                            f"lacks ({', '.join(untrained)}): a randomly initialised one would be scored; give a "
                            f"checkpoint with its pretraining head (e.g. BertForPreTraining, BertForMaskedLM), or "
                            f"only fine-tuning tasks ({', '.join(t for t, s in TASKS.items() if not s.scores_lm_head)})")
        if task == "sop" and not cfg.nsp_head:
            raise MsdsError(f"{where}: task 'sop' scores the sentence-order head, which this model does not have; "
                            f"train with data.sentence_order: true and model.nsp_head: true")


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

@dataclass
class EvalModel:
    cfg: ModelConfig
    tensors: dict[str, torch.Tensor]
    record: dict
    untrained: list[str] = field(default_factory=list)
    """Tensors the checkpoint lacked (a Hugging Face BERT without its MLM head), initialised on loading."""


def load_eval_model(model_dir: str | Path) -> EvalModel:
    """An msds model checkpoint or a Hugging Face BERT / GPT-2 directory, read and verified."""
    path = Path(model_dir)
    if not path.is_dir():
        raise MsdsError(f"--model {path}: no such directory")
    if is_model_checkpoint(path):
        cfg, tensors, _ = load_model(path)
        weights = path / "model.safetensors"
        return EvalModel(cfg, tensors, {"path": str(path), "format": "msds", "sha256": sha256_file(weights),
                                        "notes": []})
    if (path / "config.json").is_file():
        notes, untrained = [], []
        try:
            cfg, tensors = read_hf(path, report=notes.append, initialised=untrained)
        except MsdsError:
            raise
        except Exception as exc:  # json and safetensors report damaged files with many types
            raise MsdsError(f"{path}: cannot be read ({exc}); a file is truncated or corrupt") from exc
        return EvalModel(cfg, tensors, {"path": str(path), "format": "huggingface", "notes": notes}, untrained)
    raise MsdsError(f"--model {path}: neither an msds model checkpoint (config.yaml + model.safetensors, "
                    f"what `msds train` writes to <run_dir>/model) nor a Hugging Face directory (config.json)")


def load_tokenizer(tokenizer_path: str | Path | None, model_dir: str | Path) -> tuple[Tokenizer, dict]:
    """The tokenizer: `tokenizer_path` (a prepared corpus, verified against its manifest; a directory
    holding tokenizer.json; or the file), else tokenizer.json in the model directory."""
    if tokenizer_path is None:
        path = Path(model_dir) / indexed.TOKENIZER_FILE
        if not path.is_file():
            raise MsdsError(f"{model_dir}: no {indexed.TOKENIZER_FILE} next to the model; pass --tokenizer DIR, "
                            f"the prepared corpus the model was trained on (the run's data.path)")
    else:
        path = Path(tokenizer_path)
        if (path / indexed.MANIFEST).is_file():
            manifest = indexed.read_manifest(path)
            path = indexed.verify_file(path, manifest["tokenizer"])
        elif path.is_dir():
            path = path / indexed.TOKENIZER_FILE
        if not path.is_file():
            raise MsdsError(f"--tokenizer {tokenizer_path}: no {indexed.TOKENIZER_FILE} there; give a prepared "
                            f"corpus, a directory holding {indexed.TOKENIZER_FILE}, or the file")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library reports malformed files as plain exceptions
        raise MsdsError(f"{path}: not a readable tokenizer ({exc})") from exc
    # Special tokens are added by the tasks themselves; a saved truncation or padding would cut inputs.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer, {"path": str(path), "sha256": sha256_file(path)}


def special_ids(info: TokenizerInfo, arch: str, source: str) -> dict[str, int]:
    needed = {"separator": info.document_separator_id} if arch == "gpt" else \
        {"cls": info.cls_id, "sep": info.sep_id, "mask": info.mask_id, "pad": info.pad_id,
         "separator": info.document_separator_id}
    missing = [name for name, value in needed.items() if value is None]
    if missing:
        raise MsdsError(f"{source}: the tokenizer has no {missing[0]} token, which a {arch.upper()} evaluation "
                        f"needs; use the tokenizer the model was trained with")
    return needed


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------

@dataclass
class Context:
    cfg: ModelConfig
    hf_dir: str
    tokenizer: Tokenizer
    tokenizer_info: TokenizerInfo
    special: dict[str, int]
    settings: EvalSettings
    seq_len: int
    cache_dir: Optional[Path]
    log: Callable[[str], None]

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def lm(self):
        from transformers import BertForMaskedLM, GPT2LMHeadModel

        model_class = GPT2LMHeadModel if self.cfg.arch == "gpt" else BertForMaskedLM
        return model_class.from_pretrained(self.hf_dir).eval()


def _entry(task: str, value: float, n: int, reference: dict, example_set: ex.ExampleSet, **more) -> dict:
    return {"metric": TASKS[task].metric, "higher_is_better": TASKS[task].higher_is_better, "value": value,
            "n": n, "reference": reference, **more, "sources": example_set.sources,
            "examples_sha256": example_set.sha256}


def heldout_ppl(ctx: Context) -> dict:
    documents = ex.heldout_documents(ctx.cache_dir)
    model, domains, used = ctx.lm(), {}, []
    for domain in ex.HELDOUT_DOMAINS:
        texts = [d["text"] for d in documents.examples if d["domain"] == domain][:ctx.settings.max_examples]
        used += [d for d in documents.examples if d["domain"] == domain][:ctx.settings.max_examples]
        ids = ctx.encode(texts)
        if ctx.cfg.arch == "gpt":
            nll, count = gpt_nll(model, ids, ctx.special["separator"], ctx.seq_len, ctx.settings.batch_size)
        else:
            nll, count = bert_nll(model, ids, ctx.special["separator"], ctx.special, ctx.seq_len,
                                  ctx.settings.batch_size)
        domains[domain] = {"value": math.exp(nll / count), "n": count, "documents": len(texts)}
        ctx.log(f"  {domain}: {domains[domain]['value']:.2f} over {count} tokens")
    # Each domain counts the same, whatever its size: the geometric mean of the perplexities.
    value = math.exp(statistics.fmean(math.log(d["value"]) for d in domains.values()))
    reference = {"kind": "uniform model (every vocabulary entry equally likely)", "value": float(ctx.cfg.vocab_size)}
    kind = "perplexity" if ctx.cfg.arch == "gpt" else "masked-LM pseudo-perplexity (fixed 15% masking)"
    return _entry("heldout-ppl", value, sum(d["n"] for d in domains.values()), reference,
                  ex.ExampleSet(documents.name, documents.sources, used), kind=kind, domains=domains)


def cloze(ctx: Context) -> dict:
    examples = ex.cloze_examples(ctx.cache_dir).first(ctx.settings.max_examples)
    contexts = ctx.encode([e["context"] for e in examples.examples])
    targets = ctx.encode([" " + e["target"] for e in examples.examples])
    scores = cloze_scores(ctx.lm(), list(zip(contexts, targets)), ctx.seq_len, ctx.settings.batch_size)
    n = len(scores)
    frequent, count = Counter(e["target"] for e in examples.examples).most_common(1)[0]
    mean_tokens = statistics.fmean(len(t) for t in targets)
    return _entry("cloze", sum(correct for _, correct in scores) / n, n,
                  {"kind": f"always the most frequent target word ({frequent!r})", "value": count / n,
                   "uniform_model_mean_log_likelihood": -mean_tokens * math.log(ctx.cfg.vocab_size)},
                  examples, mean_log_likelihood=statistics.fmean(ll for ll, _ in scores),
                  mean_target_tokens=mean_tokens)


def sop(ctx: Context) -> dict:
    from transformers import BertForPreTraining

    documents = ex.heldout_documents(ctx.cache_dir)
    ids = ctx.encode([d["text"] for d in documents.examples])
    model = BertForPreTraining.from_pretrained(ctx.hf_dir).eval()
    correct, swapped = sentence_order_scores(model, ids, ctx.tokenizer_info, ctx.seq_len, ctx.settings.batch_size,
                                             ctx.settings.max_examples)
    n = len(correct)
    majority = max(sum(swapped), n - sum(swapped)) / n
    return _entry("sop", sum(correct) / n, n, {"kind": "majority order (chance)", "value": majority},
                  documents, kind="sentence-order pairs of the held-out stream, laid out and masked as in training")


def _classification(task: str, examples: ex.ExampleSet, ctx: Context) -> dict:
    train = [e for e in examples.examples if e["split"] == "train"][:ctx.settings.train_examples]
    dev = [e for e in examples.examples if e["split"] == "dev"][:ctx.settings.dev_examples]
    used = ex.ExampleSet(examples.name, examples.sources, train + dev)

    def encoded(rows):
        return [(ids[:ctx.seq_len - 2], e["label"]) for ids, e in zip(ctx.encode([e["text"] for e in rows]), rows)]

    majority = Counter(e["label"] for e in train).most_common(1)[0][0]
    reference = {"kind": f"majority class of the training examples (label {majority})",
                 "value": sum(e["label"] == majority for e in dev) / len(dev)}
    labels = 1 + max(e["label"] for e in examples.examples)
    result = glue_protocol(ctx.hf_dir, encoded(train), encoded(dev), ctx.special, labels, ctx.settings.lrs,
                           ctx.settings.seeds, ctx.settings.epochs, ctx.settings.batch_size, ctx.log)
    return _entry(task, result["value"], len(dev), reference, used, n_train=len(train), best_lr=result["best_lr"],
                  best_lr_at_edge=result["best_lr_at_edge"],
                  per_seed=result["per_lr"][f"{result['best_lr']:g}"]["per_seed"], per_lr=result["per_lr"])


RUNNERS = {
    "heldout-ppl": heldout_ppl,
    "cloze": cloze,
    "spam": lambda ctx: _classification("spam", ex.spam_examples(ctx.cache_dir), ctx),
    "sotu": lambda ctx: _classification("sotu", ex.sotu_examples(ctx.cache_dir), ctx),
    "sop": sop,
}
TASK_SOURCES = {"spam": ex.SPAM_ASSASSIN, "sotu": ex.SOTU}


def evaluate(model_dir: str | Path, settings: EvalSettings, tokenizer_path: str | Path | None = None,
             cache_dir: str | Path | None = None, log: Callable[[str], None] = print) -> dict:
    """Check everything, then run `settings.tasks` on the model; the JSON-serialisable record."""
    check_settings(settings)
    model = load_eval_model(model_dir)
    cfg = model.cfg
    check_tasks_fit(settings.tasks, cfg, "--tasks", model.untrained)
    tokenizer, tokenizer_record = load_tokenizer(tokenizer_path, model_dir)
    info = TokenizerInfo.of(tokenizer)
    if info.vocab_size > cfg.vocab_size:
        raise MsdsError(f"{tokenizer_record['path']}: {info.vocab_size} tokens, more than the model's vocabulary "
                        f"of {cfg.vocab_size}; this is not the tokenizer the model was trained with")
    special = special_ids(info, cfg.arch, tokenizer_record["path"])
    seq_len = settings.seq_len or min(DEFAULT_SEQ_LEN, cfg.max_positions)
    if seq_len > cfg.max_positions:
        raise MsdsError(f"--seq-len {seq_len}: longer than the model's {cfg.max_positions} positions")
    cache = Path(cache_dir) if cache_dir is not None else None
    for task in settings.tasks:
        if task in TASK_SOURCES:
            ex.check_source_available(TASK_SOURCES[task], cache)
    record = {"model": {**model.record, "arch": cfg.arch, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
                        "vocab_size": cfg.vocab_size},
              "tokenizer": tokenizer_record, "settings": {**asdict(settings), "seq_len": seq_len}, "tasks": {}}
    from transformers.utils import logging as hf_logging

    # The fresh classifier head is expected; transformers' warning about it would only be noise.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="msds-eval-") as scratch:
        hf_dir = str(write_hf(Path(scratch) / "hf", cfg, model.tensors))
        ctx = Context(cfg, hf_dir, tokenizer, info, special, settings, seq_len, cache, log)
        for task in settings.tasks:
            log(f"eval: {task}")
            start = time.perf_counter()
            entry = RUNNERS[task](ctx)
            entry["seconds"] = time.perf_counter() - start
            record["tasks"][task] = entry
            log(f"eval: {task} {entry['metric']} {entry['value']:.4f} (n {entry['n']}; reference "
                f"{entry['reference']['value']:.4f}) in {entry['seconds']:.0f} s")
    return json.loads(json.dumps(record))
