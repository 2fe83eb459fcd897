"""The order samples are visited in, and the batch iterators the trainer consumes.

The global sample stream is epoch after epoch, each a permutation of all samples drawn from
(seed, epoch). Global position g is sample perm_{g // N}[g % N] of epoch g // N. Data-parallel rank
r takes the positions g with g % dp_size == r, so the ranks together consume the stream in order,
and a run that has consumed C global samples resumes every rank exactly at position C.
Batches are built in the main process with vectorized numpy (see samples.py), which is far faster
than the small CPU models train, so no worker processes are needed.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from msds.data.indexed import load_tokenizer_info, open_split
from msds.data.samples import Samples, build_samples
from msds.errors import MsdsError


class ResumableSampler:
    """Yields (epoch, index) of this rank's share of the global stream, from `consumed_samples` on."""

    def __init__(self, num_samples: int, seed: int, dp_rank: int, dp_size: int, consumed_samples: int = 0):
        if num_samples < 1:
            raise MsdsError(f"num_samples {num_samples}: the sampler needs at least one sample")
        if not 0 <= dp_rank < dp_size:
            raise MsdsError(f"dp_rank {dp_rank}: must be in 0..{dp_size - 1} for dp_size {dp_size}")
        if consumed_samples < 0:
            raise MsdsError(f"consumed_samples {consumed_samples}: must not be negative")
        self.num_samples = num_samples
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples

    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # This rank's first position at or after consumed_samples.
        position = self.consumed_samples + (self.dp_rank - self.consumed_samples) % self.dp_size
        epoch, order = -1, None
        while True:
            if position // self.num_samples != epoch:
                epoch = position // self.num_samples
                order = self.permutation(epoch)
            yield epoch, int(order[position % self.num_samples])
            position += self.dp_size


def _split_samples(data_dir, split: str, arch: str, seq_len: int, seed: int) -> Samples:
    return build_samples(open_split(data_dir, split), arch, seq_len, seed, load_tokenizer_info(data_dir))


def train_batches(data_dir, arch: str, seq_len: int, micro_batch_size: int, seed: int, dp_rank: int,
                  dp_size: int, consumed_samples: int = 0) -> Iterator[dict]:
    """Endless micro-batches of this rank's share of the train split, resumable from a sample count.

    The files are verified when this is called, before the first batch is requested.
    """
    if micro_batch_size < 1:
        raise MsdsError(f"micro_batch_size {micro_batch_size}: must be at least 1")
    samples = _split_samples(data_dir, "train", arch, seq_len, seed)
    sampler = ResumableSampler(len(samples), seed, dp_rank, dp_size, consumed_samples)
    return _batches(samples, iter(sampler), micro_batch_size)


def _batches(samples: Samples, stream: Iterator[tuple[int, int]], batch_size: int) -> Iterator[dict]:
    while True:
        epochs, indices = zip(*(next(stream) for _ in range(batch_size)))
        yield samples.get_batch(indices, epochs)


def eval_batches(data_dir, split: str, arch: str, seq_len: int, batch_size: int, max_batches: int | None,
                 seed: int = 0) -> list[dict]:
    """The first `max_batches` batches (all when None) of `split`, in order: the same on every call."""
    if batch_size < 1:
        raise MsdsError(f"batch_size {batch_size}: must be at least 1")
    samples = _split_samples(data_dir, split, arch, seq_len, seed)
    count = len(samples) if max_batches is None else min(len(samples), batch_size * max_batches)
    return [samples.get_batch(np.arange(start, min(start + batch_size, count)), 0)
            for start in range(0, count, batch_size)]
