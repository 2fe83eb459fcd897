"""Training samples cut from a split's token stream; each a pure function of (seed, epoch, index).

GPT: sample i is the window stream[i*S : i*S + S + 1] (S = seq_len), packed back to back across
documents (which the stream already separates with the document separator); input_ids = window[:-1],
labels = window[1:]. No randomness: the sampler's order is what changes between epochs.

BERT: sample i takes the S - 3 stream tokens stream[i*(S-3) : (i+1)*(S-3)], cuts them at a random
point into segments A and B, and lays them out as [CLS] A [SEP] B [SEP] with token types 0/1.
Masked-LM as in BERT: each ordinary token is chosen with probability 15%; a chosen token becomes
[MASK] 80% of the time, a uniformly random vocabulary id 10%, and stays unchanged 10%; labels hold
the original id at chosen positions and -100 elsewhere. At least one token per sample is chosen, so
the mean loss is always defined. With `sentence_order` (ALBERT's sentence-order prediction, on
segments cut at a token rather than a sentence boundary), half of the samples, drawn by the hash,
swap the segments into [CLS] B [SEP] A [SEP], with `next_sentence_labels` 1 (0: in order), which
the model's next-sentence head learns to tell apart.

The random numbers come from a counter-based hash of (seed, epoch, index, position, stream), not
from a stateful generator, so any sample can be rebuilt alone and whole batches are computed with a
few vectorized numpy operations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from msds.data.indexed import TokenDataset
from msds.data.tokenizer import TokenizerInfo
from msds.errors import MsdsError

MASK_PROBABILITY = 0.15
MASK_TOKEN_SHARE = 0.8  # of the chosen tokens; then RANDOM_TOKEN_SHARE random, the rest unchanged
RANDOM_TOKEN_SHARE = 0.1
IGNORE_INDEX = -100

# Independent random streams of the BERT sample.
_CUT, _CHOOSE, _ACTION, _RANDOM_TOKEN, _SWAP = range(5)
_UINT64 = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a bijective 64-bit scrambler (wrap-around arithmetic intended)."""
    x = (x ^ (x >> _UINT64(30))) * _UINT64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _UINT64(27))) * _UINT64(0x94D049BB133111EB)
    return x ^ (x >> _UINT64(31))


