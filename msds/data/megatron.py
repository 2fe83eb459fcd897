"""Megatron-LM's indexed datasets (`PREFIX.bin` + `PREFIX.idx`), read and written.

Reading uses megatron-core's own `IndexedDataset` for the index (header, dtype, sequence lengths
and pointers, document boundaries); the tokens are memory-mapped here, since the `.bin` is the same
flat array of ids that msds writes. A Megatron dataset is one token stream: its documents are cut
into train / valid / test as Megatron's dataset builder cuts a low-level dataset, in contiguous
document ranges sized by the `--split` weights (`data.split`). It carries no tokenizer, so
`data.tokenizer` names the one its ids come from.

Writing (`msds data export-megatron`) gives each split of a prepared corpus its own prefix: the
`.bin` is the split's `.bin` (hard-linked when it can be, else copied; converted where Megatron has
no code for the dtype), and the `.idx` holds one sequence per document (the document's tokens and
its separator, as Megatron's `preprocess_data.py --append-eod` writes them). The index is written
with numpy in Megatron's layout, in the dtype codes of megatron-core's `DType`, rather than with
`IndexedDatasetBuilder`, which keeps a Python int per document until it finishes.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np

from msds.data.indexed import TokenDataset, open_split, read_manifest
from msds.errors import MsdsError

SPLITS = ("train", "valid", "test")  # the order of megatron-core's Split enum
INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1


def is_megatron_prefix(path) -> bool:
    """Whether `path` names a Megatron dataset: PATH.bin and PATH.idx both exist."""
    return Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()


def split_documents(split_weights: str, documents: int, where: str = "data.split") -> dict[str, tuple[int, int]]:
    """{split: (first document, end)} as megatron-core's builder cuts `documents` documents."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    try:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split_weights))
    except (AssertionError, ZeroDivisionError, ValueError):
        raise MsdsError(f"{where}: {split_weights!r} is not a train,valid,test weight list such as "
                        f"'969,30,1'") from None
    return {name: (int(round(bounds[0] * documents)), int(round(bounds[1] * documents)))
            for name, bounds in zip(SPLITS, matrix) if bounds is not None}


def open_megatron_split(prefix, split: str, split_weights: str) -> TokenDataset:
    """Split `split` of the Megatron dataset at `prefix`, as a TokenDataset over its memory-mapped
    tokens; checks the .bin's size against the index (not its content)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = str(prefix)
    try:
        index = IndexedDataset(prefix).index
    except (AssertionError, ValueError, KeyError) as exc:
        raise MsdsError(f"{prefix}.idx: not a megatron-core indexed dataset ({exc}); make it with "
                        f"Megatron's preprocess_data.py or `msds data export-megatron`") from None
    itemsize = np.dtype(index.dtype).itemsize
    sequence_starts = np.append(index.sequence_pointers // itemsize,
                                int(index.sequence_pointers[-1]) // itemsize + int(index.sequence_lengths[-1])
                                if len(index) else 0)
    total = int(sequence_starts[-1])
    size = os.path.getsize(f"{prefix}.bin")
    if size != total * itemsize:
        raise MsdsError(f"{prefix}.bin: {size} bytes, its index says {total * itemsize} (truncated or "
                        f"replaced); make the dataset again")
    doc_offsets = sequence_starts[np.asarray(index.document_indices)]
    ranges = split_documents(split_weights, len(doc_offsets) - 1)
    begin, end = ranges.get(split, (0, 0))
    if end <= begin:
        raise MsdsError(f"data.split: {split_weights!r} gives split {split!r} no document of the "
                        f"{len(doc_offsets) - 1} in {prefix}; give it a positive weight")
    tokens = np.memmap(f"{prefix}.bin", dtype=index.dtype, mode="r")
    first, last = int(doc_offsets[begin]), int(doc_offsets[end])
    return TokenDataset(split, tokens[first:last], (doc_offsets[begin:end + 1] - first).astype(np.int64))


def _write_index(path: Path, dtype: np.dtype, doc_offsets: np.ndarray) -> None:
    """A Megatron `.idx` with one sequence per document."""
    from megatron.core.datasets.indexed_dataset import DType

    lengths = np.diff(doc_offsets)
    if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
        raise MsdsError(f"{path}: a document of {lengths.max()} tokens exceeds Megatron's int32 lengths")
    with open(path, "wb") as handle:
        handle.write(INDEX_HEADER)
        handle.write(struct.pack("<Q", INDEX_VERSION))
        handle.write(struct.pack("<B", DType.code_from_dtype(dtype.type)))
        handle.write(struct.pack("<Q", len(lengths)))
        handle.write(struct.pack("<Q", len(lengths) + 1))
        lengths.astype(np.int32).tofile(handle)
        (doc_offsets[:-1] * dtype.itemsize).astype(np.int64).tofile(handle)
        np.arange(len(lengths) + 1, dtype=np.int64).tofile(handle)


def _write_tokens(source: Path, target: Path, tokens: np.ndarray, dtype: np.dtype) -> None:
    if tokens.dtype == dtype:
        try:
            os.link(source, target)
        except OSError:  # another file system, or links not allowed
            shutil.copyfile(source, target)
        return
    with open(target, "wb") as handle:
        for start in range(0, len(tokens), 2**24):
            tokens[start:start + 2**24].astype(dtype).tofile(handle)


def export_megatron(data_dir, out_dir) -> list[str]:
    """Write every split of the prepared corpus `data_dir` as the Megatron dataset OUT/<split>;
    returns the prefixes."""
    from megatron.core.datasets.indexed_dataset import DType

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    manifest = read_manifest(data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefixes = []
    for split in manifest["splits"]:
        dataset = open_split(data_dir, split)
        # Megatron has codes for uint16 and int32 but none for uint32 (vocabularies of 2**16 or more).
        dtype = dataset.tokens.dtype
        if dtype not in [np.dtype(t.name) for t in DType]:
            dtype = np.dtype(np.int32)
        prefix = out_dir / split
        for stale in (f"{prefix}.bin", f"{prefix}.idx"):
            Path(stale).unlink(missing_ok=True)
        _write_tokens(data_dir / manifest["splits"][split]["bin"]["file"], Path(f"{prefix}.bin"),
                      dataset.tokens, dtype)
        _write_index(Path(f"{prefix}.idx"), dtype, dataset.doc_offsets)
        prefixes.append(str(prefix))
    return prefixes
