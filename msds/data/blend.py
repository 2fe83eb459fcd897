"""What a run reads: one dataset or a weighted blend, each a prepared msds directory or a Megatron
`.bin`/`.idx` prefix, and the order a blend's samples are visited in.

A blend's global stream interleaves its datasets as megatron-core's `BlendedDataset` does: position
g goes to the dataset whose count lags its weight most (megatron-core's `build_blending_indices`,
the same C++ helper). That greedy table is built once for `BLEND_PERIOD` positions and repeated, so
the dataset and the within-dataset number k of any position follow from g alone: a resumed run
needs only its consumed-sample count, and the table's memory does not grow with the run. Dataset d
visits its own samples epoch after epoch, each a permutation drawn from (seed, d, epoch); its BERT
masks use seed + d. Data-parallel rank r takes the positions g with g % dp_size == r, as
`ResumableSampler` does for one dataset.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from msds.config import ConfigError
from msds.data.indexed import MANIFEST, TokenDataset, load_tokenizer_info, open_split
from msds.data.megatron import is_megatron_prefix, open_megatron_split
from msds.data.tokenizer import TokenizerInfo
from msds.errors import MsdsError

BLEND_PERIOD = 4096


@dataclass(frozen=True)
class DataSpec:
    """The datasets of a run with their weights, and how Megatron datasets among them are read."""

    entries: tuple[tuple[float, str], ...]
    tokenizer: str = ""
    split: str = "969,30,1"
    sentence_order: bool = False
    max_predictions_per_seq: int = 0

    @classmethod
    def of(cls, data) -> "DataSpec":
        """From a DataConfig (its blend, else its path) or a bare path of one dataset."""
        if isinstance(data, (str, Path)):
            return cls(((1.0, str(data)),))
        entries = tuple((float(w), str(p)) for w, p in data.blend) if data.blend else ((1.0, data.path),)
        return cls(entries, data.tokenizer, data.split, data.sentence_order, data.max_predictions_per_seq)

    def where(self, number: int) -> str:
        """The config field that names dataset `number`."""
        return f"data.blend[{number}]" if len(self.entries) > 1 else "data.path"

    @property
    def weights(self) -> np.ndarray:
        weights = np.array([w for w, _ in self.entries], dtype=np.float64)
        return weights / weights.sum()


def open_dataset(spec: DataSpec, number: int, split: str) -> TokenDataset:
    path = spec.entries[number][1]
    if is_megatron_prefix(path):
        return open_megatron_split(path, split, spec.split)
    if not (Path(path) / MANIFEST).is_file():
        raise MsdsError(f"{spec.where(number)}: {path} is neither a prepared corpus (no {MANIFEST}) nor a "
                        f"Megatron dataset prefix ({path}.bin and {path}.idx); prepare it with "
                        f"`msds data prepare --tokenizer NAME --out {path}`")
    return open_split(path, split)


def _megatron_tokenizer_info(spec: DataSpec, number: int) -> TokenizerInfo:
    from tokenizers import Tokenizer

    from msds.data.sources import default_cache_dir
    from msds.data.tokenizer import build_tokenizer, parse_tokenizer_name

    name = spec.tokenizer
    if not name:
        raise ConfigError(f"data.tokenizer: {spec.where(number)} {spec.entries[number][1]} is a Megatron "
                          f"dataset, which names no tokenizer; set data.tokenizer to gpt2, bert, a "
                          f"tokenizer.json file or a prepared msds corpus directory")
    if name in ("gpt2", "bert"):
        return TokenizerInfo.of(build_tokenizer(parse_tokenizer_name(name), [], default_cache_dir()))
    if (Path(name) / MANIFEST).is_file():
        return load_tokenizer_info(name)
    if Path(name).is_file():
        return TokenizerInfo.of(Tokenizer.from_file(name))
    raise ConfigError(f"data.tokenizer: {name!r} is not gpt2, bert, a tokenizer.json file or a prepared "
                      f"msds corpus directory")


def tokenizer_info(spec: DataSpec) -> TokenizerInfo:
    """The vocabulary and special ids of the run's data; every dataset of a blend must agree."""
    infos = [_megatron_tokenizer_info(spec, n) if is_megatron_prefix(path) else load_tokenizer_info(path)
             for n, (_, path) in enumerate(spec.entries)]
    for number, info in enumerate(infos[1:], start=1):
        if info != infos[0]:
            raise ConfigError(f"data.blend[{number}]: {spec.entries[number][1]} has another tokenizer than "
                              f"data.blend[0] ({info} vs {infos[0]}); blend datasets of one tokenizer")
    return infos[0]


def blend_table(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, within-dataset number) of the first BLEND_PERIOD positions, by megatron-core's helper."""
    from megatron.core.datasets import helpers

    dataset_index = np.zeros(BLEND_PERIOD, dtype=np.int16)
    sample_index = np.zeros(BLEND_PERIOD, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, sample_index, weights.astype(np.float64), len(weights),
                                   BLEND_PERIOD, False)
    return dataset_index, sample_index


class BlendedSampler:
    """Yields (dataset, epoch, index) of this rank's share of a blend's stream, from
    `consumed_samples` on."""

    def __init__(self, weights: np.ndarray, sizes: list[int], seed: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0):
        if min(sizes) < 1:
            raise MsdsError("a blend's dataset has no sample; every dataset needs at least one")
        self.table, self.numbers = blend_table(weights)
        self.per_period = np.bincount(self.table, minlength=len(sizes))
        self.sizes, self.seed = sizes, seed
        self.dp_rank, self.dp_size, self.consumed_samples = dp_rank, dp_size, consumed_samples

    def locate(self, position: int) -> tuple[int, int]:
        """(dataset, its k-th sample) at global `position`."""
        period, offset = divmod(position, BLEND_PERIOD)
        dataset = int(self.table[offset])
        return dataset, period * int(self.per_period[dataset]) + int(self.numbers[offset])

    def permutation(self, dataset: int, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, dataset, epoch]).permutation(self.sizes[dataset])

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        position = self.consumed_samples + (self.dp_rank - self.consumed_samples) % self.dp_size
        orders: dict[int, tuple[int, np.ndarray]] = {}
        while True:
            dataset, k = self.locate(position)
            epoch = k // self.sizes[dataset]
            if orders.get(dataset, (-1,))[0] != epoch:
                orders[dataset] = (epoch, self.permutation(dataset, epoch))
            yield dataset, epoch, int(orders[dataset][1][k % self.sizes[dataset]])
            position += self.dp_size
