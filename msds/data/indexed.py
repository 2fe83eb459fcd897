"""Reading a prepared corpus: the manifest, the tokenizer info and the memory-mapped splits.

A prepared directory holds, per split, `<split>.bin` (all token ids back to back, every document
ended by the tokenizer's document separator) and `<split>.idx` (int64 offsets of the document
starts, plus the total, so document d is bin[idx[d]:idx[d+1]]). `manifest.json` records the
sha256, size and token count of each file. Opening a split (what every training rank does) checks
the sizes and the counts only, which costs the same for any corpus size, so a truncated or swapped
file stops the run before training; `verify_corpus` (`msds data verify DIR`, and `msds data
prepare` before it declares an output up to date) also hashes every file, once.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from msds.data.tokenizer import TokenizerInfo
from msds.errors import MsdsError
from msds.integrity import sha256_file

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "msds-data/1"


def read_manifest(data_dir) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise MsdsError(f"{path}: no such file; prepare the corpus first with "
                        f"`msds data prepare --tokenizer NAME --out {data_dir}`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MsdsError(f"{path}: not valid JSON ({exc}); prepare the corpus again") from None
    if manifest.get("format") != FORMAT:
        raise MsdsError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}; "
                        f"prepare the corpus again with this version of msds")
    return manifest


def check_file(data_dir: Path, record: dict) -> Path:
    """The path of a manifest-listed file, after checking that it exists with the listed size."""
    path = data_dir / record["file"]
    if not path.is_file():
        raise MsdsError(f"{path}: missing; prepare the corpus again")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise MsdsError(f"{path}: {size} bytes, the manifest says {record['bytes']} (truncated or "
                        f"replaced); prepare the corpus again")
    return path


def verify_file(data_dir: Path, record: dict) -> Path:
    """The path of a manifest-listed file, after checking its size and sha256."""
    path = check_file(data_dir, record)
    digest = sha256_file(path)
    if digest != record["sha256"]:
        raise MsdsError(f"{path}: sha256 {digest} differs from the manifest's {record['sha256']} "
                        f"(the file was altered); prepare the corpus again")
    return path


def load_tokenizer_info(data_dir) -> TokenizerInfo:
    """Vocabulary size and special-token ids of a prepared corpus (from its manifest)."""
    manifest = read_manifest(data_dir)
    check_file(Path(data_dir), manifest["tokenizer"])
    return TokenizerInfo(**manifest["tokenizer"]["info"])


@dataclass(frozen=True)
class TokenDataset:
    """One split: `tokens` (memory-mapped ids) and `doc_offsets` (document d = tokens[o[d]:o[d+1]])."""

    split: str
    tokens: np.ndarray
    doc_offsets: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.doc_offsets.shape[0] - 1)


def open_split(data_dir, split: str) -> TokenDataset:
    """Memory-map a split after checking its files' sizes and counts against the manifest (MsdsError
    on mismatch); the checksums are `verify_corpus`'s."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    splits = manifest["splits"]
    if split not in splits:
        raise MsdsError(f"split {split!r} is not in {data_dir / MANIFEST}; choose one of "
                        f"{', '.join(splits)}")
    record = splits[split]
    bin_path = check_file(data_dir, record["bin"])
    idx_path = check_file(data_dir, record["idx"])
    tokens = np.memmap(bin_path, dtype=np.dtype(manifest["dtype"]), mode="r") if record["tokens"] else \
        np.zeros(0, dtype=manifest["dtype"])  # numpy cannot map an empty file
    doc_offsets = np.fromfile(idx_path, dtype=np.int64)
    consistent = (tokens.shape[0] == record["tokens"] and doc_offsets.shape[0] == record["documents"] + 1
                  and doc_offsets[0] == 0 and doc_offsets[-1] == tokens.shape[0]
                  and bool(np.all(np.diff(doc_offsets) > 0)))
    if not consistent:
        raise MsdsError(f"{bin_path}: token or document counts disagree with the manifest and "
                        f"{idx_path.name}; prepare the corpus again")
    return TokenDataset(split, tokens, doc_offsets)


def verify_corpus(data_dir) -> list[str]:
    """Every file of a prepared corpus against the manifest's sha256s, sizes and counts (MsdsError
    naming the first that differs); returns one line per checked file."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    records = [manifest["tokenizer"]] + [split[kind] for split in manifest["splits"].values()
                                          for kind in ("bin", "idx")]
    lines = []
    for record in records:
        verify_file(data_dir, record)
        lines.append(f"{record['file']}: {record['bytes']} bytes, sha256 {record['sha256'][:16]}... ok")
    for split in manifest["splits"]:
        dataset = open_split(data_dir, split)
        lines.append(f"{split}: {dataset.num_documents} documents, {dataset.num_tokens} tokens ok")
    return lines
