"""Language-model scores through Hugging Face models: GPT perplexity, BERT masked-LM pseudo-perplexity
and cloze (last-word) scoring. Inputs are token ids; outputs are sums, so callers pool them.

- GPT perplexity: the documents back to back, each ended by the document separator (as in the
  training token files), cut into windows of seq_len + 1 tokens that overlap by one token; each
  window's first token is context only, every later token is predicted once.
- BERT pseudo-perplexity: the same stream cut into windows of seq_len - 2 tokens laid out as
  [CLS] window [SEP]; a fixed 15% of each window's positions (at least one), chosen by the counter-based
  hash of msds/data/samples.py from (MASK_SEED, window index, position), are all replaced by [MASK]
  and scored. Every machine masks the same positions.
- Sentence order (BERT): the stream laid out as BERT's sentence-order training samples
  (msds/data/samples.py, seed MASK_SEED, masked as in training); half the pairs swapped by the hash;
  the next-sentence head's argmax is the prediction (0: in order, 1: swapped).
- Cloze: context + target tokens, the context cut from the left to fit the window; the score is
  the sum of the target tokens' log-probabilities, each given the context and the target tokens
  before it; the example is correct when every target token is the model's argmax there (greedy
  decoding would produce the target).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from msds.data.indexed import TokenDataset
from msds.data.samples import MASK_PROBABILITY, Samples, uniform
from msds.data.tokenizer import TokenizerInfo

MASK_SEED = 2024
IGNORE = -100


def _stream(documents: list[list[int]], separator: int) -> list[int]:
    return [token for doc in documents for token in (*doc, separator)]


def _batches(rows: list[list[int]], batch_size: int):
    for start in range(0, len(rows), batch_size):
        yield start, rows[start:start + batch_size]


def pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


@torch.no_grad()
def gpt_nll(model, documents: list[list[int]], separator: int, seq_len: int, batch_size: int) -> tuple[float, int]:
    """(summed negative log-likelihood, predicted tokens) of the documents' stream."""
    stream = _stream(documents, separator)
    windows = [stream[s:s + seq_len + 1] for s in range(0, max(len(stream) - 1, 0), seq_len)]
    total, count = 0.0, 0
    for _, rows in _batches(windows, batch_size):
        # Right padding: a causal model's outputs at real positions never see the padding after them.
        inputs = pad_rows([r[:-1] for r in rows], 0)
        labels = pad_rows([r[1:] for r in rows], IGNORE)
        logits = model(input_ids=inputs).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"))
        count += int((labels != IGNORE).sum())
    return total, count


def mask_positions(num_windows: int, width: int) -> np.ndarray:
    """[num_windows, width] booleans: the fixed masked positions (at least one per window)."""
    draws = uniform(MASK_SEED, np.zeros(num_windows, dtype=np.int64), np.arange(num_windows), width, 0)
    chosen = draws < MASK_PROBABILITY
    chosen[np.arange(num_windows), draws.argmin(axis=1)] = True
    return chosen


@torch.no_grad()
def bert_nll(model, documents: list[list[int]], separator: int, special: dict[str, int], seq_len: int,
             batch_size: int) -> tuple[float, int]:
    """(summed negative log-likelihood, masked tokens) of the documents' stream under the fixed masking;
    `special` holds the ids of cls, sep, mask and pad."""
    stream = _stream(documents, separator)
    width = seq_len - 2
    windows = [stream[s:s + width] for s in range(0, len(stream), width)]
    chosen = mask_positions(len(windows), width)
    total, count = 0.0, 0
    for start, rows in _batches(windows, batch_size):
        inputs, labels = [], []
        for i, row in enumerate(rows):
            masked = chosen[start + i, :len(row)]
            inputs.append([special["cls"], *(special["mask"] if m else t for t, m in zip(row, masked)), special["sep"]])
            labels.append([IGNORE, *(t if m else IGNORE for t, m in zip(row, masked)), IGNORE])
        input_ids = pad_rows(inputs, special["pad"])
        attention = pad_rows([[1] * len(r) for r in inputs], 0)
        label_ids = pad_rows(labels, IGNORE)
        logits = model(input_ids=input_ids, attention_mask=attention,
                       token_type_ids=torch.zeros_like(input_ids)).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), label_ids.flatten(), ignore_index=IGNORE, reduction="sum"))
        count += int((label_ids != IGNORE).sum())
    return total, count


@torch.no_grad()
def sentence_order_scores(model, documents: list[list[int]], info: TokenizerInfo, seq_len: int, batch_size: int,
                          max_pairs: int | None) -> tuple[list[bool], list[bool]]:
    """(correct, swapped) of each sentence-order pair cut from the documents' stream (at most
    `max_pairs`, the first ones); `model` is a BertForPreTraining."""
    stream = np.asarray(_stream(documents, info.document_separator_id), dtype=np.int64)
    pairs = Samples(TokenDataset("heldout", stream, np.array([0, len(stream)])), "bert", seq_len, MASK_SEED, info,
                    sentence_order=True)
    count = len(pairs) if max_pairs is None else min(len(pairs), max_pairs)
    correct, swapped = [], []
    for start in range(0, count, batch_size):
        batch = pairs.get_batch(np.arange(start, min(start + batch_size, count)), 0)
        logits = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                       attention_mask=batch["attention_mask"]).seq_relationship_logits
        truth = batch["next_sentence_labels"]
        correct += (logits.argmax(dim=-1) == truth).tolist()
        swapped += truth.bool().tolist()
    return correct, swapped


def cloze_window(context: list[int], target: list[int], seq_len: int) -> list[int]:
    """Context and target in one window of seq_len + 1 tokens at most, the context cut from the left."""
    keep = max(1, seq_len + 1 - len(target))
    return (context[-keep:] + target)[-(seq_len + 1):]


@torch.no_grad()
def cloze_scores(model, pairs: list[tuple[list[int], list[int]]], seq_len: int,
                 batch_size: int) -> list[tuple[float, bool]]:
    """(target log-likelihood, greedy-correct) of each (context ids, target ids) pair, in order."""
    windows = [cloze_window(c, t, seq_len) for c, t in pairs]
    # Similar lengths batched together waste less on padding; results go back to the input order.
    order = sorted(range(len(windows)), key=lambda i: len(windows[i]))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
    for start, _ in _batches(order, batch_size):
        members = order[start:start + batch_size]
        inputs = pad_rows([windows[i][:-1] for i in members], 0)
        log_probs = torch.log_softmax(model(input_ids=inputs).logits.float(), dim=-1)
        for row, i in enumerate(members):
            window, width = windows[i], len(pairs[i][1])
            positions = torch.arange(len(window) - 1 - width, len(window) - 1)
            target = torch.tensor(window[-width:])
            picked = log_probs[row, positions]
            results[i] = (float(picked.gather(1, target[:, None]).sum()),
                          bool((picked.argmax(dim=-1) == target).all()))
    return results
