"""The order samples are visited in, and the batch iterators the trainer consumes.

The global sample stream is epoch after epoch, each a permutation of all samples drawn from
(seed, epoch). Global position g is sample perm_{g // N}[g % N] of epoch g // N. Data-parallel rank
r takes the positions g with g % dp_size == r, so the ranks together consume the stream in order,
and a run that has consumed C global samples resumes every rank exactly at position C. A blend of
datasets (`data.blend`) is visited in the order of msds.data.blend's `BlendedSampler`, resumable in
the same way. Batches are built with vectorized numpy (see samples.py), in the main process or, with
`prefetch`, ahead of the step in one background thread (`Prefetcher`) that also pins them for an
asynchronous copy to a GPU; no worker processes are needed.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import numpy as np
import torch

from msds.data.blend import BlendedSampler, DataSpec, open_dataset, tokenizer_info
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


def _split_samples(spec: DataSpec, split: str, arch: str, seq_len: int, seed: int) -> list[Samples]:
    """Each dataset's samples of `split`; a blend's dataset d uses seed + d."""
    info = tokenizer_info(spec)
    return [build_samples(open_dataset(spec, number, split), arch, seq_len, seed + number, info,
                          spec.sentence_order, spec.max_predictions_per_seq) for number in range(len(spec.entries))]


def train_batches(data, arch: str, seq_len: int, micro_batch_size: int, seed: int, dp_rank: int,
                  dp_size: int, consumed_samples: int = 0, prefetch: int = 0,
                  pin_memory: bool = False) -> Iterator[dict]:
    """Endless micro-batches of this rank's share of the train split, resumable from a sample count.

    `data` is a DataConfig (its path or blend) or the path of one dataset. The files' sizes and
    counts are checked when this is called, before the first batch is requested. `prefetch` > 0:
    a `Prefetcher` builds up to that many batches ahead (the same batches, in the same order);
    `pin_memory`: each batch in page-locked memory (with `prefetch` only; needs CUDA).
    """
    if micro_batch_size < 1:
        raise MsdsError(f"micro_batch_size {micro_batch_size}: must be at least 1")
    spec = DataSpec.of(data)
    samples = _split_samples(spec, "train", arch, seq_len, seed)
    if len(samples) == 1:
        sampler = ResumableSampler(len(samples[0]), seed, dp_rank, dp_size, consumed_samples)
        stream = ((0, epoch, index) for epoch, index in sampler)
    else:
        stream = iter(BlendedSampler(spec.weights, [len(s) for s in samples], seed, dp_rank, dp_size,
                                     consumed_samples))
    batches = _batches(samples, stream, micro_batch_size)
    return Prefetcher(batches, prefetch, pin_memory) if prefetch > 0 else batches


class Prefetcher:
    """An iterator over `batches` (endless) whose next `depth` items a daemon thread builds, and pins
    with `pin_memory`, while the caller trains on the current one: the same items in the same order,
    whatever the timing (one producer, one FIFO queue). An error in the thread is raised by the
    `next` that would have returned its batch. `close()` (or garbage collection) stops the thread; the
    batches it built ahead are dropped, which resuming does not notice (a loader restarts at the
    consumed-sample count the trainer keeps, not at the loader's position)."""

    def __init__(self, batches: Iterator[dict], depth: int, pin_memory: bool = False):
        if depth < 1:
            raise MsdsError(f"prefetch depth {depth}: must be at least 1")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # The thread holds the queue, the event and the batches, never this object: dropping the
        # iterator lets __del__ stop it.
        self._thread = threading.Thread(target=_produce, args=(batches, self._queue, self._stop, pin_memory),
                                        name="msds-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        kind, item = self._queue.get()
        if kind == "error":
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._stop.set()

    __del__ = close


def _produce(batches: Iterator[dict], out: queue.Queue, stop: threading.Event, pin_memory: bool) -> None:
    while not stop.is_set():
        try:
            batch = next(batches)
            item = ("batch", {key: value.pin_memory() for key, value in batch.items()} if pin_memory else batch)
        except BaseException as error:   # noqa: BLE001 - handed to the consumer, which raises it
            item = ("error", error)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if item[0] == "error":
            return


def _batches(samples: list[Samples], stream: Iterator[tuple[int, int, int]], batch_size: int) -> Iterator[dict]:
    while True:
        yield _mixed_batch(samples, [next(stream) for _ in range(batch_size)])


def _mixed_batch(samples: list[Samples], picks: list[tuple[int, int, int]]) -> dict:
    """The batch of (dataset, epoch, index) picks, rows in the order given."""
    datasets = np.array([d for d, _, _ in picks])
    parts, rows = [], []
    for dataset in np.unique(datasets):
        members = np.flatnonzero(datasets == dataset)
        parts.append(samples[dataset].get_batch([picks[m][2] for m in members], [picks[m][1] for m in members]))
        rows.append(members)
    if len(parts) == 1:
        return parts[0]
    order = torch.from_numpy(np.argsort(np.concatenate(rows)))
    return {key: torch.cat([part[key] for part in parts])[order] for key in parts[0]}


def eval_batches(data, split: str, arch: str, seq_len: int, batch_size: int, max_batches: int | None,
                 seed: int = 0) -> list[dict]:
    """The first `max_batches` batches (all when None) of `split`, in order: the same on every call.
    A blend's are its datasets' samples in order (epoch 0), interleaved by the blend's weights."""
    if batch_size < 1:
        raise MsdsError(f"batch_size {batch_size}: must be at least 1")
    spec = DataSpec.of(data)
    samples = _split_samples(spec, split, arch, seq_len, seed)
    total = sum(map(len, samples))
    count = total if max_batches is None else min(total, batch_size * max_batches)
    if len(samples) == 1:
        picks = [(0, 0, index) for index in range(count)]
    else:
        blend = BlendedSampler(spec.weights, [len(s) for s in samples], seed, 0, 1)
        located = (blend.locate(position) for position in range(count))
        picks = [(dataset, 0, k % len(samples[dataset])) for dataset, k in located]
    return [_mixed_batch(samples, picks[start:min(start + batch_size, count)])
            for start in range(0, count, batch_size)]