def uniform(seed: int, epochs: np.ndarray, indices: np.ndarray, width: int, stream: int) -> np.ndarray:
    """[len(indices), width] floats in [0, 1), a fixed function of (seed, epoch, index, column, stream)."""
    golden = _UINT64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        key = _mix(np.full(len(indices), seed, dtype=np.uint64) * golden + _UINT64(stream))
        key = _mix(key + np.asarray(epochs, dtype=np.uint64) * golden)
        key = _mix(key + np.asarray(indices, dtype=np.uint64) * golden)
        bits = _mix(key[:, None] + (np.arange(width, dtype=np.uint64) + _UINT64(1))[None, :] * golden)
    return (bits >> _UINT64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class Samples:
    """Fixed-length samples of one split for one architecture: `len()`, `get()`, `get_batch()`."""

    dataset: TokenDataset
    arch: Literal["bert", "gpt"]
    seq_len: int
    seed: int
    tokenizer_info: TokenizerInfo
    sentence_order: bool = False
    max_predictions: int = 0
    """> 0: at most this many chosen tokens per sample, their positions in `masked_positions`."""

    @property
    def stride(self) -> int:
        """Stream tokens consumed per sample."""
        return self.seq_len if self.arch == "gpt" else self.seq_len - 3

    def __len__(self) -> int:
        if self.arch == "gpt":  # the last window needs one more token for its final label
            return max(0, (self.dataset.num_tokens - 1) // self.stride)
        return self.dataset.num_tokens // self.stride

    def get(self, index: int, epoch: int = 0) -> dict[str, torch.Tensor]:
        """One sample as a dict of [seq_len] LongTensors."""
        return {key: value[0] for key, value in self.get_batch([index], [epoch]).items()}

    def get_batch(self, indices, epochs) -> dict[str, torch.Tensor]:
        """Samples `indices` (of epochs `epochs`, one per index) as a dict of [batch, seq_len] LongTensors."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sample index out of range 0..{len(self) - 1} of split {self.dataset.split}")
        if self.arch == "gpt":
            windows = self._windows(indices, self.seq_len + 1)
            return {"input_ids": torch.from_numpy(windows[:, :-1]), "labels": torch.from_numpy(windows[:, 1:])}
        return self._masked_lm(indices, np.broadcast_to(np.asarray(epochs, dtype=np.int64), indices.shape))

    def _windows(self, indices: np.ndarray, width: int) -> np.ndarray:
        starts = indices * self.stride
        return self.dataset.tokens[starts[:, None] + np.arange(width)].astype(np.int64)

    def _masked_lm(self, indices: np.ndarray, epochs: np.ndarray) -> dict[str, torch.Tensor]:
        info, length, body_len = self.tokenizer_info, self.seq_len, self.stride
        body = self._windows(indices, body_len)
        # Segment A = body[:cut], B = body[cut:], both non-empty; the first laid out is A, or B when
        # swapped, and `cut` becomes the first segment's length.
        cut = 1 + (uniform(self.seed, epochs, indices, 1, _CUT)[:, 0] * (body_len - 1)).astype(np.int64)
        swapped = np.zeros(len(indices), dtype=bool)
        if self.sentence_order:
            swapped = uniform(self.seed, epochs, indices, 1, _SWAP)[:, 0] < 0.5
        first_start, second_start = np.where(swapped, cut, 0), np.where(swapped, 0, cut)
        cut = np.where(swapped, body_len - cut, cut)
        position = np.arange(length)[None, :]
        source = np.where(position <= cut[:, None], first_start[:, None] + position - 1,
                          second_start[:, None] + position - cut[:, None] - 2).clip(0, body_len - 1)
        input_ids = np.take_along_axis(body, source, axis=1)
        input_ids[:, 0] = info.cls_id
        input_ids[np.arange(len(indices)), cut + 1] = info.sep_id
        input_ids[:, -1] = info.sep_id
        token_type_ids = (position > cut[:, None] + 1).astype(np.int64)

        structural = [t for t in (info.cls_id, info.sep_id, info.pad_id, info.eos_id,
                                  info.document_separator_id) if t is not None]
        candidate = ~np.isin(input_ids, structural)
        candidate[:, 0] = candidate[:, -1] = False
        candidate[np.arange(len(indices)), cut + 1] = False
        draw = np.where(candidate, uniform(self.seed, epochs, indices, length, _CHOOSE), np.inf)
        chosen = draw < MASK_PROBABILITY
        # A sample with no chosen token would have no loss: choose its most likely candidate.
        nothing = ~chosen.any(axis=1) & candidate.any(axis=1)
        chosen[nothing, draw[nothing].argmin(axis=1)] = True
        if self.max_predictions:
            chosen &= np.argsort(np.argsort(draw, axis=1, kind="stable"), axis=1) < self.max_predictions

        labels = np.where(chosen, input_ids, IGNORE_INDEX)
        action = uniform(self.seed, epochs, indices, length, _ACTION)
        random_ids = (uniform(self.seed, epochs, indices, length, _RANDOM_TOKEN) * info.vocab_size).astype(np.int64)
        to_mask = chosen & (action < MASK_TOKEN_SHARE)
        to_random = chosen & (action >= MASK_TOKEN_SHARE) & (action < MASK_TOKEN_SHARE + RANDOM_TOKEN_SHARE)
        input_ids = np.where(to_mask, info.mask_id, np.where(to_random, random_ids, input_ids))
        batch = {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(token_type_ids),
                 "attention_mask": torch.ones(input_ids.shape, dtype=torch.int64),
                 "labels": torch.from_numpy(labels)}
        if self.sentence_order:
            batch["next_sentence_labels"] = torch.from_numpy(swapped.astype(np.int64))
        if self.max_predictions:
            batch["masked_positions"] = torch.from_numpy(_positions(chosen, self.max_predictions))
        return batch


def _positions(chosen: np.ndarray, count: int) -> np.ndarray:
    """[batch, count]: each row's chosen positions in order, then 0 ([CLS], never chosen)."""
    order = np.argsort(~chosen, axis=1, kind="stable")[:, :count]
    return np.where(np.take_along_axis(chosen, order, axis=1), order, 0)


def build_samples(dataset: TokenDataset, arch: str, seq_len: int, seed: int,
                  tokenizer_info: TokenizerInfo, sentence_order: bool = False, max_predictions: int = 0) -> Samples:
    """GPT windows or BERT masked-LM samples (with sentence-order pairs when `sentence_order`) over
    `dataset`; MsdsError when they cannot be built."""
    if arch not in ("bert", "gpt"):
        raise MsdsError(f"arch {arch!r}: expected 'bert' or 'gpt'")
    minimum = 2 if arch == "gpt" else 5  # BERT: [CLS] a [SEP] b [SEP]
    if seq_len < minimum:
        raise MsdsError(f"seq_len {seq_len}: {arch} samples need at least {minimum} positions")
    if arch == "bert":
        missing = [name for name in ("cls_id", "sep_id", "mask_id") if getattr(tokenizer_info, name) is None]
        if missing:
            raise MsdsError(f"the corpus's tokenizer has no {', '.join(missing)} for BERT masked-LM; "
                            f"prepare it with --tokenizer bert, wordpiece-N or bpe-N")
    if sentence_order and arch != "bert":
        raise MsdsError("sentence_order: sentence-order pairs exist for BERT samples only")
    if max_predictions and arch != "bert":
        raise MsdsError("data.max_predictions_per_seq: masked-LM predictions exist for BERT samples only; set it to 0")
    samples = Samples(dataset, arch, seq_len, seed, tokenizer_info, sentence_order,
                      max_predictions if arch == "bert" else 0)
    if len(samples) == 0:
        raise MsdsError(f"split {dataset.split} has {dataset.num_tokens} tokens, too few for one "
                        f"{arch} sample of seq_len {seq_len}; use a shorter seq_len or a larger corpus")
    return samples
