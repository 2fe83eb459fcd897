"""Fine-tuning a BERT for sequence classification the way users do: Hugging Face
`BertForSequenceClassification.from_pretrained` on the exported model directory, AdamW, a linear
schedule with 10% warmup, gradient clipping at 1.0, and the GLUE protocol around it: every learning
rate of a small grid x every seed, the dev score at the end of training, the median over the seeds
per learning rate, and the best learning rate's median as the task's value.

The seed decides the classifier's (and, for a model without one, the pooler's) initial weights, the
dropout and the order of the training examples.
"""
from __future__ import annotations

import math
import statistics

import torch

from msds.eval.lm import pad_rows

WARMUP_FRACTION = 0.1
WEIGHT_DECAY = 0.01


def encode_inputs(rows: list[list[int]], special: dict[str, int]) -> dict[str, torch.Tensor]:
    """[CLS] ids [SEP], right-padded, with the attention mask."""
    ids = [[special["cls"], *r, special["sep"]] for r in rows]
    return {"input_ids": pad_rows(ids, special["pad"]), "attention_mask": pad_rows([[1] * len(r) for r in ids], 0)}


def _train(model, train: list[tuple[list[int], int]], special: dict[str, int], lr: float, seed: int,
           epochs: int, batch_size: int) -> None:
    from transformers import get_linear_schedule_with_warmup

    steps = epochs * math.ceil(len(train) / batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    schedule = get_linear_schedule_with_warmup(optimizer, int(WARMUP_FRACTION * steps), steps)
    order = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        permutation = torch.randperm(len(train), generator=order).tolist()
        for start in range(0, len(train), batch_size):
            batch = [train[i] for i in permutation[start:start + batch_size]]
            loss = model(**encode_inputs([ids for ids, _ in batch], special),
                         labels=torch.tensor([label for _, label in batch])).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def accuracy(model, dev: list[tuple[list[int], int]], special: dict[str, int], batch_size: int) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(dev), batch_size):
        batch = dev[start:start + batch_size]
        logits = model(**encode_inputs([ids for ids, _ in batch], special)).logits
        correct += int((logits.argmax(dim=-1) == torch.tensor([label for _, label in batch])).sum())
    return correct / len(dev)


def finetune_once(hf_dir: str, train, dev, special: dict[str, int], num_labels: int, lr: float, seed: int,
                  epochs: int, batch_size: int) -> float:
    """Dev accuracy after fine-tuning a fresh copy of the model at `lr` with `seed`."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(hf_dir, num_labels=num_labels)
    _train(model, train, special, lr, seed, epochs, batch_size)
    return accuracy(model, dev, special, batch_size)


def glue_protocol(hf_dir: str, train, dev, special: dict[str, int], num_labels: int, lrs, seeds, epochs: int,
                  batch_size: int, log=print) -> dict:
    """{value, best_lr, best_lr_at_edge, per_lr: {lr: {median, per_seed}}}: the median dev accuracy of
    the best lr."""
    per_lr = {}
    for lr in lrs:
        scores = []
        for seed in seeds:
            scores.append(finetune_once(hf_dir, train, dev, special, num_labels, lr, seed, epochs, batch_size))
            log(f"    lr {lr:g} seed {seed}: dev accuracy {scores[-1]:.4f}")
        per_lr[f"{lr:g}"] = {"median": statistics.median(scores), "per_seed": scores}
    best_lr = max(lrs, key=lambda lr: per_lr[f"{lr:g}"]["median"])
    best = f"{best_lr:g}"
    edge = grid_edge(best_lr, lrs)
    if edge is not None:
        log(f"    note: the best rate, {best}, is the grid's {edge}; the best median may lie beyond it "
            f"(widen --lrs, or eval.lrs in a bench)")
    return {"value": per_lr[best]["median"], "best_lr": float(best), "best_lr_at_edge": edge, "per_lr": per_lr}


def grid_edge(best_lr: float, lrs) -> str | None:
    """'highest' or 'lowest' when the best rate of a grid of several is at its end, else None: then the
    grid did not bracket the best rate (docs/evaluation.md, "The learning-rate grid": a rate past the
    grid's top scored higher still)."""
    if len(set(lrs)) < 2:
        return None
    if best_lr == max(lrs):
        return "highest"
    return "lowest" if best_lr == min(lrs) else None
